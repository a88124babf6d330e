"""vLLM's presence, frequency and repetition penalties: the tensor math against hand-computed logits, the per-step
rows (placeholders of asynchronous scheduling included), SamplingParams' checks, and the engine on CPU against a
plain Python loop over the model's logits (HF transformers' and the engine's own)."""
import pytest
import torch

import nanovllm.layers.sampler as sampler_module
from conftest import TIE_MARGIN, _hf_model, close_llm, greedy, random_prompts, tiny_llm_kwargs
from nanovllm import LLM, SamplingParams
from nanovllm.core.sequence import PLACEHOLDER_TOKEN, Sequence
from nanovllm.engine.penalties import PenaltyRows, penalized_rows, step_penalties
from nanovllm.layers.penalties import apply_penalties
from nanovllm.layers.sampler import FILTER_CHUNK_ELEMENTS as CHUNK  # every test row in one chunk
from nanovllm.layers.sampler import Sampler, SamplingTensors


def rows_of(rows, penalties, outputs, prompts, placeholders=()) -> PenaltyRows:
    """A PenaltyRows by hand: per row (presence, frequency, repetition), its output and its prompt tokens;
    placeholders: (entry of the flat output list, row of the previous step's sampled ids)."""
    step = PenaltyRows(rows=list(rows))
    for (presence, frequency, repetition), output, prompt in zip(penalties, outputs, prompts):
        step.presence.append(presence)
        step.frequency.append(frequency)
        step.repetition.append(repetition)
        step.output_token_ids += output
        step.output_offsets.append(len(step.output_token_ids))
        step.prompt_token_ids += prompt
        step.prompt_offsets.append(len(step.prompt_token_ids))
    step.placeholder_indices = [i for i, _ in placeholders]
    step.placeholder_sources = [s for _, s in placeholders]
    return step


# four rows over a 6-token vocabulary; every value is a binary fraction, so the expected logits are exact
LOGITS = [[1.0, 2.0, -1.0, 4.0, -2.0, 3.0],
          [0.5, 0.5, 0.5, 0.5, 0.5, 0.5],
          [9.0, 8.0, 7.0, 6.0, 5.0, 4.0],  # no penalty: untouched
          [3.0, 0.0, 1.0, 1.0, 1.0, -1.0]]
EXPECTED = [
    # row 0, repetition 2 on prompt {1, 2} and output {2, 3, 3}, then frequency 0.25 and presence 0.5 on the output:
    # token 1 (prompt only) 2 / 2; token 2 (negative) -1 * 2 - 0.25 - 0.5; token 3 4 / 2 - 0.25 * 2 - 0.5
    [1.0, 1.0, -2.75, 1.0, -2.0, 3.0],
    # row 1, presence -0.5 and frequency 0.75 on the output {0, 0, 5}; its prompt token 4 is not counted by them
    # (and repetition 1 leaves it as it is)
    [0.5 - 1.5 + 0.5, 0.5, 0.5, 0.5, 0.5, 0.5 - 0.75 + 0.5],
    [9.0, 8.0, 7.0, 6.0, 5.0, 4.0],
    # row 3, repetition 0.5 (below 1 favours repeats) on prompt {0, 1, 5}: 3 / 0.5, 0 * 0.5, -1 * 0.5
    [6.0, 0.0, 1.0, 1.0, 1.0, -0.5],
]
STEP = dict(rows=[0, 1, 3], penalties=[(0.5, 0.25, 2.0), (-0.5, 0.75, 1.0), (0.0, 0.0, 0.5)],
            outputs=[[2, 3, 3], [0, 0, 5], []], prompts=[[1, 2], [4], [0, 1, 5, 5]])


def test_penalties_match_a_hand_computed_example():
    out = apply_penalties(torch.tensor(LOGITS), rows_of(**STEP), None, CHUNK)
    assert out.tolist() == EXPECTED


def test_chunks_of_rows_and_half_precision_logits_give_the_same_values():
    """One row per chunk (a 6-token vocabulary, 6 elements per chunk), and bfloat16 logits (exact in these values):
    float32 logits come back, vLLM's dtype for penalties (rounded back to bf16, 14.4375 / 1.2 would tie 12)."""
    assert apply_penalties(torch.tensor(LOGITS), rows_of(**STEP), None, 6).tolist() == EXPECTED
    out = apply_penalties(torch.tensor(LOGITS, dtype=torch.bfloat16), rows_of(**STEP), None, 6)
    assert out.dtype == torch.float32 and out.tolist() == EXPECTED


def test_placeholders_take_the_previous_steps_sampled_ids():
    """Row 0's last output token and row 1's middle one are placeholders; the previous step sampled [0, 3] and [0]
    ... at rows 1 and 0: the same logits as with the tokens known."""
    step = rows_of(**{**STEP, "outputs": [[2, 3, PLACEHOLDER_TOKEN], [0, PLACEHOLDER_TOKEN, 5], []]},
                   placeholders=[(2, 1), (4, 0)])
    assert apply_penalties(torch.tensor(LOGITS), step, torch.tensor([0, 3]), CHUNK).tolist() == EXPECTED
    with pytest.raises(RuntimeError, match=r"apply_penalties: rows \[0, 1, 3\] count tokens not read back"):
        apply_penalties(torch.tensor(LOGITS), step, None, CHUNK)


def test_a_greedy_row_samples_the_penalized_argmax():
    """vLLM applies penalties before greedy too: row 0's argmax 3 (logit 4) drops to 1.0, so 5 (3.0) wins."""
    logits = torch.tensor(LOGITS)
    st = SamplingTensors(torch.zeros(4), None, None, None, None, all_greedy=True)
    assert Sampler()(logits.clone(), st).tolist() == [3, 0, 0, 0]
    assert Sampler()(logits.clone(), st, (), rows_of(**STEP)).tolist() == [5, 1, 0, 0]


def test_later_steps_of_a_batch_send_only_their_outputs():
    """The rows, their values and their prompts go to the device once per batch (BatchPenalties, from the first
    step); a later step's rows carry no prompt tokens, and penalize the same with the batch's."""
    from nanovllm.layers.penalties import BatchPenalties
    batch = BatchPenalties(rows_of(**STEP), torch.device("cpu"))
    later = rows_of(**{**STEP, "prompts": [[], [], []]})
    assert later.prompt_token_ids == [] and later.prompt_offsets == [0, 0, 0, 0]
    assert apply_penalties(torch.tensor(LOGITS), later, None, 6, batch).tolist() == EXPECTED
    assert apply_penalties(torch.tensor(LOGITS), later, None, 6).tolist() != EXPECTED  # the prompts count


def make_seq(prompt, output, **params) -> Sequence:
    seq = Sequence(prompt, SamplingParams(temperature=0, **params), block_size=4)
    seq.token_ids += output
    return seq


def test_step_rows_take_only_penalized_requests_and_their_tokens():
    """Rows without a penalty are left out; the prompt is listed only for a repetition penalty; an unresolved last
    token is a placeholder whose source is the sequence's sample row."""
    seqs = [make_seq([5, 6], [7]), make_seq([8, 9], [10, 11], frequency_penalty=1.0),
            make_seq([12], [13, PLACEHOLDER_TOKEN], repetition_penalty=1.5), make_seq([14], [], presence_penalty=-1)]
    seqs[2].num_unresolved_tokens, seqs[2].sample_row = 1, 7
    rows = penalized_rows(seqs)
    assert rows == [1, 2, 3]
    step = step_penalties(seqs, rows)
    assert (step.rows, step.presence, step.frequency, step.repetition) == (
        [1, 2, 3], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0], [1.0, 1.5, 1.0])
    assert (step.output_token_ids, step.output_offsets) == ([10, 11, 13, PLACEHOLDER_TOKEN], [0, 2, 4, 4])
    assert (step.prompt_token_ids, step.prompt_offsets) == ([12], [0, 0, 1, 1])
    assert (step.placeholder_indices, step.placeholder_sources) == ([3], [7])
    assert step_penalties(seqs, penalized_rows(seqs[:1])) is None  # no penalized row: nothing built
    without = step_penalties(seqs, rows, with_prompts=False)  # a later step of the same batch
    assert (without.prompt_token_ids, without.output_token_ids) == ([], step.output_token_ids)
    seqs[2].num_unresolved_tokens = 2
    with pytest.raises(RuntimeError, match="sequence .* has 2 tokens not read back"):
        step_penalties(seqs, rows)


@pytest.mark.parametrize("kw, message", [
    (dict(presence_penalty=2.5), "presence_penalty=2.5 must be in [-2, 2]"),
    (dict(frequency_penalty=-2.01), "frequency_penalty=-2.01 must be in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty=0.0 must be > 0"),
    (dict(repetition_penalty=-1.2), "repetition_penalty=-1.2 must be > 0"),
    (dict(repetition_penalty=1e-40), "repetition_penalty=1e-40 must be > 0, in float32's normal range"),
    (dict(repetition_penalty=1e39), "repetition_penalty=1e+39 must be > 0"),
    (dict(presence_penalty=float("nan")), "presence_penalty=nan must be a finite number"),
    (dict(frequency_penalty="1"), "frequency_penalty='1' must be a finite number"),
    (dict(repetition_penalty=True), "repetition_penalty=True must be a finite number"),
])
def test_bad_penalties_are_value_errors(kw, message):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert message in str(e.value)


def test_penalty_bounds_and_defaults():
    assert not SamplingParams().has_penalties
    for kw in (dict(presence_penalty=-2), dict(frequency_penalty=2), dict(repetition_penalty=0.01)):
        assert SamplingParams(**kw).has_penalties, kw
    assert type(SamplingParams(presence_penalty=1).presence_penalty) is float


# ------------------------------------------------------------------------------------------------ the engine

def reference_penalties(logits: torch.Tensor, prompt: list[int], output: list[int], presence=0.0, frequency=0.0,
                        repetition=1.0) -> torch.Tensor:
    """vLLM's penalties one token at a time, in float32 as vLLM computes them."""
    logits = logits.clone()
    presence, frequency, repetition = (torch.tensor(v, dtype=torch.float32) for v in (presence, frequency, repetition))
    for token in set(prompt) | set(output):
        x = logits[token]
        logits[token] = x / repetition if x > 0 else x * repetition
    for token in set(output):
        logits[token] -= frequency * output.count(token)
        logits[token] -= presence
    return logits


PENALTIES = [dict(repetition_penalty=2.0), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(presence_penalty=-0.5, frequency_penalty=0.75, repetition_penalty=1.25)]
NAMES = {"presence_penalty": "presence", "frequency_penalty": "frequency", "repetition_penalty": "repetition"}
PROMPT = random_prompts([6])[0]
NUM_TOKENS = 24


def hf_penalized_greedy(model_dir: str, prompt: list[int], num_tokens: int, **penalties) -> tuple[list, list]:
    """Greedy decoding over HF transformers' float32 logits with the penalties applied by reference_penalties;
    returns the tokens and each step's top-2 margin."""
    model, tokens, margins = _hf_model(model_dir), [], []
    kw = {NAMES[k]: v for k, v in penalties.items()}
    for _ in range(num_tokens):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        penalized = reference_penalties(logits, prompt, tokens, **kw)
        top2 = penalized.topk(2).values
        margins.append(float(top2[0] - top2[1]))
        tokens.append(int(penalized.argmax()))
    return tokens, margins


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("penalties", PENALTIES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_greedy_with_penalties_is_the_reference_loop_over_hf_logits(qwen3_dir, penalties, async_scheduling):
    llm = LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=async_scheduling))
    try:
        plain, penalized = (llm.generate([PROMPT], greedy(NUM_TOKENS, **kw), use_tqdm=False)[0]["token_ids"]
                            for kw in ({}, penalties))
    finally:
        close_llm(llm)
    assert penalized != plain  # the penalty changes the output, so the comparison below means something
    expected, margins = hf_penalized_greedy(qwen3_dir, PROMPT, NUM_TOKENS, **penalties)
    if penalized != expected:
        step = next(i for i, (a, b) in enumerate(zip(penalized, expected)) if a != b)
        assert margins[step] < TIE_MARGIN, (step, penalized, expected)  # only a float32 near-tie may diverge


@pytest.fixture
def penalty_spy(monkeypatch):
    """Records each call of the sampler's apply_penalties: (logits before, logits after, penalized rows)."""
    calls = []

    def spy(logits, step, last_sampled, max_elements, batch=None):
        before = logits.clone()
        after = apply_penalties(logits, step, last_sampled, max_elements, batch)
        calls.append((before, after.clone(), list(step.rows)))
        return after
    monkeypatch.setattr(sampler_module, "apply_penalties", spy)
    return calls


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalized_logits_are_bitwise_the_reference_loops(qwen3_dir, penalty_spy, async_scheduling):
    """The engine's own logits, penalized in a batch of two penalized requests and one without: every step's rows
    equal reference_penalties over the tokens the host knows at the end (under asynchronous scheduling, the last
    one came from the device)."""
    prompts = random_prompts([6, 11, 4], seed=1)
    params = [greedy(16, **PENALTIES[3]), greedy(16), greedy(16, repetition_penalty=2.0)]
    with LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=async_scheduling)) as llm:
        outs = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert len(penalty_spy) == 16 and all(rows == [0, 2] for _, _, rows in penalty_spy)  # row 1: no penalty
    for step, (before, after, _) in enumerate(penalty_spy):
        assert torch.equal(after[1], before[1])
        for row in (0, 2):  # batch order is request order here
            sp = params[row]
            expected = reference_penalties(before[row], prompts[row], outs[row][:step], sp.presence_penalty,
                                           sp.frequency_penalty, sp.repetition_penalty)
            assert torch.equal(after[row], expected), (step, row)
            assert int(after[row].argmax()) == outs[row][step]


def test_requests_without_penalties_cost_nothing_and_keep_their_tokens(qwen3_dir, penalty_spy):
    """A batch without penalized rows never reaches apply_penalties; in a mixed batch the unpenalized requests get
    the tokens they get alone, the penalized ones theirs alone."""
    prompts = random_prompts([6, 11, 4, 9], seed=2)
    penalized = {1: PENALTIES[1], 3: PENALTIES[0]}
    params = [greedy(16, **penalized.get(i, {})) for i in range(4)]
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        plain = [o["token_ids"] for o in llm.generate(prompts, greedy(16), use_tqdm=False)]
        assert penalty_spy == []
        alone = [llm.generate([p], sp, use_tqdm=False)[0]["token_ids"] for p, sp in zip(prompts, params)]
        mixed = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert mixed == alone
    assert [mixed[i] == plain[i] for i in range(4)] == [True, False, True, False]


def test_logprobs_stay_raw_under_penalties(qwen3_dir):
    """The returned logprobs are the model's log-softmax before the penalties (vLLM's raw_logprobs): HF's at each
    position, although the penalized greedy tokens are not all the raw argmax."""
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        out = llm.generate([PROMPT], greedy(NUM_TOKENS, logprobs=2, repetition_penalty=2.0), use_tqdm=False)[0]
    tokens = out["token_ids"]
    with torch.inference_mode():
        reference = _hf_model(qwen3_dir)(torch.tensor([PROMPT + tokens])).logits[0].float().log_softmax(-1)
    raw = reference[len(PROMPT) - 1:-1]  # position p predicts token p + 1
    ranks = [entry[t].rank for entry, t in zip(out["logprobs"], tokens)]
    assert max(ranks) > 1  # the penalty picked tokens the raw distribution does not rank first
    for i, (entry, token) in enumerate(zip(out["logprobs"], tokens)):
        assert abs(entry[token].logprob - raw[i, token].item()) < 1e-4, i
