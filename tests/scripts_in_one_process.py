"""Several test scripts run in one Python subprocess, each in a fresh namespace: the process's start (torch, triton
and the kernels imported: 1.5-2 CPU-s) is paid once for a module's scripts instead of once a script. A script that
raises leaves its traceback for its own test; the others still run. Scripts must leave no module state changed that
a later one reads, and seed their own generators."""
import json
import subprocess
import sys

RUNNER = """
import contextlib, io, json, sys, traceback
results = {}
for name, script in json.loads(sys.stdin.read()).items():
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(script, name, "exec"), {"__name__": "__main__"})
        results[name] = {"result": json.loads(out.getvalue().strip().splitlines()[-1])}
    except BaseException:
        results[name] = {"error": traceback.format_exc()[-3000:]}
print(json.dumps(results))
"""


def run_scripts(scripts: dict[str, str], env: dict[str, str]) -> dict[str, dict]:
    """{name: script} -> {name: {"result": the script's last printed line as JSON} or {"error": its traceback}}."""
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(scripts), check=False,
                          capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def script_result(results: dict[str, dict], name: str):
    """One script's result; its traceback as the failure if it raised."""
    assert "error" not in results[name], results[name]["error"]
    return results[name]["result"]
