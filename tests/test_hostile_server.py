"""Hostile requests against a live server (SmolLM2-135M on the CPU, as in test_server.py): each gets a clear 4xx,
the connection it came on stays usable (or the answer says `Connection: close`), other streams keep flowing, and
the server keeps serving afterwards.

One server for the module, with an API key and the default body cap (8 MiB).
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from conftest import close_llm, serving, smollm2_llm_kwargs  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.entrypoints.server import DEFAULT_MAX_REQUEST_BYTES, build_app  # noqa: E402
from nanovllm.entrypoints.server import choices as choices_module  # noqa: E402
from nanovllm.entrypoints.server.app import check_serve_args  # noqa: E402
from nanovllm.entrypoints.server.protocol import (  # noqa: E402
    MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS)

API_KEY = "hostile-key"
MODEL = "smollm2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_GAP_S = 0.5  # the longest pause another stream may see between chunks while a hostile request is refused
# the stream's usual gaps are measured over this long before the hostile request: 5-10 decode steps of SmolLM2 on a
# busy CPU (the stream keeps a core busy the whole time, so every second of it costs the suite a CPU-second)
BASELINE_S = 0.5


@pytest.fixture(scope="module")
def server(smollm2_dir):
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(max_num_seqs=8, num_kvcache_blocks=128))
    try:
        with serving(build_app(llm, MODEL, api_key=API_KEY)) as port:
            yield port
    finally:
        close_llm(llm)


@pytest.fixture
def base_url(server) -> str:
    return f"http://127.0.0.1:{server}"


def post(base_url: str, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base_url}{path}", content=content, timeout=180,
                      headers={**AUTH, "Content-Type": "application/json"}, **kw)


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}


def assert_still_serving(base_url: str):
    r = post(base_url, "/v1/completions", completion(prompt="The capital of France is", max_tokens=4,
                                                    temperature=0, ignore_eos=True))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    assert httpx.get(f"{base_url}/health").json() == {"status": "ok"}


class StreamTimer(threading.Thread):
    """Reads one long stream and records when each chunk arrived. Once a chunk arrives after `stop_after` (a
    time.monotonic() the test sets when it has seen what it measures), the timer hangs up: the server aborts the
    rest, so a test pays for the seconds it watches, not for all max_tokens decode steps."""

    def __init__(self, base_url: str, max_tokens: int = 400):
        super().__init__(daemon=True)
        self.base_url, self.max_tokens = base_url, max_tokens
        self.arrivals: list[float] = []
        self.started = threading.Event()
        self.stop_after = float("inf")

    def run(self):
        body = completion(prompt="Once upon a time", max_tokens=self.max_tokens, ignore_eos=True, stream=True)
        with httpx.stream("POST", f"{self.base_url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.arrivals.append(time.monotonic())
                    if len(self.arrivals) == 3:
                        self.started.set()
                    if self.arrivals[-1] > self.stop_after:
                        return  # leaving the `with` closes the connection

    def longest_gap_s(self, start: float, end: float) -> float:
        times = [t for t in self.arrivals if start <= t <= end]
        return max((b - a for a, b in zip(times, times[1:])), default=float("inf"))


def refuse_while_streaming(base_url: str, refuse, may_take_most: bool = False) -> httpx.Response:
    """Run `refuse()` (a hostile request) while another stream runs; returns its response. The stream's longest
    gap between chunks, from just before the request until a while after its answer, may not pass MAX_GAP_S, nor
    twice its longest gap in the BASELINE_S before (on a machine shared with other work, steps alone can take a good
    part of MAX_GAP_S). With `may_take_most`, a request that keeps a core busy for seconds may also slow the
    stream's steps, up to 3/4 of its own time: starved of a core, not held up for the whole of it."""
    timer = StreamTimer(base_url)
    timer.start()
    assert timer.started.wait(60), "the stream did not start"
    time.sleep(BASELINE_S)
    start = time.monotonic()
    response = refuse()
    answered = time.monotonic()
    time.sleep(0.5)  # a stall shows as a gap after the answer too
    end = time.monotonic()
    timer.stop_after = end
    timer.join(180)
    assert timer.arrivals[-1] > end, "the stream ended before the hostile request was answered: make it longer"
    gap_s, usual_gap_s = timer.longest_gap_s(start - 0.2, end), timer.longest_gap_s(start - BASELINE_S, start)
    limit_s = max(MAX_GAP_S, 2 * usual_gap_s, 0.75 * (answered - start) if may_take_most else 0)
    assert gap_s < limit_s, (f"another stream paused {gap_s:.2f} s (before: {usual_gap_s:.2f} s; the request took "
                             f"{answered - start:.2f} s)")
    return response


# ------------------------------------------------------------------------------------------------ size

def test_a_10_mb_body_gets_413_and_other_streams_keep_flowing(base_url):
    body = json.dumps(completion(prompt="hello " * (10_000_000 // 6))).encode()
    assert len(body) > DEFAULT_MAX_REQUEST_BYTES
    response = refuse_while_streaming(base_url, lambda: post(base_url, "/v1/completions", body))
    assert response.status_code == 413, response.text
    assert "--max-request-bytes" in response.json()["error"]["message"]
    assert response.headers.get("connection") == "close"  # the unread body leaves the connection unusable
    assert_still_serving(base_url)


def test_a_body_without_content_length_is_cut_off_at_the_cap(base_url):
    def chunks():
        for _ in range(10):
            yield b" " * 1_000_000
    r = httpx.post(f"{base_url}/v1/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.headers.get("connection") == "close", r.text
    assert_still_serving(base_url)


def test_a_long_prompt_under_the_cap_is_tokenized_off_the_engine_thread(base_url, monkeypatch):
    """1 MB of text takes a second or more to tokenize: on the engine loop's thread that stalled every stream for
    all of it. Tokenized in a worker thread, it can still take a core from the steps on a small machine."""
    prepare_module = sys.modules["nanovllm.entrypoints.server.prepare"]  # the package exports a function of that name
    threads = []

    def tokenize(*args):
        threads.append(threading.current_thread().name)
        return real(*args)
    real = prepare_module.prompt_token_ids
    monkeypatch.setattr(prepare_module, "prompt_token_ids", tokenize)
    body = completion(prompt="hello world " * 90_000)
    response = refuse_while_streaming(base_url, lambda: post(base_url, "/v1/completions", body), may_take_most=True)
    assert response.status_code == 400 and "max_model_len" in response.json()["error"]["message"], response.text
    assert threads and all(name.startswith("nanovllm-prepare") for name in threads), threads


@pytest.mark.parametrize("fields, message", [
    (dict(stop=["x"] * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} items"),
    (dict(stop="x" * (MAX_STOP_STRING_CHARS + 1)), f"at most {MAX_STOP_STRING_CHARS} characters"),
    (dict(stop=["y" * (MAX_STOP_STRING_CHARS + 1)]), f"at most {MAX_STOP_STRING_CHARS} characters"),
    (dict(stop_token_ids=[5] * (MAX_STOP_TOKEN_IDS + 1)), f"at most {MAX_STOP_TOKEN_IDS} items"),
])
def test_too_many_or_too_long_stop_strings_get_400(base_url, fields, message):
    r = post(base_url, "/v1/completions", completion(**fields))
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------------------------------ lone surrogates

SURROGATE_BODIES = {
    "prompt": b'{"model": "smollm2", "prompt": "x\\ud800y", "max_tokens": 2}',
    "prompt list": b'{"model": "smollm2", "prompt": ["\\udfff"], "max_tokens": 2}',
    "stop": b'{"model": "smollm2", "prompt": "Hi", "stop": ["\\ud800"], "max_tokens": 2}',
    "chat content": b'{"model": "smollm2", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
    "chat part": b'{"model": "smollm2", "messages": [{"role": "user", "content": [{"type": "text", '
                 b'"text": "a\\udc00"}]}], "max_tokens": 2}',
    "chat name": b'{"model": "smollm2", "messages": [{"role": "user", "content": "hi", "name": "\\ud800"}], '
                 b'"max_tokens": 2}',
}


def keep_alive_pair(port: int, method: str, path: str, body: bytes | None) -> tuple[int, dict, bytes, int]:
    """Send a request, then a plain GET /health on the same connection; returns the first answer's status, headers
    and body, and the second answer's status (0 when the connection was dropped under it)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path, body=body, headers={**AUTH, "Content-Type": "application/json"})
        first = conn.getresponse()
        status, headers, data = first.status, {k.lower(): v for k, v in first.getheaders()}, first.read()
        if headers.get("connection") == "close":
            return status, headers, data, -1  # the server said so: the client opens a new connection
        try:
            conn.request("GET", "/health")
            return status, headers, data, conn.getresponse().status
        except (ConnectionError, http.client.HTTPException):
            return status, headers, data, 0
    finally:
        conn.close()


@pytest.mark.parametrize("where", list(SURROGATE_BODIES))
def test_a_lone_surrogate_is_a_400_on_a_connection_that_stays_usable(server, where):
    path = "/v1/chat/completions" if where.startswith("chat") else "/v1/completions"
    status, _, data, next_status = keep_alive_pair(server, "POST", path, SURROGATE_BODIES[where])
    assert status == 400 and "lone surrogate" in json.loads(data)["error"]["message"], data
    assert next_status == 200


def test_an_internal_error_is_a_500_on_a_connection_that_stays_usable(server, monkeypatch, caplog):
    def broken_prepare(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(choices_module, "prepare", broken_prepare)  # where a request's choices are prepared
    body = json.dumps(completion()).encode()
    with caplog.at_level(logging.ERROR, logger="nanovllm.server"):
        status, _, data, next_status = keep_alive_pair(server, "POST", "/v1/completions", body)
    assert status == 500 and "a bug" in json.loads(data)["error"]["message"], data
    assert next_status == 200, "the server dropped the keep-alive connection without saying Connection: close"
    assert "a bug" in caplog.text  # logged with its traceback


# ------------------------------------------------------------------------------------------------ strict types

@pytest.mark.parametrize("fields, param", [
    (dict(max_tokens=True), "max_tokens"),
    (dict(max_tokens="8"), "max_tokens"),
    (dict(max_tokens=8.0), "max_tokens"),
    (dict(prompt=[True, False]), "prompt"),
    (dict(prompt=[1.0, 2.0]), "prompt"),
    (dict(prompt=[[1.0]]), "prompt"),
    (dict(seed="1"), "seed"),
    (dict(top_k=2.0), "top_k"),
    (dict(min_tokens=False), "min_tokens"),
    (dict(stop_token_ids=[2.0]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(ignore_eos=1), "ignore_eos"),
    (dict(stream="yes"), "stream"),
    (dict(n=1.0), "n"),
    (dict(stop=5), "stop"),
])
def test_no_coercion_into_integers_token_ids_or_flags(base_url, fields, param):
    r = post(base_url, "/v1/completions", completion(**fields))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text


def test_chat_fields_are_strict_too(base_url):
    for message in ({"role": "user", "content": 5}, {"role": "user", "content": [{"type": "text", "text": 1}]}):
        r = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": [message], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages"), r.text
    r = post(base_url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                "max_completion_tokens": "3"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


def test_a_float_field_still_takes_an_integer(base_url):
    r = post(base_url, "/v1/completions", completion(temperature=0, top_p=1, min_p=0))
    assert r.status_code == 200, r.text


# ------------------------------------------------------------------------------------------------ auth and pages

def test_with_an_api_key_only_health_and_metrics_are_open(base_url):
    for path in ("/openapi.json", "/v1/models", "/docs", "/redoc"):
        assert httpx.get(f"{base_url}{path}").status_code == 401, path
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert httpx.get(f"{base_url}/metrics").status_code == 200
    assert httpx.get(f"{base_url}/openapi.json", headers=AUTH).status_code == 200


def test_no_page_loads_scripts_from_a_cdn(base_url):
    for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        r = httpx.get(f"{base_url}{path}", headers=AUTH)
        assert r.status_code == 404 and "<script" not in r.text, (path, r.text[:200])


def test_an_empty_api_key_is_refused():
    with pytest.raises(ValueError, match="empty"):
        build_app(None, MODEL, api_key="")  # refused before the app looks at the engine
    for key in ("", "  "):
        args = argparse.Namespace(api_key=key, host="127.0.0.1", max_request_bytes=None)
        with pytest.raises(ValueError, match="--api-key is empty"):
            check_serve_args(args)


def test_the_cli_refuses_a_missing_chat_template_before_loading(monkeypatch, capsys, qwen3_dir):
    from nanovllm.entrypoints import cli
    loaded = []
    monkeypatch.setattr("nanovllm.LLM", lambda *a, **k: loaded.append(a))
    assert cli.main(["serve", qwen3_dir, "--chat-template", "no/such.jinja"]) == 2
    assert "--chat-template='no/such.jinja' is neither a readable file" in capsys.readouterr().err and not loaded


def test_the_cli_refuses_an_empty_api_key_before_loading(monkeypatch, capsys, qwen3_dir):
    from nanovllm.entrypoints import cli
    loaded = []
    monkeypatch.setattr("nanovllm.LLM", lambda *a, **k: loaded.append(a))
    monkeypatch.delenv("NANOVLLM_API_KEY", raising=False)
    assert cli.main(["serve", qwen3_dir, "--api-key", "", "--host", "0.0.0.0"]) == 2
    assert "--api-key is empty" in capsys.readouterr().err and not loaded


@pytest.mark.parametrize("env_key", [None, ""])
def test_a_non_loopback_bind_without_a_key_warns(monkeypatch, caplog, capsys, qwen3_dir, env_key):
    """No --api-key, and $NANOVLLM_API_KEY unset or empty: served without a key, with the warning."""
    from nanovllm.entrypoints import cli

    def stop_before_loading(*args, **kwargs):
        raise ValueError("not loading in this test")
    monkeypatch.setattr("nanovllm.LLM", stop_before_loading)
    if env_key is None:
        monkeypatch.delenv("NANOVLLM_API_KEY", raising=False)
    else:
        monkeypatch.setenv("NANOVLLM_API_KEY", env_key)
    with caplog.at_level(logging.WARNING, logger="nanovllm.server"):
        assert cli.main(["serve", qwen3_dir, "--host", "0.0.0.0"]) == 2
    assert "without --api-key" in caplog.text and "not loading" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ large bodies

BODY_BYTES = 7 * 1024 * 1024  # under the 8 MiB cap: parsed, not refused for its size


def sized_body(head: dict, field: str, item: str, num_bytes: int = BODY_BYTES) -> bytes:
    """`head` as JSON with `field` holding a JSON array of `item` repeated up to num_bytes."""
    prefix = json.dumps(head)[:-1].encode() + f', "{field}": ['.encode()
    num_items = (num_bytes - len(prefix)) // (len(item) + 1)
    return prefix + ",".join([item] * num_items).encode() + b"]}"


LARGE_BODIES = {  # built once, before any timing: building them holds the GIL the server's thread needs
    "token ids": lambda: ("/v1/completions", sized_body({"model": MODEL, "max_tokens": 2}, "prompt", "12345")),
    "messages": lambda: ("/v1/chat/completions", sized_body(
        {"model": MODEL, "max_tokens": 2}, "messages", json.dumps({"role": "user", "content": "hi"}))),
    "unknown fields": lambda: ("/v1/completions", json.dumps(
        completion(**{f"x{i}": {"a": [1, {"b": "c"}]} for i in range(BODY_BYTES // 32)})).encode()),
    "a long unknown list": lambda: ("/v1/completions", sized_body(completion(), "extra", "[1, 2.5, \"x\"]")),
    "deep nesting": lambda: ("/v1/completions", json.dumps(completion())[:-1].encode() + b', "x": '
                             + b"[" * (BODY_BYTES // 2) + b"]" * (BODY_BYTES // 2) + b"}"),
    "a long unknown string": lambda: ("/v1/completions", json.dumps(completion(x="y" * BODY_BYTES)).encode()),
}
LARGE_BODY_ERRORS = {"token ids": "max_model_len", "messages": "object members", "unknown fields": "object members",
                     "a long unknown list": "max_model_len", "deep nesting": "nests JSON"}


@pytest.mark.parametrize("kind", list(LARGE_BODIES))
def test_a_large_body_of_any_kind_is_parsed_without_stalling_other_streams(base_url, kind):
    """JSON parsing and pydantic validation of a 7 MiB body ran on the event loop: a victim stream paused for
    seconds. Now large bodies are parsed in a worker thread, and shapes that could only be refused, and would hold
    the GIL for long (deep nesting, many object members, more array items than max_model_len), are refused before
    they are parsed."""
    path, body = LARGE_BODIES[kind]()
    assert DEFAULT_MAX_REQUEST_BYTES > len(body) > 6 * 1024 * 1024
    response = refuse_while_streaming(base_url, lambda: post(base_url, path, body))
    if kind in LARGE_BODY_ERRORS:
        assert response.status_code == 400 and LARGE_BODY_ERRORS[kind] in response.json()["error"]["message"], \
            response.text
    else:
        assert response.status_code == 200, response.text
    assert_still_serving(base_url)


def test_large_bodies_still_get_the_same_answers(base_url):
    """Past the thread hop: a valid large body is served, bad JSON and bad fields are the same 400s."""
    good = completion(prompt="The capital of France is", max_tokens=2, padding="x" * 100_000)
    assert post(base_url, "/v1/completions", good).status_code == 200
    r = post(base_url, "/v1/completions", json.dumps(good).encode()[:-5])
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text
    r = post(base_url, "/v1/completions", dict(good, max_tokens="2"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    r = post(base_url, "/v1/completions", dict(good, prompt="x\ud800"))
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------------------------------ 413 seen

def test_the_413_reaches_a_client_still_sending(base_url):
    """The server answered before reading the body and closed: httpx, still sending, saw a reset. The rest of the
    body is now read and dropped first; with and without a Content-Length."""
    body = b" " * (20 * 1024 * 1024)
    for _ in range(3):
        r = httpx.post(f"{base_url}/v1/completions", content=body, timeout=60,
                       headers={**AUTH, "Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text

    def chunks():
        for _ in range(20):
            yield b" " * 1_000_000
    r = httpx.post(f"{base_url}/v1/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413, r.text


@pytest.mark.parametrize("pause_s", [0.0, 0.5])
def test_an_over_cap_upload_is_not_reset_under_the_client(server, pause_s):
    """Closing on an unread body resets the connection: a client still sending gets ECONNRESET from its write
    (and, where the reset wins the race with the answer, never reads the 413; the openai client then sends the
    body again). The server now reads and drops the rest first: the whole upload goes through, then the 413."""
    import socket
    num_bytes = 20 * 1024 * 1024
    with socket.create_connection(("127.0.0.1", server), timeout=60) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {num_bytes}\r\n\r\n".encode())
        sock.sendall(b" " * (1 << 20))
        time.sleep(pause_s)  # 0.5 s: the server has answered and closed before the rest is sent
        sock.sendall(b" " * (num_bytes - (1 << 20)))  # raised ConnectionResetError
        assert sock.recv(65536).split(b"\r\n")[0] == b"HTTP/1.1 413 Request Entity Too Large"


def test_the_openai_client_sees_the_413_and_uploads_once(base_url):
    """The openai client took the reset for a network error and sent the whole body twice more."""
    openai = pytest.importorskip("openai")
    uploads = []
    http_client = httpx.Client(event_hooks={"request": [lambda request: uploads.append(request.url.path)]})
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, http_client=http_client, max_retries=2)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt="hello " * 2_000_000, max_tokens=2)
    assert caught.value.status_code == 413 and uploads == ["/v1/completions"], (caught.value, uploads)
    http_client.close()
