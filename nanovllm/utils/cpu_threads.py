"""How many intra-op threads torch runs the CPU engine with.

torch starts one thread per core of the machine. A decode step of a small model is hundreds of tiny ops, each split
across the threads and joined again: when another process holds one of the cores, every op waits for the thread
that is not running, and 64 tokens of SmolLM2-135M on a 2-core machine took 6x longer at 2 threads than at 1
(docs/benchmarks.md, "CPU threads"). So the engine counts the cores this process may use (its affinity and its
cgroup's CPU quota, not the machine's core count), takes away the ones the load average says are busy, and runs one
thread where the model is too small to gain from more.

The user's own choice wins: the cpu_threads option, then OMP_NUM_THREADS / MKL_NUM_THREADS (torch already read
them), then a torch.set_num_threads call made before the engine started.
"""
from __future__ import annotations

import logging
import math
import os

logger = logging.getLogger(__name__)

THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# below this hidden size a decode row's matmuls (hidden^2 multiply-adds per projection, 0.3 M at 576) take
# microseconds, about what a fork and join of the thread pool costs: more threads only add the wait
SMALL_HIDDEN_SIZE = 1024
CGROUP_ROOT = "/sys/fs/cgroup"

_engine_num_threads: int | None = None  # what the engine set last: a later engine in the process may choose again
_logged: set[tuple[int, str]] = set()


def cgroup_cpu_limit(root: str = CGROUP_ROOT) -> float | None:
    """The CPUs the process's cgroup quota allows (quota / period, e.g. 1.5); None without a quota. Reads cgroup v2
    (cpu.max: "max 100000" or "150000 100000") and v1 (cpu.cfs_quota_us, -1 without a quota, and cpu.cfs_period_us)."""
    for directory in (os.path.join(root, _v2_path().lstrip("/")), root):
        text = _read(os.path.join(directory, "cpu.max"))
        if text:
            quota, period = (text.split() + ["100000"])[:2]
            return None if quota == "max" else int(quota) / int(period)
    for directory in (os.path.join(root, "cpu"), os.path.join(root, "cpu,cpuacct")):
        quota, period = _read(os.path.join(directory, "cpu.cfs_quota_us")), _read(
            os.path.join(directory, "cpu.cfs_period_us"))
        if quota and period:
            return None if int(quota) <= 0 else int(quota) / int(period)
    return None


def _v2_path() -> str:
    """This process's cgroup v2 path ("0::/path" in /proc/self/cgroup); "/" when unknown."""
    for line in (_read("/proc/self/cgroup") or "").splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return "/"


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except (OSError, ValueError):
        return None


def affinity_cores() -> int:
    """The cores of this process's affinity mask: torch's default thread count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def usable_cores(root: str = CGROUP_ROOT) -> int:
    """The cores this process may run on: its affinity mask, cut to its cgroup quota (rounded down: a quota of 1.5
    CPUs throttles a second busy thread)."""
    num_cores = affinity_cores()
    quota = cgroup_cpu_limit(root)
    if quota is not None:
        num_cores = min(num_cores, max(1, math.floor(quota)))
    return num_cores


def choose_num_threads(cpu_threads: int | None, hidden_size: int, num_ranks: int, num_usable_cores: int,
                       load_1min: float, env: dict, torch_num_threads: int,
                       torch_default_num_threads: int) -> tuple[int, str]:
    """(threads, why) for one rank. torch_num_threads is torch's count now: the user's when it differs from both
    torch's default (torch_default_num_threads: one per core of the affinity mask) and what the engine set
    before. load_1min: the machine's 1-minute load average, the cores other processes keep busy. It is the whole
    machine's: in a container on a busy host it also counts work on cores this process never runs on, and the
    count comes out low (one thread at worst, never more than the cores); cpu_threads sets it then."""
    if cpu_threads is not None:
        return cpu_threads, f"cpu_threads={cpu_threads}"
    for name in THREAD_ENV_VARS:
        if env.get(name):
            return torch_num_threads, f"{name}={env[name]} (torch's count, as that variable set it)"
    if torch_num_threads not in (torch_default_num_threads, _engine_num_threads):
        return torch_num_threads, "torch.set_num_threads was called before the engine started"
    cores = max(1, num_usable_cores // num_ranks)
    idle_cores = max(1, min(cores, math.floor(num_usable_cores - load_1min + 0.5) // num_ranks))
    why = f"{num_usable_cores} usable core(s), load average {load_1min:.2f}"
    if num_ranks > 1:
        why += f", {num_ranks} ranks"
    if hidden_size < SMALL_HIDDEN_SIZE:
        return 1, f"{why}; hidden_size={hidden_size} < {SMALL_HIDDEN_SIZE}: its ops are too small to split"
    return idle_cores, f"{why}: one thread per idle core"


def set_cpu_threads(cpu_threads: int | None, hidden_size: int, num_ranks: int) -> int:
    """Choose the count for this process (choose_num_threads), set it in torch and log it once; returns it."""
    global _engine_num_threads
    import torch
    num_threads, why = choose_num_threads(cpu_threads, hidden_size, num_ranks, usable_cores(), os.getloadavg()[0],
                                          dict(os.environ), torch.get_num_threads(), affinity_cores())
    if num_threads != torch.get_num_threads():
        torch.set_num_threads(num_threads)
    _engine_num_threads = num_threads
    if (num_threads, why) not in _logged:
        _logged.add((num_threads, why))
        logger.info("CPU: %d intra-op thread(s) (%s); set cpu_threads or OMP_NUM_THREADS to change it",
                    num_threads, why)
    return num_threads
