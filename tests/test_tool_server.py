"""Tool round trips through the official `openai` client against a live server: SmolLM2-135M with a Qwen3-style
tool template (tests/tool_models.py), given as `nanovllm serve --chat-template FILE` gives it. SmolLM2 never learned
to call tools, so the calls here are forced with tool_choice (required, or a named function): the grammar makes the
answer a valid call, the parser reads it, and the call and its result go back as history for the next turn,
streamed and not."""
from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from conftest import close_llm, serving, smollm2_llm_kwargs  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.entrypoints.server import build_app  # noqa: E402
from nanovllm.engine.tokenizer import read_chat_template  # noqa: E402
from nanovllm.entrypoints.server.app import use_chat_template  # noqa: E402
from nanovllm.entrypoints.server.protocol import APIError  # noqa: E402
from nanovllm.entrypoints.server.tools import ChatFeatures, plan_chat  # noqa: E402
from tool_models import QWEN3_STYLE_TEMPLATE  # noqa: E402

API_KEY = "test-key"
MODEL = "smollm2-tools"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris? Then add 2 and 3."}]
# SmolLM2 never closes a <think> block it opens: the forced calls here are asked for without thinking (the grammar is
# then the call's schema alone; test_tool_calls.py checks the grammar that lets a model reason first)
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(smollm2_dir, tmp_path_factory):
    template_file = tmp_path_factory.mktemp("tools") / "tool_template.jinja"
    template_file.write_text(QWEN3_STYLE_TEMPLATE)
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(max_model_len=1024))
    try:
        with pytest.raises(APIError, match="tools"):  # SmolLM2's own template writes no tools
            plan_chat(ChatFeatures.resolve(llm.tokenizer.chat_template), llm.tokenizer, [WEATHER], "auto", None)
        use_chat_template(llm, read_chat_template(str(template_file), "--chat-template"))  # what serve does
        with serving(build_app(llm, MODEL, api_key=API_KEY)) as port:
            with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0,
                               timeout=120) as c:
                yield c
    finally:
        close_llm(llm)


def streamed_message(client, **kw) -> tuple[str, list[dict], str]:
    """(content, tool calls, finish_reason) of a streamed answer, its chunks joined as a client joins them."""
    content, calls, finish_reason = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            calls[call.index]["arguments"] += call.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return content, [calls[i] for i in sorted(calls)], finish_reason


def test_required_forces_valid_calls_streamed_as_openai_sends_them(client):
    kw = dict(messages=QUESTION, tools=[WEATHER, ADD], tool_choice="required", max_tokens=120, temperature=0,
              extra_body=NO_THINKING)
    answer = client.chat.completions.create(model=MODEL, **kw)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(c.function.name in ("get_weather", "add") and c.type == "function" for c in calls)
    for call in calls:
        arguments = json.loads(call.function.arguments)
        assert set(arguments) == set(next(t for t in (WEATHER, ADD) if t["function"]["name"] == call.function.name)
                                     ["function"]["parameters"]["required"])
    content, streamed, finish_reason = streamed_message(client, **kw)
    assert finish_reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c.function.name, c.function.arguments)
                                                               for c in calls]


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_call_and_its_result_make_a_multi_turn_round_trip(client, stream):
    kw = dict(tools=[WEATHER, ADD], max_tokens=60, temperature=0, extra_body=NO_THINKING)
    named = {"type": "function", "function": {"name": "add"}}
    if stream:
        _, calls, finish_reason = streamed_message(client, messages=QUESTION, tool_choice=named, **kw)
        call = calls[0]
    else:
        choice = client.chat.completions.create(model=MODEL, messages=QUESTION, tool_choice=named, **kw).choices[0]
        finish_reason, tool_call = choice.finish_reason, choice.message.tool_calls[0]
        call = {"id": tool_call.id, "name": tool_call.function.name, "arguments": tool_call.function.arguments}
    assert finish_reason == "tool_calls" and call["name"] == "add"
    arguments = json.loads(call["arguments"])
    history = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call["id"], "type": "function", "function": {"name": "add", "arguments": call["arguments"]}}]},
        {"role": "tool", "tool_call_id": call["id"], "content": str(arguments["a"] + arguments["b"])}]
    # the answer's first 8 tokens show it is text; the prompt-only request needs no answer at all
    final = client.chat.completions.create(model=MODEL, messages=history, tool_choice="none", **{**kw, "max_tokens": 8})
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    # the history reached the template: the tool call and its result are in the prompt
    assert final.usage.prompt_tokens > client.chat.completions.create(
        model=MODEL, messages=QUESTION, tool_choice="none", **{**kw, "max_tokens": 1}).usage.prompt_tokens + 20


def test_bad_tool_requests_get_400_naming_the_field(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    with pytest.raises(openai.BadRequestError, match="tool_choice names the function 'get_time'") as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=named)
    assert error.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError, match="tools.0.function.name"):
        client.chat.completions.create(model=MODEL, messages=QUESTION,
                                       tools=[{"type": "function", "function": {"name": "bad name!"}}])
    with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.tools"):
        client.chat.completions.create(model=MODEL, messages=QUESTION,
                                       extra_body={"chat_template_kwargs": {"tools": []}})


def test_thinking_off_through_chat_template_kwargs_renders_the_closed_block(client):
    def prompt_tokens(**extra):
        return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > prompt_tokens()
