"""End-to-end behaviour of the engine through its public API: sampling, stops,
input validation, engine lifecycle and the console command.

At most one engine is alive at a time: shared engines are class-scoped (torn
down when their class ends) and the other tests use `with LLM(...)`.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import (
    EOS,
    TINY_MAX_LEN,
    VOCAB,
    assert_matches_hf,
    close_llm,
    greedy,
    hf_greedy,
    random_prompts,
    smollm2_llm_kwargs,
    tiny_llm_kwargs,
)
from nanovllm import LLM, SamplingParams

PROMPTS = random_prompts((5, 11, 23, 8), seed=50)
N = 16


def ids(outs):
    return [list(o["token_ids"]) for o in outs]


ids_of = ids  # for tests whose locals shadow `ids`


# ---------------------------------------------------------------- sampling


@pytest.fixture(scope="class", params=[True, False], ids=["async", "sync"])
def sampling_llm(qwen2_dir, request):
    llm = LLM(qwen2_dir, **tiny_llm_kwargs(async_scheduling=request.param))
    yield llm
    close_llm(llm)


@pytest.fixture(scope="class")
def greedy_ids(sampling_llm, qwen2_dir):
    outs = sampling_llm.generate(PROMPTS, greedy(N), use_tqdm=False)
    assert_matches_hf(qwen2_dir, PROMPTS, outs, N, what="greedy reference")
    return ids(outs)


class TestSampling:
    @pytest.fixture()
    def llm(self, sampling_llm):
        return sampling_llm

    @pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
    def test_seeded_sampling_repeats_within_engine(self, llm, greedy_ids):
        sp = SamplingParams(temperature=0.8, seed=1234, max_tokens=N, ignore_eos=True)
        a = ids(llm.generate(PROMPTS, sp, use_tqdm=False))
        b = ids(llm.generate(PROMPTS, sp, use_tqdm=False))
        assert a == b
        assert all(len(x) == N and all(0 <= t < VOCAB for t in x) for x in a), a
        # it really samples: 64 draws at T=0.8 do not all land on the argmax
        assert a != greedy_ids

    def test_different_seeds_differ(self, llm):
        a = ids(llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=1, max_tokens=N, ignore_eos=True),
                             use_tqdm=False))
        b = ids(llm.generate(PROMPTS, SamplingParams(temperature=0.8, seed=2, max_tokens=N, ignore_eos=True),
                             use_tqdm=False))
        assert a != b

    def test_per_request_seeds_in_one_batch(self, llm):
        sps = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=N, ignore_eos=True)
               for i in range(len(PROMPTS))]
        a = ids(llm.generate(PROMPTS, sps, use_tqdm=False))
        b = ids(llm.generate(PROMPTS, sps, use_tqdm=False))
        assert a == b

    def test_top_k_1_equals_greedy(self, llm, greedy_ids):
        sp = SamplingParams(temperature=0.8, top_k=1, max_tokens=N, ignore_eos=True)
        assert ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == greedy_ids

    def test_tiny_top_p_equals_greedy(self, llm, greedy_ids):
        # top_p keeps the smallest set reaching p: for a tiny p that is the argmax alone
        sp = SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=N, ignore_eos=True)
        assert ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == greedy_ids

    def test_min_p_1_equals_greedy(self, llm, greedy_ids):
        # min_p=1 keeps only tokens as likely as the most likely one
        sp = SamplingParams(temperature=0.8, min_p=1.0, max_tokens=N, ignore_eos=True)
        assert ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == greedy_ids

    def test_mixed_params_batch_keeps_input_order(self, llm, greedy_ids, qwen2_dir):
        lens = [3, N, 1, 7]
        sps = [greedy(n) for n in lens]
        outs = llm.generate(PROMPTS, sps, use_tqdm=False)
        for out, ref, n in zip(outs, greedy_ids, lens):
            assert out["token_ids"] == ref[:n] and out["finish_reason"] == "length", (out, ref, n)

    def test_stop_token_ids(self, llm, greedy_ids):
        # without ignore_eos, pick a prompt whose greedy run never meets EOS
        plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=N), use_tqdm=False)
        i = next(k for k, o in enumerate(plain) if o["finish_reason"] == "length")
        ref = plain[i]["token_ids"]
        assert ref == greedy_ids[i]
        stop_tok = ref[6]
        cut = ref.index(stop_tok)
        sp = SamplingParams(temperature=0.0, max_tokens=N, stop_token_ids=[stop_tok])
        [out] = llm.generate([PROMPTS[i]], sp, use_tqdm=False)
        assert out["finish_reason"] == "stop", out
        assert out["token_ids"][-1] == stop_tok, out
        assert out["token_ids"] == ref[: cut + 1], (out, ref)

    def test_min_tokens_keeps_stop_tokens_out_of_the_first_tokens(self, llm, greedy_ids):
        """The stop token is greedy's 3rd token: with min_tokens=6 it cannot be sampled before the 7th, so
        greedy takes the next best there and the request runs on (vLLM's min_tokens)."""
        i = 0
        ref = greedy_ids[i]
        stop_tok = ref[2]
        k = ref.index(stop_tok)
        plain = SamplingParams(temperature=0.0, max_tokens=N, stop_token_ids=[stop_tok])
        [out] = llm.generate([PROMPTS[i]], plain, use_tqdm=False)
        assert out["token_ids"] == ref[:k + 1] and out["finish_reason"] == "stop"
        held = SamplingParams(temperature=0.0, max_tokens=N, stop_token_ids=[stop_tok], min_tokens=6)
        [out] = llm.generate([PROMPTS[i]], held, use_tqdm=False)
        ids = out["token_ids"]
        assert ids[:k] == ref[:k] and ids[k] != stop_tok and stop_tok not in ids[:6], (ids, ref)
        assert len(ids) > 6 and (out["finish_reason"] == "length" or ids.index(stop_tok) == len(ids) - 1), out
        # nothing to hold back (ignore_eos, no stop tokens): min_tokens changes nothing, and must not fail the step
        nothing = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=3, ignore_eos=True)
        assert ids_of(llm.generate([PROMPTS[i], PROMPTS[1]], [nothing, greedy(6)], use_tqdm=False)) == \
            [ref[:6], greedy_ids[1][:6]]

    def test_eos_stops_unless_ignored(self, llm, qwen2_dir):
        """The model's EOS (id 2) ends a request with "stop" unless ignore_eos."""
        # find a prompt on which greedy decoding produces EOS
        cands = random_prompts([6] * 64, seed=51)
        refs = hf_greedy(qwen2_dir, cands, 24)
        hit = [(p, r) for p, r in zip(cands, refs) if EOS in r]
        if not hit:
            pytest.skip("no sampled prompt makes this tiny model emit EOS")
        p, r = hit[0]
        [out] = llm.generate([p], SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
        assert out["finish_reason"] == "stop", out
        k = r.index(EOS)
        assert out["token_ids"] in (r[:k], r[: k + 1]), (out, r)
        [full] = llm.generate([p], greedy(24), use_tqdm=False)
        assert full["token_ids"] == r and full["finish_reason"] == "length"


def test_seeded_sampling_repeats_across_engines(qwen2_dir):
    sp = SamplingParams(temperature=0.8, seed=7, max_tokens=N, ignore_eos=True)
    with LLM(qwen2_dir, **tiny_llm_kwargs()) as llm:
        a = ids(llm.generate(PROMPTS, sp, use_tqdm=False))
    with LLM(qwen2_dir, **tiny_llm_kwargs(seed=123)) as llm:
        b = ids(llm.generate(PROMPTS, sp, use_tqdm=False))
    assert a == b


# ---------------------------------------------------------------- stop strings (real model)


@pytest.fixture(scope="class")
def smol_llm(smollm2_dir):
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs())
    yield llm
    close_llm(llm)


# the story's length: about 25 words, enough for stop strings early, in the middle and late in the text (every claim
# of TestStopStrings is about where the text is cut, not about its length)
STORY_TOKENS = 32


@pytest.fixture(scope="class")
def smol_tok(smollm2_dir):
    """SmolLM2's tokenizer, loaded once for the class (0.3-0.9 CPU-s a load)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="class")
def story(smol_llm, smol_tok):
    """A greedy chat answer of SmolLM2; the stop strings are picked from its text."""
    tok = smol_tok
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Tell me a short story about a cat and a dog."}],
        tokenize=False, add_generation_prompt=True,
    )
    [out] = smol_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS), use_tqdm=False)
    words = [w for w in re.findall(r"[A-Za-z]+", out["text"])]
    assert len(words) >= 12, out
    return prompt, out


class TestStopStrings:
    @pytest.fixture()
    def llm(self, smol_llm):
        return smol_llm

    @staticmethod
    def middle_word(text: str) -> str:
        words = re.findall(r"[A-Za-z]{4,}", text)
        return words[len(words) // 2]

    def check(self, llm, prompt, ref_text, stop):
        idx = min(ref_text.index(s) for s in stop if s in ref_text)
        assert idx > 0
        [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=stop),
                             use_tqdm=False)
        assert out["finish_reason"] == "stop", (stop, out)
        assert out["text"] == ref_text[:idx], (stop, out["text"], ref_text)

    def test_stop_word(self, llm, story):
        prompt, ref = story
        self.check(llm, prompt, ref["text"], [self.middle_word(ref["text"])])

    def test_stop_phrase_spanning_tokens(self, llm, story):
        prompt, ref = story
        text = ref["text"]
        w = self.middle_word(text)
        start = text.index(w)
        phrase = text[start: start + len(w) + 8]  # the word and what follows: several tokens
        self.check(llm, prompt, text, [phrase])

    def test_earliest_stop_string_wins(self, llm, story):
        prompt, ref = story
        text = ref["text"]
        words = re.findall(r"[A-Za-z]{4,}", text)
        late, early = words[-2], words[len(words) // 3]
        self.check(llm, prompt, text, [late, early])

    def test_stop_string_completed_by_the_last_allowed_token(self, llm, story, smol_tok):
        """The token that completes the stop string is also the last max_tokens allows: the text is still cut
        and the reason is "stop", not "length" (vLLM checks the last token too)."""
        tok = smol_tok
        prompt, ref = story
        w = self.middle_word(ref["text"])
        n = next(n for n in range(1, STORY_TOKENS + 1)
                 if w in tok.decode(ref["token_ids"][:n], skip_special_tokens=True))
        [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, stop=[w]), use_tqdm=False)
        assert out["finish_reason"] == "stop" and out["text"] == ref["text"][:ref["text"].index(w)], (w, n, out)
        assert out["token_ids"] == ref["token_ids"][:n]

    def test_min_tokens_skips_stop_strings_that_end_within_them(self, llm, story, smol_tok):
        """A stop string whose first match ends within the first min_tokens tokens is matched only where it
        ends after them (vLLM checks only the text that later tokens add)."""
        tok = smol_tok
        prompt, ref = story
        text, ids = ref["text"], ref["token_ids"]
        w = re.findall(r" [A-Za-z]{3,}", text)[0]  # an early word
        n = next(n for n in range(1, STORY_TOKENS + 1) if w in tok.decode(ids[:n], skip_special_tokens=True))
        start = len(tok.decode(ids[:n], skip_special_tokens=True))
        later = text.find(w, start - len(w) + 1)
        params = SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=[w], min_tokens=n)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        if later < 0:
            assert out["finish_reason"] == "length" and out["text"] == text, (w, out)
        else:
            assert out["finish_reason"] == "stop" and out["text"] == text[:later], (w, later, out)

    def test_include_stop_str_in_output(self, llm, story):
        prompt, ref = story
        w = self.middle_word(ref["text"])
        params = SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=[w], include_stop_str_in_output=True)
        [out] = llm.generate([prompt], params, use_tqdm=False)
        end = ref["text"].index(w) + len(w)
        assert out["finish_reason"] == "stop" and out["text"] == ref["text"][:end], (w, out)

    def test_a_stop_tokens_text_is_left_out_unless_included(self, llm, story, smol_tok):
        """As in vLLM: the stop token stays in token_ids, and its text is not in `text`."""
        tok = smol_tok
        prompt, ref = story
        k = 8
        stop_id = ref["token_ids"][k]
        k = ref["token_ids"].index(stop_id)  # its first occurrence
        for include in (False, True):
            params = SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop_token_ids=[stop_id],
                                    include_stop_str_in_output=include)
            [out] = llm.generate([prompt], params, use_tqdm=False)
            assert out["finish_reason"] == "stop" and out["token_ids"] == ref["token_ids"][:k + 1], out
            assert out["text"] == tok.decode(ref["token_ids"][:k + 1 if include else k], skip_special_tokens=True)

    @pytest.mark.parametrize("where", ["never", "first_word"])
    def test_stream_chunks_join_to_the_text(self, llm, story, where):
        """A stop string longer than the text so far holds all of it back; the chunks never repeat text or
        leak the start of a stop string, and join to what generate returns."""
        prompt, ref = story
        text = ref["text"]
        stop = [text[:40] + "#" * 10] if where == "never" else [text[:30]]
        params = SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=stop)
        # a stop string that never matches leaves generate's answer the story itself: greedy, the same prompt and
        # max_tokens (so the stream is held to the whole text without a second run of 32 tokens)
        [want] = [ref] if where == "never" else llm.generate([prompt], params, use_tqdm=False)
        chunks = list(llm.generate_stream([prompt], params))
        assert "".join(c["text"] for c in chunks) == want["text"], (chunks, want)
        assert chunks[-1]["finish_reason"] == want["finish_reason"] == ("length" if where == "never" else "stop")

    def test_greedy_token_ids_unchanged_by_stop(self, llm, story):
        prompt, ref = story
        w = self.middle_word(ref["text"])
        [out] = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=STORY_TOKENS, stop=[w]),
                             use_tqdm=False)
        n = len(out["token_ids"])
        assert 0 < n <= len(ref["token_ids"]) and out["token_ids"] == ref["token_ids"][:n]


# ---------------------------------------------------------------- bad input


@pytest.fixture(scope="class", params=[True, False], ids=["async", "sync"])
def bad_input_llm(llama_dir, request):
    llm = LLM(llama_dir, **tiny_llm_kwargs(async_scheduling=request.param))
    yield llm
    close_llm(llm)


class TestBadInput:
    GOOD = random_prompts((13,), seed=60)[0]

    @pytest.fixture()
    def llm(self, bad_input_llm):
        return bad_input_llm

    @pytest.fixture()
    def serves_good(self, llm, llama_dir):
        """After each bad input the same engine still answers a good request right."""
        yield
        outs = llm.generate([self.GOOD], greedy(8), use_tqdm=False)
        assert_matches_hf(llama_dir, [self.GOOD], outs, 8, what="good request after bad input")

    @pytest.mark.parametrize(
        "prompt, pattern",
        [
            ([], r"empty"),
            ("", r"empty|tokenizer"),
            ([5] * (TINY_MAX_LEN + 1), r"max_model_len|too long|longer"),
            ([5, 10**6, 7], r"vocab|range|token"),
            ([5, -1, 7], r"vocab|range|token|negative"),
            ("a string prompt", r"tokenizer"),  # tiny models ship no tokenizer
        ],
        ids=["empty", "empty-str", "too-long", "id-too-big", "id-negative", "str-without-tokenizer"],
    )
    def test_bad_prompt(self, llm, serves_good, prompt, pattern):
        with pytest.raises(ValueError, match=re.compile(pattern, re.I)):
            llm.generate([prompt], greedy(4), use_tqdm=False)

    def test_bad_prompt_in_batch_adds_nothing(self, llm, serves_good):
        with pytest.raises(ValueError, match=re.compile(r"vocab|range|token", re.I)):
            llm.generate([self.GOOD, [5, 10**6]], greedy(4), use_tqdm=False)

    def test_sampling_params_count_mismatch(self, llm, serves_good):
        with pytest.raises(ValueError):
            llm.generate([self.GOOD, self.GOOD], [greedy(4)] * 3, use_tqdm=False)

    @pytest.mark.parametrize(
        "kw, name",
        [
            (dict(max_tokens=0), "max_tokens"),
            (dict(temperature=-0.5), "temperature"),
            (dict(top_p=0.0), "top_p"),
            (dict(top_p=1.5), "top_p"),
            (dict(top_k=2.5), "top_k"),
            (dict(seed=2**64), "seed"),
            (dict(seed=1.5), "seed"),
            (dict(seed=True), "seed"),
            (dict(temperature=float("inf")), "temperature"),
            (dict(temperature=1e39), "temperature"),  # infinite in float32: every logit would become NaN
            (dict(temperature=float("nan")), "temperature"),
            (dict(temperature="0.5"), "temperature"),
            (dict(max_tokens=2.5), "max_tokens"),
            (dict(max_tokens=float("nan")), "max_tokens"),
            (dict(stop=[5]), "stop"),
            (dict(stop_token_ids=7), "stop_token_ids"),
            (dict(stop_token_ids=[-1]), "stop_token_ids"),
            (dict(ignore_eos="yes"), "ignore_eos"),
            (dict(seed=2**64 - 1, n=2), "seed=18446744073709551615 is too large for 2 samples"),  # seed + 1 overflows
        ],
        ids=["max_tokens-0", "temperature-neg", "top_p-0", "top_p-1.5", "top_k-float", "seed-2**64", "seed-float",
             "seed-bool", "temperature-inf", "temperature-float32-inf", "temperature-nan", "temperature-str",
             "max_tokens-float", "max_tokens-nan", "stop-int", "stop_token_ids-int", "stop_token_ids-negative",
             "ignore_eos-str", "seed-plus-n"],
    )
    def test_bad_sampling_params(self, llm, serves_good, kw, name):
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw)

    def test_stop_strings_without_a_tokenizer(self, llm, serves_good):
        with pytest.raises(ValueError, match="stop_token_ids"):
            llm.generate([self.GOOD], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)

    def test_sampling_params_take_what_python_and_numpy_users_pass(self, llm, serves_good):
        import numpy as np
        params = SamplingParams(stop_token_ids=(i for i in [5, 6]), stop={"x"}, ignore_eos=np.True_,
                                include_stop_str_in_output=1, temperature=np.float32(0.5), max_tokens=np.int64(3))
        assert params.stop_token_ids == [5, 6] and params.stop == ["x"]  # a generator is not emptied by the checks
        assert params.ignore_eos is True and params.include_stop_str_in_output is True and params.max_tokens == 3

    def test_numpy_token_ids_are_a_prompt(self, llm, serves_good):
        import numpy as np
        want = llm.generate([self.GOOD], greedy(4), use_tqdm=False)[0]["token_ids"]
        assert llm.generate(np.array(self.GOOD), greedy(4), use_tqdm=False)[0]["token_ids"] == want  # one prompt
        assert llm.generate([np.array(self.GOOD)], greedy(4), use_tqdm=False)[0]["token_ids"] == want
        params = SamplingParams(temperature=0, max_tokens=np.int64(4), top_k=np.int64(3), seed=np.int32(1))
        assert llm.generate([self.GOOD], params, use_tqdm=False)[0]["token_ids"] == want
        with pytest.raises(ValueError, match="not an integer"):
            llm.generate([[5, 7.0]], greedy(4), use_tqdm=False)

    def test_top_k_beyond_the_vocabulary_disables_it(self, llm, serves_good):
        params = SamplingParams(temperature=0.8, top_k=2**63, seed=3, max_tokens=6, ignore_eos=True)
        plain = SamplingParams(temperature=0.8, seed=3, max_tokens=6, ignore_eos=True)
        got = llm.generate([self.GOOD], params, use_tqdm=False)[0]["token_ids"]
        assert got == llm.generate([self.GOOD], plain, use_tqdm=False)[0]["token_ids"]

    def test_idle_steps_return_nothing(self, llm, serves_good):
        assert llm.step() == [] and llm.step() == [] and llm.step() == []

    def test_missing_model_dir(self, llm, serves_good, tmp_path):
        missing = str(tmp_path / "no-such-model")
        with pytest.raises(ValueError, match=re.escape("no-such-model")):
            LLM(missing, **tiny_llm_kwargs())

    @pytest.mark.parametrize("edit, message", [
        (lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"),
         r"lacks weights.*qkv_proj\.weight shards \['k'\]"),
        (lambda w: w.pop("model.layers.0.mlp.up_proj.weight"), r"lacks weights.*gate_up_proj\.weight shards \['1'\]"),
        (lambda w: w.update({"model.embed_tokens.weight": w["model.embed_tokens.weight"][:-8]}),
         r"model\.embed_tokens\.weight.*\(504, 64\) does not match the parameter's \(512, 64\)"),
        (lambda w: w.update({k: w[k][:1] for k in ["model.layers.0.self_attn.o_proj.weight"]}),
         r"o_proj\.weight.*\(1, 128\) does not match the parameter's \(64, 128\)"),  # would broadcast
    ], ids=["no-k_proj", "no-up_proj", "vocab-mismatch", "broadcastable-shape"])
    def test_a_checkpoint_with_missing_or_misshapen_weights(self, llm, serves_good, qwen3_dir, tmp_path, edit,
                                                           message):
        """A packed parameter (q/k/v, gate/up) with a shard missing would keep uninitialised memory; a tensor of
        another shape must not be broadcast or padded into place."""
        from safetensors.torch import load_file, save_file
        bad = tmp_path / "bad"
        shutil.copytree(qwen3_dir, bad)
        weights = load_file(str(bad / "model.safetensors"))
        edit(weights)
        save_file(weights, str(bad / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            LLM(str(bad), **tiny_llm_kwargs())

    def test_unsupported_architecture(self, llm, serves_good, llama_dir, tmp_path):
        bad = tmp_path / "gpt2ish"
        shutil.copytree(llama_dir, bad)
        cfg_path = bad / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["architectures"] = ["GPT2LMHeadModel"]
        cfg_path.write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match="GPT2LMHeadModel"):
            LLM(str(bad), **tiny_llm_kwargs())


def test_a_request_that_fills_the_whole_cache_is_admitted(qwen3_dir):
    """8 blocks of 4 tokens hold 32 tokens of KV: a 4-token prompt may ask for 29 tokens, since the last one is
    sampled and never computed; 30 would need a ninth block."""
    prompt = random_prompts((4,), seed=61)[0]
    with LLM(qwen3_dir, **tiny_llm_kwargs(num_kvcache_blocks=8)) as llm:
        [out] = llm.generate([prompt], greedy(29), use_tqdm=False)
        assert len(out["token_ids"]) == 29 and out["finish_reason"] == "length"
        assert llm.stats()["preemptions"] == 0
        with pytest.raises(ValueError, match=r"needs 9 KV blocks \(33 tokens\) but the cache has 8"):
            llm.generate([prompt], greedy(30), use_tqdm=False)


def test_interleaved_streams_and_an_abort_from_outside(qwen3_dir):
    """Two generate_stream calls advanced in turn: each collects its own requests, and none of them is handed to
    a later step() as well; a request aborted with abort_request ends its stream with "abort"."""
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        want = ids(llm.generate(PROMPTS[:3], greedy(6), use_tqdm=False))
        a, b = llm.generate_stream(PROMPTS[:2], greedy(6)), llm.generate_stream(PROMPTS[2:3], greedy(6))
        got = {0: [], 1: [], 2: []}
        for chunk in b:
            got[2] += chunk["token_ids"]
            first = next(a, None)  # a's requests finish during b's steps too
            if first is not None:
                got[first["index"]] += first["token_ids"]
        for chunk in a:
            got[chunk["index"]] += chunk["token_ids"]
        assert [got[0], got[1], got[2]] == want
        assert llm.step() == [] and not llm.requests
        stream = llm.generate_stream(PROMPTS[:1], greedy(50))
        first = next(stream)
        llm.abort_request(next(iter(llm.requests)))
        assert [chunk["finish_reason"] for chunk in stream] == ["abort"] and first["finish_reason"] is None


def test_a_request_added_by_hand_that_finishes_inside_generate_comes_back_from_step(qwen3_dir):
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        seq_id = llm.add_request(PROMPTS[0], greedy(2))
        outs = llm.generate(PROMPTS[1:], greedy(8), use_tqdm=False)  # runs the other request to its end too
        assert [len(o["token_ids"]) for o in outs] == [8] * 3
        finished = llm.step()
        assert [seq.seq_id for seq in finished] == [seq_id] and len(llm.output(finished[0])["token_ids"]) == 2
        assert llm.step() == [] and llm.is_finished()


def test_a_failed_step_leaves_no_prefix_cache_hits_on_blocks_it_never_wrote(qwen3_dir):
    """A step registers its full blocks in the prefix cache when it is scheduled; if its launch then fails (an
    out-of-memory error, say), their KV was never written. The engine drops its caches once nothing holds blocks,
    so the same prompt afterwards is computed again, not read from those blocks."""
    prompt = random_prompts((24,), seed=62)[0]  # 6 full blocks of 4 tokens
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        launch = llm.runner.launch

        def fail_once(*args, **kwargs):
            llm.runner.launch = launch
            raise RuntimeError("CUDA out of memory (simulated)")
        llm.runner.launch = fail_once
        with pytest.raises(RuntimeError, match="simulated"):
            llm.generate([prompt], greedy(8), use_tqdm=False)
        outs = llm.generate([prompt], greedy(8), use_tqdm=False)
        assert llm.stats()["prefix_cache_hit_tokens"] == 0
        assert llm.reset_prefix_cache()  # idle: allowed
    assert_matches_hf(qwen3_dir, [prompt], outs, 8, what="after a failed step")


# ---------------------------------------------------------------- lifecycle


def test_close_then_second_llm(qwen3_dir):
    llm = LLM(qwen3_dir, **tiny_llm_kwargs())
    a = llm.generate(PROMPTS, greedy(N), use_tqdm=False)
    llm.close()
    llm2 = LLM(qwen3_dir, **tiny_llm_kwargs())
    try:
        b = llm2.generate(PROMPTS, greedy(N), use_tqdm=False)
    finally:
        llm2.close()
    assert ids(a) == ids(b)
    assert_matches_hf(qwen3_dir, PROMPTS, b, N, what="second engine")


def test_context_manager_and_switching_models(qwen2_dir, llama_dir):
    with LLM(qwen2_dir, **tiny_llm_kwargs()) as llm:
        a = llm.generate(PROMPTS[:2], greedy(6), use_tqdm=False)
    with LLM(llama_dir, **tiny_llm_kwargs()) as llm:
        b = llm.generate(PROMPTS[:2], greedy(6), use_tqdm=False)
    assert_matches_hf(qwen2_dir, PROMPTS[:2], a, 6, what="qwen2 in context manager")
    assert_matches_hf(llama_dir, PROMPTS[:2], b, 6, what="llama after qwen2")


# ---------------------------------------------------------------- console command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY_CLI = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "128", "--kvcache-block-size", "4",
            "--num-kvcache-blocks", "64", "--max-num-batched-tokens", "256", "--max-num-seqs", "4",
            "--enforce-eager"]


def run_cli(*args, console_script: bool = False, timeout: int = 180) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "nanovllm")
    if console_script and os.path.exists(exe):
        cmd = [exe, *args]  # the installed `nanovllm` command
    else:
        cmd = [sys.executable, "-m", "nanovllm.entrypoints.cli", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.subprocess
def test_cli_generate_token_ids(qwen3_dir):
    prompt = [5, 17, 42, 99]
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", ",".join(map(str, prompt)),
                "--max-tokens", "6", "--ignore-eos", "--json", *TINY_CLI)
    assert r.returncode == 0, r.stderr
    [line] = [text for text in r.stdout.splitlines() if text.startswith("{")]
    out = json.loads(line)
    assert out["token_ids"] == hf_greedy(qwen3_dir, [prompt], 6)[0], out
    assert out["finish_reason"] == "length"


@pytest.mark.subprocess
def test_cli_generate_bad_input_fails_cleanly(qwen3_dir):
    r = run_cli("generate", "--model", qwen3_dir, "--prompt-ids", "5,1000000", "--max-tokens", "4", *TINY_CLI)
    assert r.returncode != 0
    assert "1000000" in r.stderr and "Traceback" not in r.stderr, r.stderr


@pytest.mark.subprocess
def test_cli_convert_into_a_path_that_cannot_be_created_fails_cleanly(tmp_path):
    (tmp_path / "a_file").write_text("")
    r = run_cli("convert", str(tmp_path / "a_file" / "out"))
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr, r.stderr


@pytest.mark.subprocess
def test_cli_generate_text_smollm2(smollm2_dir):
    """The README demo: a text question, chat template on by default."""
    r = run_cli("generate", "What is the capital of France?", "--model", smollm2_dir, "--device", "cpu",
                "--dtype", "float32", "--max-tokens", "24", "--max-model-len", "512",
                "--kvcache-block-size", "16", "--num-kvcache-blocks", "64", "--enforce-eager",
                console_script=True)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout, r.stdout


def test_cli_chat_prompt_has_one_bos(smollm2_dir, tmp_path, monkeypatch):
    """A chat template that starts with the BOS token, and a tokenizer that adds one when it encodes (Llama 3 and
    Mistral ship both): the CLI's chat prompt must carry one BOS, as the server's does, not two."""
    model = tmp_path / "bos"
    shutil.copytree(smollm2_dir, model)
    tok_path = model / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    tok["post_processor"] = {"type": "TemplateProcessing", "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
                             "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}},
                                      {"Sequence": {"id": "B", "type_id": 1}}],
                             "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1],
                                                                 "tokens": ["<|im_start|>"]}}}
    tok_path.write_text(json.dumps(tok))
    cfg_path = model / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["bos_token"] = "<|im_start|>"
    cfg["chat_template"] = ("{{ bos_token }}{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                            "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    cfg_path.write_text(json.dumps(cfg))
    for extra in model.glob("chat_template.*"):
        extra.unlink()
    from nanovllm.engine.request_intake import RequestIntake
    from nanovllm.entrypoints import cli
    seen = []
    real = RequestIntake.checked
    monkeypatch.setattr(RequestIntake, "checked", lambda self, p, sp: seen.append(real(self, p, sp)) or seen[-1])
    assert cli.main(["generate", "hi", "--model", str(model), "--device", "cpu", "--dtype", "float32",
                     "--max-tokens", "1", "--max-model-len", "256", "--num-kvcache-blocks", "32",
                     "--kvcache-block-size", "16", "--enforce-eager"]) == 0
    assert seen and seen[0].token_ids[0] == 1 and seen[0].token_ids[1] != 1, seen[0].token_ids[:4]


def test_a_closed_engine_lets_go_of_its_kv_cache(qwen3_dir):
    """A second LLM in the same process gets the memory of the first: nothing that outlives close() may hold the copy
    engine, and through it the whole KV cache (on a GPU the next engine would find no room)."""
    import gc
    import weakref

    with LLM(qwen3_dir, device="cpu", enforce_eager=True, num_kvcache_blocks=32, kvcache_block_size=16,
             preemption_mode="swap", swap_space=0.01) as llm:
        llm.generate([[1, 2, 3, 4]] * 2, SamplingParams(max_tokens=4), use_tqdm=False)
        kv_cache = weakref.ref(llm.runner.kv_cache)
    gc.collect()
    assert kv_cache() is None
