"""The host KV pool pins exactly what swap_space asks: its pages are registered with cudaHostRegister (stubbed on
the CPU), not allocated by PyTorch's pinned allocator, which rounds up to a power of two (40 GiB would lock 64)."""
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import nanovllm_offload.host_kv_cache as host_kv_cache
import nanovllm_offload.host_memory as host_memory
from nanovllm_offload.host_kv_cache import HostKVCache
from nanovllm_offload.host_memory import GiB, check_host_memory

BLOCK_SHAPE = (2, 2, 4, 1, 32)  # layers, K/V, block_size, kv heads, head_dim: 2 KiB per float32 block


class StubCudart:
    """Records the register / unregister calls that torch.cuda.cudart() would make; 0 is cudaSuccess."""

    def __init__(self, result: int = 0):
        self.calls, self.result = [], result

    def cudaHostRegister(self, ptr, num_bytes, flags):
        self.calls.append(("register", ptr, num_bytes, flags))
        return self.result

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


@pytest.fixture()
def cudart(monkeypatch):
    stub = StubCudart()
    monkeypatch.setattr(host_kv_cache, "_cudart", lambda: stub)
    return stub


def test_the_pool_registers_exactly_the_bytes_asked(cudart):
    # 3 blocks of 2 KiB: 6 KiB, not a power of two, so a rounding allocator would lock 8 KiB
    cache = HostKVCache(3, BLOCK_SHAPE, torch.float32, pin_memory=True)
    num_bytes = cache.kv.numel() * cache.kv.element_size()
    assert num_bytes == 3 * 2048 and cache.num_blocks == 3
    ptr = cache.kv.data_ptr()
    assert cudart.calls == [("register", ptr, 3 * 2048, 1)]  # 1: cudaHostRegisterPortable
    cache.close()
    cache.close()  # twice: unregistered once
    assert cudart.calls[1:] == [("unregister", ptr)]


def test_the_pages_are_unregistered_when_the_pool_is_freed_without_close(cudart):
    cache = HostKVCache(2, BLOCK_SHAPE, torch.float16, pin_memory=True)
    ptr = cache.kv.data_ptr()
    del cache
    assert cudart.calls == [("register", ptr, 2 * 1024, 1), ("unregister", ptr)]


def test_nothing_is_pinned_on_the_cpu(cudart):
    HostKVCache(3, BLOCK_SHAPE, torch.float32, pin_memory=False).close()
    assert cudart.calls == []


def test_a_failed_registration_says_what_to_lower(monkeypatch):
    monkeypatch.setattr(host_kv_cache, "_cudart", lambda: StubCudart(result=2))
    with pytest.raises(RuntimeError, match=r"cudaHostRegister of 0\.00 GiB failed with cudaError 2.*swap_space"):
        HostKVCache(3, BLOCK_SHAPE, torch.float32, pin_memory=True)


def test_the_memory_check_counts_the_exact_size(monkeypatch):
    """40 GiB fits in 50 GiB available (the pool locks 40, not the 64 a power-of-two rounding would); every rank's
    pool counts."""
    monkeypatch.setattr(host_memory.psutil, "virtual_memory", lambda: SimpleNamespace(available=50 * GiB))
    check_host_memory(40 * GiB, 1, 40, pinned=True)  # no error: it fits
    with pytest.raises(ValueError, match=r"swap_space=46 GiB needs 46\.0 GiB of pinned memory per rank x 1 rank"
                                         r"\(s\), but only 50\.0 GiB .* lower swap_space"):
        check_host_memory(46 * GiB, 1, 46, pinned=True)
    with pytest.raises(ValueError, match="x 2 rank"):
        check_host_memory(24 * GiB, 2, 24, pinned=True)


GPU_SCRIPT = textwrap.dedent("""
    import time
    import torch
    from nanovllm_offload.host_kv_cache import HostKVCache
    cache = HostKVCache(3 * 8192, (2, 2, 16, 8, 128), torch.bfloat16, pin_memory=True)  # 3 GiB: not a power of two
    assert cache.kv.numel() * cache.kv.element_size() == 3 << 30
    assert cache.kv.is_pinned(), "the pool's pages are not registered"
    gpu = torch.empty(cache.kv[:8192].shape, dtype=cache.kv.dtype, device="cuda")
    gpu[:1].copy_(cache.kv[:1], non_blocking=True)  # the process's first copy sets up CUDA's copy path: not timed
    torch.cuda.synchronize()
    start = time.perf_counter()
    gpu.copy_(cache.kv[:8192], non_blocking=True)  # 1 GiB (blocks of 128 KiB): tens of ms over any link
    call_s = time.perf_counter() - start
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - start
    assert call_s < 0.2 * copy_s, f"the copy call took {call_s:.4f} s of the copy's {copy_s:.4f} s: not asynchronous"
    cache.close()
    assert not cache.kv.is_pinned()
    print("ok")
""")


@pytest.mark.gpu
def test_on_cuda_the_pool_is_registered_and_copies_from_it_are_asynchronous():
    proc = subprocess.run([sys.executable, "-c", GPU_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
