"""Engines that share one GPU, each under its own gpu_memory_budget_gib (pytest-xdist's GPU workers, two small
engines on one card): a budget counts this process's memory alone, as NVML lists it, and other processes' memory
only where NVML cannot say; without a budget the card counts everything that is not this process's PyTorch memory
as taken. Run on the CPU against a stand-in NVML and CUDA."""
import ctypes
import os
from types import SimpleNamespace

import pytest
import torch

from nanovllm.core.memory_plan import GiB
from nanovllm.engine import memory_profile
from nanovllm.utils.nvml import NVML_VALUE_NOT_AVAILABLE, ProcessInfo, process_gpu_bytes

UUID = "GPU-5e1f0c2a-0000-4000-8000-000000000001"


class StandInNvml:
    """libnvidia-ml's three calls that process_gpu_bytes makes, over a fixed list of (pid, bytes)."""

    def __init__(self, processes, known_uuid=UUID):
        self.processes, self.known_uuid = processes, known_uuid

    def nvmlDeviceGetHandleByUUID(self, uuid: bytes, handle):
        return 0 if uuid.decode() == self.known_uuid else 13  # NVML_ERROR_NOT_FOUND

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle, count, infos):
        for info, (pid, used) in zip(infos, self.processes):
            info.pid, info.used_gpu_memory = pid, used
        count._obj.value = len(self.processes)
        return 0


def test_nvml_gives_this_processs_memory_or_none():
    me, other = os.getpid(), os.getpid() + 1
    assert process_gpu_bytes(UUID, StandInNvml([(other, 9 * GiB), (me, 3 * GiB)])) == 3 * GiB
    assert process_gpu_bytes(UUID, StandInNvml([(other, 9 * GiB)])) is None  # a container's PIDs: not listed
    assert process_gpu_bytes(UUID, StandInNvml([(me, NVML_VALUE_NOT_AVAILABLE)])) is None
    assert process_gpu_bytes(UUID, StandInNvml([(me, GiB)], known_uuid="GPU-other")) is None
    old_driver = StandInNvml([(me, GiB)])
    old_driver.nvmlDeviceGetComputeRunningProcesses_v3 = None  # no such symbol: getattr's default
    assert process_gpu_bytes(UUID, old_driver) is None
    assert ctypes.sizeof(ProcessInfo) == 24  # nvmlProcessInfo_t's layout


@pytest.fixture
def shared_gpu(monkeypatch):
    """An 80 GiB GPU whose other processes hold 30 GiB; this one: 1 GiB reserved by PyTorch, 0.5 GiB of its own
    outside (the CUDA context), so 48.5 GiB are free. `nvml_sees_me=False`: NVML lists other PIDs only."""
    state = SimpleNamespace(nvml_sees_me=True)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: GiB)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(48.5 * GiB), 80 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(uuid=UUID[4:]))
    monkeypatch.setattr(memory_profile, "process_gpu_bytes",
                        lambda uuid: int(1.5 * GiB) if state.nvml_sees_me and uuid == UUID else None)
    fractions = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    state.fractions = fractions
    return state


def config(budget_gib):
    return SimpleNamespace(gpu_memory_budget_gib=budget_gib)


def test_a_budget_counts_only_this_processs_memory(shared_gpu):
    cuda = torch.device("cuda", 0)
    assert memory_profile.non_torch_bytes(config(6), cuda) == GiB // 2
    memory_profile.apply_budget(config(6), cuda)
    assert shared_gpu.fractions == [pytest.approx(5.5 / 80)]  # 6 GiB less the context, of the card
    shared_gpu.nvml_sees_me = False  # then the other processes' 30 GiB count as this one's, as before
    assert memory_profile.non_torch_bytes(config(6), cuda) == int(30.5 * GiB)
    with pytest.raises(ValueError, match=r"gpu_memory_budget_gib=6 leaves nothing for PyTorch"):
        memory_profile.apply_budget(config(6), cuda)


def test_the_whole_card_counts_other_processes_as_taken(shared_gpu):
    assert memory_profile.non_torch_bytes(config(None), torch.device("cuda", 0)) == int(30.5 * GiB)


def test_a_budget_beyond_what_is_free_beside_the_others_is_refused(shared_gpu):
    memory_profile.apply_budget(config(50), torch.device("cuda", 0))  # 48.5 free + 1.5 held: just fits
    with pytest.raises(ValueError, match=r"gpu_memory_budget_gib=51 is more than this process can get on cuda:0: "
                                         r"48.50 GiB free, .* lower gpu_memory_budget_gib"):
        memory_profile.apply_budget(config(51), torch.device("cuda", 0))
