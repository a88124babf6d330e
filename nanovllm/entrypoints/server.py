"""OpenAI-compatible HTTP server: `nanovllm serve MODEL`.

Three layers:
  HTTP handlers (asyncio, FastAPI) -> EngineLoop (one thread, owns the LLM) -> LLM.step() (the offline engine).
Handlers never touch the engine: they put commands on the loop's inbox (a thread-safe queue) and read token deltas
from a per-request asyncio queue that the loop thread fills with `loop.call_soon_threadsafe`.
See docs/server.md.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import logging
import queue
import secrets
import signal
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.llm import LLM

logger = logging.getLogger("nanovllm.server")


# ------------------------------------------------------------------------------------------------ the engine loop

@dataclass
class GenerateRequest:
    """What a handler hands to the engine loop. Exactly one of `prompt` / `messages` is set."""
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None  # chat: rendered with the tokenizer's chat template on the loop thread
    sampling: dict = field(default_factory=dict)  # SamplingParams options; max_tokens None: as many as fit


@dataclass
class Delta:
    """A request's new output since its previous Delta. The last Delta has `finish_reason` set ("abort" when the
    request was aborted) and `final_text`: the whole completion, exactly as the non-streaming API returns it."""
    text: str
    num_completion_tokens: int  # tokens generated so far, this delta's included
    finish_reason: str | None = None
    final_text: str | None = None


class EngineError(RuntimeError):
    """The engine failed a step; every request in flight gets this instead of its next Delta."""


class RequestStream:
    """The handler's end of one request. The loop thread calls `put` (thread-safe); the handler iterates `events`.

    NOTE: the loop thread writes `seq_id` and `num_prompt_tokens` before `EngineLoop.submit` returns the stream;
    after that only the loop thread reads `seq_id` (the handler just passes the stream back to abort it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._events: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self.seq_id: int | None = None
        self.num_prompt_tokens = 0
        self.is_finished = False  # the handler has seen the last Delta

    def put(self, event: Delta | BaseException):
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is shutting down and nobody is listening
            pass

    async def events(self) -> AsyncIterator[Delta]:
        while not self.is_finished:
            event = await self._events.get()
            if isinstance(event, BaseException):
                self.is_finished = True
                raise event
            self.is_finished = event.finish_reason is not None
            yield event


@dataclass
class _Active:
    """Loop-thread bookkeeping of one unfinished request: what its stream has been sent so far."""
    stream: RequestStream
    num_tokens_sent: int = 0
    text_sent: str = ""


class Throughput:
    """Prefill and decode tokens per second over the last `window_s` seconds, from the engine's running totals
    sampled after each step. The newest sample from before the window stays as the baseline: every token counted
    after it was computed inside the window (or since the first sample, when that is younger)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()  # (time, prefill_tokens, decode_tokens)

    def add(self, now: float, prefill_tokens: int, decode_tokens: int):
        self.samples.append((now, prefill_tokens, decode_tokens))
        self._prune(now)

    def rates(self, now: float) -> tuple[float, float]:
        self._prune(now)
        if len(self.samples) < 2:
            return 0.0, 0.0
        (t0, p0, d0), (_, p1, d1) = self.samples[0], self.samples[-1]
        seconds = max(now - max(t0, now - self.window_s), 1e-9)
        return (p1 - p0) / seconds, (d1 - d0) / seconds

    def _prune(self, now: float):
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()


_STOP = object()


class EngineLoop:
    """Runs the LLM on one dedicated thread, the only thread that touches it (the engine is not thread-safe).

    Handlers send commands through `_inbox`: `submit` (awaits the answer, so a bad request comes back as a
    ValueError), `abort` and `snapshot`. Between commands the thread steps the engine while it has unfinished
    requests and publishes each request's new tokens; with nothing to do it blocks on the inbox.
    `_active` maps seq_id -> _Active for every request added and not yet finished or aborted.
    """

    def __init__(self, llm: LLM):
        self.llm = llm
        # (fn, args, concurrent Future | None), or _STOP; a SimpleQueue's put may run inside a signal handler that
        # interrupted another put (shut_down, on Ctrl-C), where a Queue's lock would deadlock
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: dict[int, _Active] = {}
        self._throughput = Throughput()
        self.num_finished_requests = 0
        self.num_aborted_requests = 0
        self.num_rejected_requests = 0  # refused by the engine's validation (HTTP 400)
        # why the engine cannot serve any more (a failed tensor-parallel step leaves the ranks out of step), or None
        self.broken: str | None = None
        self._thread = threading.Thread(target=self._run, name="nanovllm-engine-loop", daemon=True)

    # --- called from the handlers' event loop
    def start(self):
        self._thread.start()

    def shut_down(self):
        """Fail the requests in flight ("the server is shutting down") and end the loop, without waiting for it:
        safe in a signal handler."""
        self._inbox.put(_STOP)

    def stop(self):
        """shut_down, then wait for the loop to end (a step in progress finishes first); safe to call twice."""
        if self._thread.is_alive():
            self.shut_down()
            self._thread.join()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.broken is None

    async def submit(self, request: GenerateRequest) -> RequestStream:
        """Queue a request; raises ValueError (nothing queued) when the engine refuses it."""
        stream = RequestStream(asyncio.get_running_loop())
        try:
            await self._call(self._add, stream, request)
        except asyncio.CancelledError:
            self.abort(stream)  # the add may have run already
            raise
        return stream

    def abort(self, stream: RequestStream):
        """Abort stream's request if it is still running (fire and forget; safe from a `finally`)."""
        self._inbox.put((self._abort, (stream,), None))

    async def snapshot(self) -> dict:
        return await self._call(self._snapshot)

    async def _call(self, fn: Callable, *args):
        """Run fn on the loop thread and wait for its result; EngineError when the loop has ended (shutting down)
        and can no longer answer."""
        reply = concurrent.futures.Future()
        self._inbox.put((fn, args, reply))
        waiting = asyncio.wrap_future(reply)
        try:
            while not (await asyncio.wait({waiting}, timeout=1.0))[0]:
                if not self._thread.is_alive() and not reply.running():
                    raise EngineError("the server is shutting down")
        finally:
            waiting.cancel()  # no-op once done; else the command is skipped if the loop has not taken it yet
        return waiting.result()

    # --- the loop thread
    def _run(self):
        self._sample_throughput()
        while True:
            for command in self._take_commands(block=self.llm.is_finished()):
                if command is _STOP:
                    self._fail_all(EngineError("the server is shutting down"))
                    return
                self._run_command(*command)
            if not self.llm.is_finished():
                self._step()

    def _take_commands(self, block: bool) -> list:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    @staticmethod
    def _run_command(fn: Callable, args: tuple, reply: concurrent.futures.Future | None):
        """Run one command; its result or exception goes to the waiting handler (none waits on an abort)."""
        if reply is not None and not reply.set_running_or_notify_cancel():
            return  # the handler gave up waiting: don't run it
        try:
            result = fn(*args)
        except Exception as e:
            if reply is None:
                logger.exception("engine loop: %s failed", fn.__name__)
            else:
                reply.set_exception(e)
            return
        if reply is not None:
            reply.set_result(result)

    def _add(self, stream: RequestStream, request: GenerateRequest):
        if self.broken is not None:
            raise EngineError(self.broken)
        try:
            token_ids = self._prompt_token_ids(request)
            sampling = dict(request.sampling)
            if sampling.get("max_tokens") is None:
                sampling["max_tokens"] = self._room_left(token_ids)
            stream.seq_id = self.llm.add_request(token_ids, SamplingParams(**sampling))
        except ValueError:
            self.num_rejected_requests += 1
            raise
        stream.num_prompt_tokens = len(token_ids)
        self._active[stream.seq_id] = _Active(stream)

    def _prompt_token_ids(self, request: GenerateRequest) -> list[int]:
        tokenizer = self.llm.tokenizer
        if isinstance(request.prompt, list):
            return request.prompt
        if tokenizer is None:
            raise ValueError(f"model {self.llm.config.model!r} has no tokenizer files; send the prompt as token ids "
                             f"to /v1/completions")
        if request.messages is None:
            return tokenizer.encode(request.prompt)
        if not tokenizer.chat_template:
            raise ValueError(f"model {self.llm.config.model!r} has no chat template; use /v1/completions")
        from jinja2 import TemplateError
        try:
            text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # templates raise on messages they refuse, e.g. roles out of order
            raise ValueError(f"the chat template refused these messages: {e}") from None
        return tokenizer.encode(text, add_special_tokens=False)  # the template already has its special tokens

    def _room_left(self, token_ids: list[int]) -> int:
        """The default max_tokens: up to max_model_len, and no more than the whole GPU KV cache holds."""
        config = self.llm.config
        if len(token_ids) >= config.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, max_model_len={config.max_model_len} leaves no "
                             f"room for a completion; shorten it")
        max_len = min(config.max_model_len, self.llm.num_gpu_blocks * config.kvcache_block_size)
        return max(1, max_len - len(token_ids))  # max(1, ...): past the cache, add_request names the limit

    def _abort(self, stream: RequestStream):
        if self._active.pop(stream.seq_id, None) is None:
            return  # never added, already finished, or already aborted
        self.llm.abort_request(stream.seq_id)
        self.num_aborted_requests += 1
        stream.put(Delta("", 0, finish_reason="abort", final_text=""))

    def _step(self):
        """One engine step, then every request's new output. A failure fails the requests in flight, not the loop:
        at tensor_parallel_size 1 the server keeps taking new ones. With tensor parallelism a rank that failed has
        left the others mid-step, so the engine is marked broken: /health answers 503 and new requests are refused
        until the server is restarted."""
        try:
            self.llm.step()
            self._sample_throughput()
            for active in list(self._active.values()):
                self._publish(active)
        except Exception as e:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._active))
            if self.llm.workers is not None:
                self.broken = f"a tensor-parallel step failed ({e!r}); the ranks are out of step: restart the server"
            self._fail_all(EngineError(f"the engine failed a step: {e!r}"))

    def _sample_throughput(self):
        stats = self.llm.scheduler.stats
        self._throughput.add(time.monotonic(), stats.prefill_tokens, stats.decode_tokens)

    def _publish(self, active: _Active):
        """Send the tokens and text that are new since the last Delta; on the last one, forget the request."""
        seq_id = active.stream.seq_id
        seq = self.llm.requests[seq_id]
        new_ids = seq.completion_token_ids[active.num_tokens_sent:]
        if not new_ids and not seq.is_finished:
            return
        text = self.llm._stream_text(seq)
        delta = Delta(text[len(active.text_sent):], seq.num_completion_tokens)
        active.num_tokens_sent += len(new_ids)
        active.text_sent = text
        if seq.is_finished:
            delta.finish_reason = seq.finish_reason
            delta.final_text = self.llm.output(self.llm.requests.pop(seq_id))["text"]
            del self._active[seq_id]
            self.num_finished_requests += 1
        active.stream.put(delta)

    def _fail_all(self, error: BaseException):
        for seq_id, active in list(self._active.items()):
            active.stream.put(error)
            try:
                self.llm.abort_request(seq_id)
            except Exception:
                logger.exception("engine loop: could not abort request %d", seq_id)
        self._active.clear()

    def _snapshot(self) -> dict:
        """The numbers behind /metrics (see METRICS), read on the loop thread."""
        llm, scheduler = self.llm, self.llm.scheduler
        stats = llm.stats()
        num_free_gpu_blocks = scheduler.block_manager.num_free_blocks
        num_free_cpu_blocks = scheduler.host_pool.num_free_blocks if scheduler.host_pool else 0
        prefill_rate, decode_rate = self._throughput.rates(time.monotonic())
        return {
            **stats,
            "num_requests_running": len(scheduler.running),
            "num_requests_waiting": len(scheduler.waiting),
            "num_requests_swapped": len(scheduler.swapped),
            "prefill_throughput_tokens_per_s": prefill_rate,
            "decode_throughput_tokens_per_s": decode_rate,
            "num_free_gpu_blocks": num_free_gpu_blocks,
            "gpu_kv_cache_usage_ratio": _usage_ratio(stats["num_gpu_blocks"], num_free_gpu_blocks),
            "num_free_cpu_blocks": num_free_cpu_blocks,
            "cpu_kv_cache_usage_ratio": _usage_ratio(stats["num_cpu_blocks"], num_free_cpu_blocks),
            "finished_requests": self.num_finished_requests,
            "aborted_requests": self.num_aborted_requests,
            "rejected_requests": self.num_rejected_requests,
        }


# ------------------------------------------------------------------------------------------------ errors

class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body, status_code=error.status_code)


def _validation_error(exc: RequestValidationError) -> APIError:
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", first.get("msg"))
        return APIError(400, f"the request body is not valid JSON: {reason} at character {'.'.join(loc) or '?'}",
                        code="invalid_json")
    where = ".".join(loc) or "body"
    return APIError(400, f"{where}: {first.get('msg')}", param=where)


def _install_error_handlers(app: FastAPI):
    @app.exception_handler(APIError)
    async def on_api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        return _error_response(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(exc.status_code, str(exc.detail), type=kind))

    @app.exception_handler(EngineError)
    async def on_engine_error(request: Request, exc: EngineError):
        return _error_response(APIError(500, str(exc), type="server_error"))

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception):  # logged with its traceback by the server
        return _error_response(APIError(500, f"internal error: {exc!r}", type="server_error"))


# ------------------------------------------------------------------------------------------------ request models

# OpenAI and vLLM options this server does not implement, each with a test for the values that change nothing: a
# request that sets one to any other value gets a 400 instead of an answer without it.
UNSUPPORTED_OPTIONS = {
    "best_of": lambda v: v == 1,
    "echo": lambda v: not v,
    "logprobs": lambda v: v is False,  # chat: a bool; completions: an int, where 0 asks for the sampled tokens'
    "top_logprobs": lambda v: v == 0,
    "logit_bias": lambda v: v == {},
    "suffix": lambda v: v == "",
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "repetition_penalty": lambda v: v == 1,
    "tools": lambda v: v == [],
    "functions": lambda v: v == [],
    "response_format": lambda v: v == {"type": "text"},
}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions. None means the engine's default; top_k, min_p,
    ignore_eos, stop_token_ids, min_tokens and include_stop_str_in_output are vLLM's extensions (send them in the openai
    client's `extra_body`)."""
    model_config = ConfigDict(extra="allow")  # other OpenAI options are accepted and ignored, see `check`

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    def check(self, served_model_name: str):
        if self.model != served_model_name:
            raise APIError(404, f"model {self.model!r} is not served here; this server serves {served_model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.n != 1:
            raise APIError(400, f"n={self.n}: only n=1 is supported", param="n")
        for name, changes_nothing in UNSUPPORTED_OPTIONS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and not changes_nothing(value):
                raise APIError(400, f"{name}={value!r} is not supported by this server", param=name)

    def sampling(self, max_tokens: int | None) -> dict:
        options = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": self.top_k, "min_p": self.min_p, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                   "seed": self.seed, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                   "include_stop_str_in_output": self.include_stop_str_in_output}
        return {k: v for k, v in options.items() if v is not None or k == "max_tokens"}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request: send one prompt per request",
                               param="prompt")
            prompt = prompt[0]
        return prompt


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ...: passed to the chat template as they are

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise APIError(400, "only text content parts are supported", param="messages")
            content = "\n".join(part.text or "" for part in content)  # as vLLM joins text parts
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise APIError(400, "messages is empty: a chat needs at least one message", param="messages")
        return [m.as_template_message() for m in self.messages]


# ------------------------------------------------------------------------------------------------ responses

def _usage(stream: RequestStream, num_completion_tokens: int) -> dict:
    return {"prompt_tokens": stream.num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": stream.num_prompt_tokens + num_completion_tokens}


@dataclass
class _Reply:
    """What every response object of one request shares."""
    id: str
    model: str
    created: int = field(default_factory=lambda: int(time.time()))

    def body(self, choice: dict, object: str = "text_completion", **extra) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": [choice] if choice else [], **extra}


async def _collect(stream: RequestStream, watch: _ClientWatch) -> Delta:
    """Wait for a request's last Delta (non-streaming responses)."""
    last = None
    try:
        async for last in stream.events():
            pass
    finally:
        watch.close()
    return last


def _completion_response(reply: _Reply, stream: RequestStream, last: Delta) -> dict:
    choice = {"index": 0, "text": last.final_text, "logprobs": None, "finish_reason": last.finish_reason}
    return reply.body(choice, usage=_usage(stream, last.num_completion_tokens))


def _chat_response(reply: _Reply, stream: RequestStream, last: Delta) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": last.final_text}, "logprobs": None,
              "finish_reason": last.finish_reason}
    return reply.body(choice, object="chat.completion", usage=_usage(stream, last.num_completion_tokens))


async def _completion_chunks(reply: _Reply, stream: RequestStream, include_usage: bool) -> AsyncIterator[dict]:
    num_tokens = 0
    async for delta in stream.events():
        if delta.finish_reason == "abort":
            return
        num_tokens = delta.num_completion_tokens
        yield reply.body({"index": 0, "text": delta.text, "logprobs": None,
                                "finish_reason": delta.finish_reason})
    if include_usage:
        yield reply.body({}, usage=_usage(stream, num_tokens))


async def _chat_chunks(reply: _Reply, stream: RequestStream, include_usage: bool) -> AsyncIterator[dict]:
    chunk = "chat.completion.chunk"
    yield reply.body({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}, object=chunk)
    num_tokens = 0
    async for delta in stream.events():
        if delta.finish_reason == "abort":
            return
        num_tokens = delta.num_completion_tokens
        yield reply.body({"index": 0, "delta": {"content": delta.text} if delta.text else {},
                                "logprobs": None, "finish_reason": delta.finish_reason}, object=chunk)
    if include_usage:
        yield reply.body({}, object=chunk, usage=_usage(stream, num_tokens))


def _sse_response(chunks: AsyncIterator[dict], watch: _ClientWatch) -> StreamingResponse:
    """Server-Sent Events: one `data: {json}` per chunk, then `data: [DONE]`."""
    async def body():
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except EngineError as e:  # the status line is already sent; report it in the stream
            yield f"data: {json.dumps(APIError(500, str(e), type='server_error').body)}\n\n"
        finally:
            watch.close()
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _ClientWatch:
    """Aborts a request when its client disconnects, streaming or not. A task reads the ASGI receive channel, which
    says `http.disconnect` once the client is gone (the body has been read already). Started by the handler, so it
    also covers a streaming response whose body never ran; `close()` when the response is done, or left early."""

    def __init__(self, engine: EngineLoop, stream: RequestStream, request: Request):
        self.engine = engine
        self.stream = stream
        self.task = asyncio.create_task(self._watch(request))

    async def _watch(self, request: Request):
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine.abort(self.stream)

    def close(self):
        self.task.cancel()
        if not self.stream.is_finished:
            self.engine.abort(self.stream)


# ------------------------------------------------------------------------------------------------ metrics

# (name, type, help): the name is the key in EngineLoop's snapshot; counters get Prometheus' `_total` suffix
METRICS = [
    ("num_requests_running", "gauge", "Requests in the running batch"),
    ("num_requests_waiting", "gauge", "Requests waiting to be admitted (new, or preempted by recompute)"),
    ("num_requests_swapped", "gauge", "Requests whose KV is swapped out to host memory"),
    ("prefill_throughput_tokens_per_s", "gauge", "Prefill tokens per second over the last 10 s"),
    ("decode_throughput_tokens_per_s", "gauge", "Decode tokens per second over the last 10 s"),
    ("num_gpu_blocks", "gauge", "KV blocks on the GPU (device) tier"),
    ("num_free_gpu_blocks", "gauge", "Free GPU KV blocks (prefix-cached blocks that no request holds count as free)"),
    ("gpu_kv_cache_usage_ratio", "gauge", "Fraction of GPU KV blocks held by requests"),
    ("num_cpu_blocks", "gauge", "KV blocks in the host tier (0: no host tier)"),
    ("num_free_cpu_blocks", "gauge", "Free host KV blocks (cached blocks that no swapped request holds count as free)"),
    ("cpu_kv_cache_usage_ratio", "gauge", "Fraction of host KV blocks held by swapped requests"),
    ("finished_requests", "counter", "Requests that finished (stop or length)"),
    ("aborted_requests", "counter", "Requests aborted because their client disconnected"),
    ("rejected_requests", "counter", "Requests the engine refused with HTTP 400 (prompt or sampling values)"),
    ("prefill_tokens", "counter", "Prompt tokens computed (recomputed ones included)"),
    ("decode_tokens", "counter", "Tokens computed by decode steps"),
    ("prefix_cache_hit_tokens", "counter", "Prompt tokens served from the prefix cache"),
    ("preemptions", "counter", "Preemptions (swap and recompute)"),
    ("preemptions_swap", "counter", "Preemptions by swapping KV out to host memory"),
    ("preemptions_recompute", "counter", "Preemptions by recompute"),
    ("recomputed_tokens", "counter", "Tokens computed again after a recompute preemption"),
    ("blocks_swapped_out", "counter", "KV blocks copied GPU -> host"),
    ("blocks_swapped_in", "counter", "KV blocks copied host -> GPU"),
    ("bytes_swapped_out", "counter", "Bytes copied GPU -> host (all ranks)"),
    ("bytes_swapped_in", "counter", "Bytes copied host -> GPU (all ranks)"),
    ("swap_seconds", "counter", "Seconds spent in swap copies"),
    ("swap_exposed_seconds", "counter", "Swap copy seconds not hidden behind compute"),
    ("host_prefix_query_tokens", "counter", "Prompt tokens looked up in the host prefix cache"),
    ("host_prefix_hit_tokens", "counter", "Prompt tokens served from the host prefix cache"),
    ("blocks_offloaded", "counter", "Cached KV blocks copied to the host prefix cache"),
    ("blocks_onloaded", "counter", "Host prefix-cache blocks copied back to the GPU"),
]


def format_metrics(snapshot: dict) -> str:
    """Prometheus text exposition format, every name prefixed with `nanovllm_`."""
    lines = []
    for name, kind, help in METRICS:
        full_name = f"nanovllm_{name}_total" if kind == "counter" else f"nanovllm_{name}"
        lines += [f"# HELP {full_name} {help}", f"# TYPE {full_name} {kind}", f"{full_name} {snapshot[name]}"]
    return "\n".join(lines) + "\n"


def _usage_ratio(num_blocks: int, num_free: int) -> float:
    return (num_blocks - num_free) / num_blocks if num_blocks else 0.0


# ------------------------------------------------------------------------------------------------ the app

def build_app(llm: LLM, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The FastAPI app. Its lifespan starts the engine loop thread and stops it (aborting what is in flight);
    closing `llm` stays with the caller."""
    engine = EngineLoop(llm)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="nanovllm", lifespan=lifespan)
    app.state.engine = engine
    _install_error_handlers(app)
    if api_key is not None:
        app.add_middleware(_APIKeyCheck, api_key=api_key)
    _add_routes(app, engine, served_model_name, llm.config.max_model_len)
    return app


class _APIKeyCheck:
    """ASGI middleware: every /v1 route needs `Authorization: Bearer <api_key>`; /health and /metrics stay open.
    It answers before the body is read, so an unauthorized request gets 401 whatever it carries."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.expected):
                error = APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                 type="authentication_error", code="invalid_api_key")
                return await _error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


def _add_routes(app: FastAPI, engine: EngineLoop, served_model_name: str, max_model_len: int):
    @app.get("/health")
    async def health():
        if not engine.is_alive:
            raise APIError(503, engine.broken or "the engine loop is not running", type="server_error")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(format_metrics(await engine.snapshot()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": 0,
                                            "owned_by": "nanovllm", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check(served_model_name)
        generate = GenerateRequest(prompt=body.single_prompt(), sampling=body.sampling(body.max_tokens))
        stream = await _submit(engine, generate)
        reply, watch = _Reply(f"cmpl-{uuid.uuid4().hex}", served_model_name), _ClientWatch(engine, stream, request)
        if body.stream:
            return _sse_response(_completion_chunks(reply, stream, body.include_usage), watch)
        return _completion_response(reply, stream, await _collect(stream, watch))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check(served_model_name)
        generate = GenerateRequest(messages=body.template_messages(),
                                   sampling=body.sampling(body.max_tokens if body.max_completion_tokens is None
                                                         else body.max_completion_tokens))
        stream = await _submit(engine, generate)
        reply, watch = _Reply(f"chatcmpl-{uuid.uuid4().hex}", served_model_name), _ClientWatch(engine, stream, request)
        if body.stream:
            return _sse_response(_chat_chunks(reply, stream, body.include_usage), watch)
        return _chat_response(reply, stream, await _collect(stream, watch))


async def _submit(engine: EngineLoop, request: GenerateRequest) -> RequestStream:
    try:
        return await engine.submit(request)
    except ValueError as e:  # the engine's own validation: the message names the problem
        raise APIError(400, str(e)) from None
    except EngineError as e:  # the engine is broken (see EngineLoop._step)
        raise APIError(503, str(e), type="server_error") from None


# ------------------------------------------------------------------------------------------------ entry points

def serve(args: argparse.Namespace, model: str, engine_kwargs: dict) -> int:
    """Load the model, then serve until Ctrl-C or SIGTERM; `nanovllm serve` calls this."""
    from nanovllm import LLM

    name = args.served_model_name or model
    if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without --api-key: anyone who can reach it can use it", args.host)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again; leave through the `with`
    # either way, so the LLM releases its caches and worker processes
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with LLM(model, **engine_kwargs) as llm:
            app = build_app(llm, name, api_key=args.api_key)
            engine = app.state.engine
            server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level), engine)
            print(f"nanovllm: serving {name!r} on http://{args.host}:{args.port}/v1", flush=True)
            try:
                server.run()
            finally:  # a forced exit (a second Ctrl-C) skips the app's shutdown: the loop must not step a closed LLM
                engine.stop()
    except KeyboardInterrupt:
        pass
    return 0


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


def main(argv: list[str] | None = None) -> int:
    """`python -m nanovllm.entrypoints.server ARGS` is `nanovllm serve ARGS`."""
    import sys

    from nanovllm.entrypoints.cli import main as cli_main
    return cli_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    raise SystemExit(main())
