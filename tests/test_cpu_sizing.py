"""What the engine reserves on the CPU: a KV cache of what was asked or of a stated share of the available memory
(capped by what max_num_seqs x max_model_len can use), no host tier unless asked for, and one start-up line each."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from conftest import close_llm
from nanovllm import LLM
from nanovllm.core.memory_plan import GiB
from nanovllm.engine.kv_cache import CPU_KV_MAX_BYTES, CPU_KV_MEMORY_FRACTION

# what a user passes: no cache options, no host-tier options
PLAIN = dict(device="cpu", dtype="float32", enforce_eager=True, max_model_len=256, kvcache_block_size=16)


def start(model_dir, caplog, **kwargs):
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        llm = LLM(model_dir, **{**PLAIN, **kwargs})
    lines = [r.getMessage() for r in caplog.records]
    return llm, [line for line in lines if line.startswith(("KV cache:", "CPU: no host tier"))]


def fake_available(monkeypatch, available_bytes: int):
    import psutil
    real = psutil.virtual_memory
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(**{**real()._asdict(),
                                                                            "available": available_bytes}))


def test_default_cpu_kv_is_a_share_of_available_memory_and_no_host_tier(qwen3_dir, caplog, monkeypatch):
    fake_available(monkeypatch, 64 << 20)  # the tiny model's 512 x 256 tokens would need 128 MiB
    llm, lines = start(qwen3_dir, caplog, max_num_seqs=512)
    try:
        expected = int((64 << 20) * CPU_KV_MEMORY_FRACTION) // llm.block_bytes
        assert expected * llm.block_bytes < CPU_KV_MAX_BYTES
        assert llm.num_gpu_blocks == expected
        assert llm.host_tier is None and llm.runner.host_cache is None
        assert llm.stats()["num_cpu_blocks"] == 0
        assert lines[0] == "CPU: no host tier (host and device memory are the same RAM); pass swap_space to have one"
        assert lines[1].startswith(f"KV cache: {expected} blocks of 16 tokens, ") and "10% of the available" in lines[1]
    finally:
        close_llm(llm)


def test_the_cpu_kv_is_capped_by_what_the_batch_limits_can_use(qwen3_dir, caplog, monkeypatch):
    fake_available(monkeypatch, 64 * GiB)
    llm, lines = start(qwen3_dir, caplog, max_num_seqs=2)
    try:
        assert llm.num_gpu_blocks == 2 * (256 // 16)  # two sequences of max_model_len
        assert "max_num_seqs=2 x max_model_len=256" in lines[-1]
    finally:
        close_llm(llm)


def test_what_was_asked_is_what_is_reserved(qwen3_dir, caplog):
    llm, lines = start(qwen3_dir, caplog, kv_cache_memory_bytes=1 << 20)
    try:
        assert llm.num_gpu_blocks == (1 << 20) // llm.block_bytes
        assert "(kv_cache_memory_bytes=1048576;" in lines[-1]
    finally:
        close_llm(llm)


@pytest.mark.parametrize("asked", [dict(swap_space=0.01), dict(preemption_mode="swap"),
                                   dict(host_cache_policy="write_through")],
                         ids=["swap_space", "preemption_mode", "host_cache_policy"])
def test_the_host_tier_runs_on_the_cpu_when_asked_for(qwen3_dir, caplog, asked):
    llm, lines = start(qwen3_dir, caplog, num_kvcache_blocks=16, **asked)
    try:
        assert llm.host_tier is not None and llm.host_tier.num_blocks > 0
        assert not any(line.startswith("CPU: no host tier") for line in lines)
    finally:
        close_llm(llm)
