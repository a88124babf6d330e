"""`make test`'s pytest command, with torch's default intra-op thread count against the one thread per process the
test suite chooses (tests/conftest.py), with the machine idle and with a busy loop on one core, one after the other
in a single run.

    python -m benchmarks.bench_make_test                          # both counts, idle then busy: four whole suites
    python -m benchmarks.bench_make_test --loads idle --threads 1 # the suite as `make test` runs it, once

"torch" sets OMP_NUM_THREADS to the cores the process may use (torch's own default: one thread per core of the
affinity mask, which tests/conftest.py would otherwise replace with 1); "1" leaves the suite's choice. Each run is a
fresh `python -m pytest tests/ -q -n WORKERS` (the Makefile's command, its PATH included) and prints one JSON line:
its wall time, the CPU time of the whole process tree (pytest, its xdist workers and the processes they waited
for), the counts of pytest's summary line and the 1-minute load average just before it started. Run it from the
repository's root inside the test environment (`make setup-test` makes one).
"""
import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

from benchmarks.bench_cpu_threads import machine_load, print_machine

SUMMARY_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_suite(threads: str, workers: str, pytest_args: list[str]) -> dict:
    """One whole run of the suite as `make test` runs it; returns its measurements."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if threads == "torch":
        env["OMP_NUM_THREADS"] = str(len(os.sched_getaffinity(0)))
    elif threads != "1":  # "1" is the suite's own choice: conftest sets it when the variable is unset
        env["OMP_NUM_THREADS"] = threads
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the `nanovllm` command
    command = [sys.executable, "-m", "pytest", "tests/", "-q", "-n", workers, "-p", "no:cacheprovider", *pytest_args]
    load_before = os.getloadavg()[0]
    cpu_before, start = children_cpu_s(), time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    wall_s, cpu_s = time.perf_counter() - start, children_cpu_s() - cpu_before
    last_line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {name.rstrip("s") if name.startswith("error") else name: int(n)
              for n, name in SUMMARY_COUNT.findall(last_line)}
    failures = [line for line in proc.stdout.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return dict(threads=threads, omp_num_threads=env.get("OMP_NUM_THREADS", "unset (conftest: 1)"),
                workers=workers, exit_code=proc.returncode, wall_s=round(wall_s, 1), cpu_s=round(cpu_s, 1),
                loadavg_1min=round(load_before, 2), **counts, failures=failures)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", nargs="+", default=["torch", "1"],
                        help='"torch": torch\'s default count; "1": the suite\'s choice; a number: that many')
    parser.add_argument("--loads", nargs="+", default=["idle", "busy"], choices=["idle", "busy"])
    parser.add_argument("--workers", default="auto", help="pytest-xdist's -n (the Makefile's WORKERS)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments, after --, e.g. -- -k tiny")
    args = parser.parse_args()
    print_machine()
    for load in args.loads:
        with machine_load(load):
            for threads in args.threads:
                print(json.dumps(dict(load=load, **run_suite(threads, args.workers, args.pytest_args))), flush=True)


if __name__ == "__main__":
    main()
