"""`nanovllm chat`: a conversation on stdin and stdout. Each line read is a user turn; the reply streams out as it
is generated and joins the history, and the whole history, rendered by the chat template, is the next turn's prompt.
Its KV is not computed again: the previous turn's prompt and reply are in the prefix cache (the template renders an
earlier turn the same way every time), so a turn costs its new tokens. Works with piped stdin as with a terminal."""
from __future__ import annotations

import json
import sys

EXIT_COMMANDS = ("/exit", "/quit")
RESET_COMMAND = "/reset"


def chat_session(model: str, engine_kwargs: dict, params, system: str | None, show_stats: bool) -> int:
    """`nanovllm chat`: the engine for `model`, then the loop on stdin and stdout."""
    from nanovllm import LLM
    with LLM(model, **engine_kwargs) as llm:
        if llm.tokenizer is None or not llm.tokenizer.chat_template:
            raise ValueError(f"model {model!r} has no chat template; `nanovllm generate --no-chat` takes plain "
                             f"prompts")
        run_chat(llm, params, sys.stdin, sys.stdout, system)
        if show_stats:
            print(json.dumps(llm.stats(), indent=1))
    return 0


def run_chat(llm, params, lines, out, system: str | None = None) -> list[dict]:
    """The loop: one turn per line of `lines` until it ends or says /exit; returns the history."""
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    interactive = lines.isatty()
    while True:
        if interactive:
            out.write("> ")
            out.flush()
        line = lines.readline()
        if not line or line.strip() in EXIT_COMMANDS:
            return history
        text = line.strip()
        if text == RESET_COMMAND:
            history = list(start)
            continue
        if text:
            history.append({"role": "user", "content": text})
            history.append({"role": "assistant", "content": reply(llm, history, params, out)})


def reply(llm, history: list[dict], params, out) -> str:
    """Stream one answer to `out`; returns its text."""
    from nanovllm.engine.tokenizer import chat_token_ids
    prompt = chat_token_ids(llm.tokenizer, history, llm.config.model)
    pieces = []
    for chunk in llm.generate_stream([prompt], params):
        out.write(chunk["text"])
        out.flush()
        pieces.append(chunk["text"])
    out.write("\n")
    out.flush()
    return "".join(pieces)
