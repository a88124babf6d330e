"""async_scheduling=True: step N+1 is scheduled while step N runs, sampled tokens come back one step late. The
outputs must be exactly those of the synchronous engine, under every path that touches the pending tokens.

Asynchronous scheduling is the default, so every comparison pins both sides (async_scheduling=False against True);
test_a_planted_async_lag_fails_the_comparison shows that the comparison sees a bug of the asynchronous side alone."""
import pytest

from conftest import close_llm, greedy, random_prompts, smollm2_llm_kwargs, tiny_llm_kwargs
from nanovllm import LLM, SamplingParams

PROMPTS = random_prompts([3, 17, 40, 9, 33, 21])
# no pressure (in the fast core), then preemption by recompute and by swap, and chunked prefill
PRESSURES = [{}, *(pytest.param(p, marks=pytest.mark.slow) for p in (
    dict(num_kvcache_blocks=24, preemption_mode="recompute"), dict(num_kvcache_blocks=24, preemption_mode="swap"),
    dict(max_num_batched_tokens=16)))]


def generate(model_dir, prompts, params, plant=None, **kwargs):
    llm = LLM(model_dir, **kwargs)
    try:
        if plant is not None:
            plant(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o["token_ids"], o["finish_reason"], o["text"]) for o in outs], llm.stats()
    finally:
        close_llm(llm)


def sync_and_async(model_dir, prompts, params, llm_kwargs, plant=None):
    """(the synchronous engine's outputs, the asynchronous engine's outputs, the asynchronous engine's stats)."""
    sync, _ = generate(model_dir, prompts, params, plant, **{**llm_kwargs, "async_scheduling": False})
    got, stats = generate(model_dir, prompts, params, plant, **{**llm_kwargs, "async_scheduling": True})
    return sync, got, stats


def lag_one_step_when_async(llm):
    """A planted bug of asynchronous scheduling: each sequence is given the token sampled one step before."""
    if not llm.config.async_scheduling:
        return
    resolve, previous = llm.scheduler.resolve, {}

    def lagged(rows, token_ids, *args):
        late = []
        for row, token_id in zip(rows, token_ids):
            seq_id = None if row is None else row[0].seq_id
            late.append(previous.get(seq_id, token_id))
            previous[seq_id] = token_id
        return resolve(rows, late, *args)
    llm.scheduler.resolve = lagged


def test_a_planted_async_lag_fails_the_comparison(qwen3_dir):
    """The plant reaches both engines and changes the asynchronous one alone; without it the two agree
    (test_async_equals_sync's unpressured case, same prompts and params)."""
    sync, got, _ = sync_and_async(qwen3_dir, PROMPTS, greedy(20), tiny_llm_kwargs(), plant=lag_one_step_when_async)
    assert got != sync


@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
@pytest.mark.parametrize("pressure", PRESSURES)
def test_async_equals_sync(tiny_dirs, pressure):
    for family in ("qwen3", "llama"):
        sync, got, stats = sync_and_async(tiny_dirs[family], PROMPTS, greedy(20), tiny_llm_kwargs(**pressure))
        assert got == sync, family
        if pressure.get("preemption_mode") == "swap":
            assert stats["preemptions_swap"] > 0 and stats["recomputed_tokens"] == 0


@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
def test_async_stops_on_tokens_and_mixed_lengths_like_sync(qwen3_dir):
    sync_params = [greedy(20), greedy(3), greedy(12), greedy(1), greedy(20), greedy(7)]
    first, _ = generate(qwen3_dir, PROMPTS, sync_params, **tiny_llm_kwargs(async_scheduling=False))
    # stop on a token the synchronous run produced mid-way: the asynchronous run has already sampled past it
    stop_token = first[0][0][5]
    params = [greedy(20, stop_token_ids=[stop_token])] + sync_params[1:]
    sync, got, _ = sync_and_async(qwen3_dir, PROMPTS, params, tiny_llm_kwargs())
    assert got == sync
    assert got[0][1] == "stop" and got[0][0][-1] == stop_token and len(got[0][0]) <= 6


def test_async_seeded_sampling_equals_sync(qwen3_dir):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True)
    sync, got, _ = sync_and_async(qwen3_dir, PROMPTS, params, tiny_llm_kwargs())
    assert got == sync


def test_async_stop_strings_and_eos_on_smollm2(smollm2_dir):
    """12 tokens are enough: the stop word (the fourth of the second answer) comes within them, and the other two
    answers run on past it, the asynchronous engine one step ahead."""
    prompts = ["The capital of France is", "Once upon a time", "List three colors:"]
    # one synchronous engine gives the answers without and with the stop word: the prompts are shorter than a KV
    # block, so the second run takes no prefix-cache hit and computes just what a fresh engine would
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(async_scheduling=False))
    try:
        base = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        stop = base[1]["text"].split()[3]  # a word from the middle of the second answer
        params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
        sync = [(o["token_ids"], o["finish_reason"], o["text"]) for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats()["prefix_cache_hit_tokens"] == 0
    finally:
        close_llm(llm)
    got, _ = generate(smollm2_dir, prompts, params, **smollm2_llm_kwargs(async_scheduling=True))
    assert got == sync and got[1][1] == "stop" and stop not in got[1][2]


def test_async_stream_joins_to_generate(qwen3_dir):
    llm = LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=True))
    try:
        full = llm.generate(PROMPTS, greedy(12), use_tqdm=False)
        chunks = {}
        for chunk in llm.generate_stream(PROMPTS, greedy(12)):
            assert -1 not in chunk["token_ids"]  # placeholders never reach the caller
            chunks.setdefault(chunk["index"], []).extend(chunk["token_ids"])
        assert [chunks[i] for i in range(len(PROMPTS))] == [o["token_ids"] for o in full]
        assert llm.is_finished()
    finally:
        close_llm(llm)


def test_async_needs_tp1(qwen3_dir):
    with pytest.raises(ValueError, match="async_scheduling=True needs tensor_parallel_size=1"):
        LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=True, tensor_parallel_size=2))


@pytest.mark.parametrize("mode, swap_space", [("recompute", 4), ("swap", 0)])  # swap with no host room: recompute
def test_async_preempt_between_steps_before_the_token_is_read_back(qwen3_dir, mode, swap_space):
    """Scheduler.preempt between two step() calls: the sequence's last token is still a placeholder, and its
    recompute prefill ends on it; the runner must fill it in from the step in flight (it reached the embedding as
    -1 before)."""
    prompts = random_prompts([10, 14])
    ref, _ = generate(qwen3_dir, prompts, greedy(8), **tiny_llm_kwargs(async_scheduling=False))
    llm = LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=True, swap_space=swap_space))
    try:
        seq_ids = [llm.add_request(p, greedy(8)) for p in prompts]
        seqs = [llm.requests[i] for i in seq_ids]
        llm.step()
        llm.step()
        assert seqs[0].num_unresolved_tokens == 1 and seqs[0].token_ids[-1] == -1
        llm.scheduler.preempt(seqs[0], mode=mode)
        assert seqs[0].status.name == "WAITING"
        while not all(seq.is_finished for seq in seqs):
            llm.step()
        assert [seq.completion_token_ids for seq in seqs] == [r[0] for r in ref]
        assert llm.stats()["preemptions_recompute"] == 1
    finally:
        close_llm(llm)


@pytest.mark.parametrize("asynchronous", [True, False])
def test_prefill_speed_is_timed_between_read_backs(qwen3_dir, monkeypatch, asynchronous):
    """The "auto" policy's prefill speed. A fake clock advances only while a read-back waits for the device: 2 s
    for a step with a prompt, 0.1 s for a decode step. With asynchronous scheduling a step's own wall time is the
    wait for the step before it (a decode: 0.1 s); the sample must be the prompt's tokens over its own 2 s."""
    from types import SimpleNamespace

    import nanovllm.engine.engine_core as engine_module
    clock = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    prompt = PROMPTS[2]
    with LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=asynchronous)) as llm:
        launch = llm.runner.launch

        def launch_with_device_time(plan, sample_seqs=None, grammar_mask=None):
            handle = launch(plan, sample_seqs, grammar_mask)
            device_s = 2.0 if plan.num_tokens > len(plan.query_lens) else 0.1
            tolist = handle.tolist
            handle.tolist = lambda: clock.__setitem__(0, clock[0] + device_s) or tolist()
            return handle
        llm.runner.launch = launch_with_device_time
        prior = llm.host_tier.policy.prefill_tokens_per_s
        llm.generate([prompt], greedy(4), use_tqdm=False)
        policy = llm.host_tier.policy
        weight = policy.ema * len(prompt) / policy.full_prefill_sample_tokens  # a short prompt's sample counts less
        want = prior + weight * (len(prompt) / 2.0 - prior)  # one sample: the prompt's step
        assert policy.prefill_tokens_per_s == pytest.approx(want), (prior, policy.prefill_tokens_per_s)


def test_an_idle_spell_is_not_timed_as_prefill(qwen3_dir, monkeypatch):
    """A prompt chunk that samples nothing leaves tokens waiting for the next read-back; when its request is
    aborted and the engine then idles (a fake 3 s), the next prompt's sample must not include the idle time."""
    from types import SimpleNamespace

    import nanovllm.engine.engine_core as engine_module
    clock = [0.0]
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    with LLM(qwen3_dir, **tiny_llm_kwargs(max_num_batched_tokens=16, async_scheduling=False)) as llm:
        seq_id = llm.add_request(PROMPTS[2], greedy(4))  # 40 tokens: three chunks
        llm.step()  # the first chunk: nothing sampled, nothing read back
        llm.abort_request(seq_id)
        clock[0] += 3.0
        prior = llm.host_tier.policy.prefill_tokens_per_s
        llm.generate([PROMPTS[1]], greedy(2), use_tqdm=False)  # 17 tokens; the fake device time is 0
        assert llm.host_tier.policy.prefill_tokens_per_s == prior  # a 0 s sample is skipped; a 3 s one would lower it


@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
@pytest.mark.parametrize("pressure", PRESSURES)
def test_async_penalties_equal_sync(qwen3_dir, pressure):
    """Penalties count every completion token, and the last one of a sequence is still on the device when the next
    step is planned (a placeholder on the host): the counts take it from the previous step's sampled ids. Penalized
    and unpenalized requests mixed, under preemption (a recomputed row samples too) and chunked prefill."""
    # the fourth favours repeating its output at once: counting the last token a step late would change it
    penalties = [dict(repetition_penalty=2.0), {}, dict(frequency_penalty=1.5, presence_penalty=0.5),
                 dict(presence_penalty=-2.0, frequency_penalty=-2.0), {},
                 dict(repetition_penalty=0.5, frequency_penalty=-0.5)]
    params = [greedy(20, **kw) for kw in penalties]
    plain, _ = generate(qwen3_dir, PROMPTS, greedy(20), **tiny_llm_kwargs(async_scheduling=False, **pressure))
    sync, got, stats = sync_and_async(qwen3_dir, PROMPTS, params, tiny_llm_kwargs(**pressure))
    assert got == sync
    assert [s == p for s, p in zip(sync, plain)] == [not kw for kw in penalties]  # each penalty changed its output
    if "preemption_mode" in pressure:
        assert stats["preemptions"] > 0
