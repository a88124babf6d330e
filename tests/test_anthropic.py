"""/v1/messages and /v1/messages/count_tokens (Anthropic's Messages API).

Without a model: the request's translation to chat messages and tools, and the streamed event sequence on made-up
engine deltas. With one: the official `anthropic` client against a live server (SmolLM2-135M with a Qwen3-style tool
template, tests/tool_models.py): tool_use forced by tool_choice, its tool_result sent back, streamed and not,
thinking turned off, stop sequences, count_tokens, both API-key headers, and Anthropic's error body."""
from __future__ import annotations

import asyncio
import json

import pytest

anthropic = pytest.importorskip("anthropic")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from conftest import close_llm, serving, smollm2_llm_kwargs  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.entrypoints.server import build_app  # noqa: E402
from nanovllm.entrypoints.server.anthropic_protocol import MessagesRequest  # noqa: E402
from nanovllm.entrypoints.server.anthropic_routes import message_events  # noqa: E402
from nanovllm.entrypoints.server.protocol import APIError  # noqa: E402
from nanovllm.entrypoints.server.tools import ChatFeatures, plan_chat  # noqa: E402
from test_tool_calls import TWO_CALLS, FakeStream, NoTokenizer  # noqa: E402
from tool_models import QWEN3_STYLE_TEMPLATE, smollm2_with_tool_template  # noqa: E402

API_KEY = "test-key"
WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                            "required": ["city"], "additionalProperties": False}}
ADD = {"name": "add", "input_schema": {"type": "object", "properties": {
    "a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


# ------------------------------------------------------------------------------------------------ without a model

def test_a_conversation_with_tool_use_and_results_becomes_chat_messages():
    request = MessagesRequest.model_validate({
        "model": "claude-sonnet-4-5", "max_tokens": 10, "system": [{"type": "text", "text": "Be brief."}],
        "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "metadata": {"user_id": "u"},  # accepted and ignored, as are cache_control marks
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "Call it.", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "18 C"}]},
                                         {"type": "text", "text": "And tomorrow?"}]}]})
    request.check("served")
    assert request.chat_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"}]
    assert request.function_tools() == [{"type": "function", "function": {
        "name": "get_weather", "parameters": WEATHER["input_schema"], "description": WEATHER["description"]}}]
    assert (request.openai_tool_choice(), request.parallel_tool_calls) == ("required", False)


@pytest.mark.parametrize("body, message", [
    ({"messages": QUESTION}, "max_tokens: Field required"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content.0: 'image' blocks are not supported"),
    ({"max_tokens": 5, "messages": QUESTION, "temperature": 1.5}, "temperature=1.5 must be in [0, 1]"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search",
                                                        "input_schema": {}}]}, "tools.0: the server tool"),
    ({"max_tokens": 5, "messages": QUESTION, "tool_choice": {"type": "tool"}}, "tool_choice.name is required"),
])
def test_malformed_requests_are_refused_naming_the_field(body, message):
    with pytest.raises(APIError, match=message.replace("[", r"\[")):
        request = MessagesRequest.model_validate(body)
        request.check("served")
        request.chat_messages()


def collect_events(pieces: list[str], finish_reason="stop", stop_reason=None, tools=None) -> list[tuple[str, dict]]:
    plan = plan_chat(ChatFeatures.resolve(QWEN3_STYLE_TEMPLATE), NoTokenizer(), tools, None, None)

    async def run():
        stream = FakeStream(pieces, finish_reason, stop_reason)
        return [event async for event in message_events("msg_1", "m", plan.make_parser(), stream)]
    return asyncio.run(run())


def test_streamed_events_follow_anthropics_sequence_block_by_block():
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("get_weather", "add")]
    events = collect_events(TWO_CALLS, tools=tools)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    starts = [data for name, data in events if name == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"), (1, "tool_use"),
                                                                          (2, "tool_use")]
    assert [s["content_block"]["name"] for s in starts[1:]] == ["get_weather", "add"]
    # every block opens, gets its deltas, and closes before the next opens
    open_index = None
    inputs: dict[int, str] = {}
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
            if data["delta"]["type"] == "input_json_delta":
                inputs[open_index] = inputs.get(open_index, "") + data["delta"]["partial_json"]
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None
    assert {i: json.loads(text) for i, text in inputs.items()} == {1: {"city": "Oslo"}, 2: {"a": 1, "b": 2}}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


def test_a_stop_sequence_and_max_tokens_are_named_in_the_stop_reason():
    events = collect_events(["Hello ", "world"], stop_reason="END")
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert collect_events(["Hi"], finish_reason="length")[-2][1]["delta"]["stop_reason"] == "max_tokens"
    empty = collect_events([""])
    assert [name for name, _ in empty][2:5] == ["content_block_start", "content_block_stop", "message_delta"]


# ------------------------------------------------------------------------------------------------ the live server

@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory):
    model_dir = smollm2_with_tool_template(smollm2_dir, str(tmp_path_factory.mktemp("anthropic") / "model"))
    llm = LLM(model_dir, **smollm2_llm_kwargs(max_model_len=1024))
    try:
        with serving(build_app(llm, "smollm2-tools", api_key=API_KEY)) as port:
            yield f"http://127.0.0.1:{port}"
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server, api_key=API_KEY, max_retries=0, timeout=120) as c:
        yield c


def test_a_forced_tool_use_and_its_result_make_a_round_trip_streamed_and_not(client):
    # SmolLM2 never closes a <think> block it opens: the forced call is asked for without thinking
    kw = dict(model="claude-sonnet-4-5", max_tokens=60, extra_body={"temperature": 0}, tools=[WEATHER, ADD],
              thinking={"type": "disabled"})
    forced = {"type": "tool", "name": "add"}
    message = client.messages.create(messages=QUESTION, tool_choice=forced, **kw)
    assert message.stop_reason == "tool_use" and message.role == "assistant"
    tool_use = next(block for block in message.content if block.type == "tool_use")
    assert tool_use.name == "add" and set(tool_use.input) == {"a", "b"} and tool_use.id.startswith("toolu_")
    assert message.usage.input_tokens > 50 and message.usage.output_tokens > 0
    with client.messages.stream(messages=QUESTION, tool_choice=forced, **kw) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [tool_use.input]
    history = QUESTION + [
        {"role": "assistant", "content": [block.model_dump() for block in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use.id,
                                      "content": str(tool_use.input["a"] + tool_use.input["b"])}]}]
    # the answer's first 8 tokens show it is text
    final = client.messages.create(messages=history, tool_choice={"type": "none"}, **{**kw, "max_tokens": 8})
    assert final.stop_reason in ("end_turn", "max_tokens") and [b.type for b in final.content] == ["text"]
    counted = client.messages.count_tokens(model=kw["model"], messages=history, tools=kw["tools"],
                                           thinking=kw["thinking"])
    assert counted.input_tokens == final.usage.input_tokens


def test_text_streams_as_one_text_block_and_matches_the_non_streamed_answer(client):
    kw = dict(model="any-name", max_tokens=12, extra_body={"temperature": 0}, messages=QUESTION,
              thinking={"type": "disabled"}, system="You are terse.")
    message = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert [b.type for b in message.content] == ["text"] and text == message.content[0].text
    assert streamed.content[0].text == text and streamed.stop_reason == message.stop_reason
    assert streamed.usage.output_tokens == message.usage.output_tokens


def test_max_tokens_past_the_context_is_a_cap_not_an_error(client):
    """Harnesses send their model's output limit (32,000 and more) whatever the prompt: the answer stops where the
    context ends (max_model_len 1,024 here) instead of being refused, as OpenAI's routes refuse it."""
    message = client.messages.create(model="m", max_tokens=32000, extra_body={"temperature": 0, "top_k": 1},
                                     messages=QUESTION, thinking={"type": "disabled"}, stop_sequences=["."])
    assert message.stop_reason in ("end_turn", "stop_sequence", "max_tokens")
    assert message.usage.input_tokens + message.usage.output_tokens <= 1024


def test_stop_sequences_end_the_answer_and_are_named(client):
    first = client.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0}, messages=QUESTION,
                                   thinking={"type": "disabled"}).content[0].text
    word = first.split()[1] if len(first.split()) > 1 else first[-2:]
    stopped = client.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0}, messages=QUESTION,
                                     thinking={"type": "disabled"}, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_both_api_key_headers_work_and_errors_have_anthropics_body(server):
    body = {"model": "m", "max_tokens": 2, "messages": QUESTION}
    assert httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": API_KEY}).status_code == 200
    assert httpx.post(f"{server}/v1/messages", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    wrong = httpx.post(f"{server}/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert wrong.status_code == 401 and wrong.json()["type"] == "error"
    assert wrong.json()["error"]["type"] == "authentication_error"
    bad = httpx.post(f"{server}/v1/messages", json={"model": "m", "messages": QUESTION},
                     headers={"x-api-key": API_KEY})
    assert bad.status_code == 400 and bad.json() == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"}}
    # the OpenAI routes keep OpenAI's error body, with either header
    openai_bad = httpx.post(f"{server}/v1/chat/completions", json={"messages": []}, headers={"x-api-key": API_KEY})
    assert openai_bad.status_code == 400 and "error" in openai_bad.json() and "type" not in openai_bad.json()
