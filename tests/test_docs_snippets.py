"""Every code block in README.md and docs/*.md runs as written, or says why it does not.

How a block is treated:
- ```python blocks run from the repository root: in the test's process, as a script in a fresh namespace (in a
  subprocess when it starts processes: STARTS_PROCESSES). One that talks to http://127.0.0.1:PORT runs
  against the server a reader following the page would have running: the last `nanovllm serve` line above it
  (plain `nanovllm serve` if there is none), with PORT replaced by a free port.
- ```bash / ```sh / ```shell blocks run line by line when every line is a command the test knows how to run:
  `nanovllm serve ...` is started, must answer /health, and is stopped at the end of the module; any other
  `nanovllm ...` must exit 0; `pip install ...` lines are not run (the test environment has the extras; .ci/run
  builds it with scripts/setup_venv.sh). A `/path/to/...` placeholder stands for the default SmolLM2 checkpoint.
- A block whose commands the test cannot run carries a marker on the line before it:
  `<!-- snippet: no-run (reason) -->`, or `<!-- snippet: gpu (reason) -->` for a block that runs only where a GPU
  is (and docker, for a `docker` line). Every marker must give its reason; the reason is the skip message.
- Blocks with another language tag or none (diagrams, sample output) are not code and are not run, but an
  untagged block that starts like a command fails: tag it.
"""
import dataclasses
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.docs, pytest.mark.subprocess]  # the docs' snippets run, servers included

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUN_LANGS = {"python", "bash", "sh", "shell"}
FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARKER = re.compile(r"<!--\s*snippet:\s*([\w-]+)\s*(?:\((.*)\))?\s*-->\s*$")
MARKER_KINDS = {"no-run", "gpu"}
LOCAL_URL = re.compile(r"(?:127\.0\.0\.1|localhost):(\d+)")
PLACEHOLDER = re.compile(r"/path/to/\S+")
COMMAND_START = re.compile(r"^\s*(\$ |nanovllm |python3? |pip |make |docker |git )")
# a python snippet that starts processes runs in a subprocess, every other one in the test's process
STARTS_PROCESSES = re.compile(r"tensor_parallel_size|multiprocessing|subprocess|concurrent\.futures|os\.fork")
SNIPPET_TIMEOUT_S = 600
SERVER_START_TIMEOUT_S = 300


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # "no-run", "gpu", ... or None
    reason: str | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def read_blocks(page: Path) -> list[Block]:
    source = page.read_text()
    blocks = []
    for match in FENCE.finditer(source):
        line = source.count("\n", 0, match.start()) + 1
        before = [line for line in source[:match.start()].splitlines() if line.strip()]
        marker = MARKER.search(before[-1]) if before else None
        blocks.append(Block(page, line, match.group(1).lower(), match.group(2),
                            marker.group(1) if marker else None,
                            marker.group(2).strip() if marker and marker.group(2) else None))
    return blocks


BLOCKS = [block for page in PAGES for block in read_blocks(page)]
CODE_BLOCKS = [block for block in BLOCKS if block.lang in RUN_LANGS]


def shell_commands(text: str) -> list[list[str]]:
    """The block's commands as argv lists (comments dropped, backslash continuations joined)."""
    joined = text.replace("\\\n", " ")
    return [argv for argv in (shlex.split(line, comments=True) for line in joined.splitlines()) if argv]


def unrunnable_command(block: Block) -> str | None:
    """The first command of a shell block that this test cannot run, or None when it can run them all."""
    for argv in shell_commands(block.text):
        if argv[0] == "nanovllm" or argv[:2] == ["pip", "install"]:
            continue
        return " ".join(argv)
    return None


def test_pages_have_code_blocks():
    assert len(CODE_BLOCKS) >= 4, [block.where for block in CODE_BLOCKS]  # the parser finds what the pages hold


def test_markers_are_known_and_give_reasons():
    for block in BLOCKS:
        if block.marker is None:
            continue
        assert block.marker in MARKER_KINDS, f"{block.where}: unknown snippet marker {block.marker!r}"
        assert block.reason, f"{block.where}: `<!-- snippet: {block.marker} -->` needs a reason in parentheses"


def test_command_blocks_are_tagged():
    for block in BLOCKS:
        if not block.lang:
            first = next((line for line in block.text.splitlines() if line.strip()), "")
            assert not COMMAND_START.match(first), f"{block.where}: an untagged block of commands; tag it ```bash"


def test_unrunnable_blocks_are_marked():
    for block in CODE_BLOCKS:
        if block.lang != "python" and block.marker is None and unrunnable_command(block):
            pytest.fail(f"{block.where}: this test cannot run `{unrunnable_command(block)}`; mark the block "
                        f"with <!-- snippet: no-run (reason) --> or <!-- snippet: gpu (reason) -->")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_port(argv: list[str], port: int) -> list[str]:
    argv = list(argv)
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    else:
        argv += ["--port", str(port)]
    return argv


def with_model(argv: list[str]) -> list[str]:
    if not any(PLACEHOLDER.search(arg) for arg in argv):
        return argv
    from nanovllm.utils.convert import default_model_dir
    model_dir = default_model_dir()
    return [PLACEHOLDER.sub(model_dir, arg) for arg in argv]


def require_nanovllm_command():
    if shutil.which("nanovllm") is None:
        pytest.skip("the `nanovllm` command is not on PATH (pip install -e . puts it there)")


def require_serving(client: bool = False):
    for module in ("fastapi", "uvicorn") + (("openai",) if client else ()):
        pytest.importorskip(module, reason=f"needs {module} (pip install -e '.[test]')")


class Servers:
    """The `nanovllm serve` process this module runs: at most one at a time (each holds a model and its KV cache),
    kept while the next snippet asks for the same command line, stopped at the module's end."""

    def __init__(self):
        self.argv: tuple | None = None
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, argv: list[str]) -> int:
        if self.proc is None or self.argv != tuple(argv) or self.proc.poll() is not None:
            self.stop()
            self.argv, self.port = tuple(argv), free_port()
            # stderr to a file: a pipe nobody reads would fill and block the server
            self.log = tempfile.TemporaryFile(mode="w+")
            self.proc = subprocess.Popen(with_model(with_port(argv, self.port)), cwd=ROOT, text=True,
                                         stdout=subprocess.DEVNULL, stderr=self.log)
            wait_for_health(self.proc, self.port, self.log)
        return self.port

    def stop(self):
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self.log.close()


def wait_for_health(proc: subprocess.Popen, port: int, log):
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"`{' '.join(proc.args)}` exited with {proc.returncode}: {log.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    pytest.fail(f"`{' '.join(proc.args)}` did not answer /health within {SERVER_START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def servers():
    started = Servers()
    yield started
    started.stop()


def server_command_before(block: Block) -> list[str]:
    """The server a reader of the page has running when they reach this block: the last `nanovllm serve` line
    above it (plain `nanovllm serve` if there is none)."""
    command = ["nanovllm", "serve"]
    for earlier in read_blocks(block.page):
        if earlier.line < block.line and earlier.lang in RUN_LANGS - {"python"} and earlier.marker is None:
            command = next((argv for argv in reversed(shell_commands(earlier.text))
                            if argv[:2] == ["nanovllm", "serve"]), command)
    return command


def skip_unless_marker_allows(block: Block):
    if block.marker == "no-run":
        pytest.skip(block.reason)
    if block.marker == "gpu":
        import torch
        if not torch.cuda.is_available():
            pytest.skip(block.reason)
        if any(argv[0] == "docker" for argv in shell_commands(block.text)) and shutil.which("docker") is None:
            pytest.skip(f"no docker here ({block.reason})")


def run_checked(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S, **kwargs)
    assert proc.returncode == 0, f"`{' '.join(argv)}` exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.parametrize("block", CODE_BLOCKS, ids=[f"{b.where}:{b.lang}" for b in CODE_BLOCKS])
def test_snippet_runs(block: Block, servers, tmp_path):
    skip_unless_marker_allows(block)
    if block.lang == "python":
        run_python_snippet(block, servers, tmp_path)
    elif block.marker == "gpu":
        run_checked(["bash", "-e", "-c", block.text])
    else:
        run_shell_snippet(block, servers)


def run_python_snippet(block: Block, servers: Servers, tmp_path: Path):
    text = block.text
    if LOCAL_URL.search(text):
        require_serving(client=True)
        require_nanovllm_command()
        port = servers.start(server_command_before(block))
        text = LOCAL_URL.sub(lambda m: m.group(0).replace(m.group(1), str(port)), text)
    path = tmp_path / "snippet.py"
    path.write_text(text)
    if STARTS_PROCESSES.search(text):
        run_checked([sys.executable, str(path)])
    else:
        run_in_this_process(text, path)


def run_in_this_process(text: str, path: Path):
    """The snippet as a script runs it: compiled from its own file, in a fresh namespace named "__main__" (so every
    name it uses must come from its own imports), from the repository root. A subprocess would add 3-4 CPU-s of
    importing torch and transformers again to each snippet, and nothing a reader's run has that this one lacks; a
    snippet that starts processes (a spawned child re-imports the main module, which only a real script has) runs
    in a subprocess instead (STARTS_PROCESSES)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(text, str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})
    finally:
        os.chdir(cwd)


def run_shell_snippet(block: Block, servers: Servers):
    for argv in shell_commands(block.text):
        if argv[:2] == ["pip", "install"]:
            continue
        require_nanovllm_command()
        if argv[:2] == ["nanovllm", "serve"]:
            require_serving()
            servers.start(argv)
        else:
            run_checked(with_model(argv), env={**os.environ, "PYTHONUNBUFFERED": "1"})
