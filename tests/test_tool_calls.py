"""Tool calls and reasoning on /v1/chat/completions, without a model: the request plan (tools.py) and the response
shapes (chat_output.py, streaming.py) on engine deltas made up in each test. The end-to-end round trips through the
official SDKs are in test_tool_server.py and test_anthropic.py."""
import asyncio
import json
import re

import pytest

pytest.importorskip("fastapi")

from nanovllm.entrypoints.server import streaming  # noqa: E402
from nanovllm.engine.output_processor import StreamDelta  # noqa: E402
from nanovllm.entrypoints.server.engine_loop import Delta  # noqa: E402
from nanovllm.entrypoints.server.protocol import APIError  # noqa: E402
from nanovllm.entrypoints.server.tools import ChatFeatures, plan_chat, required_calls_schema  # noqa: E402
from tool_models import QWEN3_STYLE_TEMPLATE  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CHATML_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


class FakeStream:
    """A RequestStream that replays made-up engine deltas: `pieces` of text, the last one finishing."""

    def __init__(self, pieces: list[str], finish_reason: str = "stop", stop_reason=None):
        self.pieces, self.finish_reason, self.stop_reason = pieces, finish_reason, stop_reason
        self.num_prompt_tokens = 7
        self.is_finished = False

    async def events(self):
        for i, piece in enumerate(self.pieces):
            is_last = i == len(self.pieces) - 1
            yield Delta(StreamDelta([], piece, self.finish_reason if is_last else None, i + 1),
                        final_text="".join(self.pieces) if is_last else None,
                        stop_reason=self.stop_reason if is_last else None)
        self.is_finished = True


def collect_chunks(stream: FakeStream, parser) -> list[dict]:
    async def run():
        reply = streaming.Reply("chatcmpl-test", "m")
        return [chunk async for chunk in streaming.chat_chunks(reply, [stream], False, 0, [parser])]
    return asyncio.run(run())


def features(template: str = QWEN3_STYLE_TEMPLATE, **options) -> ChatFeatures:
    return ChatFeatures.resolve(template, **options)


class NoTokenizer:
    """The plan renders the template only to see whether a prompt opens <think>; this template never does."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        return "<|im_start|>assistant\n"


# ------------------------------------------------------------------------------------------------ the plan

def test_parsers_default_from_the_template_and_can_be_named_or_turned_off():
    assert (features().tool_call_parser, features().reasoning_parser) == ("hermes", "qwen3")
    assert (features(CHATML_TEMPLATE).tool_call_parser, features(CHATML_TEMPLATE).reasoning_parser) == (None, None)
    named = features(CHATML_TEMPLATE, tool_call_parser="mistral", reasoning_parser="qwen3")
    assert (named.tool_call_parser, named.reasoning_parser) == ("mistral", "qwen3")
    assert features(reasoning_parser="none").reasoning_parser is None
    with pytest.raises(ValueError, match="--tool-call-parser 'pythonic' is not one of hermes, llama3_json, mistral"):
        features(tool_call_parser="pythonic")
    with pytest.raises(ValueError, match="--reasoning-parser 'deepseek_r1'"):
        features(reasoning_parser="deepseek_r1")


@pytest.mark.parametrize("template, tools, tool_choice, message, param", [
    (CHATML_TEMPLATE, [WEATHER], None, "this model's chat template does not take tools", "tools"),
    (QWEN3_STYLE_TEMPLATE, [WEATHER], {"type": "function", "function": {"name": "get_time"}},
     "tool_choice names the function 'get_time', which is not among the tools ('get_weather')", "tool_choice"),
    (QWEN3_STYLE_TEMPLATE, None, "required", "tool_choice='required' needs tools: the request has none",
     "tool_choice"),
])
def test_bad_tool_requests_are_refused_naming_the_field(template, tools, tool_choice, message, param):
    with pytest.raises(APIError, match=re.escape(message)) as error:
        plan_chat(features(template), NoTokenizer(), tools, tool_choice, None)
    assert error.value.status_code == 400 and error.value.body["error"]["param"] == param


def test_auto_without_tools_is_plain_text():
    plan = plan_chat(features(), NoTokenizer(), None, "auto", None)
    assert "tools" not in plan.template_kwargs and plan.make_parser().parse_all("<tool_call>").content == "<tool_call>"


def test_tools_go_to_the_template_and_auto_reads_calls_with_the_family_parser():
    plan = plan_chat(features(), NoTokenizer(), [WEATHER], None, {"enable_thinking": True})
    assert plan.template_kwargs == {"enable_thinking": True, "tools": [WEATHER]} and plan.sampling == {}
    parsed = plan.make_parser().parse_all('<think>hm</think><tool_call>{"name": "get_weather", '
                                          '"arguments": {"city": "Oslo"}}</tool_call>')
    assert parsed.reasoning == "hm" and parsed.tool_calls[0].name == "get_weather"


def test_tool_choice_none_keeps_the_tools_in_the_prompt_and_reads_text():
    plan = plan_chat(features(), NoTokenizer(), [WEATHER], "none", None)
    assert plan.template_kwargs["tools"] == [WEATHER] and "structured_outputs" not in plan.sampling
    assert plan.make_parser().parse_all('<tool_call>{"name": "x"}</tool_call>').content.startswith("<tool_call>")


def test_required_and_named_tool_choice_are_forced_by_a_json_schema():
    no_reasoning = features(reasoning_parser="none")
    required = plan_chat(no_reasoning, NoTokenizer(), [WEATHER, ADD], "required", None, parallel_tool_calls=False)
    schema = required.sampling["structured_outputs"].json
    assert schema == required_calls_schema([WEATHER, ADD], False) and schema["maxItems"] == 1
    assert [c["properties"]["name"] for c in schema["items"]["anyOf"]] == [{"const": "get_weather"}, {"const": "add"}]
    named = plan_chat(no_reasoning, NoTokenizer(), [WEATHER, ADD], {"type": "function", "function": {"name": "add"}},
                      None)
    assert named.sampling["structured_outputs"].json == ADD["function"]["parameters"]
    call = named.make_parser().parse_all('{"a": 1, "b": 2}').tool_calls[0]
    assert (call.name, call.arguments) == ("add", '{"a": 1, "b": 2}')


def test_a_forced_call_and_response_format_together_are_refused():
    plan = plan_chat(features(), NoTokenizer(), [ADD], "required", None)
    assert plan.sampling_with({"temperature": 0.5})["temperature"] == 0.5
    with pytest.raises(APIError, match="cannot be combined with response_format"):
        plan.sampling_with({"structured_outputs": object()})


def test_with_a_reasoning_parser_the_forced_call_comes_after_the_reasoning():
    named = plan_chat(features(), NoTokenizer(), [ADD], {"type": "function", "function": {"name": "add"}}, None)
    grammar = named.sampling["structured_outputs"].grammar
    assert grammar.splitlines() == [
        "%llguidance {}", 'start: ("<think>" reasoning)? /[ \\t\\r\\n]*/ answer',
        'reasoning[lazy]: /(.|\\n)*/ "</think>"', "answer: %json " + json.dumps(ADD["function"]["parameters"])]
    parsed = named.make_parser().parse_all('<think>\nadd them\n</think>\n\n{"a": 1, "b": 2}')
    assert parsed.reasoning == "\nadd them\n" and parsed.tool_calls[0].arguments == '{"a": 1, "b": 2}'
    assert named.template_kwargs == {"tools": [ADD]}  # thinking stays as the template has it
    # thinking turned off: the prompt closed the block, so the grammar is the schema alone
    off = plan_chat(features(), NoTokenizer(), [ADD], "required", {"enable_thinking": False})
    assert off.sampling["structured_outputs"].json == required_calls_schema([ADD])


def test_a_template_that_opens_think_in_the_prompt_starts_the_answer_in_reasoning():
    class OpensThink:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            return "<|im_start|>assistant\n<think>\n"
    plan = plan_chat(features(), OpensThink(), None, None, None)
    parsed = plan.make_parser().parse_all("step one\n</think>\n\nAnswer.")
    assert (parsed.reasoning, parsed.content) == ("step one\n", "Answer.")


# ------------------------------------------------------------------------------------------------ response shapes

TWO_CALLS = ['<think>\nneed ', 'weather</th', 'ink>\n\n<tool_', 'call>\n{"name": "get_', 'weather", "arguments": ',
             '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, ', '"b": 2}}\n',
             '</tool_call>']


def test_streamed_chunks_carry_reasoning_and_openai_tool_call_deltas_that_join_to_the_message():
    plan = plan_chat(features(), NoTokenizer(), [WEATHER, ADD], None, None)
    chunks = collect_chunks(FakeStream(TWO_CALLS), plan.make_parser())
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("reasoning", "") for d in deltas) == "\nneed weather"
    assert not any(d.get("content") for d in deltas[1:])
    heads = [call for d in deltas for call in d.get("tool_calls", []) if "id" in call]
    assert [(h["index"], h["type"], h["function"]["name"]) for h in heads] == [(0, "function", "get_weather"),
                                                                              (1, "function", "add")]
    arguments = ["", ""]
    for d in deltas:
        for call in d.get("tool_calls", []):
            arguments[call["index"]] += call["function"]["arguments"]
    assert [json.loads(a) for a in arguments] == [{"city": "Oslo"}, {"a": 1, "b": 2}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    # the non-streamed message of the same text
    reply = streaming.Reply("chatcmpl-test", "m")
    last = Delta(StreamDelta([], "", "stop", 9), final_text="".join(TWO_CALLS))
    body = streaming.chat_response(reply, [FakeStream(TWO_CALLS)], [last], 0, [plan.make_parser()])
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"] == "\nneed weather"
    assert [c["function"]["arguments"] for c in message["tool_calls"]] == arguments
    assert body["choices"][0]["finish_reason"] == "tool_calls"


def test_a_plain_answer_is_content_as_before():
    plan = plan_chat(features(CHATML_TEMPLATE), NoTokenizer(), None, None, None)
    chunks = collect_chunks(FakeStream(["Hel", "lo <tool_call> x"]), plan.make_parser())
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello <tool_call> x"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_the_think_then_call_grammar_accepts_reasoning_then_the_call_and_nothing_after(smollm2_dir):
    """llguidance compiles the grammar of a forced call with reasoning (SmolLM2's tokenizer) and takes a reasoning
    block that mentions the end tag's pieces and JSON, then the call; or the call alone; but no text after the call,
    and no JSON that breaks the schema."""
    import llguidance.hf  # binds llguidance too
    from transformers import AutoTokenizer

    from nanovllm.entrypoints.server.tools import forced_call_grammar
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer)
    grammar = llguidance.grammar_from("lark", forced_call_grammar(ADD["function"]["parameters"], True, False).grammar)
    assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
    assert accepts('<think>\nadd {"a": 2} </thin then </think>\n\n{"a": 1, "b": 2}')
    assert accepts('{"a": 1, "b": 2}')
    assert not accepts('<think>x</think>{"a": 1, "b": 2} and more')
    assert not accepts('<think>x</think>{"a": "one", "b": 2}')
