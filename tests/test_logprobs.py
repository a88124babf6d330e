"""SamplingParams(logprobs, prompt_logprobs): the model's raw log-softmax (before temperature and filters), as
HF transformers computes it for the same tokens, through chunked prefill, the prefix cache, preemption, the
decode-graph buffers, tensor parallelism and streaming; bad values are ValueErrors."""
import json
import math
import re
import sys

import pytest
import torch

from conftest import VOCAB, close_llm, greedy, random_prompts, serving, smollm2_llm_kwargs, tiny_llm_kwargs
from nanovllm import LLM, SamplingParams
from nanovllm.logprobs import Logprob

TOLERANCE = 1e-4  # absolute, in nats: float32 engine vs float32 HF
PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden press into a system that could produce books quickly.")


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_dir):
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs())
    yield llm
    close_llm(llm)


@pytest.fixture(scope="module")
def hf_log_softmax(smollm2_dir):
    """token ids -> [len, vocab] float32 log-softmax of HF's logits at each position (position i predicts i + 1)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()

    cache = {}  # the module asks for PROMPT's reference four times

    def run(token_ids: list[int]) -> torch.Tensor:
        key = tuple(token_ids)
        if key not in cache:
            with torch.no_grad():
                cache[key] = model(torch.tensor([token_ids])).logits[0].float().log_softmax(-1)
        return cache[key]
    return run


def assert_position_matches(entry: dict, reference: torch.Tensor, chosen_id: int, num_top: int, what: str):
    """One position's {token_id: Logprob} against the reference log-softmax row: the chosen token's logprob and
    rank, then the top-k in rank order with their values (ids compared where the reference has no near-tie)."""
    assert all(isinstance(v, Logprob) for v in entry.values()), what
    chosen = entry[chosen_id]
    assert abs(chosen.logprob - reference[chosen_id].item()) < TOLERANCE, (what, chosen, reference[chosen_id])
    # the rank may differ only where another token's logprob is within the tolerance of the chosen one's
    lowest = int((reference > reference[chosen_id] + TOLERANCE).sum()) + 1
    highest = int((reference >= reference[chosen_id] - TOLERANCE).sum())
    assert lowest <= chosen.rank <= highest, (what, chosen, lowest, highest)
    assert next(iter(entry)) == chosen_id, what  # the chosen token comes first, as in vLLM
    top = sorted(((v.rank, token_id, v.logprob) for token_id, v in entry.items() if v.rank <= num_top))
    if chosen.rank > num_top:  # not among the top: k alternatives besides it
        assert len(entry) == num_top + 1, what
    else:
        assert len(entry) == num_top, what
    assert [rank for rank, _, _ in top] == list(range(1, num_top + 1)), (what, top)
    ref_values, ref_ids = reference.topk(num_top) if num_top else (reference[:0], reference[:0].long())
    for (rank, token_id, value), ref_value, ref_id in zip(top, ref_values.tolist(), ref_ids.tolist()):
        assert abs(value - ref_value) < TOLERANCE, (what, rank, value, ref_value)
        assert token_id == ref_id or abs(reference[token_id].item() - ref_value) < TOLERANCE, (what, rank)
    values = [value for _, _, value in top]
    assert values == sorted(values, reverse=True), (what, values)


def assert_prompt_logprobs_match(prompt_logprobs, token_ids, reference, num_top, what):
    assert len(prompt_logprobs) == len(token_ids) and prompt_logprobs[0] is None, what
    for j in range(1, len(token_ids)):
        assert_position_matches(prompt_logprobs[j], reference[j - 1], token_ids[j], num_top, f"{what} token {j}")


@pytest.mark.parametrize("num_top", [0, 3])
def test_prompt_logprobs_match_hf_and_skip_the_prefix_cache(smollm2_llm, hf_log_softmax, num_top):
    """The same prompt twice: the second time its blocks are in the prefix cache, which a prompt_logprobs
    request must not use (a hit would skip the positions that give the logprobs); a plain request does."""
    token_ids = smollm2_llm.tokenizer.encode(PROMPT)
    reference = hf_log_softmax(token_ids)
    params = SamplingParams(max_tokens=1, prompt_logprobs=num_top)
    for attempt in ("first", "cached"):
        hits = smollm2_llm.stats()["prefix_cache_hit_tokens"]
        out = smollm2_llm.generate([token_ids], params, use_tqdm=False)[0]
        assert smollm2_llm.stats()["prefix_cache_hit_tokens"] == hits, attempt
        assert_prompt_logprobs_match(out["prompt_logprobs"], token_ids, reference, num_top, attempt)
        assert out["logprobs"] is None
    hits = smollm2_llm.stats()["prefix_cache_hit_tokens"]
    smollm2_llm.generate([token_ids], SamplingParams(max_tokens=1), use_tqdm=False)
    assert smollm2_llm.stats()["prefix_cache_hit_tokens"] > hits  # the blocks were cached all along


def test_prompt_logprobs_across_a_chunked_prefill_match_hf(smollm2_dir, hf_log_softmax):
    """Chunks of 16 tokens: each chunk gives the logprobs of the tokens its positions predict; with a second
    request sharing the step, so prompt rows are not the step's first rows."""
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(max_num_batched_tokens=16))
    try:
        token_ids = llm.tokenizer.encode(PROMPT)
        assert len(token_ids) > 2 * 16
        outs = llm.generate([[1, 2, 3], token_ids], [greedy(4), SamplingParams(max_tokens=1, prompt_logprobs=2)],
                            use_tqdm=False)
        assert outs[0]["prompt_logprobs"] is None
        assert_prompt_logprobs_match(outs[1]["prompt_logprobs"], token_ids, hf_log_softmax(token_ids), 2, "chunked")
    finally:
        close_llm(llm)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampled_logprobs_are_the_raw_distribution(smollm2_llm, hf_log_softmax, temperature):
    """Each generated token's entry is HF's log-softmax at its position, untempered and unfiltered: with
    temperature 0.8 and top_k=5 the tokens come from a sharpened, cut distribution, the logprobs do not."""
    token_ids = smollm2_llm.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=temperature, top_k=5, max_tokens=8, ignore_eos=True, seed=3, logprobs=4)
    out = smollm2_llm.generate([token_ids], params, use_tqdm=False)[0]
    completion = out["token_ids"]
    reference = hf_log_softmax(token_ids + completion)
    assert len(out["logprobs"]) == len(completion) == 8 and out["prompt_logprobs"] is None
    for i, (entry, token_id) in enumerate(zip(out["logprobs"], completion)):
        assert_position_matches(entry, reference[len(token_ids) - 1 + i], token_id, 4, f"token {i}")
        assert entry[token_id].rank <= 5  # top_k=5 filtered the draw, not the logprobs
        if temperature == 0:
            assert entry[token_id].rank == 1
        assert entry[token_id].decoded_token == smollm2_llm.tokenizer.decode([token_id])
    if temperature:  # a tempered log-softmax would be sharper: the logprobs of the top tokens would differ
        top = reference[len(token_ids) - 1]
        tempered = (top / 0.8).log_softmax(-1)
        assert abs(tempered.max() - top.max()) > 10 * TOLERANCE


def test_greedy_output_unchanged_with_logprobs(smollm2_llm):
    """Logprob rows change nothing that is sampled: the same greedy tokens with and without them, alone and
    batched with requests that ask for none. Six steps: every decode step computes its logprob rows the same way,
    so a row that touched what is sampled would change the first step's token already."""
    prompts = [PROMPT, "Once upon a time", "def fibonacci(n):"]
    plain = smollm2_llm.generate(prompts, greedy(6), use_tqdm=False)
    mixed = smollm2_llm.generate(prompts, [greedy(6, logprobs=2, prompt_logprobs=1), greedy(6),
                                           greedy(6, logprobs=0)], use_tqdm=False)
    assert [o["token_ids"] for o in mixed] == [o["token_ids"] for o in plain]
    assert [o["text"] for o in mixed] == [o["text"] for o in plain]
    assert [len(o["logprobs"] or ()) for o in mixed] == [6, 0, 6]
    assert all(len(entry) == 1 for entry in mixed[2]["logprobs"])  # logprobs=0: the chosen token only
    dumped = json.loads(json.dumps(mixed[0]))  # the dict shape's promise: outputs with logprobs serialize too
    first = next(iter(mixed[0]["logprobs"][0].items()))
    assert dumped["logprobs"][0][str(first[0])] == list(first[1]) and dumped["prompt_logprobs"][0] is None


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("value", [-1, 2.0, "3", True])
def test_bad_values_are_value_errors(name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r}.*20"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_than_max_logprobs_is_refused_by_the_engine(smollm2_llm, name):
    """As in vLLM, SamplingParams takes any count; the engine refuses more than its max_logprobs (default 20)."""
    SamplingParams(**{name: 21})
    with pytest.raises(ValueError, match=f"{name}=21 is more than max_logprobs=20"):
        smollm2_llm.generate(["Hello"], SamplingParams(**{name: 21}), use_tqdm=False)


def test_engine_keeps_serving_after_a_bad_value(smollm2_llm):
    with pytest.raises(ValueError, match="logprobs=21"):
        smollm2_llm.generate(["Hello"], SamplingParams(logprobs=21), use_tqdm=False)
    out = smollm2_llm.generate(["Hello"], SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0]
    assert len(out["logprobs"]) == 2 and len(out["logprobs"][0]) in (20, 21)


def test_stream_chunks_carry_their_tokens_logprobs(smollm2_llm):
    prompts = [PROMPT, "Once upon a time"]
    params = [greedy(10, logprobs=3, prompt_logprobs=2), greedy(6)]
    whole = smollm2_llm.generate(prompts, params, use_tqdm=False)
    chunks = list(smollm2_llm.generate_stream(prompts, params))
    streamed = [entry for c in chunks if c["index"] == 0 for entry in c["logprobs"]]
    assert [c["logprobs"] for c in chunks if c["index"] == 1] == [None] * sum(c["index"] == 1 for c in chunks)
    for c in chunks:
        assert c["logprobs"] is None or len(c["logprobs"]) == len(c["token_ids"])
    assert len(streamed) == 10
    assert_values_close(streamed, whole[0]["logprobs"], 1e-6)
    first = next(c for c in chunks if c["index"] == 0)
    assert_values_close(first["prompt_logprobs"][1:], whole[0]["prompt_logprobs"][1:], 1e-6)
    assert all(c["prompt_logprobs"] is None for c in chunks if c is not first)


def _values(entries) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) of every entry of every position, flat; compare with pytest.approx per part."""
    pairs = [(token_id, v.logprob) for entry in entries for token_id, v in entry.items()]
    return [token_id for token_id, _ in pairs], [value for _, value in pairs]


def assert_values_close(got_entries, expected_entries, abs_tolerance):
    got_ids, got_values = _values(got_entries)
    expected_ids, expected_values = _values(expected_entries)
    assert got_ids == expected_ids
    assert got_values == pytest.approx(expected_values, abs=abs_tolerance)


def test_perplexity_from_prompt_logprobs_zero(smollm2_llm, hf_log_softmax):
    """prompt_logprobs=0: just each prompt token's own logprob, what a perplexity needs."""
    token_ids = smollm2_llm.tokenizer.encode(PROMPT)
    out = smollm2_llm.generate([token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    logprobs = [entry[t].logprob for entry, t in zip(out["prompt_logprobs"][1:], token_ids[1:])]
    assert all(len(entry) == 1 for entry in out["prompt_logprobs"][1:])
    reference = hf_log_softmax(token_ids)
    expected = [reference[j - 1, t].item() for j, t in enumerate(token_ids) if j]
    assert math.exp(-sum(logprobs) / len(logprobs)) == pytest.approx(math.exp(-sum(expected) / len(expected)),
                                                                     rel=1e-5)


# --- the engine's other paths, on a tiny model: each must give the plain eager run's logprobs

TINY_PROMPTS = random_prompts([37, 5, 50, 21, 44, 30], seed=7)


def tiny_logprobs(model_dir, **kwargs):
    params = [greedy(12, logprobs=3, prompt_logprobs=2 if i % 2 == 0 else None) for i in range(len(TINY_PROMPTS))]
    llm = LLM(model_dir, **tiny_llm_kwargs(**kwargs))
    try:
        outs = llm.generate(TINY_PROMPTS, params, use_tqdm=False)
        return [(o["token_ids"], o["logprobs"], o["prompt_logprobs"]) for o in outs], llm.stats()
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def tiny_reference(qwen3_dir):
    return tiny_logprobs(qwen3_dir)[0]


def assert_same_logprobs(got, expected):
    for (ids, logprobs, prompt_logprobs), (exp_ids, exp_logprobs, exp_prompt) in zip(got, expected):
        assert ids == exp_ids
        assert_values_close(logprobs, exp_logprobs, TOLERANCE)
        assert [e is None for e in prompt_logprobs or ()] == [e is None for e in exp_prompt or ()]
        assert_values_close((prompt_logprobs or [None])[1:], (exp_prompt or [None])[1:], TOLERANCE)


def test_logprobs_in_row_chunks_are_the_whole_batchs(monkeypatch):
    """logprobs_of, 3 rows at a time, gives chosen_and_top(raw_logprobs(...)) of the whole batch bit for bit."""
    import nanovllm.layers.logprobs as logprobs_module
    torch.manual_seed(0)
    logits = torch.randn(10, 50, dtype=torch.bfloat16)
    chosen = torch.randint(50, (10,))
    expected = logprobs_module.chosen_and_top(logprobs_module.raw_logprobs(logits), chosen, 4)
    monkeypatch.setattr(logprobs_module, "LOGPROB_CHUNK_ELEMENTS", 3 * 50)
    got = logprobs_module.logprobs_of(logits, chosen, 4)
    assert len(got) == 3 and all(torch.equal(g, e) for g, e in zip(got, expected))


def test_sliced_mlp_and_chunked_logprobs_match_the_whole_steps(qwen3_dir, tiny_reference, monkeypatch):
    """The MLP in slices of 16 rows (prefill steps of up to 187 tokens here) and logprobs 2 rows at a time: the
    same tokens, and the same logprobs but for the GEMMs' rounding of other row counts."""
    import nanovllm.layers.logprobs as logprobs_module
    import nanovllm.models.decoder as decoder
    monkeypatch.setattr(logprobs_module, "LOGPROB_CHUNK_ELEMENTS", 2 * VOCAB)
    slices = []
    add_rows = decoder.DecoderLayer._add_mlp_rows
    monkeypatch.setattr(decoder.DecoderLayer, "_add_mlp_rows",
                        lambda layer, residual: slices.append(residual.size(0)) or add_rows(layer, residual))
    got, _ = tiny_logprobs(qwen3_dir, mlp_chunk_tokens=16)
    assert_same_logprobs(got, tiny_reference)
    assert 16 in slices and max(slices) == 16  # the prefill steps ran sliced, the decode steps whole


def _rope_store_standin(qkv, positions, cos_sin, H, K, D, k_cache, v_cache, slots, q_weight, k_weight, eps, *_):
    """rope_store_kvcache's contract in torch (tests/test_rope_store_kernel.py checks the kernel against it)."""
    from nanovllm.layers.layernorm import rms_norm
    from nanovllm.layers.rotary_embedding import apply_rope
    q, k, v = qkv.split([H * D, K * D, K * D], dim=-1)
    q, k, v = q.view(-1, H, D), k.view(-1, K, D), v.view(-1, K, D)
    if q_weight is not None:
        q, k = rms_norm.fn(q, q_weight, eps), rms_norm.fn(k, k_weight, eps)
    q, k = apply_rope.fn(positions, q, k, cos_sin)
    valid = slots >= 0
    k_cache[slots[valid] // k_cache.size(1), slots[valid] % k_cache.size(1)] = k[valid]
    v_cache[slots[valid] // v_cache.size(1), slots[valid] % v_cache.size(1)] = v[valid]
    return q


def test_the_fused_rope_store_glue_gives_the_unfused_paths_logprobs(qwen3_dir, tiny_reference, monkeypatch):
    """The fused path's two halves (Attention.rope_store, then attend_stored over the cache it wrote), with the
    kernel's torch stand-in: the eager layer drops qkv between them. The same tokens and logprobs."""
    import types

    from nanovllm.engine.model_runner import ModelRunner
    monkeypatch.setattr(ModelRunner, "use_fused_rope_store", lambda self: True)
    calls = []
    module = types.ModuleType("nanovllm.kernels.rope_store")
    module.rope_store_kvcache = lambda *args: calls.append(1) or _rope_store_standin(*args)
    monkeypatch.setitem(sys.modules, "nanovllm.kernels.rope_store", module)
    got, _ = tiny_logprobs(qwen3_dir)
    assert_same_logprobs(got, tiny_reference)
    assert calls


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_prompts_get_their_logprobs_once(qwen3_dir, tiny_reference, mode):
    """A cache too small for the batch: sequences are preempted mid-prefill and mid-decode; a recomputed prefill
    must not give its prompt logprobs twice, a resumed one continues where it was."""
    got, stats = tiny_logprobs(qwen3_dir, num_kvcache_blocks=30, max_num_batched_tokens=24,
                               preemption_mode=mode, swap_space=0.01)
    assert stats[f"preemptions_{mode}"] > 0, stats
    assert_same_logprobs(got, tiny_reference)
    for (_, _, prompt_logprobs), prompt in zip(got, TINY_PROMPTS):
        assert prompt_logprobs is None or len(prompt_logprobs) == len(prompt)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_graph_buffers_and_scheduling_modes(qwen3_dir, tiny_reference, monkeypatch, async_scheduling):
    monkeypatch.setenv("NANOVLLM_DECODE_GRAPHS", "1")
    monkeypatch.setenv("NANOVLLM_PIECEWISE_GRAPHS", "1")
    got, _ = tiny_logprobs(qwen3_dir, async_scheduling=async_scheduling, max_num_batched_tokens=32)
    assert_same_logprobs(got, tiny_reference)


@pytest.mark.subprocess
def test_tensor_parallel_logprobs(qwen3_dir, tiny_reference):
    got, _ = tiny_logprobs(qwen3_dir, tensor_parallel_size=2)
    assert_same_logprobs(got, tiny_reference)


# --- OpenAI's formats (the server's)

def test_openai_formats_of_an_entry():
    from nanovllm.entrypoints.server.openai_logprobs import chat_logprobs, completion_logprobs
    outside = {7: Logprob(-3.0, 4, "c"), 5: Logprob(-0.5, 1, "a"), 6: Logprob(-1.5, 2, "bb")}  # chosen: rank 4
    inside = {6: Logprob(-1.5, 2, "bb"), 5: Logprob(-0.5, 1, "a")}  # chosen among the top 2
    infinite = {9: Logprob(float("-inf"), 50, None)}  # no tokenizer, k = 0
    legacy = completion_logprobs([outside, inside, infinite], text_offset=10)
    assert legacy == {"tokens": ["c", "bb", "token_id:9"], "token_logprobs": [-3.0, -1.5, -9999.0],
                      "top_logprobs": [{"c": -3.0, "a": -0.5, "bb": -1.5}, {"bb": -1.5, "a": -0.5},
                                       {"token_id:9": -9999.0}],
                      "text_offset": [10, 11, 13]}
    chat = chat_logprobs([outside, inside], num_top=2)["content"]
    assert [c["token"] for c in chat] == ["c", "bb"] and chat[1]["bytes"] == [98, 98]
    assert [[t["token"] for t in c["top_logprobs"]] for c in chat] == [["a", "bb"], ["a", "bb"]]
    assert chat_logprobs([infinite], num_top=0)["content"] == [
        {"token": "token_id:9", "logprob": -9999.0, "bytes": list(b"token_id:9"), "top_logprobs": []}]


# --- the server: OpenAI's client parses both formats, streamed or not (this module's last tests: the server's
# engine loop takes smollm2_llm over until the module ends)

SERVED = "smollm2"


@pytest.fixture(scope="module")
def smollm2_llm_offline_logprobs(smollm2_llm):
    """The offline engine's greedy logprobs for PROMPT, taken before the server owns the engine."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    return smollm2_llm.generate([PROMPT], params, use_tqdm=False)[0]["logprobs"]


@pytest.fixture(scope="module")
def openai_client(smollm2_llm, smollm2_llm_offline_logprobs):
    openai = pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from nanovllm.entrypoints.server import build_app
    with serving(build_app(smollm2_llm, SERVED), start_timeout_s=60) as port:
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120) as c:
            yield c


GREEDY_BODY = dict(model=SERVED, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})


def test_server_completions_logprobs(openai_client, smollm2_llm_offline_logprobs):
    offline = smollm2_llm_offline_logprobs
    out = openai_client.completions.create(prompt=PROMPT, logprobs=2, **GREEDY_BODY).choices[0]
    lp = out.logprobs
    chosen = [next(iter(entry.values())) for entry in offline]
    assert lp.tokens == [c.decoded_token for c in chosen] and "".join(lp.tokens) == out.text
    assert lp.token_logprobs == pytest.approx([c.logprob for c in chosen], abs=TOLERANCE)
    assert [len(top) for top in lp.top_logprobs] == [len(entry) for entry in offline]  # chosen + top 2, merged
    assert all(top[token] == value for top, token, value in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    chunks = list(openai_client.completions.create(prompt=PROMPT, logprobs=2, stream=True, **GREEDY_BODY))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=TOLERANCE)
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset  # offsets run on across chunks
    plain = openai_client.completions.create(prompt=PROMPT, **GREEDY_BODY).choices[0]
    assert plain.logprobs is None and plain.text == out.text


def test_server_chat_logprobs(openai_client):
    messages = [{"role": "user", "content": "Name a color."}]
    body = dict(GREEDY_BODY, messages=messages, logprobs=True, top_logprobs=3)
    out = openai_client.chat.completions.create(**body).choices[0]
    content = out.logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content).startswith(out.message.content)
    for token in content:
        assert token.bytes == list(token.token.encode()) and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].token == token.token  # greedy: the chosen token is the most likely
        values = [t.logprob for t in token.top_logprobs]
        assert values == sorted(values, reverse=True) and token.logprob == values[0]
    chunks = list(openai_client.chat.completions.create(stream=True, **body))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=TOLERANCE)
    only_chosen = openai_client.chat.completions.create(**dict(body, top_logprobs=None)).choices[0].logprobs
    assert [t.top_logprobs for t in only_chosen.content] == [[]] * 6


@pytest.mark.parametrize("options, message", [
    (dict(logprobs=True, top_logprobs=21), "top_logprobs=21 must be in [0, 20]"),
    (dict(top_logprobs=2), "top_logprobs=2 needs logprobs=true"),
])
def test_server_bad_chat_logprobs_get_400(openai_client, options, message):
    import openai
    with pytest.raises(openai.BadRequestError, match=re.escape(message)):
        openai_client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **GREEDY_BODY, **options)
    assert openai_client.completions.create(prompt="Hi", **GREEDY_BODY).choices[0].text  # still serving
