"""Structured outputs on the server: OpenAI's response_format (json_object, json_schema with strict) and vLLM's
structured_outputs field, through the official `openai` client against a live uvicorn, on the random model with
SmolLM2's tokenizer (test_structured_outputs.py's tok_model_dir)."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from conftest import close_llm, serving  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.entrypoints.server import build_app  # noqa: E402
from nanovllm.entrypoints.server.structured import StructuredOutputsError, requested_structured_outputs  # noqa: E402
from test_structured_outputs import llm_kwargs, tok_model_dir  # noqa: E402,F401 -- the fixture, shared

API_KEY = "test-key"
MODEL = "tiny"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"]}  # no additionalProperties: strict closes the object
# llguidance's own JSON option, carried in the schema: response_format has no disable_any_whitespace, and a random
# model would write whitespace between the tokens until max_tokens
COMPACT_PERSON = {**PERSON, "x-guidance": {"whitespace_flexible": False}}
MESSAGES = [{"role": "user", "content": "Describe a person in JSON."}]


@pytest.fixture(scope="module")
def base_url(tok_model_dir):  # noqa: F811 -- pytest's fixture argument
    llm = LLM(tok_model_dir, **llm_kwargs(max_num_seqs=16, num_kvcache_blocks=512))
    try:
        with serving(build_app(llm, MODEL, api_key=API_KEY)) as port:
            yield f"http://127.0.0.1:{port}"
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def strict_schema(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": strict}}


def test_response_format_json_schema_strict_validates_streamed_or_not(client):
    """strict closes the object to other keys (a random model would otherwise write keys without end); the
    stream's deltas join to the same text."""
    options = dict(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0,
                   response_format=strict_schema(COMPACT_PERSON))
    chat = client.chat.completions.create(**options)
    content = chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop", content
    person = json.loads(content)
    jsonschema.validate(person, PERSON)
    assert set(person) <= {"name", "age", "tags"}
    chunks = client.chat.completions.create(**options, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_structured_outputs_field_on_completions_and_chat(client):
    out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert out.choices[0].text in ("red", "green", "blue") and out.choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0.7, seed=1,
                                          extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{4}"}})
    assert re.fullmatch("[A-Z]{2}-[0-9]{4}", chat.choices[0].message.content)
    compact = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=150, temperature=0, n=2,
                                             extra_body={"structured_outputs": {
                                                 "json": PERSON, "disable_any_whitespace": True,
                                                 "disable_additional_properties": True}})
    for choice in compact.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object_starts_an_object(client):
    """Any object: a random model's keys run on until max_tokens, but the first token is the object's."""
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0,
                                          response_format={"type": "json_object"})
    assert chat.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "needs json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", "unknown option"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "not both"),
    ({"structured_outputs": {"regex": "(unclosed"}}, None, "structured_outputs.regex is invalid"),
    ({"structured_outputs": {"json": {"type": "no-such-type"}}}, None, "structured_outputs.json is invalid"),
    ({"response_format": strict_schema({"type": "object", "properties": {"a": {"type": 5}}})}, None,
     "structured_outputs.json is invalid"),
])
def test_bad_structured_requests_get_400_naming_the_field(base_url, client, body, param, message):
    for route, prompt in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": MESSAGES})):
        r = httpx.post(f"{base_url}/v1/{route}", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"},
                       json={"model": MODEL, "max_tokens": 4, **prompt, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert message in error["message"] and error["param"] == param, error
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                    extra_body={"structured_outputs": {"choice": ["ok"]}})
    assert out.choices[0].text == "ok"  # the server serves on


def test_the_mapping_of_response_format():
    assert requested_structured_outputs({"type": "text"}, None) is None
    assert requested_structured_outputs(None, None) is None
    assert requested_structured_outputs({"type": "json_object"}, None).json_object is True
    strict = requested_structured_outputs(strict_schema(PERSON), None)
    assert strict.json == PERSON and strict.disable_additional_properties
    assert not requested_structured_outputs(strict_schema(PERSON, strict=False), None).disable_additional_properties
    with pytest.raises(StructuredOutputsError, match="response_format.json_schema.strict"):
        requested_structured_outputs({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, None)
