"""A step's plan and its packed input tensors, exactly: the decode fast path against the general loop, cache
slots per block against the per-token formula, and every packed part 16-byte aligned with its values intact."""
import random

import pytest
import torch

from nanovllm.engine.step_inputs import PackedInputs
from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.core.sequence import PLACEHOLDER_TOKEN
from nanovllm.engine.step_plan import StepPlan, _fill_decode_rows, _fill_rows, _slots, make_plan
from metadata_factories import make_seq


def decode_seqs(num_seqs: int, block_size: int, rng: random.Random):
    """Sequences with a random context, a table just long enough, and a placeholder last token on some."""
    seqs = []
    for i in range(num_seqs):
        seq = make_seq(num_tokens=rng.randint(1, 5 * block_size), start=10 + i)
        seq.num_computed_tokens = seq.num_tokens - 1
        seq.block_table = rng.sample(range(1000), seq.num_blocks_for(seq.num_tokens))
        if rng.random() < 0.5:
            seq.token_ids[-1] = PLACEHOLDER_TOKEN
            seq.sample_row = rng.randint(0, num_seqs - 1)
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("seed", range(5))
def test_decode_rows_equal_the_general_loop(seed):
    rng = random.Random(seed)
    seqs = decode_seqs(rng.randint(1, 40), 4, rng)
    fast, loop = StepPlan(), StepPlan()
    _fill_decode_rows(fast, seqs, 4)
    _fill_rows(loop, seqs, [1] * len(seqs), 4)
    for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "placeholder_rows", "placeholder_sources"):
        assert getattr(fast, name) == getattr(loop, name), name


@pytest.mark.parametrize("seed", range(3))
def test_a_decode_plan_takes_its_slots_from_the_blocks_the_scheduler_named(seed):
    """The scheduler names the blocks a step writes once (written_gpu_block_ids); a decode plan carries that list
    to the copy engine and computes its slots from it, as the per-token loop would."""
    rng = random.Random(seed)
    seqs = decode_seqs(rng.randint(1, 40), 4, rng)
    out = SchedulerOutput(seqs=seqs, num_new_tokens=[1] * len(seqs), samples=[True] * len(seqs))
    out.name_written_blocks(4)
    assert out.written_gpu_block_ids == [seq.block_table[-1] for seq in seqs]  # the last token's block
    plan, _ = make_plan(out, 4)
    loop = StepPlan()
    _fill_rows(loop, seqs, [1] * len(seqs), 4)
    assert plan.written_gpu_block_ids is out.written_gpu_block_ids and plan.slot_mapping == loop.slot_mapping


def test_a_mixed_step_names_each_rows_blocks_in_order():
    a, b = make_seq(num_tokens=9), make_seq(num_tokens=6)
    a.block_table, b.block_table = [7, 8, 9], [3, 4]
    a.num_computed_tokens, b.num_computed_tokens = 8, 1  # a decodes position 8; b computes positions 1-5
    out = SchedulerOutput(seqs=[a, b], num_new_tokens=[1, 5], samples=[True, True])
    out.name_written_blocks(4)
    assert out.written_gpu_block_ids == [9, 3, 4]


def test_make_plan_logits_indices_and_sample_seqs_of_a_mixed_step():
    seqs = decode_seqs(2, 4, random.Random(0)) + [make_seq(num_tokens=9), make_seq(num_tokens=6)]
    for seq in seqs[2:]:
        seq.block_table = [7, 8, 9]
    out = SchedulerOutput(seqs=seqs, num_new_tokens=[1, 1, 5, 6], samples=[True, True, False, True])
    plan, sample_seqs = make_plan(out, 4)
    assert plan.query_lens == [1, 1, 5, 6]
    assert plan.logits_indices == [0, 1, 12]  # token rows 0, 1, then 2-6 (no sample) and 7-12
    assert sample_seqs == [seqs[0], seqs[1], seqs[3]]
    assert plan.slot_mapping[2:7] == [28, 29, 30, 31, 32]  # blocks 7, 8 at block size 4, positions 0-4


def test_slots_per_block_equal_the_per_token_formula():
    rng = random.Random(0)
    for _ in range(500):
        block_size = rng.choice([1, 4, 16, 64])
        table = rng.sample(range(1000), rng.randint(1, 12))
        start = rng.randint(0, len(table) * block_size - 1)
        end = rng.randint(start + 1, len(table) * block_size)
        expected = [table[p // block_size] * block_size + p % block_size for p in range(start, end)]
        assert list(_slots(table, start, end, block_size)) == expected


@pytest.mark.parametrize("seed", range(4))
def test_packed_parts_are_aligned_and_exact(seed):
    rng = random.Random(seed)
    int64_parts = [[rng.randint(-1, 1 << 40) for _ in range(rng.randint(0, 9))] for _ in range(6)]
    int32_parts = [[rng.randint(-1, 1 << 20) for _ in range(rng.randint(0, 9))] for _ in range(3)]
    tables = [rng.sample(range(100), rng.randint(0, 5)) for _ in range(rng.randint(1, 6))]
    width = 6
    parts = PackedInputs(int64_parts, int32_parts, tables, pin_memory=False, width=width).to(torch.device("cpu"))
    for tensor in parts:
        assert tensor.data_ptr() % PackedInputs.ALIGN_BYTES == 0
    for tensor, values in zip(parts, int64_parts):
        assert tensor.dtype == torch.int64 and tensor.tolist() == values
    for tensor, values in zip(parts[6:], int32_parts):
        assert tensor.dtype == torch.int32 and tensor.tolist() == values
    assert parts[-1].dtype == torch.int32
    assert parts[-1].tolist() == [t + [-1] * (width - len(t)) for t in tables]


class RecordingDecodeBackend:
    """Stands in for the Triton backend: records the row order each decode call gets."""
    longest_first = True

    def __init__(self):
        self.orders = []

    def decode(self, q, kv, md, scale, out=None):
        self.orders.append(md.decode_row_order.tolist())
        return q


def test_the_first_layer_orders_decode_rows_longest_first_once_per_forward():
    from nanovllm.layers.attention import Attention
    from nanovllm.utils.context import AttentionMetadata

    backend = RecordingDecodeBackend()
    layers = [Attention(2, 4, 0.5, 1) for _ in range(3)]
    for i, layer in enumerate(layers):
        layer.backend, layer.is_first_layer = backend, i == 0
    seq_lens = torch.tensor([5, 9, 1, 7], dtype=torch.int32)
    md = AttentionMetadata(True, torch.zeros(4, dtype=torch.int64), seq_lens, torch.zeros(4, 1, dtype=torch.int32))
    q = torch.zeros(4, 2, 4)
    for layer in layers:
        layer._attend(q, md)
    seq_lens.copy_(torch.tensor([2, 1, 8, 3]))  # the next step reuses the metadata object, as a CUDA graph does
    for layer in layers:
        layer._attend(q, md)
    assert backend.orders == [[1, 3, 0, 2]] * 3 + [[2, 3, 0, 1]] * 3
