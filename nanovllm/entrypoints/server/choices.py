"""A request's choices: one engine request per (prompt, sample), submitted together, numbered as OpenAI and vLLM
number them (prompt-major: choice prompt_index * n + sample_index), and their Deltas merged as they come.

Sample i of a prompt runs with seed + i when the request has a seed (nanovllm/engine/parallel_sampling.py), so
choice i repeats alone with that seed; the samples of one prompt share its KV blocks through the prefix cache.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, AsyncIterator

from nanovllm.entrypoints.server.engine_loop import Delta, EngineError, EngineLoop, RequestStream
from nanovllm.entrypoints.server.prepare import prepare
from nanovllm.entrypoints.server.protocol import APIError

if TYPE_CHECKING:
    from nanovllm.llm import LLM


async def submit_choices(engine: EngineLoop, preparers: ThreadPoolExecutor, llm: LLM, inputs: list[dict],
                         sampling: dict) -> list[RequestStream]:
    """Prepare each prompt (`inputs`: prepare()'s prompt= or messages= per prompt) in a worker thread (tokenizing can
    take seconds: never on the engine loop's thread), then hand its samples to the loop. All or nothing: when one
    is refused, the ones already added are aborted."""
    loop = asyncio.get_running_loop()
    try:
        requests = [await loop.run_in_executor(preparers, lambda kw=kw: prepare(llm, **kw, sampling=sampling))
                    for kw in inputs]
    except ValueError as e:  # the message names the problem
        engine.count_rejected()
        raise APIError(400, str(e)) from None
    streams = []
    try:
        for request in requests:
            for sample in request.samples():
                streams.append(await engine.submit(sample))
    except BaseException as e:
        for stream in streams:
            engine.abort(stream)
        if isinstance(e, ValueError):  # the engine's own validation
            raise APIError(400, str(e)) from None
        if isinstance(e, EngineError):  # the engine is broken (see EngineLoop._step)
            raise APIError(503, str(e), type="server_error") from None
        raise
    return streams


async def merged_events(streams: list[RequestStream]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, Delta) of all the streams, in the order they arrive; an engine error ends it."""
    if len(streams) == 1:
        async for delta in streams[0].events():
            yield 0, delta
        return
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream):
        try:
            async for delta in stream.events():
                arrivals.put_nowait((index, delta))
        except Exception as error:  # noqa: BLE001 -- handed to the reader, which raises it
            arrivals.put_nowait((index, error))
            return
        arrivals.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            index, item = await arrivals.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def usage(streams: list[RequestStream], num_completion_tokens: int, n: int) -> dict:
    """OpenAI's usage: each prompt's tokens once (its n samples share it), every choice's completion tokens."""
    num_prompt_tokens = sum(stream.num_prompt_tokens for stream in streams[::n])
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}
