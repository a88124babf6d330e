"""A model that takes tools, for the server tests of tool calls, reasoning and the Anthropic API: SmolLM2-135M's
weights and tokenizer with a Qwen3-style chat template (tools in the system prompt, `<tool_call>` JSON, tool results
as `<tool_response>`, `<think>` blocks and `enable_thinking`). SmolLM2 never learned that format, so the tests that
need a call force one with tool_choice (a grammar); the parsers' own tests use outputs in each family's format."""
import os
import shutil

from benchmarks.agent_session import QWEN3_STYLE_TEMPLATE  # the agent replay benchmark's template


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
