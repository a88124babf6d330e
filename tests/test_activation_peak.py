"""The profiling step's live bytes (memory_profile.profile_step), counted op by op on the meta device
(benchmarks/activation_peak.py's LiveBytes; the `compilable` ops counted as the fused kernels they are on a GPU).

Each phase's peak is asserted from the tensor shapes: the MLP of a step larger than mlp_chunk_tokens holds one
slice's intermediates, attention does not hold the qkv projection's output, and sampling holds bounded chunks
beside the bf16 logits, never a float32 copy of all [rows, vocab]. A one-layer bf16 Qwen3 stands for the model
(one layer's activations are freed before the next runs)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from activation_peak import count_profile_step  # noqa: E402

import nanovllm.layers.logprobs as logprobs_module  # noqa: E402
import nanovllm.layers.sampler as sampler_module  # noqa: E402
import nanovllm.models.decoder as decoder  # noqa: E402

HIDDEN, INTER, VOCAB = 64, 256, 4096
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 16
TOKENS, SEQ_LEN, ROWS = 256, 128, 64  # the step: 2 sequences of 128 tokens, the last 64 rows sampled
BF16 = 2
INDEX_BYTES = 2 * TOKENS * 8  # input_ids and positions (int64), alive through the step


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config
    hf = Qwen3Config(hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1, num_attention_heads=NUM_HEADS,
                     num_key_value_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB,
                     max_position_embeddings=512, tie_word_embeddings=False)
    with torch.device("meta"):
        return decoder.DecoderForCausalLM(hf, "qwen3").to(torch.bfloat16)


def profile(model):
    return count_profile_step(model, torch.device("meta"), TOKENS, SEQ_LEN, ROWS)


@pytest.mark.parametrize("chunk_tokens", [64, TOKENS])
def test_the_mlp_of_a_large_step_holds_one_slice(model, monkeypatch, chunk_tokens):
    # the residual stream, and one slice's gate_up output [C, 2I] beside SiLU's [C, I]; whole (C = T) the MLP
    # holds 3.4x as much here, the largest activation of the step
    for layer in model.model.layers:
        monkeypatch.setattr(layer, "mlp_chunk_tokens", chunk_tokens)
    counter = profile(model)
    assert counter.phase_peak_bytes["mlp"] == INDEX_BYTES + BF16 * (TOKENS * HIDDEN + chunk_tokens * 3 * INTER)


def test_attention_frees_the_qkv_projection_once_rope_has_read_it(model):
    # the peak is rope's: the residual stream, the qkv projection, and q, k and a copy of v after the q/k norm and
    # rope; then qkv is freed, and attention holds q, k, v, its output and one head's attention (2 sequences) at
    # a time. qkv alive through attention (v a view of it) would add qkv + out - k; K and V repeated for every
    # query head would add 2 x T x heads x head_dim
    counter = profile(model)
    qkv = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    assert counter.phase_peak_bytes["attention"] == INDEX_BYTES + BF16 * TOKENS * (HIDDEN + qkv + q + 2 * kv)


def test_sampling_and_logprobs_hold_chunks_beside_the_logits(model, monkeypatch):
    # chunks of 4 rows: a float32 [ROWS, VOCAB] copy is 16 chunk-sized float32 tensors, more than the bound
    rows_per_chunk = 4
    monkeypatch.setattr(sampler_module, "FILTER_CHUNK_ELEMENTS", rows_per_chunk * VOCAB)
    monkeypatch.setattr(logprobs_module, "LOGPROB_CHUNK_ELEMENTS", rows_per_chunk * VOCAB)
    counter = profile(model)
    logits = BF16 * ROWS * VOCAB  # the sampler's logits and the logprob rows' raw copy
    per_row_params = ROWS * (4 + 8 + 4)  # temperature, top-k, top-p
    chunk = rows_per_chunk * VOCAB * 4  # one float32 chunk
    before = INDEX_BYTES + 2 * logits + per_row_params
    assert counter.phase_peak_bytes["logits"] == before
    # the filtered chunk's peak: the scaled logits, the sort's values and int64 indices, softmax, cumsum and the
    # bool mask (6.25 chunks); the logprobs' chunk: its float32 copy, log-softmax and a bool rank mask
    assert before < counter.phase_peak_bytes["sampler"] <= before + 7 * chunk
    assert before < counter.phase_peak_bytes["logprobs"] <= before + 3 * chunk
    assert counter.peak_bytes < before + ROWS * VOCAB * 4  # no whole float32 copy at any point
