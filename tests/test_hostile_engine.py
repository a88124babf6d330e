"""Hostile input to the Python API: every case is a ValueError that names the value, and the same engine then
serves a normal request with the same tokens as before. Also: an interrupted generate leaves nothing behind, a
SamplingParams changed after construction is checked again, a swap that has to recompute is said and counted."""
from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from conftest import close_llm, greedy, random_prompts, smollm2_llm_kwargs, tiny_llm_kwargs
from nanovllm import LLM, SamplingParams

GOOD = random_prompts((13, 7, 21), seed=70)


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(qwen3_dir, request):
    """One engine per scheduling mode, shared by the module's tests."""
    engine = LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=request.param))
    yield engine
    close_llm(engine)


@pytest.fixture(scope="module")
def reference(llm):
    return [o["token_ids"] for o in llm.generate(GOOD, greedy(8), use_tqdm=False)]


def assert_idle(llm):
    """Nothing left of earlier calls: no request, no queued or running sequence, every GPU block free."""
    scheduler = llm.scheduler
    assert llm.requests == {} and llm._generating == set() and llm._unclaimed == []
    assert scheduler.is_finished() and not scheduler.running and not scheduler.waiting and not scheduler.swapped
    assert scheduler.block_manager.num_free_blocks == llm.num_gpu_blocks


@pytest.fixture()
def serves_the_same(llm, reference):
    """After each case the engine is idle and gives the reference tokens again."""
    yield
    assert_idle(llm)
    assert [o["token_ids"] for o in llm.generate(GOOD, greedy(8), use_tqdm=False)] == reference
    assert_idle(llm)


def _generator():
    yield [5, 6, 7]


@pytest.mark.parametrize("prompts, pattern", [
    (b"The capital of France is", r"prompts=b'The capital of France is' is bytes.*decode"),
    (bytearray(b"abc"), r"prompts=bytearray\(b'abc'\) is bytearray"),
    ([b"abc"], r"prompt=b'abc' is bytes"),
    (None, r"prompts=None \(NoneType\) must be a string, a list of token ids"),
    (5, r"prompts=5 \(int\) must be"),
    ([1.0, 2.0], r"token id 1\.0 is not an integer"),
    (np.array([1.5, 2.0]), r"token id 1\.5 is not an integer"),
    (np.array([[1.5, 2.0]]), r"token id 1\.5 is not an integer"),
    (np.array(7), r"prompts=array\(7\) is a scalar array"),
    (_generator(), r"prompts=<generator object .*\(generator\) must be"),
    ({"a": 1}, r"prompts=\{'a': 1\} \(dict\) must be"),
    ([[5, 6], None], r"prompt None \(NoneType\) must be a string or a list of token ids"),
    ([[5, 6], {"a": 1}], r"prompt \{'a': 1\} \(dict\) must be"),
    ([True, False], r"token id True is not an integer"),
    ({"prompt": [5, 6]}, r"prompt \{'prompt': \[5, 6\]\}: 'prompt' holds a string, 'prompt_token_ids' a list"),
    ([{"prompt_token_ids": "x"}], r"prompt \{'prompt_token_ids': 'x'\}: 'prompt' holds a string"),
    ({"prompt_token_ids": [5], "multi_modal_data": {}}, r"\(dict\) must be"),
    ("x\ud800y", r"prompt has a lone surrogate '\\ud800' at character 1"),
], ids=["bytes", "bytearray", "bytes-in-list", "None", "int", "floats", "np-floats", "np-floats-2d", "np-scalar",
        "generator", "dict", "None-in-list", "dict-in-list", "bools", "text-prompt-of-ids", "tokens-prompt-of-text",
        "dict-prompt-with-more-keys", "lone-surrogate"])
def test_bad_prompts_are_value_errors(llm, serves_the_same, prompts, pattern):
    with pytest.raises(ValueError, match=pattern):
        llm.generate(prompts, greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match=pattern):
        list(llm.generate_stream(prompts, greedy(4)))


def test_vllm_dict_prompts_are_the_plain_ones(llm, serves_the_same, reference):
    """vLLM's TokensPrompt ({"prompt_token_ids": ...}) alone or in a list, and its TextPrompt ({"prompt": ...})."""
    outs = llm.generate([{"prompt_token_ids": p} for p in GOOD], greedy(8), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == reference
    assert llm.generate({"prompt_token_ids": GOOD[0]}, greedy(8), use_tqdm=False)[0]["token_ids"] == reference[0]
    with pytest.raises(ValueError, match="has no tokenizer files"):  # the tiny model has none: text is refused
        llm.generate({"prompt": "hello"}, greedy(2), use_tqdm=False)
    assert llm.get_tokenizer() is None
    with pytest.raises(ValueError, match="has no tokenizer files, so no chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_add_request_refuses_bytes(llm, serves_the_same):
    with pytest.raises(ValueError, match=r"prompt=b'\\x05\\x06' is bytes"):
        llm.add_request(b"\x05\x06", greedy(4))


def test_integer_arrays_stay_prompts(llm, serves_the_same, reference):
    assert llm.generate(np.array(GOOD[0]), greedy(8), use_tqdm=False)[0]["token_ids"] == reference[0]
    assert llm.generate(np.array(GOOD[0], dtype=np.int32)[None], greedy(8), use_tqdm=False)[0]["token_ids"] \
        == reference[0]
    assert llm.generate(tuple(GOOD[0]), greedy(8), use_tqdm=False)[0]["token_ids"] == reference[0]


# ---------------------------------------------------------------- SamplingParams changed after construction


@pytest.mark.parametrize("field, value, pattern", [
    ("max_tokens", 0, r"max_tokens=0 must be an int >= 1"),
    ("temperature", float("nan"), r"temperature=nan must be a finite number"),
    ("top_p", 0.0, r"top_p=0\.0 must be in"),
    ("stop_token_ids", 7, r"stop_token_ids=7 must be a list"),
    ("min_tokens", 99, r"min_tokens=99 must be an int in \[0, max_tokens=4\]"),
])
def test_a_sampling_params_changed_into_an_invalid_state_is_refused(llm, serves_the_same, field, value, pattern):
    params = greedy(4)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=pattern):
        llm.generate(GOOD, params, use_tqdm=False)
    with pytest.raises(ValueError, match=pattern):  # one bad one among good ones: nothing is queued
        llm.generate(GOOD, [greedy(4), params, greedy(4)], use_tqdm=False)
    with pytest.raises(ValueError, match=pattern):
        llm.add_request(GOOD[0], params)


def test_a_change_after_add_request_does_not_reach_the_request(llm, serves_the_same, reference):
    params = greedy(8)
    seq_id = llm.add_request(GOOD[0], params)
    params.max_tokens = 1
    finished = []
    while not finished:
        finished = llm.step()
    assert [s.seq_id for s in finished] == [seq_id] and llm.output(finished[0])["token_ids"] == reference[0]
    llm.requests.pop(seq_id)


# ---------------------------------------------------------------- engine options


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(swap_space=1e300), r"swap_space=1e\+300 GiB must be in \[0, 1048576\]"),
    (dict(swap_space=-1), r"swap_space=-1 GiB must be in \[0, 1048576\]"),
    (dict(swap_space=float("inf")), r"swap_space=inf must be a finite number"),
    (dict(swap_space=100000), r"swap_space=100000 GiB needs 100000\.0 GiB of memory per rank x 1 rank\(s\), but only"),
], ids=["swap_space-1e300", "swap_space-negative", "swap_space-inf",
                                  "swap_space-beyond-the-host"])
def test_bad_engine_options(llm, serves_the_same, qwen3_dir, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LLM(qwen3_dir, **tiny_llm_kwargs(**kwargs))


@pytest.mark.parametrize("model", [None, 5, b"/tmp"])
def test_model_that_is_not_a_path(llm, serves_the_same, model):
    with pytest.raises(ValueError, match=re.escape(f"model={model!r} must be the path")):
        LLM(model, **tiny_llm_kwargs())


# ---------------------------------------------------------------- interrupted calls


def interrupt_after(monkeypatch, llm, num_steps: int):
    """llm.step raises KeyboardInterrupt (a Ctrl-C) once num_steps steps have run."""
    step, count = llm.step, [0]

    def step_then_interrupt():
        if count[0] == num_steps:
            monkeypatch.setattr(llm, "step", step)
            raise KeyboardInterrupt
        count[0] += 1
        return step()
    monkeypatch.setattr(llm, "step", step_then_interrupt)


@pytest.mark.parametrize("num_steps", [3, 9, 14])
def test_an_interrupted_generate_leaves_nothing_behind(llm, serves_the_same, monkeypatch, num_steps):
    """Requests of 4, 8 and 16 new tokens finish at different steps, so the interrupts land with none, some or
    most of them finished; three interrupts in a row, as a user pressing Ctrl-C again and again."""
    params = [greedy(4), greedy(8), greedy(16)]
    for _ in range(3):
        interrupt_after(monkeypatch, llm, num_steps)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(GOOD, params, use_tqdm=False)
        assert_idle(llm)


@pytest.mark.parametrize("num_chunks", [1, 6])
def test_a_stream_interrupted_or_closed_early_leaves_nothing_behind(llm, serves_the_same, monkeypatch, num_chunks):
    params = [greedy(4), greedy(8), greedy(16)]
    for _ in range(3):
        stream = llm.generate_stream(GOOD, params)
        for _ in range(num_chunks):
            next(stream)
        stream.close()
        assert_idle(llm)
        interrupt_after(monkeypatch, llm, num_chunks)
        with pytest.raises(KeyboardInterrupt):
            list(llm.generate_stream(GOOD, params))
        assert_idle(llm)


# ---------------------------------------------------------------- a swap that has to recompute


def test_a_swap_that_recomputes_is_said_once_and_counted(qwen3_dir, caplog):
    """1e-6 GiB of swap space holds no block of this model: every preemption that "swap" asks for recomputes."""
    prompts = random_prompts((10, 12, 14, 11), seed=71)
    kwargs = tiny_llm_kwargs(num_kvcache_blocks=12, max_model_len=48, max_num_seqs=4, preemption_mode="swap",
                             swap_space=1e-6)
    with caplog.at_level(logging.WARNING, logger="nanovllm.engine.scheduler"), LLM(qwen3_dir, **kwargs) as llm:
        llm.generate(prompts, greedy(24), use_tqdm=False)
        stats = llm.stats()
    assert stats["preemptions_recompute"] > 1 and stats["preemptions_swap"] == 0, stats
    assert stats["swap_fallback_recomputes"] == stats["preemptions_recompute"], stats
    warnings = [r.getMessage() for r in caplog.records if "recomputed" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert re.search(r"the host pool holds 0 blocks, fewer than its \d+; raise swap_space", warnings[0]), warnings


def test_recompute_by_choice_is_no_fallback(qwen3_dir):
    prompts = random_prompts((10, 12, 14, 11), seed=71)
    kwargs = tiny_llm_kwargs(num_kvcache_blocks=12, max_model_len=48, max_num_seqs=4, preemption_mode="recompute")
    with LLM(qwen3_dir, **kwargs) as llm:
        llm.generate(prompts, greedy(24), use_tqdm=False)
        stats = llm.stats()
    assert stats["preemptions_recompute"] > 0 and stats["swap_fallback_recomputes"] == 0, stats


def test_resuming_a_sequence_whose_blocks_are_all_cached_is_progress(qwen3_dir):
    """A swap whose blocks are cached on the GPU and the host needs no copy either way: the step that resumes it
    launches nothing, but it is not a stall (two such steps used to raise "no progress")."""
    kwargs = tiny_llm_kwargs(kvcache_block_size=4, num_kvcache_blocks=32, swap_space=0.001,
                             host_cache_policy="write_through", preemption_mode="swap", async_scheduling=False)
    with LLM(qwen3_dir, **kwargs) as llm:
        seq_id = llm.add_request(list(range(10, 18)), greedy(4))
        seq = llm.requests[seq_id]
        llm.step()  # the prompt: 2 full blocks, cached on the GPU and (write-through) on the host
        for _ in range(3):
            llm.scheduler.preempt(seq, mode="swap")
            assert llm.step() == [] and seq.status.name == "RUNNING"
        assert llm.stats()["blocks_swapped_in"] == 0 and llm.stats()["preemptions_swap"] == 3
        while not llm.is_finished():
            llm.step()
        assert len(seq.completion_token_ids) == 4


def test_a_models_generation_config_sets_the_sampling_defaults(qwen3_dir, tmp_path):
    """vLLM's generation_config="auto": options a request leaves unset come from generation_config.json (its
    repetition_penalty included); "vllm" ignores the file; a value the engine would refuse names the file."""
    import json
    import shutil
    model = tmp_path / "qwen3"
    shutil.copytree(qwen3_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5, "top_p": 0.5,
                                                              "repetition_penalty": 2.0, "eos_token_id": 2}))
    prompts = GOOD[:2]
    with LLM(str(model), **tiny_llm_kwargs()) as llm:
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.0, top_k=5, top_p=0.5,
                                                                   repetition_penalty=2.0)
        plain, penalized = ([o["token_ids"] for o in llm.generate(prompts, SamplingParams(temperature=0.0, **kw),
                                                                   use_tqdm=False)]
                            for kw in ({}, dict(repetition_penalty=2.0)))
        assert penalized != plain  # the file's penalty changes these prompts' tokens
        assert [o["token_ids"] for o in llm.generate(prompts, use_tqdm=False)] == penalized  # the file's options
    with LLM(str(model), **tiny_llm_kwargs(generation_config="vllm")) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    (model / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature=-1.*generation_config='vllm'"):
        LLM(str(model), **tiny_llm_kwargs())
    with pytest.raises(ValueError, match=r"generation_config='nowhere' must be 'auto', 'vllm' or a directory"):
        LLM(str(model), **tiny_llm_kwargs(generation_config="nowhere"))


# ---------------------------------------------------------------- a closed engine, two callers at once


def test_a_closed_engine_refuses_every_call_with_one_runtime_error(qwen3_dir):
    """After close() every call that would touch the engine raises the same RuntimeError (it used to raise
    AttributeError from inside the runner, accept a request, or answer False)."""
    llm = LLM(qwen3_dir, **tiny_llm_kwargs())
    llm.close()
    calls = {
        "generate": lambda: llm.generate(GOOD, greedy(2), use_tqdm=False),
        "generate_stream": lambda: list(llm.generate_stream(GOOD, greedy(2))),
        "chat": lambda: llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False),
        "step": llm.step,
        "add_request": lambda: llm.add_request(GOOD[0], greedy(2)),
        "abort_request": lambda: llm.abort_request(0),
        "reset_prefix_cache": llm.reset_prefix_cache,
    }
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=rf"LLM\.{name}: the engine is closed"):
            call()
    llm.close()  # still safe twice


def test_two_threads_calling_generate_at_once_each_get_their_own_tokens(llm, serves_the_same):
    """The second caller waits for the first (the calls used to interleave schedule() and step() and fail with an
    IndexError or an AttributeError, or could swap outputs). 20 rounds, each thread its own prompts."""
    import threading
    prompts = [random_prompts((9, 17), seed=72), random_prompts((15, 6, 11), seed=73)]
    params = [greedy(12), greedy(7)]
    expected = [[o["token_ids"] for o in llm.generate(p, sp, use_tqdm=False)] for p, sp in zip(prompts, params)]
    for _ in range(20):
        results, errors = [None, None], []
        barrier = threading.Barrier(2)

        def run(i, barrier, results, errors):
            try:
                barrier.wait()
                results[i] = [o["token_ids"] for o in llm.generate(prompts[i], params[i], use_tqdm=False)]
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)
        threads = [threading.Thread(target=run, args=(i, barrier, results, errors)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors and results == expected, errors


# ---------------------------------------------------------------- chat messages as OpenAI sends them


def test_chat_takes_openai_content_parts_and_names_a_message_with_a_lone_surrogate(smollm2_dir):
    """Text parts are joined by newlines, as the server (and vLLM) join them: the same tokens as the joined text.
    A lone surrogate is a ValueError naming the message (it was the tokenizer's TypeError)."""
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color.\nOne word."}]
    parts = [plain[0], {"role": "user", "content": [{"type": "text", "text": "Name a color."},
                                                    {"type": "text", "text": "One word."}]}]
    with LLM(smollm2_dir, **smollm2_llm_kwargs(num_kvcache_blocks=32)) as engine:
        expected = engine.chat(plain, greedy(3), use_tqdm=False)[0]["token_ids"]
        assert engine.chat(parts, greedy(3), use_tqdm=False)[0]["token_ids"] == expected
        assert engine.chat([parts, plain], greedy(3), use_tqdm=False)[0]["token_ids"] == expected
        bad = [plain[0], {"role": "user", "content": [{"type": "text", "text": "x\ud800"}]}]
        with pytest.raises(ValueError, match=r"message 1: its 'content' has a lone surrogate '\\ud800' at character 1"):
            engine.chat(bad, greedy(3), use_tqdm=False)
        with pytest.raises(ValueError, match=r"message 0 has the content part .*image_url.*only text parts"):
            engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                        greedy(3), use_tqdm=False)
        assert engine.chat(plain, greedy(3), use_tqdm=False)[0]["token_ids"] == expected
