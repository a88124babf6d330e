"""The house rules, checked from the source: imports run downward through explicit layers, no module or package
imports itself back through others, the host tier never imports the engine, and the metadata floor imports without
torch. The import graph is drawn with `ast` from every file of nanovllm and nanovllm_offload (imports inside
functions count: a lazy import is still a dependency)."""
import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("nanovllm", "nanovllm_offload")

# lowest first; a module may import modules of its own layer or of a lower one. A pattern "a.b.*" holds the package
# a.b and every module under it, a pattern without ".*" holds exactly that module; the longest matching pattern names
# a module's layer. A module no pattern holds fails test_every_module_has_a_layer: give it a layer here.
LAYERS = [
    # metadata, request checks; a request's options and its logprobs' type (vLLM's modules)
    ("floor", ["nanovllm.core.*", "nanovllm.sampling_params", "nanovllm.inputs", "nanovllm.logprobs",
               "nanovllm.outputs", "nanovllm.version"]),
    ("config", ["nanovllm.config", "nanovllm.utils.*"]),
    ("offload", ["nanovllm_offload.*"]),  # the host tier: the floor, torch, config types
    ("kernels", ["nanovllm.kernels.*"]),
    ("layers", ["nanovllm.layers.*"]),
    ("models", ["nanovllm.models.*"]),
    ("engine", ["nanovllm.engine.*"]),
    ("llm", ["nanovllm.llm", "nanovllm"]),  # `nanovllm` is the package's __init__: LLM and SamplingParams
    ("entrypoints", ["nanovllm.entrypoints.*"]),
]
# the unit whose cycles count as package cycles: a subpackage, or a top-level module
UNIT_DEPTH = {"nanovllm": 2, "nanovllm_offload": 1}
TORCH_FREE = ["nanovllm.core.*", "nanovllm.sampling_params", "nanovllm.inputs", "nanovllm.logprobs", "nanovllm.config",
              "nanovllm.utils.quant_spec", "nanovllm.utils.gguf_model",
              "nanovllm.outputs", "nanovllm.engine.scheduler", "nanovllm.engine.step_plan",
              "nanovllm.engine.output_processor", "nanovllm.engine.request_intake",
              "nanovllm.engine.penalties", "nanovllm.engine.logit_rules", "nanovllm.engine.parallel_sampling",
              "nanovllm_offload.host_block_pool",
              "nanovllm_offload.policy", "nanovllm_offload.host_memory", "nanovllm_offload.offload_manager",
              "nanovllm_offload.transfer_report", "nanovllm_offload.swap_in_allocation"]


def module_files(root: pathlib.Path) -> dict[str, pathlib.Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the project modules it imports (`from a import b` counts as a.b when b is a module)."""
    files = module_files(root)
    graph = {}
    for name, path in files.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names)
        graph[name] = set()
        for target in targets:
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def matches(module: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        return module == pattern[:-2] or module.startswith(pattern[:-1])
    return module == pattern


def layer_of(module: str) -> int:
    best = max(((len(pattern), i) for i, (_, patterns) in enumerate(LAYERS) for pattern in patterns
                if matches(module, pattern)), default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


def modules_without_layer(root: pathlib.Path = ROOT) -> list[str]:
    return [module for module in sorted(module_files(root))
            if not any(matches(module, pattern) for _, patterns in LAYERS for pattern in patterns)]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
            for a, targets in sorted(graph.items()) for b in sorted(targets) if layer_of(b) > layer_of(a)]


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    def unit(module):
        parts = module.split(".")
        return ".".join(parts[:UNIT_DEPTH[parts[0]]])
    units = {}
    for a, targets in graph.items():
        units.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    return units


def violations(root: pathlib.Path = ROOT) -> list[str]:
    graph = import_graph(root)
    found = upward_imports(graph)
    found += [f"module cycle {c}" for c in cycles(graph)]
    found += [f"package cycle {c}" for c in cycles(unit_graph(graph))]
    found += [f"{a} imports {b}: the host tier must not know the engine" for a, targets in sorted(graph.items())
              if a.startswith("nanovllm_offload") for b in sorted(targets) if b.startswith("nanovllm.engine")]
    return found


def test_imports_run_downward_without_cycles():
    assert violations() == []


@pytest.mark.parametrize("plant", [
    ("nanovllm/core/sequence.py", "from nanovllm.engine.scheduler import Scheduler"),  # upward
    ("nanovllm/engine/output_processor.py", "import nanovllm.engine.llm_engine"),  # a cycle inside the engine
    ("nanovllm_offload/host_kv_cache.py", "from nanovllm.engine import scheduler"),  # offload -> engine
])
def test_a_planted_violation_is_found(tmp_path, plant):
    copy_packages(tmp_path)
    path, line = plant
    with open(tmp_path / path, "a") as f:
        f.write(f"\n{line}\n")
    assert violations(tmp_path), plant


def test_every_module_has_a_layer():
    assert modules_without_layer() == []


@pytest.mark.parametrize("path", ["nanovllm/planted.py", "nanovllm/newpackage/__init__.py"])
def test_a_module_outside_every_layer_is_found(tmp_path, path):
    """The package's own name holds only its __init__: a new top-level module or package must be given a layer."""
    copy_packages(tmp_path)
    (tmp_path / path).parent.mkdir(exist_ok=True)
    (tmp_path / path).write_text("import nanovllm.core.sequence\n")
    assert modules_without_layer(tmp_path) == [path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")]


@pytest.mark.subprocess
def test_the_metadata_floor_imports_without_torch():
    modules = [m for pattern in TORCH_FREE for m in module_files(ROOT) if matches(m, pattern)]
    code = ("import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
            + "".join(f"import {m}\n" for m in modules)
            + "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok" and len(modules) > 10


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
# Files are judged by job, not by lines: a file over MAX_FILE_LINES names here the one job that keeps it whole.
LONG_FILES: dict[str, str] = {}
# A function over MAX_FUNCTION_LINES names here why it is one piece.
LONG_FUNCTIONS = {
    "nanovllm.kernels.decode_attention._decode_kernel":
        "a Triton kernel: its loads, split-K loop and stores share registers and masks",
    "nanovllm.kernels.paged_common.attend_tile":
        "a Triton device function inlined into both attention kernels: one tile's online softmax",
    "nanovllm.kernels.prefill_attention._prefill_kernel":
        "a Triton kernel: its loads, causal loop and stores share registers and masks",
}


def sizes(root: pathlib.Path = ROOT) -> tuple[dict[str, int], dict[str, int]]:
    """Lines per production file and per function (methods as module.Class.method), nested ones included."""
    file_lines, function_lines = {}, {}
    for module, path in module_files(root).items():
        text = path.read_text()
        file_lines[module] = text.count("\n")
        tree = ast.parse(text)
        for parent in ast.walk(tree):
            prefix = module if parent is tree else None
            if isinstance(parent, ast.ClassDef):
                prefix = f"{module}.{parent.name}"
            elif isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
                prefix = f"{module}.{parent.name}"
            for node in ast.iter_child_nodes(parent):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and prefix is not None:
                    function_lines[f"{prefix}.{node.name}"] = node.end_lineno - node.lineno + 1
    return file_lines, function_lines


def oversized(root: pathlib.Path = ROOT) -> list[str]:
    """Files over 400 lines and functions over 60 that no allow-list names, and allow-list entries that are no
    longer long (an allow-list that outlives its reason would excuse the next long function of that name)."""
    file_lines, function_lines = sizes(root)
    found = [f"{m}: {n} lines" for m, n in sorted(file_lines.items()) if n > MAX_FILE_LINES and m not in LONG_FILES]
    found += [f"{f}: {n} lines" for f, n in sorted(function_lines.items())
              if n > MAX_FUNCTION_LINES and f not in LONG_FUNCTIONS]
    found += [f"{m}: allowed in LONG_FILES but {file_lines.get(m, 0)} lines" for m in LONG_FILES
              if file_lines.get(m, 0) <= MAX_FILE_LINES]
    found += [f"{f}: allowed in LONG_FUNCTIONS but {function_lines.get(f, 0)} lines" for f in LONG_FUNCTIONS
              if function_lines.get(f, 0) <= MAX_FUNCTION_LINES]
    return found


def test_files_and_functions_stay_small():
    assert oversized() == []


def copy_packages(root: pathlib.Path) -> pathlib.Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_an_oversized_function_and_file_are_found(tmp_path):
    copy = copy_packages(tmp_path)
    body = "".join(f"        x{i} = {i}\n" for i in range(61))
    (copy / "nanovllm" / "core" / "planted.py").write_text(f"class Planted:\n    def method(self):\n{body}")
    (copy / "nanovllm" / "core" / "long.py").write_text("x = 1\n" * 401)
    assert oversized(copy) == ["nanovllm.core.long: 401 lines", "nanovllm.core.planted.Planted.method: 62 lines"]


def test_a_stale_allowance_is_found(tmp_path, monkeypatch):
    monkeypatch.setitem(LONG_FUNCTIONS, "nanovllm.core.sequence.Sequence.__init__", "planted")
    monkeypatch.setitem(LONG_FILES, "nanovllm.core.sequence", "planted")
    found = oversized()
    assert any(f.startswith("nanovllm.core.sequence.Sequence.__init__: allowed") for f in found), found
    assert any(f.startswith("nanovllm.core.sequence: allowed") for f in found), found
