"""vLLM's request options through the official `openai` client. Choices: n samples of a prompt and a list of
prompts in one completion request, streamed and not, numbered prompt-major as OpenAI and vLLM number them; choice i
of a seeded request is what the offline engine gives that prompt alone with seed + i. Sampling: logit_bias,
bad_words and skip_special_tokens as the offline engine applies them. Echo and prompt logprobs (how evaluation
harnesses score a text): the offline engine's prompt_logprobs, in the legacy format and in vLLM's field."""
from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from conftest import close_llm, serving, smollm2_llm_kwargs  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.entrypoints.server import build_app  # noqa: E402

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Once upon a time"]
NUM_TOKENS = 3
SEED = 11
SAMPLING = {"temperature": 1.0, "max_tokens": NUM_TOKENS, "seed": SEED}


@pytest.fixture(scope="module")
def served(smollm2_dir):
    """(client, reference): reference[(prompt, i)] is the offline engine's text for the prompt alone with seed + i,
    computed before the server takes the engine over."""
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs())
    greedy = SamplingParams(temperature=0, max_tokens=NUM_TOKENS)
    offline = {"greedy": llm.generate([PROMPTS[0]], greedy, use_tqdm=False)[0].outputs[0],
               "banned": llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                                   bad_words=["Paris"]), use_tqdm=False)[0].outputs[0],
               "scored": llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, logprobs=1,
                                                                   prompt_logprobs=1), use_tqdm=False)[0]}
    reference = {(p, i): llm.generate([p], SamplingParams(temperature=1.0, max_tokens=NUM_TOKENS, seed=SEED + i,
                                                          ignore_eos=True), use_tqdm=False)[0].outputs[0].text
                 for p in PROMPTS for i in range(3)}
    try:
        with serving(build_app(llm, MODEL)) as port, \
                openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                              timeout=120) as client:
            yield client, reference | offline
    finally:
        close_llm(llm)


def test_n_choices_are_the_seeds_run_alone(served):
    client, reference = served
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], n=3, extra_body={"ignore_eos": True},
                                    **SAMPLING)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [reference[(PROMPTS[0], i)] for i in range(3)]
    assert len({c.text for c in out.choices}) > 1  # different seeds, different samples
    # the prompt's tokens count once, every choice's completion tokens count
    assert out.usage.completion_tokens == 3 * NUM_TOKENS
    one = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1)
    assert out.usage.prompt_tokens == one.usage.prompt_tokens


def test_a_list_of_prompts_is_numbered_prompt_major(served):
    client, reference = served
    out = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, extra_body={"ignore_eos": True}, **SAMPLING)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [reference[(p, i)] for p in PROMPTS for i in range(2)]
    assert out.usage.completion_tokens == 4 * NUM_TOKENS


def test_streamed_choices_carry_their_index(served):
    client, reference = served
    texts = {}
    finish = {}
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
                                       **SAMPLING)
    usage = None
    for chunk in chunks:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finish[choice.index] = choice.finish_reason
    assert texts == {k: reference[(p, i)] for k, (p, i) in enumerate((p, i) for p in PROMPTS for i in range(2))}
    assert finish == dict.fromkeys(range(4), "length")
    assert usage.completion_tokens == 4 * NUM_TOKENS


def test_chat_n_streamed_and_not(served):
    client, _ = served
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, n=2, **SAMPLING)
    assert [c.index for c in out.choices] == [0, 1]
    streamed = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, n=2, stream=True, **SAMPLING):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in out.choices}  # same seeds, same samples


def test_logit_bias_bad_words_and_skip_special_tokens(served):
    client, reference = served
    greedy, banned = reference["greedy"], reference["banned"]
    paris = greedy.token_ids[0]  # " Paris"
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS, "temperature": 0}
    out = client.completions.create(logit_bias={str(paris): -100}, **body).choices[0]
    assert not out.text.startswith(greedy.text[:len(" Paris")])
    out = client.completions.create(extra_body={"bad_words": ["Paris"]}, **body).choices[0]
    assert out.text == banned.text and "Paris" not in out.text
    # EOS (<|im_end|>, id 2) forced twice and not stopping: its text shows only with skip_special_tokens=False
    forced = {**body, "max_tokens": 2, "logit_bias": {"2": 100}}
    kept = client.completions.create(extra_body={"ignore_eos": True, "skip_special_tokens": False}, **forced)
    assert kept.choices[0].text == "<|im_end|><|im_end|>"
    skipped = client.completions.create(extra_body={"ignore_eos": True}, **forced)
    assert skipped.choices[0].text == ""


def legacy(entries) -> tuple[list, list]:
    """The offline engine's logprob entries as the legacy format's token_logprobs and top_logprobs (chosen first)."""
    values = [None if entry is None else next(iter(entry.values())).logprob for entry in entries]
    tops = [None if entry is None else {lp.decoded_token: lp.logprob for lp in entry.values()} for entry in entries]
    return values, tops


def test_echo_puts_the_prompt_and_its_logprobs_first(served):
    client, reference = served
    scored = reference["scored"]
    completion = scored.outputs[0]
    prompt_tokens = [reference["scored"].prompt_logprobs[i] for i in range(1, len(scored.prompt_token_ids))]
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": NUM_TOKENS, "temperature": 0, "logprobs": 1}
    out = client.completions.create(echo=True, **body).choices[0]
    assert out.text == PROMPTS[0] + completion.text
    values, tops = legacy([None, *prompt_tokens, *completion.logprobs])
    assert out.logprobs.token_logprobs == pytest.approx(values) and out.logprobs.top_logprobs[1:] == [
        pytest.approx(top) for top in tops[1:]] and out.logprobs.top_logprobs[0] is None
    assert "".join(out.logprobs.tokens) == out.text
    assert out.logprobs.text_offset == [len("".join(out.logprobs.tokens[:i])) for i in range(len(values))]
    # max_tokens=0: the prompt alone, scored (lm-evaluation-harness's loglikelihood request)
    alone = client.completions.create(echo=True, **{**body, "max_tokens": 0})
    assert alone.choices[0].text == PROMPTS[0] and alone.usage.completion_tokens == 0
    assert alone.choices[0].logprobs.token_logprobs == pytest.approx(values[:len(scored.prompt_token_ids)])
    # streamed, with two samples: each choice's first chunk opens with the prompt and its logprobs
    texts, tokens = {}, {}
    for chunk in client.completions.create(echo=True, n=2, stream=True, **body):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
            tokens[choice.index] = tokens.get(choice.index, []) + choice.logprobs.tokens
    assert texts == {0: out.text, 1: out.text} and tokens == {0: out.logprobs.tokens, 1: out.logprobs.tokens}


def test_prompt_logprobs_come_in_vllms_field(served):
    client, reference = served
    scored = reference["scored"]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, n=2,
                                    extra_body={"prompt_logprobs": 1})
    for choice in out.choices:  # every choice, though only the prompt's first sample computes them
        field = choice.model_extra["prompt_logprobs"]
        assert field[0] is None and len(field) == len(scored.prompt_token_ids)
        for got, entry in zip(field[1:], scored.prompt_logprobs[1:]):
            assert [(int(token_id), value["rank"], value["decoded_token"]) for token_id, value in got.items()] == [
                (token_id, lp.rank, lp.decoded_token) for token_id, lp in entry.items()]  # the prompt's token first
            assert [value["logprob"] for value in got.values()] == pytest.approx(
                [lp.logprob for lp in entry.values()])
    for body, field in [({"max_tokens": 0}, "max_tokens"), ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt_logprobs": 21}, "prompt_logprobs")]:
        with pytest.raises(openai.BadRequestError) as error:
            client.post("/completions", cast_to=dict, body={"model": MODEL, "prompt": PROMPTS[0], **body})
        assert error.value.body["param"] == field
