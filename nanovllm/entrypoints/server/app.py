"""The FastAPI app (routes and error handlers) and `serve`, the entry point of `nanovllm serve`."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.engine.tokenizer import read_chat_template
from nanovllm.entrypoints.server import streaming
from nanovllm.entrypoints.server.anthropic_routes import add_anthropic_routes
from nanovllm.entrypoints.server.body import MAX_JSON_MEMBERS, ChatBody, CompletionBody
from nanovllm.entrypoints.server.choices import submit_choices
from nanovllm.entrypoints.server.completion_output import CompletionChoices
from nanovllm.entrypoints.server.engine_loop import EngineError, EngineLoop
from nanovllm.entrypoints.server.guards import APIKeyCheck, BodySizeLimit, InternalErrors, error_response
from nanovllm.entrypoints.server.info_routes import add_info_routes
from nanovllm.entrypoints.server.metrics import METRICS_CONTENT_TYPE, format_metrics
from nanovllm.entrypoints.server.protocol import APIError
from nanovllm.entrypoints.server.tools import ChatFeatures, plan_chat

if TYPE_CHECKING:
    from nanovllm.llm import LLM

logger = logging.getLogger("nanovllm.server")

# 8 MiB: a prompt of 131,072 tokens (a long max_model_len) is about 0.5 MB of English text, 1 MB as token ids and
# at most ~3 MB with every character JSON-escaped, so a prompt that fits any model passes, while a body that could
# only be refused (10 MB and more) is refused before it is read
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
NUM_PREPARE_THREADS = 4  # requests tokenized at once; more wait their turn without holding up the engine


def build_app(llm: LLM, served_model_name: str, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tool_call_parser: str = "auto",
              reasoning_parser: str = "auto") -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine loop thread and stops it (aborting what is in flight);
    closing `llm` stays with the caller. No /docs or /redoc pages: they load their scripts from a CDN.
    `tool_call_parser` / `reasoning_parser`: `--tool-call-parser` / `--reasoning-parser` (tools.py)."""
    if api_key is not None and not api_key:
        raise ValueError("api_key='' is empty: pass a key, or None to serve without one")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes={max_request_bytes} must be >= 1")
    features = ChatFeatures.resolve(getattr(llm.tokenizer, "chat_template", None), tool_call_parser,
                                    reasoning_parser)
    engine = EngineLoop(llm)
    preparers = ThreadPoolExecutor(NUM_PREPARE_THREADS, "nanovllm-prepare")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)
        preparers.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="nanovllm", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.max_json_items = llm.config.max_model_len + MAX_JSON_MEMBERS  # body.py: what a body may hold
    _install_error_handlers(app)
    app.add_middleware(InternalErrors)  # added first: the innermost, it sees what the routes raise
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key)  # the outermost: nothing is read before the key is checked
    _add_routes(app, engine, llm, served_model_name, preparers, features)
    add_info_routes(app, llm, served_model_name, preparers)
    add_anthropic_routes(app, engine, llm, served_model_name, preparers, features)
    return app


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    # a field of several types (prompt, stop) fails once per type: a broken limit says more than a wrong type
    first = next((e for e in errors if not e.get("type", "").endswith("_type")), errors[0])
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _is_type_tag(part)]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        return APIError(400, f"the request body is not valid JSON: {reason} at character {'.'.join(loc) or '?'}",
                        code="invalid_json")
    where = ".".join(loc) or "body"
    return APIError(400, f"{where}: {first.get('msg')}", param=where)


def _is_type_tag(part) -> bool:
    """pydantic's name for one type of a union in an error's location ("str", "list[int]", "constrained-str")."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


def _install_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return error_response(exc, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return error_response(_validation_error(exc), path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(APIError(exc.status_code, str(exc.detail), type=kind), exc.headers, request.url.path)

    @app.exception_handler(EngineError)
    async def on_engine_error(request: Request, exc: EngineError):
        return error_response(APIError(500, str(exc), type="server_error"), path=request.url.path)


def _add_routes(app: FastAPI, engine: EngineLoop, llm: LLM, served_model_name: str, preparers: ThreadPoolExecutor,
                features: ChatFeatures):
    @app.get("/health")
    async def health():
        if not engine.is_alive:
            raise APIError(503, engine.broken or "the engine loop is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(format_metrics(await engine.snapshot()), media_type=METRICS_CONTENT_TYPE)

    created = int(time.time())  # the model card's: when the server started serving it

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "nanovllm", "max_model_len": llm.config.max_model_len}]}

    def decode(token_ids: list[int]) -> str:
        return "" if llm.tokenizer is None else llm.tokenizer.decode(token_ids)

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request):
        body.check(served_model_name, llm.config.max_logprobs)
        streams = await submit_choices(engine, preparers, llm, [{"prompt": p} for p in body.prompts()],
                                       body.sampling(body.max_tokens))
        reply = streaming.Reply(f"cmpl-{uuid.uuid4().hex}", served_model_name, body.n)
        if body.echo:  # decoding the prompts takes a while for long ones: off the event loop
            choices = await asyncio.get_running_loop().run_in_executor(preparers, CompletionChoices.of, body,
                                                                       streams, decode)
        else:
            choices = CompletionChoices.of(body, streams, decode)
        watch = streaming.ClientWatch(engine, streams, request)
        if body.stream:
            return streaming.sse_response(streaming.completion_chunks(reply, streams, body.include_usage, choices),
                                          watch)
        return streaming.completion_response(reply, streams, await streaming.collect(streams, watch), choices)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request):
        body.check(served_model_name, llm.config.max_logprobs)
        max_tokens = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
        plan = await asyncio.get_running_loop().run_in_executor(preparers, lambda: plan_chat(
            features, llm.tokenizer, body.tool_dicts(), body.tool_choice_value(), body.chat_template_kwargs,
            body.parallel_tool_calls))
        inputs = [{"messages": body.template_messages(), "chat_template_kwargs": plan.template_kwargs}]
        streams = await submit_choices(engine, preparers, llm, inputs, plan.sampling_with(body.sampling(max_tokens)))
        parsers = [plan.make_parser() for _ in streams]
        reply = streaming.Reply(f"chatcmpl-{uuid.uuid4().hex}", served_model_name, body.n)
        watch = streaming.ClientWatch(engine, streams, request)
        if body.stream:
            return streaming.sse_response(
                streaming.chat_chunks(reply, streams, body.include_usage, body.top_logprobs or 0, parsers), watch)
        return streaming.chat_response(reply, streams, await streaming.collect(streams, watch),
                                       body.top_logprobs or 0, parsers)


# ------------------------------------------------------------------------------------------------ entry point

def check_serve_args(args: argparse.Namespace):
    """What can be refused before the model loads."""
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty (an unset shell variable?): pass a key, or leave the flag out to serve "
                         "without one")
    if args.max_request_bytes is None:
        args.max_request_bytes = DEFAULT_MAX_REQUEST_BYTES
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes={args.max_request_bytes} must be >= 1")
    if args.chat_template is not None:  # the file is read now: a wrong path fails before the model loads
        args.chat_template = read_chat_template(args.chat_template, "--chat-template")
    check_port(args.host, args.port)
    if args.api_key is None and args.host not in LOOPBACK_HOSTS:
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)


def check_port(host: str, port: int):
    """ValueError naming --port or --host when the address cannot be bound: the model would load for nothing. Bound
    and released at once, with SO_REUSEADDR as uvicorn binds it (a port in TIME_WAIT is free to it)."""
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port} must be in [0, 65535]")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as e:
            raise ValueError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); pick another port, or "
                             f"stop what holds it") from None


def serve(args: argparse.Namespace, model: str, served_model_name: str, engine_kwargs: dict) -> int:
    """Load the model, then serve until Ctrl-C or SIGTERM; `nanovllm serve` calls this."""
    from nanovllm import LLM

    check_serve_args(args)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again; leave through the `with`
    # either way, so the LLM releases its caches and worker processes
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with LLM(model, **engine_kwargs) as llm:
            if args.chat_template is not None:
                use_chat_template(llm, args.chat_template)
            app = build_app(llm, served_model_name, api_key=args.api_key, max_request_bytes=args.max_request_bytes,
                            tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
            engine = app.state.engine
            server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level), engine)
            print(f"nanovllm: serving {served_model_name!r} on http://{args.host}:{args.port}/v1", flush=True)
            try:
                server.run()
            finally:  # a forced exit (a second Ctrl-C) skips the app's shutdown: the loop must not step a closed LLM
                engine.stop()
    except KeyboardInterrupt:
        pass
    return 0


def use_chat_template(llm: LLM, chat_template: str):
    """Every route renders chats with `chat_template` (the template's text): it replaces the tokenizer's own."""
    if llm.tokenizer is None:
        raise ValueError(f"--chat-template: model {llm.config.model!r} has no tokenizer files to render chats with")
    llm.tokenizer.chat_template = chat_template


class _Server(uvicorn.Server):
    """On Ctrl-C or SIGTERM the requests in flight fail at once (streams get an error event, then [DONE]): uvicorn
    waits for open connections to close before it shuts the app down, which would otherwise let every stream
    generate to its end."""

    def __init__(self, config: uvicorn.Config, engine: EngineLoop):
        super().__init__(config)
        self.engine = engine

    def handle_exit(self, sig, frame):
        self.engine.shut_down()
        super().handle_exit(sig, frame)


def _exit_on_sigterm(signum, frame):
    raise SystemExit(0)
