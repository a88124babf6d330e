"""The engine loop: one thread that owns the LLM, adds and aborts requests, steps the engine and publishes each
request's new tokens to its handler.

Handlers never touch the engine: they put commands on the loop's inbox (a thread-safe queue) and read token deltas
from a per-request asyncio queue that the loop thread fills with `loop.call_soon_threadsafe`. See docs/server.md.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Callable

from nanovllm.engine.output_processor import DeltaCursor, StreamDelta
from nanovllm.engine.request_intake import CheckedRequest
from nanovllm.entrypoints.server.metrics import LatencyHistograms, Throughput, usage_ratio

if TYPE_CHECKING:
    from nanovllm.llm import LLM

logger = logging.getLogger("nanovllm.server")


@dataclass
class Delta:
    """A request's new output since its previous Delta: the engine's StreamDelta (the output processor's, as
    generate_stream sends it) and, on the last one, the whole completion exactly as the non-streaming API returns
    it. The last Delta has `finish_reason` set ("abort" when the request was aborted)."""
    stream: StreamDelta
    final_text: str | None = None  # the last Delta's: the whole text
    final_logprobs: list | None = None  # the last Delta's: all the completion's logprobs (when asked for)
    final_prompt_logprobs: list | None = None  # the last Delta's: the prompt's (when asked for; the first sample's)
    stop_reason: int | str | None = None  # the last Delta's: the stop token id or stop string that ended it (vLLM's)

    @property
    def text(self) -> str:
        return self.stream.text

    @property
    def num_completion_tokens(self) -> int:  # tokens generated so far, this delta's included
        return self.stream.num_completion_tokens

    @property
    def finish_reason(self) -> str | None:
        return self.stream.finish_reason

    @property
    def logprobs(self) -> list | None:  # SamplingParams.logprobs asked: this delta's tokens' {token_id: Logprob}
        return self.stream.logprobs


class EngineError(RuntimeError):
    """The engine failed a step; every request in flight gets this instead of its next Delta."""


class RequestStream:
    """The handler's end of one request. The loop thread calls `put` (thread-safe); the handler iterates `events`.

    NOTE: the loop thread writes `seq_id` and `prompt_token_ids` before `EngineLoop.submit` returns the stream;
    after that only the loop thread reads `seq_id` (the handler just passes the stream back to abort it).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._events: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self.seq_id: int | None = None
        self.prompt_token_ids: list[int] = []
        self.is_finished = False  # the handler has seen the last Delta

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

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
    cursor: DeltaCursor = field(default_factory=DeltaCursor)


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
        self._latency = LatencyHistograms()
        self.num_finished_requests = 0
        self.num_aborted_requests = 0
        self.num_rejected_requests = 0  # refused by prepare() or the engine's validation (HTTP 400)
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

    async def submit(self, request: CheckedRequest) -> RequestStream:
        """Queue a request (one sample: CheckedRequest.samples' items); raises ValueError (nothing queued) when the
        engine refuses it."""
        stream = RequestStream(asyncio.get_running_loop())
        try:
            await self._call(self._add, stream, request)
        except asyncio.CancelledError:
            self.abort(stream)  # the add may have run already
            raise
        return stream

    def count_rejected(self):
        """Count a request refused before it reached the loop (see prepare.py), on the loop thread that owns the
        counter."""
        self._inbox.put((self._count_rejected, (), None))

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

    def _add(self, stream: RequestStream, request: CheckedRequest):
        if self.broken is not None:
            raise EngineError(self.broken)
        try:
            stream.seq_id = self.llm.add_checked_request(request)  # checked by prepare(), off this thread
        except ValueError:
            self.num_rejected_requests += 1
            raise
        stream.prompt_token_ids = request.token_ids
        self._active[stream.seq_id] = _Active(stream)

    def _count_rejected(self):
        self.num_rejected_requests += 1

    def _abort(self, stream: RequestStream):
        if self._active.pop(stream.seq_id, None) is None:
            return  # never added, already finished, or already aborted
        self.llm.abort_request(stream.seq_id)
        self.num_aborted_requests += 1
        stream.put(Delta(StreamDelta.aborted(), final_text=""))

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
            if self.llm.config.tensor_parallel_size > 1:
                self.broken = f"a tensor-parallel step failed ({e!r}); the ranks are out of step: restart the server"
            self._fail_all(EngineError(f"the engine failed a step: {e!r}"))

    def _sample_throughput(self):
        stats = self.llm.scheduler.stats
        self._throughput.add(time.monotonic(), stats.prefill_tokens, stats.decode_tokens)

    def _publish(self, active: _Active):
        """Send the tokens and text that are new since the last Delta; on the last one, forget the request."""
        seq_id = active.stream.seq_id
        seq = self.llm.requests[seq_id]
        stream_delta = self.llm.output_processor.delta(seq, active.cursor)
        if stream_delta is None:
            return
        delta = Delta(stream_delta)
        if seq.is_finished:
            delta.stop_reason = seq.stop_reason
            output = self.llm.output(self.llm.requests.pop(seq_id))
            delta.final_text, delta.final_logprobs = output["text"], output["logprobs"]
            delta.final_prompt_logprobs = output["prompt_logprobs"]
            self._latency.observe(output["metrics"])
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
            "gpu_kv_cache_usage_ratio": usage_ratio(stats["num_gpu_blocks"], num_free_gpu_blocks),
            "num_free_cpu_blocks": num_free_cpu_blocks,
            "cpu_kv_cache_usage_ratio": usage_ratio(stats["num_cpu_blocks"], num_free_cpu_blocks),
            "finished_requests": self.num_finished_requests,
            "aborted_requests": self.num_aborted_requests,
            "rejected_requests": self.num_rejected_requests,
            **self._latency.snapshot(),
        }
