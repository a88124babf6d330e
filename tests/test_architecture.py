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

# lowest first; a module may import modules of its own layer or of a lower one. The longest matching prefix names a
# module's layer.
LAYERS = [
    # metadata, request checks; a request's options and its logprobs' type (vLLM's modules)
    ("floor", ["nanovllm.core", "nanovllm.sampling_params", "nanovllm.inputs", "nanovllm.logprobs"]),
    ("config", ["nanovllm.config", "nanovllm.utils"]),
    ("offload", ["nanovllm_offload"]),  # the host tier: the floor, torch, config types
    ("kernels", ["nanovllm.kernels"]),
    ("layers", ["nanovllm.layers"]),
    ("models", ["nanovllm.models"]),
    ("engine", ["nanovllm.engine"]),
    ("llm", ["nanovllm.llm", "nanovllm"]),  # `nanovllm` is the package's __init__: LLM and SamplingParams
    ("entrypoints", ["nanovllm.entrypoints"]),
]
# the unit whose cycles count as package cycles: a subpackage, or a top-level module
UNIT_DEPTH = {"nanovllm": 2, "nanovllm_offload": 1}
TORCH_FREE = ["nanovllm.core.*", "nanovllm.sampling_params", "nanovllm.inputs", "nanovllm.logprobs", "nanovllm.config",
              "nanovllm.utils.quant_spec", "nanovllm.utils.gguf_model",
              "nanovllm.engine.scheduler", "nanovllm.engine.step_plan", "nanovllm.engine.output",
              "nanovllm.engine.penalties",
              "nanovllm_offload.host_block_pool",
              "nanovllm_offload.policy", "nanovllm_offload.host_memory", "nanovllm_offload.host_tier"]


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


def layer_of(module: str) -> int:
    best = max(((len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
                if module == prefix or module.startswith(prefix + ".")), default=None)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")
    return best[1]


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


# known violations that another change under way removes (the server split breaks the CLI <-> server cycle);
# delete an entry once it no longer occurs
def test_imports_run_downward_without_cycles():
    assert violations() == []


@pytest.mark.parametrize("plant", [
    ("nanovllm/core/sequence.py", "from nanovllm.engine.scheduler import Scheduler"),  # upward
    ("nanovllm/engine/output.py", "import nanovllm.engine.llm_engine"),  # a cycle inside the engine
    ("nanovllm_offload/host_kv_cache.py", "from nanovllm.engine import scheduler"),  # offload -> engine
])
def test_a_planted_violation_is_found(tmp_path, plant):
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    path, line = plant
    with open(tmp_path / path, "a") as f:
        f.write(f"\n{line}\n")
    assert violations(tmp_path), plant


def test_every_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_the_metadata_floor_imports_without_torch():
    modules = [m for pattern in TORCH_FREE for m in module_files(ROOT)
               if m == pattern or (pattern.endswith(".*") and m.startswith(pattern[:-1]))]
    code = ("import sys\nsys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
            + "".join(f"import {m}\n" for m in modules)
            + "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\nprint('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok" and len(modules) > 10


MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def oversized(root: pathlib.Path = ROOT) -> list[str]:
    """Production files over 400 lines and functions over 60. Triton kernels (@triton.jit) are excepted: each says
    in a comment why it is one piece (a kernel's loads, loop and stores share registers and masks)."""
    found = []
    for module, path in module_files(root).items():
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            found.append(f"{module}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                is_kernel = any("jit" in ast.unparse(d) for d in node.decorator_list)
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and not is_kernel:
                    found.append(f"{module}.{node.name}: {length} lines")
    return found


def test_files_and_functions_stay_small():
    assert oversized() == []


def test_an_oversized_function_is_found(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "nanovllm", copy / "nanovllm")
    shutil.copytree(ROOT / "nanovllm_offload", copy / "nanovllm_offload")
    body = "".join(f"    x{i} = {i}\n" for i in range(61))
    (copy / "nanovllm" / "core" / "planted.py").write_text(f"def planted():\n{body}")
    assert oversized(copy) == ["nanovllm.core.planted.planted: 62 lines"]
