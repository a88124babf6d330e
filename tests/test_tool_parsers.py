"""The tool-call and reasoning parsers on model outputs in each family's format, fed whole and cut at every split
point: the deltas must join to the same answer whatever the cuts (what streaming relies on), and the whole-text
parse must be the expected calls, content and reasoning exactly."""
import itertools
import json

import pytest

from nanovllm.entrypoints.server.reasoning import ChatOutputParser, Qwen3ReasoningParser
from nanovllm.entrypoints.server.parsed_output import ParsedDelta
from nanovllm.entrypoints.server.tool_parsers import (NamedCallParser, NoToolParser, hermes_parser,
                                                      llama3_json_parser, mistral_parser, required_calls_parser)

# Outputs written in each family's format as its models write them (spacing, newlines and all).
QWEN3_THINK_AND_TWO_CALLS = (
    '<think>\nThe user wants the weather in Paris and in Tōkyō. I will call get_weather twice.\n</think>\n\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "T\\u014dky\\u014d", "days": [1, 2], '
    '"note": "a \\"quoted\\" }{ string"}}\n</tool_call>')
QWEN3_TEXT_THEN_CALL = ('Let me look that up.\n<tool_call>\n{"arguments": {"path": "/tmp/a<b>.txt"}, '
                        '"name": "read_file"}\n</tool_call>')
QWEN3_NO_CALL = "<think>\nSimple: 2+2=4. The < sign is not a tag.\n</think>\n\nThe answer is 4 < 5 <tool_ and </think."
LLAMA3_TWO_CALLS = ('<|python_tag|>{"name": "search", "parameters": {"query": "nano vllm", "top_k": 3}}; '
                    '{"name": "open_url", "parameters": {"url": "https://example.com/?q={x}"}}')
LLAMA3_TEXT = "I can't call a tool for that: {braces} appear later."
MISTRAL_CALLS = ('Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2.5}}, '
                 '{"name": "noop", "arguments": {}}]')
MISTRAL_V11_CALLS = ('Sure.[TOOL_CALLS]add[ARGS]{"a": 1, "b": {"c": "[ARGS]"}} and [TOOL_CALLS]noop[ARGS]{}')
REQUIRED_CALLS = '[{"name": "add", "parameters": {"a": 1, "b": [true, null]}}, {"name": "noop", "parameters": {}}]'


def make_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def joined(deltas: list[ParsedDelta]) -> dict:
    """Deltas merged as a client merges OpenAI's chunks: text joined, each call's header once, its arguments joined."""
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for call in d.tool_calls:
            if call.id is not None:
                assert call.index not in calls, f"call {call.index} got a second header"
                calls[call.index] = {"id": call.id, "name": call.name, "arguments": ""}
            calls[call.index]["arguments"] += call.arguments
    assert sorted(calls) == list(range(len(calls))), "call indices must count up from 0"
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


def run_cut(make_parser, text: str, cuts: tuple[int, ...]) -> dict:
    parser = make_parser()
    pieces = [text[a:b] for a, b in zip((0,) + cuts, cuts + (len(text),))]
    return joined([parser.feed(piece) for piece in pieces] + [parser.finish()])


def chat_parser(tool_parser_factory, starts_in_reasoning=False, with_reasoning=True):
    return lambda: ChatOutputParser(tool_parser_factory(make_ids()),
                                    Qwen3ReasoningParser(starts_in_reasoning) if with_reasoning else None)


def call(name: str, arguments: str, index: int) -> dict:
    return {"id": f"call_{index}", "name": name, "arguments": arguments}


CASES = {
    "qwen3_think_two_calls": (chat_parser(hermes_parser), QWEN3_THINK_AND_TWO_CALLS, {
        "reasoning": "\nThe user wants the weather in Paris and in Tōkyō. I will call get_weather twice.\n",
        "content": "",
        "calls": [call("get_weather", '{"city": "Paris", "unit": "celsius"}', 0),
                  call("get_weather", '{"city": "T\\u014dky\\u014d", "days": [1, 2], '
                                      '"note": "a \\"quoted\\" }{ string"}', 1)]}),
    "qwen3_text_then_call_arguments_first": (chat_parser(hermes_parser), QWEN3_TEXT_THEN_CALL, {
        "reasoning": "", "content": "Let me look that up.\n",
        "calls": [call("read_file", '{"path": "/tmp/a<b>.txt"}', 0)]}),
    "qwen3_no_call_tag_lookalikes": (chat_parser(hermes_parser), QWEN3_NO_CALL, {
        "reasoning": "\nSimple: 2+2=4. The < sign is not a tag.\n",
        "content": "The answer is 4 < 5 <tool_ and </think.", "calls": []}),
    "qwen3_thinking_opened_by_the_template": (chat_parser(hermes_parser, starts_in_reasoning=True),
                                              "plan it\n</think>\n\nDone.", {
        "reasoning": "plan it\n", "content": "Done.", "calls": []}),
    "llama3_two_calls": (chat_parser(llama3_json_parser, with_reasoning=False), LLAMA3_TWO_CALLS, {
        "reasoning": "", "content": "",
        "calls": [call("search", '{"query": "nano vllm", "top_k": 3}', 0),
                  call("open_url", '{"url": "https://example.com/?q={x}"}', 1)]}),
    "llama3_plain_text": (chat_parser(llama3_json_parser, with_reasoning=False), LLAMA3_TEXT, {
        "reasoning": "", "content": LLAMA3_TEXT, "calls": []}),
    "mistral_text_then_calls": (chat_parser(mistral_parser, with_reasoning=False), MISTRAL_CALLS, {
        "reasoning": "", "content": "Sure.",
        "calls": [call("add", '{"a": 1, "b": 2.5}', 0), call("noop", "{}", 1)]}),
    "mistral_v11_calls": (chat_parser(mistral_parser, with_reasoning=False), MISTRAL_V11_CALLS, {
        "reasoning": "", "content": "Sure. and ",
        "calls": [call("add", '{"a": 1, "b": {"c": "[ARGS]"}}', 0), call("noop", "{}", 1)]}),
    "required_array": (chat_parser(required_calls_parser, with_reasoning=False), REQUIRED_CALLS, {
        "reasoning": "", "content": "",
        "calls": [call("add", '{"a": 1, "b": [true, null]}', 0), call("noop", "{}", 1)]}),
    "named_function": (lambda: ChatOutputParser(NamedCallParser("add", make_ids())), '{"a": 1, "b": 2}', {
        "reasoning": "", "content": "", "calls": [call("add", '{"a": 1, "b": 2}', 0)]}),
    "hermes_malformed_call_is_text": (chat_parser(hermes_parser, with_reasoning=False),
                                      "A<tool_call>\nnot json</tool_call>", {
        "reasoning": "", "content": "A\nnot json</tool_call>", "calls": []}),
    "no_tools": (lambda: ChatOutputParser(NoToolParser(), Qwen3ReasoningParser()), "<think>x</think>y", {
        "reasoning": "x", "content": "y", "calls": []}),
}


@pytest.mark.parametrize("case", CASES)
def test_whole_text_parses_to_the_expected_answer(case):
    make_parser, text, expected = CASES[case]
    assert run_cut(make_parser, text, ()) == expected
    for got in expected["calls"]:
        json.loads(got["arguments"])  # the arguments are the model's JSON text, valid on their own


@pytest.mark.parametrize("case", CASES)
def test_every_split_point_and_every_pair_of_them_give_the_same_answer(case):
    make_parser, text, expected = CASES[case]
    for cut in range(1, len(text)):
        assert run_cut(make_parser, text, (cut,)) == expected, f"cut at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    # every character alone: the most deltas a stream can have
    assert run_cut(make_parser, text, tuple(range(1, len(text)))) == expected


def test_byte_cuts_decoded_as_a_stream_decodes_them():
    """A stream's text deltas are whole characters (the detokenizer holds a partial UTF-8 sequence back); cut at every
    byte, each piece is what an incremental decoder releases, and the answer is the same."""
    import codecs
    make_parser, text, expected = CASES["qwen3_think_two_calls"]
    data = text.encode()
    for cut in range(1, len(data)):
        decoder = codecs.getincrementaldecoder("utf-8")()
        parser = make_parser()
        deltas = [parser.feed(decoder.decode(data[:cut])), parser.feed(decoder.decode(data[cut:], final=True))]
        assert joined(deltas + [parser.finish()]) == expected, f"byte cut at {cut}"


def test_a_call_streams_its_name_first_then_its_arguments_as_they_come():
    parser = hermes_parser(make_ids())
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu').tool_calls[0].name == "get_weather"
    delta = parser.feed('ments": {"city": "Pa')
    assert [(c.index, c.id, c.arguments) for c in delta.tool_calls] == [(0, None, '{"city": "Pa')]
    assert parser.feed('ris"}}\n</tool_call>').tool_calls[0].arguments == 'ris"}'


def test_a_call_cut_off_before_its_name_comes_back_as_text():
    parser = ChatOutputParser(hermes_parser(make_ids()))
    assert joined([parser.parse_all('Checking.<tool_call>\n{"na')]) == {
        "content": 'Checking.\n{"na', "reasoning": "", "calls": []}


def test_finish_reason_is_tool_calls_only_after_a_call():
    with_call, without = ChatOutputParser(hermes_parser()), ChatOutputParser(hermes_parser())
    with_call.parse_all('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    without.parse_all("hello")
    assert (with_call.finish_reason("stop"), with_call.finish_reason("length")) == ("tool_calls", "length")
    assert without.finish_reason("stop") == "stop"
    # a tag around a JSON object that is no call (no name) sends no call: no "tool_calls" to look for either
    unnamed = ChatOutputParser(hermes_parser())
    assert unnamed.parse_all('<tool_call>\n{"foo": 1}\n</tool_call>').tool_calls == []
    assert unnamed.finish_reason("stop") == "stop" and unnamed.num_calls == 0
