"""The KV sizing arithmetic (nanovllm/core/memory_plan.py): stubbed measurements give exact block counts; and the
batch limits a card under 70 GiB gets."""
from types import SimpleNamespace

import pytest
from conftest import close_llm, tiny_llm_kwargs

from nanovllm.core.memory_plan import GiB, format_breakdown, plan_kv_blocks

MiB = 1 << 20


def test_every_term_is_subtracted_once():
    # 8 GiB x 0.9 = 7.2 GiB usable; 3.2 + 1 + 0.25 + 0.5 GiB spent -> 2.25 GiB of 28 MiB blocks = 82 blocks
    num_blocks, b = plan_kv_blocks(8 * GiB, 0.9, int(3.2 * GiB), 1 * GiB, GiB // 4, GiB // 2, 28 * MiB)
    assert num_blocks == (int(8 * GiB * 0.9) - int(3.2 * GiB) - GiB - GiB // 4 - GiB // 2) // (28 * MiB) == 82
    assert b["kv"] == 82 * 28 * MiB
    assert b["usable"] == int(8 * GiB * 0.9)
    parts = ("weights", "activation_peak", "graph_pools", "non_torch", "kv", "left_free")
    assert sum(b[k] for k in parts) == 8 * GiB  # every byte of the card is in exactly one term


def test_activation_peak_not_taken_twice():
    # the old rule took (peak - current) off a `total - free` that already held it: 1 GiB less KV here
    num_blocks, _ = plan_kv_blocks(10 * GiB, 1.0, 2 * GiB, 1 * GiB, 0, 0, GiB)
    assert num_blocks == 7


def test_cap_and_no_room():
    assert plan_kv_blocks(10 * GiB, 1.0, 0, 0, 0, 0, GiB, max_blocks=3)[0] == 3
    num_blocks, b = plan_kv_blocks(4 * GiB, 0.9, 4 * GiB, 0, 0, 0, MiB)
    assert num_blocks == 0 and b["kv"] == 0 and b["left_free"] == 0


def test_log_line_names_every_term():
    line = format_breakdown(plan_kv_blocks(8 * GiB, 0.9, 3 * GiB, GiB, 0, GiB // 2, 64 * MiB)[1])
    for word in ("weights 3.00", "activation peak 1.00", "graph pools 0.00", "other (non-torch) 0.50", "KV 2.69",
                 "(43 blocks)", "left free 0.81"):
        assert word in line, (word, line)


def test_engine_sizing_uses_the_measured_terms_once():
    import torch
    from nanovllm.config import Config
    from nanovllm.engine.kv_cache import num_blocks_for_budget
    from nanovllm.utils.presets import preset_dir
    config = Config(preset_dir("qwen3-1.7b"), device="cpu", max_model_len=4096, max_num_seqs=256,
                    gpu_memory_budget_gib=8)
    measured = dict(card_bytes=8 * GiB, weights_bytes=int(3.2 * GiB), activation_peak_bytes=GiB // 2,
                    graph_pool_bytes=GiB // 4, non_torch_bytes=GiB // 2)
    block_bytes = 7 * MiB  # Qwen3-1.7B, 64 tokens, bf16
    num_blocks, b = num_blocks_for_budget(config, block_bytes, torch.device("cuda"), lambda: measured, 1)
    assert num_blocks == (int(8 * GiB * 0.9) - int(4.45 * GiB)) // (7 * MiB) == 402 and b["num_blocks"] == 402
    config.num_kvcache_blocks = 100  # an explicit cap: the breakdown shows the memory it leaves free
    num_blocks, b = num_blocks_for_budget(config, block_bytes, torch.device("cuda"), lambda: measured, 1)
    assert num_blocks == 100 and b["kv"] == 700 * MiB and b["left_free"] == 8 * GiB - int(4.45 * GiB) - 700 * MiB


def test_the_model_holds_one_rope_table_for_all_layers():
    """Besides its weights a model holds one cos/sin table, whatever its depth: the layers share it (a table per
    layer was 28 x 20 MiB at Qwen3's 40,960 positions, KV that an 8 GiB card lost)."""
    import torch
    from nanovllm.config import SUPPORTED_ARCHITECTURES, Config
    from nanovllm.models.decoder import DecoderForCausalLM
    from nanovllm.utils.presets import preset_dir
    config = Config(preset_dir("qwen3-1.7b"), device="cpu", load_format="dummy")
    with torch.device("meta"):
        model = DecoderForCausalLM(config.hf_config, SUPPORTED_ARCHITECTURES[config.architecture])
    buffers = list(model.buffers())  # shared modules' buffers are listed once
    assert len(buffers) == 1 and buffers[0].shape == (40960, 128) and buffers[0].dtype == torch.float32
    layers = model.model.layers
    assert len(layers) == 28 and all(layer.self_attn.rotary_emb is layers[0].self_attn.rotary_emb for layer in layers)


def test_small_card_batch_limits_are_vllms_under_70_gib():
    """vLLM's batch limits, and the MLP of a large step in 2,048-row slices, under 70 GiB only."""
    from nanovllm.config import small_card_batch_limits
    assert small_card_batch_limits({}, 8 * GiB) == small_card_batch_limits({}, 70 * GiB - 1) == dict(
        max_num_seqs=256, max_num_batched_tokens=8192, mlp_chunk_tokens=2048)
    assert small_card_batch_limits({"max_num_seqs": 8, "mlp_chunk_tokens": None}, 8 * GiB) == dict(
        max_num_batched_tokens=8192)
    assert small_card_batch_limits({}, 70 * GiB) == small_card_batch_limits({}, None) == {}


@pytest.mark.parametrize("device, budget_gib, expected", [
    ("auto", None, 80 * GiB), ("cuda", 8, 8 * GiB), ("auto", 8.5, int(8.5 * GiB)), ("auto", 100, 80 * GiB),
    ("auto", float("inf"), 80 * GiB), ("auto", -1, 80 * GiB), ("auto", True, 80 * GiB),  # Config rejects these
    ("cpu", 8, None), ("tpu", 8, None),
])
def test_the_card_is_the_gpu_or_the_smaller_budget(monkeypatch, device, budget_gib, expected):
    import numpy as np
    import torch
    from nanovllm.engine.device import card_memory_bytes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(total_memory=80 * GiB))
    assert card_memory_bytes(device, budget_gib) == expected
    if isinstance(budget_gib, int) and not isinstance(budget_gib, bool):
        assert card_memory_bytes(device, np.int64(budget_gib)) == expected  # any real number Config accepts


def test_a_cuda_that_cannot_answer_leaves_configs_defaults(monkeypatch):
    import torch
    from nanovllm.engine.device import card_memory_bytes

    def no_properties(index):
        raise RuntimeError("CUDA driver initialization failed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_properties)
    assert card_memory_bytes("cuda", 8) is None  # the runner's start-up reports the real error


@pytest.mark.parametrize("card_gib, passed, expected", [
    (8, {}, (256, 8192)),
    (8, dict(max_num_seqs=64, max_num_batched_tokens=1024), (64, 1024)),  # what the caller passes wins
    (8, dict(max_num_seqs=600), (600, 8192)),
    (80, {}, (512, 16384)),
    (None, {}, (512, 16384)),
], ids=["8gib", "8gib_passed", "8gib_one_passed", "80gib", "cpu"])
def test_the_engine_takes_the_cards_batch_limits_unless_passed(qwen3_dir, monkeypatch, card_gib, passed, expected):
    import nanovllm.engine.device as device
    from nanovllm import LLM
    seen = []

    def stub_card(device, budget_gib):
        seen.append((device, budget_gib))
        return None if card_gib is None else card_gib * GiB

    monkeypatch.setattr(device, "card_memory_bytes", stub_card)
    kwargs = tiny_llm_kwargs(gpu_memory_budget_gib=card_gib)
    del kwargs["max_num_seqs"], kwargs["max_num_batched_tokens"]
    llm = LLM(qwen3_dir, **kwargs, **passed)
    try:
        assert seen == [("cpu", card_gib)]
        config, scheduler = llm.config, llm.scheduler
        assert (config.max_num_seqs, config.max_num_batched_tokens) == expected
        assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == expected
    finally:
        close_llm(llm)


class FakeDriver:
    """libcuda's two limit calls, recording what the engine asks."""
    def __init__(self, rc=0):
        self.rc, self.calls = rc, []

    def cuCtxSetLimit(self, limit, value):
        self.calls.append((limit, value.value))
        return self.rc


@pytest.mark.parametrize("device, switch_on, rc, expected_calls, released", [
    ("cuda", True, 0, [(0, 0)], True),     # CU_LIMIT_STACK_SIZE (0) set to 0 bytes
    ("cuda", True, 1, [(0, 0)], False),    # the driver refused: the default stays, no error
    ("cuda", False, 0, [], False),         # NANOVLLM_CUDA_STACK=0
    ("cpu", True, 0, [], False),
])
def test_the_stack_reservation_is_released_once_on_cuda(monkeypatch, switches, device, switch_on, rc,
                                                       expected_calls, released):
    import torch

    from nanovllm.engine import memory_profile
    driver = FakeDriver(rc)
    monkeypatch.setattr(memory_profile, "_driver", lambda: driver)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (0, 0))
    switches(release_cuda_stack=switch_on)
    assert memory_profile.release_stack_reservation(torch.device(device)) is released
    assert driver.calls == expected_calls
