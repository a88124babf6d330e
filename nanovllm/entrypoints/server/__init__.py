"""OpenAI- and Anthropic-compatible HTTP server: `nanovllm serve MODEL`. See docs/server.md.

  HTTP handlers (asyncio, FastAPI: app.py) -> EngineLoop (one thread, owns the LLM: engine_loop.py)
    -> LLM.step() (the offline engine)

protocol.py holds the request models, prepare.py tokenizes and checks a request off the loop thread, streaming.py
writes the responses and Server-Sent Events, metrics.py /metrics, guards.py the API key, the body cap and internal
errors.
Agents: tools.py plans a chat request's tools and reasoning, tool_parsers.py / call_reader.py / reasoning.py read
them out of the model's text as it streams, chat_output.py shapes OpenAI's answer, anthropic_protocol.py and
anthropic_routes.py serve /v1/messages.
The CLI imports this package lazily; nothing here imports the CLI.
"""
from nanovllm.entrypoints.server.app import DEFAULT_MAX_REQUEST_BYTES, build_app, serve
from nanovllm.entrypoints.server.engine_loop import EngineError, EngineLoop
from nanovllm.entrypoints.server.prepare import prepare

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "EngineError", "EngineLoop", "build_app", "prepare", "serve"]
