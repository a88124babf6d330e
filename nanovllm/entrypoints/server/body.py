"""A request body from bytes to a checked pydantic model, with large bodies parsed off the event loop.

FastAPI parses and validates a body on the asyncio thread: for a body of megabytes (a prompt of a million token
ids, a long `messages` list, piles of unknown fields) that stalls every other stream for as long as it takes. Here
a body over OFF_LOOP_BYTES is parsed in a worker thread. A worker thread still holds the GIL through each C call
(json.loads, pydantic's validation), so the body's shape is checked first, in numpy (json_shape), and a body that
could only be refused is refused before it is parsed:
- nesting deeper than MAX_JSON_DEPTH;
- more than MAX_JSON_MEMBERS object members in all (a long `messages` list, unknown fields by the thousand);
- more array items than a prompt of max_model_len token ids and MAX_JSON_MEMBERS more (`app.state.max_json_items`).
And the walk that looks for lone surrogates (protocol.find_unencodable) runs only when the body holds a surrogate
escape (`\\ud800`-`\\udfff`): UTF-8 bytes cannot encode one, so a body without that escape has none.
"""
from __future__ import annotations

import asyncio
import json
import re
from typing import Annotated

import numpy as np
from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from nanovllm.entrypoints.server.protocol import APIError, ChatCompletionRequest, CompletionRequest

OFF_LOOP_BYTES = 64 * 1024  # smaller bodies parse in well under a millisecond: the thread hop would cost more
# An OpenAI body nests about 5 deep (messages, content parts, their fields); 32 leaves room for tool schemas
MAX_JSON_DEPTH = 32
# object members in the whole body: a message has 2 or 3, so this allows ~10,000 messages; pydantic builds each
# one holding the GIL (about 5 us each)
MAX_JSON_MEMBERS = 32768
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_COLON, _COMMA = 2, 3
_CODES = np.zeros(256, np.int8)  # per byte: 1 opens a container, -1 closes one, _COLON, _COMMA; 0 anything else
_CODES[list(b"[{")], _CODES[list(b"]}")], _CODES[ord(":")], _CODES[ord(",")] = 1, -1, _COLON, _COMMA


def json_body(model: type[BaseModel]):
    """A FastAPI dependency: the request's body as `model`, checked as FastAPI would (a RequestValidationError for
    bad JSON or fields) and parsed in a worker thread when large."""
    async def parse(request: Request) -> BaseModel:
        raw = await request.body()
        max_items = getattr(request.app.state, "max_json_items", None)
        if len(raw) <= OFF_LOOP_BYTES:
            return parse_body(raw, model, max_items)
        return await asyncio.to_thread(parse_body, raw, model, max_items)
    return parse


def parse_body(raw: bytes, model: type[BaseModel], max_items: int | None = None) -> BaseModel:
    """Bytes -> model: UTF-8, then the shape (check_shape), then json.loads, then pydantic (strict, with the
    surrogate walk only where a surrogate escape is)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _json_error(e.start, f"the body is not UTF-8 ({e.reason})") from None
    check_shape(raw, max_items)
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise _json_error(getattr(e, "pos", 0), getattr(e, "msg", str(e))) from None
    context = {"may_hold_surrogates": _SURROGATE_ESCAPE.search(raw) is not None}
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def check_shape(raw: bytes, max_items: int | None):
    """APIError 400 for a body nested too deep or too large to be a request this server can serve."""
    depth, num_members, num_items = json_shape(raw)
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the request body nests JSON {depth} deep, more than {MAX_JSON_DEPTH}",
                       code="invalid_json")
    if num_members > MAX_JSON_MEMBERS:
        raise APIError(400, f"the request body has {num_members:,} JSON object members, more than "
                            f"{MAX_JSON_MEMBERS:,} (a messages list that long cannot be served)", code="invalid_json")
    if max_items is not None and num_items > max_items:
        raise APIError(400, f"the request body has about {num_items:,} JSON array items, more than a prompt of "
                            f"max_model_len token ids needs ({max_items:,} in all); shorten it", code="invalid_json")


def json_shape(raw: bytes) -> tuple[int, int, int]:
    """(deepest nesting, object members, about the array items) of a JSON text, counted without parsing it, in numpy
    (whose loops let other threads run: a 7 MiB body holds the GIL for about 10 ms at a time). Quotes that are not
    escaped (after an even run of backslashes) bound the strings; the structural characters outside them are
    counted. For malformed JSON the numbers are rough; json.loads then names the error."""
    chars = np.frombuffer(raw, np.uint8)
    quotes = np.flatnonzero(chars == _QUOTE)
    if len(quotes) and raw.find(b"\\") >= 0:
        positions = np.arange(len(chars), dtype=np.int64)
        last_plain = np.maximum.accumulate(np.where(chars == _BACKSLASH, -1, positions))  # last non-backslash
        num_backslashes = quotes - 1 - last_plain[np.maximum(quotes - 1, 0)]
        num_backslashes[quotes == 0] = 0
        quotes = quotes[num_backslashes % 2 == 0]
    codes = _CODES[chars]
    marks = np.flatnonzero(codes)
    if len(quotes):
        marks = marks[np.searchsorted(quotes, marks) % 2 == 0]  # outside strings: an even number of quotes before
    codes = codes[marks]
    num_members = int(np.count_nonzero(codes == _COLON))
    num_items = int(np.count_nonzero(codes == _COMMA)) + 1 - num_members
    depth = np.cumsum(np.where(np.abs(codes) == 1, codes, 0), dtype=np.int64)
    return int(depth.max(initial=0)), num_members, num_items


def _json_error(position: int, reason: str) -> RequestValidationError:
    """FastAPI's own error for a body that is not JSON (app.py's handler words it)."""
    return RequestValidationError([{"type": "json_invalid", "loc": ("body", position), "msg": "JSON decode error",
                                    "input": {}, "ctx": {"error": reason}}])


CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest))]
ChatBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest))]
