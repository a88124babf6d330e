"""A model that takes tools, for the server tests of tool calls, reasoning and the Anthropic API: SmolLM2-135M's
weights and tokenizer with a Qwen3-style chat template (tools in the system prompt, `<tool_call>` JSON, tool results
as `<tool_response>`, `<think>` blocks and `enable_thinking`). SmolLM2 never learned that format, so the tests that
need a call force one with tool_choice (a grammar); the parsers' own tests use outputs in each family's format."""
import os
import shutil

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


def smollm2_with_tool_template(smollm2_dir: str, out_dir: str) -> str:
    """SmolLM2's checkpoint (the weights linked, not copied) with QWEN3_STYLE_TEMPLATE as its chat template."""
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(smollm2_dir):
        source, target = os.path.join(smollm2_dir, name), os.path.join(out_dir, name)
        if name == "chat_template.jinja" or os.path.exists(target):
            continue
        if name.endswith(".safetensors"):
            os.symlink(source, target)
        else:
            shutil.copy(source, target)
    with open(os.path.join(out_dir, "chat_template.jinja"), "w") as f:
        f.write(QWEN3_STYLE_TEMPLATE)
    return out_dir
