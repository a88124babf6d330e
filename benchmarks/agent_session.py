"""bench_agent_replay.py's session and model: a recorded tool-using agent session in Anthropic's message format, and
a model directory (a preset's config, dummy weights) with a word-level tokenizer and a Qwen3-style chat template.

The tokenizer maps every word of the session ("w123") to one token and isolates punctuation, so lengths are exact
and a history tokenizes the same as a prefix of its next turn (what the prefix caches need). Its vocabulary fills the
model's (151,936 for Qwen3), so every token a dummy model samples decodes to a word.
"""
import json
import os
import random

NUM_TOOLS = 24
SYSTEM_WORDS = 9_000  # the instructions; the tools' definitions bring the rendered system prompt to about 20k tokens
TOOL_RESULT_WORDS = (200, 1000)  # the longest history (about 26k tokens) fits the KV of an 8 GiB card alone
NUM_WORDS = 30_000  # the session's words are drawn from w0 .. w29999
SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
TAG_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)

# Qwen3's tool format: the tools in the system prompt, calls as <tool_call> JSON, results as <tool_response>
QWEN3_STYLE_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
{{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within " }}
{{- "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}" }}
{{- "\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}
{{- '<|im_start|>user\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if message.reasoning_content %}{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' }}{%- endif %}
{{- message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set fc = tool_call.function %}
{{- '\n<tool_call>\n{"name": "' + fc.name + '", "arguments": ' }}
{%- if fc.arguments is string %}{{- fc.arguments }}{%- else %}{{- fc.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + message.content + '\n</tool_response><|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()


def words(rng: random.Random, num_words: int) -> str:
    return " ".join(f"w{rng.randrange(NUM_WORDS)}" for _ in range(num_words))


def shared_prompt(token_scale: float) -> tuple[str, list[dict]]:
    """The system prompt and the tools every session sends (random.Random(4))."""
    rng = random.Random(4)
    scaled = lambda n: max(1, round(n * token_scale))  # noqa: E731
    tools = []
    for i in range(NUM_TOOLS):
        properties = {f"arg{j}": {"type": "string", "description": words(rng, scaled(20))} for j in range(6)}
        tools.append({"name": f"tool_{i}", "description": words(rng, scaled(150)),
                      "input_schema": {"type": "object", "properties": properties, "required": ["arg0"]}})
    return words(rng, scaled(SYSTEM_WORDS)), tools


def agent_session(session: int, num_turns: int, token_scale: float = 1.0) -> dict:
    """{"system", "tools", "messages"}: the task, then per turn the assistant's text and tool_use and the user's
    tool_result (random.Random(100 + session)); request t sends messages[:1 + 2 * (t - 1)]."""
    system, tools = shared_prompt(token_scale)
    rng = random.Random(100 + session)
    scaled = lambda n: max(1, round(n * token_scale))  # noqa: E731
    messages = [{"role": "user", "content": words(rng, scaled(100))}]
    for turn in range(num_turns - 1):
        tool_use_id = f"toolu_{session}_{turn}"
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": words(rng, scaled(30))},
            {"type": "tool_use", "id": tool_use_id, "name": f"tool_{rng.randrange(NUM_TOOLS)}",
             "input": {"arg0": words(rng, scaled(10)), "arg1": words(rng, scaled(5))}}]})
        num_result_words = rng.randint(scaled(TOOL_RESULT_WORDS[0]), scaled(TOOL_RESULT_WORDS[1]))
        messages.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": tool_use_id, "content": words(rng, num_result_words)}]})
    return {"system": system, "tools": tools, "messages": messages}


def build_model_dir(shape: str, path: str) -> str:
    """`shape` (a preset, or "tiny") as a dummy-weights checkpoint directory with the word-level tokenizer."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    from nanovllm.utils.presets import PRESETS, QWEN3_COMMON
    if shape != "tiny" and shape not in PRESETS:
        raise ValueError(f"--shape {shape!r} is not a preset ({', '.join(sorted(PRESETS))}) or tiny")
    config = {**QWEN3_COMMON, **(TINY_CONFIG if shape == "tiny" else PRESETS[shape])}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    base = ["[UNK]", *SPECIAL_TOKENS, *TAG_TOKENS, *sorted(set("{}[]\":,.<>/|_-#()'=!?*+;&%$@^`~\\"))]
    num_words = config["vocab_size"] - len(base)
    vocab = {token: i for i, token in enumerate(base + [f"w{i}" for i in range(num_words)])}
    model = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                   pre_tokenizers.Punctuation(behavior="isolated")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="[UNK]", eos_token="<|im_end|>",
                                        additional_special_tokens=SPECIAL_TOKENS[:1])
    tokenizer.add_tokens(TAG_TOKENS)
    tokenizer.chat_template = QWEN3_STYLE_TEMPLATE
    tokenizer.save_pretrained(path)
    return path
