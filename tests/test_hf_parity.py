"""Greedy token ids of the engine equal transformers' greedy `generate` on the
same weights in float32: plain batches, prefix-cache hits, chunked prefill,
preemption by recompute and by swap to the CPU tier.

Tiny random models use KV blocks of 4 tokens, so every prompt spans many blocks.
"""
from __future__ import annotations

import json
import os

import pytest

from conftest import (
    TINY_BLOCK,
    assert_matches_hf,
    greedy,
    hf_greedy,
    random_prompts,
    shared_prefix_prompts,
    smollm2_llm_kwargs,
    tiny_llm_kwargs,
)
from nanovllm import LLM, SamplingParams

LENGTHS = (3, 9, 17, 26, 40)
MAX_NEW = 20


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "llama_bias"])
def test_greedy_matches_hf(kind, tiny_dirs):
    model_dir = tiny_dirs[kind]
    prompts = random_prompts(LENGTHS, seed=10)
    with LLM(model_dir, **tiny_llm_kwargs()) as llm:
        outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert_matches_hf(model_dir, prompts, outs, MAX_NEW, what=kind)
    for out in outs:
        assert out["finish_reason"] == "length"
        assert len(out["token_ids"]) == MAX_NEW


def test_prefix_cache_hits_match_hf(qwen2_dir):
    # 24 shared tokens = 6 full blocks of 4; suffixes >= 1 token so every prompt
    # has all 6 prefix blocks cacheable
    prompts = shared_prefix_prompts(24, (3, 7, 12, 1), seed=20)
    with LLM(qwen2_dir, **tiny_llm_kwargs()) as llm:
        first = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
        first_hits = llm.stats()["prefix_cache_hit_tokens"]
        second = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
        stats = llm.stats()
    # all four are admitted in one step: the first one's prefix blocks are shared as soon as they are scheduled
    assert first_hits == 24 * (len(prompts) - 1), first_hits
    assert_matches_hf(qwen2_dir, prompts, first, MAX_NEW, what="prefix cache, first run")
    assert_matches_hf(qwen2_dir, prompts, second, MAX_NEW, what="prefix cache, second run")
    # the second run alone must reuse at least the shared prefix of every prompt
    assert stats["prefix_cache_hit_tokens"] >= 24 * len(prompts), stats


def test_next_turn_reuses_the_partial_last_block_of_the_previous_turn(qwen3_dir):
    """A chat's next prompt is the previous prompt + reply + a new user turn: the previous sequence's partial last
    block (a tail) is taken over, so every token with KV is served from the cache, not only whole blocks."""
    first = random_prompts((21,), seed=23)[0]
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        reply = llm.generate([first], greedy(10), use_tqdm=False)[0]["token_ids"]
        second = first + reply + random_prompts((5,), seed=24)[0]  # 36 tokens
        hits_before = llm.stats()["prefix_cache_hit_tokens"]
        out = llm.generate([second], greedy(MAX_NEW), use_tqdm=False)
        hits = llm.stats()["prefix_cache_hit_tokens"] - hits_before
    # 30 tokens have KV (the last reply token has none): 7 full blocks of 4 and a tail of 2
    assert hits == 30, hits
    with LLM(qwen3_dir, **tiny_llm_kwargs(enable_prefix_caching=False)) as llm:
        uncached = llm.generate([second], greedy(MAX_NEW), use_tqdm=False)
    assert out[0]["token_ids"] == uncached[0]["token_ids"]
    assert_matches_hf(qwen3_dir, [second], out, MAX_NEW, what="tail of the previous turn")


def test_prefix_cache_hit_in_later_batch_with_new_prompts(llama_dir):
    """A cached prefix serves prompts that were never seen whole (hit then divergent suffix)."""
    base = shared_prefix_prompts(32, (5,), seed=21)[0]
    later = [base[:32] + extra for extra in random_prompts((1, 6, 11), seed=22)]
    with LLM(llama_dir, **tiny_llm_kwargs()) as llm:
        llm.generate([base], greedy(8), use_tqdm=False)
        outs = llm.generate(later, greedy(MAX_NEW), use_tqdm=False)
        stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] >= 32, stats
    assert_matches_hf(llama_dir, later, outs, MAX_NEW, what="prefix cache, new suffixes")


@pytest.mark.parametrize("split_mixed", [True, False])
def test_chunked_prefill_matches_hf(llama_dir, monkeypatch, split_mixed):
    # 40-token prompts with a 16-token budget per step: each prefill takes 3 steps, beside the others' decodes.
    # Split, a mixed step's decode rows run through the decode path and its prompt chunks through prefill.
    from nanovllm.engine import step_inputs
    num_decode_rows = []
    split = step_inputs.split_mixed
    monkeypatch.setattr(step_inputs, "split_mixed",
                        lambda md, d, *tensors: (num_decode_rows.append(d), split(md, d, *tensors)))
    prompts = random_prompts((40, 37, 33, 5), seed=30)
    with LLM(llama_dir, **tiny_llm_kwargs(max_num_batched_tokens=16)) as llm:
        llm.runner.split_mixed_steps = split_mixed  # off: as a backend that takes mixed steps whole runs them
        outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
        stats = llm.stats()
    assert_matches_hf(llama_dir, prompts, outs, MAX_NEW, what="chunked prefill")
    assert stats["decode_tokens"] > 0 and stats["prefill_tokens"] > 0, stats
    assert (max(num_decode_rows, default=0) >= 2) == split_mixed, num_decode_rows


def test_piecewise_mixed_step_forward_matches_hf(qwen3_dir, monkeypatch, switches):
    """The pieces that piecewise CUDA graphs capture (engine/cuda_graph.py), called eagerly on CPU: the same
    shared buffers, token buckets and padding rows as on the GPU, with attention in between."""
    from nanovllm.engine.graph_runner import GraphRunner
    buckets = []
    pick = GraphRunner.mixed_graph_for
    monkeypatch.setattr(GraphRunner, "mixed_graph_for", lambda self, plan: (
        buckets.append((plan.num_tokens, g.num_tokens)) if (g := pick(self, plan)) else None) or g)
    switches(piecewise_graphs="1")
    prompts = random_prompts((40, 37, 33, 5), seed=31)
    with LLM(qwen3_dir, **tiny_llm_kwargs(max_num_batched_tokens=48)) as llm:
        outs = llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False)
    assert_matches_hf(qwen3_dir, prompts, outs, MAX_NEW, what="piecewise pieces")
    assert any(n < bucket for n, bucket in buckets), buckets  # padded steps happened
    assert all(n <= bucket <= 48 for n, bucket in buckets) and len(buckets) > 10, buckets


def test_decode_graph_static_buffers_match_hf(qwen3_dir, monkeypatch, switches):
    """Decode steps through DecodeGraph's static buffers (engine/cuda_graph.py), run eagerly on CPU: padding rows,
    slot -1, and block tables copied into the left columns of a max_model_len-wide table whose other columns keep
    earlier steps' ids (never read past a row's seq_len)."""
    from nanovllm.engine.cuda_graph import DecodeGraph
    replays = []
    replay = DecodeGraph.replay
    monkeypatch.setattr(DecodeGraph, "replay", lambda self, inputs: (
        replays.append((inputs.input_ids.size(0), self.batch_size, inputs.metadata.block_tables.size(1),
                        self.width)), replay(self, inputs))[1])
    switches(decode_graphs_on_cpu=True)
    prompts = random_prompts((40, 7, 23, 5, 12), seed=32)
    max_new = (6, 20, 20, 20, 6)  # the longest row finishes first: the tables get narrower mid-run
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        outs = llm.generate(prompts, [greedy(n) for n in max_new], use_tqdm=False)
    for n in set(max_new):
        rows = [i for i, m in enumerate(max_new) if m == n]
        assert_matches_hf(qwen3_dir, [prompts[i] for i in rows], [outs[i] for i in rows], n, what="decode graphs")
    assert any(n < size for n, size, _, _ in replays), replays  # padded batches
    widths = [w for _, _, w, _ in replays]
    assert all(w < width for _, _, w, width in replays), replays  # never the graph's whole width
    assert any(later < earlier for earlier, later in zip(widths, widths[1:])), widths  # stale columns left



def test_decode_batches_over_the_capture_size_run_eagerly(qwen3_dir, monkeypatch, switches):
    """max_cudagraph_capture_size=2: graphs for 1 and 2 rows only; a 3-row decode step runs the model eagerly,
    and once a row finishes the other two replay the 2-row graph. Tokens match HF either way."""
    from nanovllm.engine.graph_runner import GraphRunner
    lookups = []
    graph_for = GraphRunner.decode_graph_for
    monkeypatch.setattr(GraphRunner, "decode_graph_for", lambda self, plan: (
        lookups.append((plan.is_decode_only, len(plan.query_lens), graph_for(self, plan))), lookups[-1][2])[1])
    switches(decode_graphs_on_cpu=True)
    prompts = random_prompts((9, 5, 14), seed=33)
    max_new = (4, 12, 12)
    with LLM(qwen3_dir, **tiny_llm_kwargs(max_cudagraph_capture_size=2)) as llm:
        assert llm.runner.graph_runner.decode_batch_sizes == [1, 2]
        outs = llm.generate(prompts, [greedy(n) for n in max_new], use_tqdm=False)
    assert_matches_hf(qwen3_dir, prompts[:1], outs[:1], 4, what="eager decode over the capture size")
    assert_matches_hf(qwen3_dir, prompts[1:], outs[1:], 12, what="decode graphs")
    decode = [(rows, graph) for is_decode, rows, graph in lookups if is_decode]
    assert any(rows == 3 for rows, _ in decode), decode
    assert all((graph is None) == (rows > 2) for rows, graph in decode), decode
    assert all(graph.batch_size == 2 for rows, graph in decode if rows == 2), decode

# 4 sequences of up to 14 + 24 = 38 tokens need 10 blocks each (40 in all);
# 12 blocks hold one at a time plus a bit, so the scheduler must preempt.
PREEMPT_LENGTHS = (10, 12, 14, 11)
PREEMPT_NEW = 24


def preempt_kwargs(**kw):
    return tiny_llm_kwargs(num_kvcache_blocks=12, max_model_len=48, max_num_seqs=4, **kw)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_recompute_matches_hf(qwen3_dir, prefix_caching):
    prompts = random_prompts(PREEMPT_LENGTHS, seed=40)
    kw = preempt_kwargs(preemption_mode="recompute", enable_prefix_caching=prefix_caching)
    with LLM(qwen3_dir, **kw) as llm:
        outs = llm.generate(prompts, greedy(PREEMPT_NEW), use_tqdm=False)
        stats = llm.stats()
    assert_matches_hf(qwen3_dir, prompts, outs, PREEMPT_NEW, what="preemption by recompute")
    assert stats["preemptions"] > 0, stats
    assert stats["preemptions_recompute"] > 0 and stats["preemptions_swap"] == 0, stats
    assert stats["blocks_swapped_out"] == 0 and stats["blocks_swapped_in"] == 0, stats
    if prefix_caching:
        # re-admitted sequences may find some of their blocks still cached
        assert stats["recomputed_tokens"] + stats["prefix_cache_hit_tokens"] > 0, stats
    else:
        assert stats["recomputed_tokens"] > 0, stats


def kv_block_bytes(model_dir: str, block_size: int, bytes_per_elem: int = 4) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * block_size * c["num_key_value_heads"] * head_dim * bytes_per_elem


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_preemption_swap_matches_hf(kind, tiny_dirs):
    model_dir = tiny_dirs[kind]
    prompts = random_prompts(PREEMPT_LENGTHS, seed=41)
    with LLM(model_dir, **preempt_kwargs(preemption_mode="swap", swap_space=0.01)) as llm:
        outs = llm.generate(prompts, greedy(PREEMPT_NEW), use_tqdm=False)
        stats = llm.stats()
    assert_matches_hf(model_dir, prompts, outs, PREEMPT_NEW, what=f"{kind} preemption by swap")
    assert stats["preemptions"] > 0, stats
    assert stats["preemptions_swap"] > 0 and stats["preemptions_recompute"] == 0, stats
    assert stats["recomputed_tokens"] == 0, stats
    assert stats["blocks_swapped_out"] > 0, stats
    # (swapped_in may exceed swapped_out: a full block already on the host from an
    # earlier swap-out is not copied out again, yet it is copied in each time)
    assert stats["blocks_swapped_in"] > 0, stats
    block = kv_block_bytes(model_dir, TINY_BLOCK)
    assert stats["bytes_swapped_out"] == stats["blocks_swapped_out"] * block, (block, stats)
    assert stats["bytes_swapped_in"] == stats["blocks_swapped_in"] * block, (block, stats)
    # on a CPU-only machine copies are synchronous memcpys: all of their time is exposed
    assert stats["swap_seconds"] > 0 and stats["swap_exposed_seconds"] == stats["swap_seconds"], stats


def test_swap_with_cached_blocks_left_on_the_gpu_equals_the_unpressured_run(qwen3_dir):
    """The GPU swap test's workload on the CPU (block 16, 24 blocks): a resumed sequence finds some of its full
    blocks still cached on the GPU and others reused, which once gave it one block twice (table [8, 5, 5])."""
    prompts = random_prompts([5, 40, 130, 300, 17, 77], seed=0)
    kwargs = dict(kvcache_block_size=16, max_model_len=512)
    with LLM(qwen3_dir, **tiny_llm_kwargs(**kwargs)) as llm:
        base = [o["token_ids"] for o in llm.generate(prompts, greedy(48), use_tqdm=False)]
    with LLM(qwen3_dir, **tiny_llm_kwargs(num_kvcache_blocks=24, preemption_mode="swap", **kwargs)) as llm:
        swap = [o["token_ids"] for o in llm.generate(prompts, greedy(48), use_tqdm=False)]
        stats = llm.stats()
    assert swap == base
    assert stats["preemptions_swap"] > 0 and stats["blocks_swapped_in"] > 0 and stats["recomputed_tokens"] == 0


def test_swap_space_too_small_falls_back_to_recompute(qwen3_dir):
    # 1e-6 GiB is ~1 KiB, less than one 4 KiB KV block of this model
    assert kv_block_bytes(qwen3_dir, TINY_BLOCK) > 1e-6 * 2**30
    prompts = random_prompts(PREEMPT_LENGTHS, seed=42)
    with LLM(qwen3_dir, **preempt_kwargs(preemption_mode="swap", swap_space=1e-6)) as llm:
        outs = llm.generate(prompts, greedy(PREEMPT_NEW), use_tqdm=False)
        stats = llm.stats()
    assert_matches_hf(qwen3_dir, prompts, outs, PREEMPT_NEW, what="swap space full -> recompute")
    assert stats["preemptions"] > 0, stats
    assert stats["preemptions_recompute"] > 0, stats
    assert stats["blocks_swapped_in"] == 0, stats


def test_preemption_auto_matches_hf(llama_dir):
    prompts = random_prompts(PREEMPT_LENGTHS, seed=43)
    with LLM(llama_dir, **preempt_kwargs(preemption_mode="auto", swap_space=0.01)) as llm:
        outs = llm.generate(prompts, greedy(PREEMPT_NEW), use_tqdm=False)
        stats = llm.stats()
    assert_matches_hf(llama_dir, prompts, outs, PREEMPT_NEW, what="preemption auto")
    assert stats["preemptions"] > 0, stats
    assert stats["preemptions_swap"] + stats["preemptions_recompute"] == stats["preemptions"], stats


# ---------------------------------------------------------------- SmolLM2-135M

SMOL_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
]
SMOL_NEW = 20


def chat(tokenizer, question: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def smol_llm(smollm2_dir):
    """One SmolLM2 engine for the module's two SmolLM2 tests: greedy outputs do not depend on what the engine ran
    before (prefix-cache hits give the same tokens, test_prefix_cache_hits_match_hf), and the greedy test, the first
    to use it, starts from an empty cache."""
    with LLM(smollm2_dir, **smollm2_llm_kwargs()) as llm:
        yield llm


def test_smollm2_greedy_matches_hf(smollm2_dir, smol_tokenizer, smol_llm):
    texts = SMOL_TEXTS + [chat(smol_tokenizer, "What is the capital of France?")]
    ids = [smol_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    # rendering the chat template then tokenizing equals the template's own tokenization
    templ = smol_tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=True, add_generation_prompt=True, return_dict=True,
    )["input_ids"]
    assert ids[-1] == list(templ)
    # strings and token ids in one batch
    prompts = texts + [ids[0]]
    outs = smol_llm.generate(prompts, greedy(SMOL_NEW), use_tqdm=False)
    # the last prompt is the first's ids: its output equals the first's, which is checked against transformers
    assert_matches_hf(smollm2_dir, ids, outs[:-1], SMOL_NEW, what="SmolLM2")
    assert outs[0]["token_ids"] == outs[-1]["token_ids"]
    for out in outs[:4]:
        assert out["text"].strip(), out


def test_smollm2_chat_answers_paris(smollm2_dir, smol_tokenizer, smol_llm):

    prompt = chat(smol_tokenizer, "What is the capital of France?")
    [out] = smol_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert "Paris" in out["text"], out
    assert out["finish_reason"] == "stop", out  # stopped at <|im_end|> (EOS)
    assert "<|im_end|>" not in out["text"], out
    eos = smol_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = smol_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ref = hf_greedy(smollm2_dir, [ids], 32)[0]
    assert eos in ref, ref
    n = len(out["token_ids"])
    assert out["token_ids"] == ref[:n] and ref.index(eos) in (n - 1, n), (out["token_ids"], ref)
    # vLLM's LLM.chat renders the same prompt
    question = [{"role": "user", "content": "What is the capital of France?"}]
    [alone] = smol_llm.chat(question, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    both = smol_llm.chat([question, question + [{"role": "assistant", "content": "Paris."}]],
                         SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="must be a non-empty list"):
        smol_llm.chat([], use_tqdm=False)
    assert alone["token_ids"] == out["token_ids"] and len(both) == 2
    assert both[0]["token_ids"] == out["token_ids"][:4] and both[1]["token_ids"] != both[0]["token_ids"]


def test_chat_takes_another_template_as_text_or_file(smol_llm, smol_tokenizer, tmp_path):
    """vLLM's LLM.chat(chat_template=...): the template's text or the path of its file, instead of the model's."""
    template = "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}A:"
    (tmp_path / "t.jinja").write_text(template)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    expected = smol_tokenizer.encode("<<user: What is the capital of France?>>A:", add_special_tokens=False)
    for given in (template, str(tmp_path / "t.jinja")):
        [out] = smol_llm.chat(question, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=given)
        assert out.prompt_token_ids == expected and out.prompt == "<<user: What is the capital of France?>>A:"
    [own] = smol_llm.chat(question, SamplingParams(max_tokens=1), use_tqdm=False)  # the model's, untouched
    assert own.prompt_token_ids != expected
    with pytest.raises(ValueError, match=r"chat_template='no/such.jinja' is neither a readable file nor a Jinja"):
        smol_llm.chat(question, use_tqdm=False, chat_template="no/such.jinja")
