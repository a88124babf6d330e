"""What the test suite costs, and the order it is spent in.

`pytest --cpu-durations N` lists the N tests that cost the most CPU time (0: all) and the suite's sum. Wall time
lies on a shared machine (a test waits for cores other jobs hold); CPU time does not. Each phase (setup, call,
teardown) is charged the process's CPU time (all its threads) plus that of the child processes it waited for (the
CLI's and the server's subprocesses) and, once the process has started a forkserver (nanovllm.utils.fresh_process),
of the children still running, with what they waited for. A session fixture is charged to the first test that uses it.

Under pytest-xdist, HEAVIEST_MODULES_FIRST orders the modules the workers take (pyproject.toml's addopts).
"""
from __future__ import annotations

import resource
import sys
import time

import pytest

# The test modules that cost the most CPU time (pytest --cpu-durations, summed per module), heaviest first: every
# module of 4 CPU-s or more. Under pytest-xdist (`--dist loadfile --no-loadscope-reorder`, pyproject.toml) each
# module runs whole on one worker, so a module-scoped engine or server is built once, and the modules go out in
# this order, then the rest in collection order: the last to go out cost a few CPU-s at most, so neither worker
# waits long for the other at the end. A stale list costs balance, never a test.
HEAVIEST_MODULES_FIRST = [
    "test_quant_perplexity.py",  # GPTQ of four formats and five perplexity runs on SmolLM2: 83 CPU-s alone
    "test_triton_compile.py",  # 72 CPU-s with Triton's cache empty (a fresh machine), 4 with it warm
    "test_server.py", "test_fp8_accuracy.py", "test_engine_e2e.py", "test_triton_interpreter.py",
    "test_tensor_parallel.py",
    "test_quant_kernels_compile.py",  # 22 CPU-s with Triton's cache empty, 4 with it warm
    "test_hostile_server.py", "test_hf_parity.py", "test_logprobs.py", "test_gguf_engine.py", "test_docs_snippets.py",
    "test_structured_outputs.py", "test_async_scheduling.py", "test_quant_formats.py", "test_quant_kernels.py",
    "test_quant_kernels_residual.py",
    "test_disk_tier.py", "test_tool_server.py", "test_cli_chat.py", "test_quant_decode_kernels.py", "test_fp8_kv.py",
    "test_bench_agent_replay.py", "test_sampler.py", "test_anthropic.py", "test_vllm_script.py",
    "test_verify_swap.py",  # its checks' forkserver (~4 CPU-s) is no child --cpu-durations waits for
    "test_quant_kernels_plans.py", "test_sweep_w4.py", "test_tp_failure.py", "test_hostile_engine.py",
    "test_server_vllm.py", "test_bench_restart.py", "test_bench.py",
]


class HeaviestModulesFirst:
    """A plugin of its own: a conftest has one pytest_collection_modifyitems, and this one must wrap all others."""

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, items):
        """After every other reordering: the heaviest modules first, each module's tests in their own order (a
        stable sort by module)."""
        result = yield
        rank = {name: i for i, name in enumerate(HEAVIEST_MODULES_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
        return result


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # on pytest-xdist's workers only: a run without -n keeps pytest's order
        config.pluginmanager.register(HeaviestModulesFirst(), "heaviest-modules-first")


# ---------------------------------------------------------------- --cpu-durations


def pytest_addoption(parser):
    parser.addoption("--cpu-durations", type=int, default=None, metavar="N",
                     help="list the N tests that cost the most CPU time (0: all) and the whole suite's sum")


def _cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime + _running_children_cpu_seconds()


def _running_children_cpu_seconds() -> float:
    """The CPU time of this process's children still running, with that of the children they waited for. A
    forkserver outlives the tests that use it and is never waited for: without this, what it and the processes
    forked from it spend would be charged to no test. A child counted here while running and later waited for is
    counted once: the phase that waits gains its total and loses what it had here. 0 until this process has started
    a forkserver (listing the children costs about a millisecond, which every test would pay)."""
    if "multiprocessing.forkserver" not in sys.modules:
        return 0.0
    import psutil
    total = 0.0
    for child in psutil.Process().children():
        try:
            times = child.cpu_times()
        except psutil.Error:  # one that ended meanwhile
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if item.config.getoption("cpu_durations") is not None:
        started = item.stash.get(_CPU_PHASE_START, None)
        if started is not None:
            outcome.get_result().user_properties.append(("cpu_s", _cpu_seconds() - started))
        item.stash[_CPU_PHASE_START] = _cpu_seconds()  # the next phase starts here


_CPU_PHASE_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    if item.config.getoption("cpu_durations") is not None:
        item.stash[_CPU_PHASE_START] = _cpu_seconds()
    yield


_cpu_s_by_test: dict[str, float] = {}


def pytest_runtest_logreport(report):
    # runs in the controller too under pytest-xdist: the user_properties come back with the report
    for name, value in report.user_properties:
        if name == "cpu_s":
            _cpu_s_by_test[report.nodeid] = _cpu_s_by_test.get(report.nodeid, 0.0) + value


def pytest_terminal_summary(terminalreporter, config):
    num_shown = config.getoption("cpu_durations")
    if num_shown is None or not _cpu_s_by_test:
        return
    ranked = sorted(_cpu_s_by_test.items(), key=lambda item: -item[1])
    terminalreporter.write_sep("=", f"CPU time per test (process + its children), top {num_shown or 'all'}")
    for nodeid, cpu_s in ranked[:num_shown or None]:
        terminalreporter.write_line(f"{cpu_s:9.2f}s  {nodeid}")
    terminalreporter.write_line(f"{sum(_cpu_s_by_test.values()):9.2f}s  CPU in all, {len(ranked)} tests")
