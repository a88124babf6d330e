"""A script written for vLLM runs unchanged on SmolLM2 (CPU): `from vllm import LLM, SamplingParams` resolves to
nanovllm here, and the script reads RequestOutput objects, samples n=4 with a seed, ranks best_of, biases logits
and bans words as it would on vLLM.

Then what the script cannot see: the 4 samples of a prompt hold its full prompt blocks once (exact block counts),
and each sample is token for token what its seed (seed + i, vLLM's rule) gives when run alone."""
import pathlib
import shutil
import sys

import pytest

from conftest import close_llm

# A vLLM script, as a user would write it (vLLM's argument names; the KV budget kept small for the CPU).
VLLM_SCRIPT = '''
from vllm import LLM, SamplingParams

llm = LLM(model=MODEL, tokenizer=TOKENIZER, device="cpu", dtype="float", trust_remote_code=False, max_logprobs=5,
          disable_log_stats=True, seed=0, max_model_len=512, enforce_eager=True, swap_space=0,
          kv_cache_memory_bytes=64 * 2**20)
prompts = ["The capital of France is", "Once upon a time"]

outputs = llm.generate(prompts, SamplingParams(n=4, seed=42, temperature=0.8, top_p=0.95, max_tokens=4),
                       use_tqdm=False)
for output in outputs:
    for sample in output.outputs:
        print(f"{output.prompt!r} [{sample.index}] {sample.text!r} ({sample.finish_reason})")

best = llm.generate(prompts[0], SamplingParams(n=2, best_of=4, seed=7, max_tokens=6, logprobs=1))[0]
greedy = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
paris = llm.get_tokenizer().encode(" Paris", add_special_tokens=False)[0]
biased = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=3, logit_bias={paris: 100.0}))[0]
banned = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=6, bad_words=["Paris"]))[0]
no_period = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, bad_words=["Paris."]))[0]
'''


@pytest.fixture(scope="module")
def script(smollm2_dir, tmp_path_factory):
    """The script's variables after it ran; `vllm` is nanovllm while it runs. Its tokenizer is a copy of the
    model's tokenizer files in a directory of their own."""
    import nanovllm
    tokenizer_dir = tmp_path_factory.mktemp("tokenizer")
    for path in pathlib.Path(smollm2_dir).iterdir():
        if path.name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(path, tokenizer_dir / path.name)
    saved = sys.modules.get("vllm")
    sys.modules["vllm"] = nanovllm
    namespace = {"MODEL": smollm2_dir, "TOKENIZER": str(tokenizer_dir)}
    try:
        exec(compile(VLLM_SCRIPT, "vllm_script.py", "exec"), namespace)
        yield namespace
    finally:
        if saved is None:
            sys.modules.pop("vllm", None)
        else:
            sys.modules["vllm"] = saved
        if "llm" in namespace:
            close_llm(namespace["llm"])


def test_request_outputs_read_as_in_vllm(script):
    outputs = script["outputs"]
    assert [o.prompt for o in outputs] == ["The capital of France is", "Once upon a time"]
    tokenizer = script["llm"].get_tokenizer()
    for output in outputs:
        assert output.prompt_token_ids == tokenizer.encode(output.prompt) and output.finished
        assert [s.index for s in output.outputs] == [0, 1, 2, 3]
        for sample in output.outputs:
            assert sample.finish_reason in ("stop", "length") and sample.finished()
            assert 1 <= len(sample.token_ids) <= 4 and sample.text == tokenizer.decode(
                sample.token_ids[:-1] if sample.finish_reason == "stop" else sample.token_ids,
                skip_special_tokens=True)
            assert sample.logprobs is None and sample.cumulative_logprob is None  # not asked for
        assert len({tuple(s.token_ids) for s in output.outputs}) > 1  # four seeds, not one sample four times
        assert output["text"] == output.outputs[0].text  # the old dict shape still reads
        assert output.metrics.first_token_time >= output.metrics.arrival_time


def test_best_of_returns_the_n_most_likely_of_its_samples(script):
    best = script["best"]
    assert len(best.outputs) == 2 and [s.index for s in best.outputs] == [0, 1]
    for sample in best.outputs:
        assert sample.cumulative_logprob == pytest.approx(
            sum(entry[token].logprob for entry, token in zip(sample.logprobs, sample.token_ids)))
    # the 4 samples are seeds 7..10: the two returned are the two of highest cumulative logprob among them
    from nanovllm import SamplingParams
    llm = script["llm"]
    alone = [llm.generate("The capital of France is", SamplingParams(seed=7 + i, max_tokens=6, logprobs=1),
                          use_tqdm=False)[0].outputs[0] for i in range(4)]
    ranked = sorted(alone, key=lambda s: s.cumulative_logprob, reverse=True)[:2]
    assert [s.token_ids for s in best.outputs] == [s.token_ids for s in ranked]
    assert best.outputs[0].cumulative_logprob >= best.outputs[1].cumulative_logprob


def test_logit_bias_and_bad_words(script):
    paris, greedy = script["paris"], script["greedy"]
    assert paris in greedy.token_ids  # the model's own answer: " Paris"
    assert script["biased"].outputs[0].token_ids == [paris] * 3  # +100 wins every step, greedy or not
    banned = script["banned"].outputs[0]
    assert paris not in banned.token_ids and "Paris" not in banned.text
    assert banned.token_ids[:greedy.token_ids.index(paris)] == greedy.token_ids[:greedy.token_ids.index(paris)]


def test_a_bad_word_of_two_tokens_bans_its_second_after_its_first(script):
    """"Paris." is " Paris" then "." inside a sentence: " Paris" may come, "." may not follow it. Under asynchronous
    scheduling (the default here) " Paris" is not read back when the next step is scheduled, so the ban is the
    device's conditional one."""
    llm, paris, greedy = script["llm"], script["paris"], script["greedy"]
    assert llm.config.async_scheduling
    period = llm.get_tokenizer().encode(" Paris.", add_special_tokens=False)
    assert period[0] == paris and len(period) == 2
    at = greedy.token_ids.index(paris)
    assert greedy.token_ids[at + 1] == period[1]  # the model's own answer: " Paris."
    no_period = script["no_period"].outputs[0]
    assert no_period.token_ids[:at + 1] == greedy.token_ids[:at + 1] and no_period.token_ids[at + 1] != period[1]


def test_the_samples_share_the_prompt_blocks_counted_once(script):
    """A prompt of 2 full blocks and one token more, 4 samples: 2 shared blocks + 4 own ones (one each, which their
    first tokens fill), where 4 separate requests would hold 12."""
    from nanovllm import SamplingParams
    llm = script["llm"]
    block_size = llm.config.kvcache_block_size
    prompt = list(range(1000, 1000 + 2 * block_size + 1))
    assert llm.reset_prefix_cache()
    blocks = llm.scheduler.block_manager
    stream = llm.generate_stream([prompt], SamplingParams(n=4, seed=3, max_tokens=4, ignore_eos=True))
    first = next(stream)  # after the prefill: the samples hold their blocks
    seqs = [seq for seq in llm.requests.values() if not seq.is_finished]
    assert first["index"] == 0 and len(seqs) == 4
    shared = seqs[0].block_table[:2]
    assert all(seq.block_table[:2] == shared for seq in seqs)
    assert [blocks.ref_counts[b] for b in shared] == [4, 4]
    assert len({seq.block_table[2] for seq in seqs}) == 4 and all(len(seq.block_table) == 3 for seq in seqs)
    assert blocks.num_blocks - blocks.num_free_blocks == 2 + 4
    chunks = [first, *stream]  # the stream numbers each sample: "index" the prompt's, "output_index" the sample's
    for i in range(4):
        assert sum((c["token_ids"] for c in chunks if c["output_index"] == i), []) == seqs[i].completion_token_ids
        assert len(seqs[i].completion_token_ids) == 4
    assert {c["index"] for c in chunks} == {0}
    with pytest.raises(ValueError, match="best_of=4 > n=2 cannot stream"):
        next(llm.generate_stream([prompt], SamplingParams(n=2, best_of=4)))


def test_the_samples_are_the_seeds_run_alone(script):
    from nanovllm import SamplingParams
    llm = script["llm"]
    params = dict(temperature=0.8, top_p=0.95, max_tokens=4)
    for output in script["outputs"]:
        alone = [llm.generate(output.prompt, SamplingParams(seed=42 + i, **params), use_tqdm=False)[0]
                 .outputs[0].token_ids for i in range(4)]
        assert [s.token_ids for s in output.outputs] == alone


def test_the_llm_options_are_honoured(script, monkeypatch):
    llm = script["llm"]
    assert llm.get_tokenizer().name_or_path == script["TOKENIZER"] != script["MODEL"]
    assert llm.config.dtype == "float32" and llm.config.max_logprobs == 5
    from nanovllm import SamplingParams
    with pytest.raises(ValueError, match="logprobs=6 is more than max_logprobs=5"):
        llm.generate("Hi", SamplingParams(logprobs=6), use_tqdm=False)
    # disable_log_stats: the progress bar never reads the throughput counters
    import nanovllm.engine.llm_engine as engine_module

    def no_stats(*args):
        raise AssertionError("update_bar called")
    monkeypatch.setattr(engine_module, "update_bar", no_stats)
    llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=True)
    monkeypatch.setattr(llm.config, "disable_log_stats", False)
    with pytest.raises(AssertionError, match="update_bar called"):
        llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=True)


@pytest.mark.parametrize("options, message", [
    ({"trust_remote_code": True}, "runs only its own model code"),
    ({"tokenizer": "/no/such/dir"}, "tokenizer='/no/such/dir' is not a directory"),
    ({"max_logprobs": -1}, "max_logprobs=-1 must be an int >= 0"),
    ({"dtype": "double"}, "dtype='double' must be one of"),
])
def test_vllm_options_refused_with_the_reason(smollm2_dir, options, message):
    from nanovllm.config import Config
    with pytest.raises(ValueError, match=message):
        Config(smollm2_dir, **options)


def test_vllm_options_without_effect_pass_with_their_no_op_values_only():
    """vLLM's options this engine has no use for: accepted where they ask for what it always does, a ValueError
    with the reason otherwise; block_size is vLLM's name for kvcache_block_size."""
    from nanovllm.utils.vllm_options import from_vllm_options
    assert from_vllm_options({"enable_chunked_prefill": True, "tokenizer_mode": "auto", "revision": None,
                              "task": "generate", "block_size": 16, "seed": 1}) == {"kvcache_block_size": 16, "seed": 1}
    for options, message in [({"enable_chunked_prefill": False}, "prefills are always chunked"),
                             ({"revision": "main"}, "never from a hub"),
                             ({"pipeline_parallel_size": True}, r"pipeline_parallel_size=True .* \(or 1\)"),
                             ({"block_size": 16, "kvcache_block_size": 8}, "pass one of them")]:
        with pytest.raises(ValueError, match=message):
            from_vllm_options(options)


@pytest.mark.parametrize("name, dtype", [("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16"),
                                         ("auto", "auto")])
def test_dtype_takes_vllms_names(smollm2_dir, name, dtype):
    import torch

    from nanovllm.config import Config
    assert Config(smollm2_dir, dtype=name).dtype == dtype
    if dtype != "auto":  # and torch's dtypes, as vLLM takes them
        assert Config(smollm2_dir, dtype=getattr(torch, dtype)).dtype == dtype


def test_text_options_truncation_and_an_open_max_tokens(script):
    from nanovllm import SamplingParams
    llm, prompt = script["llm"], "The capital of France is"
    tokenizer = llm.get_tokenizer()
    ids_only = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, detokenize=False), use_tqdm=False)[0]
    assert ids_only.outputs[0].text == "" and len(ids_only.outputs[0].token_ids) == 3
    cut = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, truncate_prompt_tokens=2), use_tqdm=False)
    assert cut[0].prompt_token_ids == tokenizer.encode(prompt)[-2:]
    forced = dict(temperature=0, max_tokens=2, ignore_eos=True, logit_bias={tokenizer.eos_token_id: 100})
    kept = llm.generate(prompt, SamplingParams(skip_special_tokens=False, **forced), use_tqdm=False)[0].outputs[0]
    assert kept.text == tokenizer.eos_token * 2
    assert llm.generate(prompt, SamplingParams(**forced), use_tqdm=False)[0].outputs[0].text == ""
    # max_tokens=None: no limit but max_model_len; here the greedy answer's "." ends it, and is its stop_reason
    period = tokenizer.encode(" Paris.", add_special_tokens=False)[1]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, stop_token_ids=[period]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == period and out.token_ids[-1] == period
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, stop=["."]), use_tqdm=False)[0]
    assert stopped.outputs[0].stop_reason == "." and stopped.outputs[0].text == " Paris"
