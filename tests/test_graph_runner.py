"""The graph runner's buckets (nanovllm/engine/graph_runner.py), the one place they are decided: the decode batch
sizes and piecewise token buckets that capture builds, and the step the memory profile reserves the graphs' pool
for. Plain arithmetic on the config: no model and no GPU. The graphs themselves run in tests/test_hf_parity.py
(their static buffers on CPU) and tests/test_gpu_engine.py (captured)."""
from types import SimpleNamespace

import pytest
import torch

from nanovllm.engine.graph_runner import MAX_MIXED_GRAPH_TOKENS, GraphRunner, decode_batch_sizes, mixed_token_buckets


def make_config(max_num_seqs=256, max_cudagraph_capture_size=1024, max_num_batched_tokens=8192,
                enforce_eager=False):
    return SimpleNamespace(max_num_seqs=max_num_seqs, max_cudagraph_capture_size=max_cudagraph_capture_size,
                           max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager)


@pytest.mark.parametrize("max_num_seqs, capture_size, sizes", [
    (300, 1024, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 288, 300]),
    (256, 1024, [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256]),
    (256, 2, [1, 2]),  # the capture size caps the batch sizes
    (6, 1024, [1, 2, 4, 6]),  # max_num_seqs is always the last
    (1, 1024, [1]),
])
def test_decode_batch_sizes_end_at_the_smaller_limit(max_num_seqs, capture_size, sizes):
    assert decode_batch_sizes(make_config(max_num_seqs, capture_size)) == sizes


@pytest.mark.parametrize("max_num_batched_tokens, buckets", [
    (16384, [16, 32, 64, 128, 192, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]),
    (2048, [16, 32, 64, 128, 192, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]),
    (300, [16, 32, 64, 128, 192, 256, 300]),  # no step is larger than the step budget
    (48, [16, 32, 48]),
    (8, [8]),
])
def test_mixed_token_buckets_end_at_the_step_budget_or_2048(max_num_batched_tokens, buckets):
    assert MAX_MIXED_GRAPH_TOKENS == 2048
    assert mixed_token_buckets(make_config(max_num_batched_tokens=max_num_batched_tokens)) == buckets


@pytest.mark.parametrize("config, piecewise, tokens", [
    (make_config(), "", 2048),  # the largest piecewise bucket
    (make_config(max_num_batched_tokens=512), "", 512),
    (make_config(max_num_batched_tokens=512), "0", 256),  # no piecewise graphs: the largest decode batch
    (make_config(max_num_seqs=1024, max_num_batched_tokens=512), "", 1024),  # decode rows larger than any bucket
])
def test_the_profile_reserves_the_largest_captured_step(switches, config, piecewise, tokens):
    switches(piecewise_graphs=piecewise)
    graphs = GraphRunner(None, config, torch.device("cuda"), torch.bfloat16, "triton")  # captures nothing yet
    assert graphs.captures_on_gpu and graphs.largest_graph_tokens() == tokens


@pytest.mark.parametrize("device, backend, enforce_eager", [
    ("cpu", "torch", False),  # the CPU runs eagerly (NANOVLLM_DECODE_GRAPHS=1 builds graphs it never captures)
    ("cuda", "torch", False),  # the reference backend
    ("cuda", "triton", True),
])
def test_nothing_is_reserved_where_nothing_is_captured(device, backend, enforce_eager):
    graphs = GraphRunner(None, make_config(enforce_eager=enforce_eager), torch.device(device), torch.float32, backend)
    assert not graphs.captures_on_gpu and graphs.largest_graph_tokens() == 0
