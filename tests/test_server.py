"""The OpenAI-compatible server end to end: the official `openai` client against a live uvicorn on loopback,
serving SmolLM2-135M on the CPU.

One server for the whole module (loading the model is the slow part). Its KV cache is kept small on purpose
(64 GPU blocks of 8 tokens, preemption by swap), so concurrent requests get preempted and swapped and the tests
also cover the host tier. Every check that counts blocks reads /metrics, the way an operator would.
"""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from conftest import VOCAB, close_llm, serving, smollm2_llm_kwargs  # noqa: E402
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.entrypoints.server import build_app  # noqa: E402

API_KEY = "test-key"
MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colors are"]
VOCAB_SIZE = 49152  # SmolLM2's
NUM_TOKENS = 8  # per completion in the concurrency tests; ignore_eos makes every answer exactly this long
IGNORE_EOS = {"ignore_eos": True}  # vLLM's extension, sent through the openai client's extra_body
# per prompt, penalties that change its greedy NUM_TOKENS tokens (repetition_penalty is vLLM's extension)
# one client for the module's plain HTTP calls: httpx.get() builds a client, and its TLS context, per call (22 ms of
# CPU each, most of the cost of the /metrics and /health polls)
HTTP = httpx.Client()
PENALTIES = {PROMPTS[0]: {"presence_penalty": 1.5, "frequency_penalty": 1.0}, PROMPTS[3]: {"repetition_penalty": 1.3}}


@pytest.fixture(scope="module")
def server(smollm2_dir):
    """Yields (base_url, reference, penalized): the server's address and, per prompt, the offline engine's greedy
    text for NUM_TOKENS tokens, plain and (for the prompts of PENALTIES) with its penalties, computed before the
    server takes the engine over."""
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(max_num_seqs=16, num_kvcache_blocks=64, preemption_mode="swap",
                                                swap_space=0.05))
    # one batch per dict: the server batches concurrent requests too, and its answers must equal these
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    reference = dict(zip(PROMPTS, (o["text"] for o in llm.generate(PROMPTS, params, use_tqdm=False))))
    penalized_params = [SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, **kw)
                        for kw in PENALTIES.values()]
    penalized = dict(zip(PENALTIES, (o["text"] for o in llm.generate(list(PENALTIES), penalized_params,
                                                                      use_tqdm=False))))
    try:
        with serving(build_app(llm, MODEL, api_key=API_KEY)) as port:
            yield f"http://127.0.0.1:{port}", reference, penalized
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def base_url(server) -> str:
    return server[0]


@pytest.fixture(scope="module")
def reference(server) -> dict[str, str]:
    return server[1]


@pytest.fixture(scope="module")
def client(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def async_client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def wait_for(predicate, what: str, timeout_s: float = 20.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def metrics(base_url: str) -> dict[str, float]:
    text = HTTP.get(f"{base_url}/metrics").text
    lines = [line.split() for line in text.splitlines() if line and not line.startswith("#")]
    return {name.removeprefix("nanovllm_"): float(value) for name, value in lines}


def assert_all_blocks_free(base_url: str):
    """Nothing in flight, and every GPU and host block back in its free list (cached blocks count as free)."""
    def idle():
        m = metrics(base_url)
        return (m["num_requests_running"] == m["num_requests_waiting"] == m["num_requests_swapped"] == 0
                and m["num_free_gpu_blocks"] == m["num_gpu_blocks"] and m["num_free_cpu_blocks"] == m["num_cpu_blocks"])
    wait_for(idle, f"every block to be free; /metrics: {metrics(base_url)}", timeout_s=10)


# ------------------------------------------------------------------------------------------------ basics

def test_models_health_and_metrics_format(base_url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert HTTP.get(f"{base_url}/health").json() == {"status": "ok"}
    text = HTTP.get(f"{base_url}/metrics").text
    assert "# TYPE nanovllm_aborted_requests_total counter" in text
    assert "# TYPE nanovllm_num_requests_swapped gauge" in text
    m = metrics(base_url)
    assert m["num_gpu_blocks"] == 64 and m["num_cpu_blocks"] > 0
    for name in ("decode_throughput_tokens_per_s", "gpu_kv_cache_usage_ratio", "blocks_swapped_out_total",
                 "bytes_swapped_in_total", "preemptions_swap_total", "finished_requests_total"):
        assert name in m, name


def test_completion_matches_offline_and_stream_joins_to_it(client, reference):
    prompt = PROMPTS[0]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                    extra_body=IGNORE_EOS)
    assert out.choices[0].text == reference[prompt]
    assert out.choices[0].finish_reason == "length"
    assert (out.usage.completion_tokens, out.usage.prompt_tokens > 0) == (NUM_TOKENS, True)

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                            extra_body=IGNORE_EOS, stream=True,
                                            stream_options={"include_usage": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) > 1, "streamed as one chunk: not token by token"
    assert "".join(texts) == out.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == NUM_TOKENS


def test_chat_stream_joins_to_non_streamed(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    answer = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    assert "Paris" in answer  # the chat template is applied: the instruct model answers the question
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == out.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_chat_text_parts_are_joined_by_newlines(client):
    """As vLLM renders [{"type": "text"}, ...] content: the parts joined by a newline."""
    def prompt_tokens(content):
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                              max_tokens=1).usage.prompt_tokens
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    assert prompt_tokens(parts) == prompt_tokens("Hello\nthere") != prompt_tokens("Hellothere")


def test_idle_engine_loop_blocks_instead_of_spinning(base_url):
    """With nothing to do, the engine loop thread waits on its inbox: the whole process, uvicorn and this test
    included, uses well under the ~1 s of CPU per second that a polling loop would burn."""
    assert_all_blocks_free(base_url)
    start_cpu, start = time.process_time(), time.monotonic()
    time.sleep(1.0)
    cpu_share = (time.process_time() - start_cpu) / (time.monotonic() - start)
    assert cpu_share < 0.2, f"the idle server used {cpu_share:.0%} of a core"


# ------------------------------------------------------------------------------------------------ concurrency

async def _stream_text(c: openai.AsyncOpenAI, prompt: str) -> tuple[str, str]:
    stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                        extra_body=IGNORE_EOS, stream=True)
    texts, reasons = [], []
    async for chunk in stream:
        texts.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    return "".join(texts), reasons[-1]


def test_32_concurrent_streams_all_correct(base_url, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]

    async def run():
        async with async_client(base_url) as c:
            return await asyncio.gather(*(_stream_text(c, p) for p in prompts))

    results = asyncio.run(run())
    for i, (prompt, (text, reason)) in enumerate(zip(prompts, results)):
        assert (text, reason) == (reference[prompt], "length"), f"stream #{i} ({prompt!r})"
    assert_all_blocks_free(base_url)


def test_bounded_load_loses_nothing(base_url):
    """32 requests, one every 25 ms (0.8 s of arrivals), half streamed, completions and chats mixed: every one is
    answered in full within 60 s, and the server ends idle with every block free. 16 running requests of up to
    ~70 tokens overflow the 64 GPU blocks of 8 tokens, so requests get swapped out and back in on the way (two
    batches of 16 are enough load for that; the assertion below checks it happened)."""
    num_requests, interval_s, deadline_s, num_tokens = 32, 0.025, 60, 24
    before = metrics(base_url)

    async def one(c: openai.AsyncOpenAI, i: int) -> int:
        await asyncio.sleep(i * interval_s)
        stream = i % 2 == 1
        if i % 4 < 2:
            kw = dict(prompt=PROMPTS[i % len(PROMPTS)])
            create = c.completions.create
        else:
            kw = dict(messages=[{"role": "user", "content": f"Count to {i}."}])
            create = c.chat.completions.create
        out = await create(model=MODEL, max_tokens=num_tokens, temperature=0.8, seed=i, extra_body=IGNORE_EOS,
                           stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}), **kw)
        if stream:
            chunks = [chunk async for chunk in out]
            assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
            return chunks[-1].usage.completion_tokens
        assert out.choices[0].finish_reason == "length"
        return out.usage.completion_tokens

    async def run():
        async with async_client(base_url) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(num_requests))), deadline_s)

    assert asyncio.run(run()) == [num_tokens] * num_requests
    after = metrics(base_url)
    assert after["finished_requests_total"] - before["finished_requests_total"] == num_requests
    assert after["aborted_requests_total"] == before["aborted_requests_total"]
    assert after["preemptions_swap_total"] > before["preemptions_swap_total"], "the load never swapped"
    assert_all_blocks_free(base_url)


# ------------------------------------------------------------------------------------------------ disconnects

def test_disconnected_streams_are_aborted_and_free_their_blocks(base_url):
    """12 long streams overflow the GPU cache; once some are swapped out, every client disconnects. Each request is
    aborted (running and swapped ones alike) and every GPU and host block comes back. The prompts (~40 tokens,
    distinct from the first token so they share no cached block) fill most of the 64 blocks at admission already."""
    num_streams, max_tokens = 12, 400
    prompts = [f"Story {i}: " + "once upon a time there was a little fox. " * 4 for i in range(num_streams)]
    before = metrics(base_url)

    async def read(stream):
        try:
            async for _ in stream:
                pass
        finally:
            await stream.close()

    async def run():
        async with async_client(base_url) as c:
            streams = [await c.completions.create(model=MODEL, prompt=prompts[i], max_tokens=max_tokens,
                                                  extra_body=IGNORE_EOS, stream=True) for i in range(num_streams)]
            readers = [asyncio.create_task(read(s)) for s in streams]
            await asyncio.to_thread(wait_for, lambda: metrics(base_url)["num_requests_swapped"] > 0,
                                    "a request to be swapped out", 30)
            for task in readers:
                task.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    asyncio.run(run())
    wait_for(lambda: metrics(base_url)["aborted_requests_total"] - before["aborted_requests_total"] == num_streams,
             f"{num_streams} aborts; /metrics: {metrics(base_url)}")
    assert_all_blocks_free(base_url)
    after = metrics(base_url)
    assert after["finished_requests_total"] == before["finished_requests_total"]
    assert after["decode_tokens_total"] - before["decode_tokens_total"] < num_streams * max_tokens / 2


def test_disconnected_non_streaming_request_is_aborted(base_url):
    before = metrics(base_url)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1 s and closes its connection
        httpx.post(f"{base_url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=1.0)
    wait_for(lambda: metrics(base_url)["aborted_requests_total"] == before["aborted_requests_total"] + 1,
             "the abort")
    assert_all_blocks_free(base_url)


# ------------------------------------------------------------------------------------------------ bad requests

LONG_PROMPT = "hello " * 600  # > max_model_len=512 tokens


@pytest.mark.parametrize("kw, message", [
    (dict(stream_options={"include_usage": True}), "only allowed when stream is true"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=2.0), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(prompt=LONG_PROMPT), "max_model_len"),
    (dict(prompt=""), "empty prompt"),
    (dict(prompt=[10**9]), "outside the vocabulary"),
    (dict(prompt=[]), "prompt is an empty list"),
    (dict(n=0), "n=0 must be >= 1"),
    (dict(n=257), "more than 256 in one request"),
    (dict(logprobs=21), "logprobs=21 must be in [0, 20]"),
    (dict(logprobs=-1), "logprobs=-1"),
    (dict(presence_penalty=2.5), "presence_penalty=2.5 must be in [-2, 2]"),
    (dict(frequency_penalty=-3), "frequency_penalty=-3.0 must be in [-2, 2]"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty=0.0 must be > 0"),
    (dict(extra_body={"guided_choice": ["a", "b"]}), "guided_choice"),
    (dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs=21 must be in [0, 20]"),
    (dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs is not available with stream=true"),
    (dict(extra_body={"allowed_token_ids": [1]}), "allowed_token_ids"),
    (dict(logit_bias={"x": 1}), "logit_bias key 'x' must be a token id"),
    (dict(logit_bias={str(VOCAB_SIZE): 1}), f"logit_bias names token id {VOCAB_SIZE}"),
    (dict(max_tokens=512), "and max_tokens=512 make 513, more than max_model_len=512"),  # "Hi": 1 token
    (dict(extra_body={"min_tokens": 8}), "min_tokens=8 must be an int in [0, max_tokens=4]"),
    (dict(temperature=1e39), "temperature"),  # inf in float32: it once crashed the step of every request
    (dict(stream=True, temperature=-1), "temperature"),  # a bad stream is refused before it starts
    (dict(seed=2**64), "seed"),  # accepted once, it failed every later step of every request in flight
])
def test_bad_completion_requests_get_400(client, kw, message):
    kw = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw)
    error = e.value.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_an_unknown_model_gets_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="Hi", max_tokens=4)
    error = e.value.response.json()["error"]
    assert "not served here" in error["message"] and error["code"] == "model_not_found" and error["param"] == "model"


def test_a_request_without_model_goes_to_the_served_model(base_url, reference):
    """vLLM's default: `model` may be left out; the answer names the served model."""
    r = HTTP.post(f"{base_url}/v1/completions", timeout=60, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": PROMPTS[2], "max_tokens": NUM_TOKENS, "temperature": 0, **IGNORE_EOS})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL and r.json()["choices"][0]["text"] == reference[PROMPTS[2]]


@pytest.mark.parametrize("body, message, param", [
    (b'{"model": "smollm2", "prompt": ', "not valid JSON", None),
    (b'{"model": "smollm2", "prompt": "Hi", "temperature": "hot"}', "valid number", "temperature"),
    (b'{"model": "smollm2"}', "Field required", "prompt"),
    (b'[1, 2]', "valid dictionary", "body"),
])
def test_malformed_bodies_get_400(base_url, body, message, param):
    r = HTTP.post(f"{base_url}/v1/completions", content=body, timeout=10,
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param


def test_options_set_to_what_changes_nothing_are_accepted(client, reference):
    """vLLM accepts these: the answer is the plain one."""
    neutral = {"best_of": 1, "presence_penalty": 0, "repetition_penalty": 1.0, "min_tokens": 0, **IGNORE_EOS}
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0,
                                    extra_body=neutral)
    assert out.choices[0].text == reference[PROMPTS[2]]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          response_format={"type": "text"})
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_penalties_are_applied_as_offline(client, server):
    """presence_penalty and frequency_penalty (OpenAI's) and repetition_penalty (vLLM's, in extra_body) give the
    offline engine's penalized text, which differs from the plain one; chat takes them too."""
    _, reference, penalized = server
    for prompt, penalties in PENALTIES.items():
        first_class = {k: v for k, v in penalties.items() if k != "repetition_penalty"}
        extra = {k: v for k, v in penalties.items() if k == "repetition_penalty"}
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                        extra_body={**IGNORE_EOS, **extra}, **first_class)
        assert out.choices[0].text == penalized[prompt] != reference[prompt], (prompt, penalties)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          frequency_penalty=0.5, extra_body={"repetition_penalty": 1.1})
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_include_stop_str_in_output(client, reference):
    text = reference[PROMPTS[2]]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = text.index(stop)
    for include, want in ((False, text[:cut]), (True, text[:cut + len(stop)])):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0,
                                        stop=[stop], extra_body={**IGNORE_EOS, "include_stop_str_in_output": include})
        assert out.choices[0].text == want and out.choices[0].finish_reason == "stop", (include, stop, out)


def test_bad_chat_requests_get_400(client):
    with pytest.raises(openai.BadRequestError, match="at least one message"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="a user message needs content"):  # not the text "None"
        client.chat.completions.create(model=MODEL, messages=[{"role": "user"}])
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG_PROMPT}])
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):  # 0 is not "unset"
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=0, max_tokens=3)
    for option, value in (("add_generation_prompt", False), ("continue_final_message", True),  # they would change
                          ("echo", True), ("prompt_logprobs", 1)):  # the prompt or the answer: refused, not ignored
        with pytest.raises(openai.BadRequestError, match=option):
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           extra_body={option: value})


def test_server_keeps_serving_after_bad_requests(base_url, client, reference):
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=NUM_TOKENS, temperature=0,
                                    extra_body=IGNORE_EOS)
    assert out.choices[0].text == reference[PROMPTS[2]]
    assert metrics(base_url)["rejected_requests_total"] > 0
    assert_all_blocks_free(base_url)


# ------------------------------------------------------------------------------------------------ auth

def test_wrong_or_missing_api_key_gets_401(base_url):
    with openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0) as c:
        with pytest.raises(openai.AuthenticationError) as e:
            c.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert e.value.response.json()["error"]["code"] == "invalid_api_key"
    for path in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        r = HTTP.request("GET" if path == "/v1/models" else "POST", f"{base_url}{path}", content=b"{not json")
        assert r.status_code == 401, (path, r.text)  # checked before the body is even read
    assert HTTP.get(f"{base_url}/health").status_code == 200  # health and metrics stay open for probes
    assert HTTP.get(f"{base_url}/metrics").status_code == 200
    for header, status in ((f"bearer {API_KEY}", 200), (f"BEARER  {API_KEY}", 200), (f"Basic {API_KEY}", 401),
                           (f"Bearer {API_KEY}x", 401), (API_KEY, 401)):  # the scheme is case-insensitive
        r = HTTP.get(f"{base_url}/v1/models", headers={"Authorization": header})
        assert r.status_code == status, (header, r.text)


# ------------------------------------------------------------------------------------------------ the CLI

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.subprocess
def test_cli_serve_tiny_model_without_tokenizer(qwen3_dir):
    """`nanovllm serve` in a subprocess, on a tiny random Qwen3 that has no tokenizer files: token-id prompts
    work, text prompts and chat get a 400 that says why, it binds to loopback, and SIGTERM stops it cleanly."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanovllm.entrypoints.cli", "serve", qwen3_dir, "--port", str(port),
           "--served-model-name", "tiny", "--device", "cpu", "--enforce-eager", "--max-model-len", "128",
           "--kvcache-block-size", "4", "--num-kvcache-blocks", "64", "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_API_KEY"}  # no key: /v1 is open
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: proc.poll() is not None or _is_up(port), "the server to come up", timeout_s=120)
        assert proc.poll() is None, proc.stdout.read()
        url = f"http://127.0.0.1:{port}/v1"
        r = HTTP.post(f"{url}/completions", json={"model": "tiny", "prompt": [5, 17, 42], "max_tokens": 5,
                                                   "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        for path, body in (("completions", {"prompt": "Hi"}), ("chat/completions", {"messages": [
                {"role": "user", "content": "Hi"}]})):
            r = HTTP.post(f"{url}/{path}", json={"model": "tiny", **body})
            assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"], r.text
        r = HTTP.post(f"{url}/completions", json={"model": "tiny", "prompt": [VOCAB]})
        assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"], r.text
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert f"on http://127.0.0.1:{port}/v1" in output


@pytest.mark.subprocess
def test_sigterm_fails_open_streams_at_once_and_exits(smollm2_dir):
    """uvicorn waits for open connections before it shuts the app down: without failing the requests in flight
    first, a SIGTERM waited for every stream to generate to its end (39 s for two 400-token streams)."""
    port = free_port()
    cmd = [sys.executable, "-m", "nanovllm.entrypoints.cli", "serve", smollm2_dir, "--port", str(port),
           "--served-model-name", "m", "--device", "cpu", "--enforce-eager", "--max-model-len", "512",
           "--log-level", "warning"]
    env = {k: v for k, v in os.environ.items() if k != "NANOVLLM_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            stdin=subprocess.DEVNULL)
    events, first = [], threading.Event()

    def stream():
        body = {"model": "m", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                events.append(line)
                first.set()
    try:
        wait_for(lambda: proc.poll() is not None or _is_up(port), "the server to come up", timeout_s=120)
        reader = threading.Thread(target=stream)
        reader.start()
        assert first.wait(60)
        proc.terminate()
        start = time.monotonic()
        proc.wait(timeout=30)
        seconds = time.monotonic() - start
        reader.join(10)
    finally:
        if proc.poll() is None:
            proc.kill()
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0 and seconds < 10, (seconds, output)
    data = [e for e in events if e.startswith("data: ")]
    assert "the server is shutting down" in data[-2] and data[-1] == "data: [DONE]", data[-3:]
    assert "Traceback" not in output, output


def _is_up(port: int) -> bool:
    try:
        return HTTP.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_multi_turn_chat_history_comes_back_from_the_host_tier(base_url, client):
    """Turn 2 of a chat repeats turn 1 as its prefix. Once unrelated requests have evicted that prefix from the 64
    GPU blocks, it is served from the host tier, and the answer is the one the GPU prefix cache gave."""
    system = "You are a helpful assistant. " + " ".join(f"Fact {i}: the number {i} is {i * 7}." for i in range(16))
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "What is fact 3?"}]
    answer = client.chat.completions.create(model=MODEL, messages=turn1, max_tokens=12, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "And fact 5?"}]

    def ask_turn2() -> str:
        reply = client.chat.completions.create(model=MODEL, messages=turn2, max_tokens=12, temperature=0)
        return reply.choices[0].message.content

    from_gpu_cache = ask_turn2()
    before = metrics(base_url)
    for i in range(3):  # 3 x 205 prompt tokens + 4: 81 blocks of unrelated prompts, more than the 64 GPU blocks
        client.completions.create(model=MODEL, prompt=f"Story {i}: " + "once more " * 100, max_tokens=4,
                                  temperature=0)
    from_host_tier = ask_turn2()
    after = metrics(base_url)
    assert after["host_prefix_hit_tokens_total"] - before["host_prefix_hit_tokens_total"] >= 160
    assert after["blocks_onloaded_total"] > before["blocks_onloaded_total"]
    assert from_host_tier == from_gpu_cache


# ------------------------------------------------------------------------------------------------ docs

def test_the_client_snippet_in_docs_server_md_runs_as_written(base_url, capsys):
    """The snippet names the model a plain `nanovllm serve` serves (its directory's name); run against this
    module's server, only the address, the key and that name are swapped."""
    from nanovllm.utils.convert import default_model_dir
    docs = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "server.md")).read()
    [snippet] = [block.split("```")[0] for block in docs.split("```python\n")[1:] if "OpenAI(" in block]
    default_name = os.path.basename(default_model_dir(convert=False))
    assert f'model="{default_name}"' in snippet and "http://127.0.0.1:8000/v1" in snippet
    exec(snippet.replace(f'"{default_name}"', f'"{MODEL}"').replace("http://127.0.0.1:8000", base_url)
         .replace('"unused-without---api-key"', f'"{API_KEY}"'), {})
    assert len(capsys.readouterr().out.strip()) > 0


# ------------------------------------------------------------------------------------------------ engine failures

@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
def test_a_failed_tensor_parallel_step_marks_the_engine_broken(qwen3_dir, monkeypatch):
    """At TP 1 a failed step fails the requests in flight and the loop goes on. With tensor parallelism the ranks
    are out of step after one: the loop stops taking requests and /health stops saying ok."""
    from conftest import tiny_llm_kwargs
    from nanovllm.entrypoints.server import EngineError, EngineLoop, prepare
    llm = LLM(qwen3_dir, **tiny_llm_kwargs())
    engine = EngineLoop(llm)

    def failing_step():
        raise RuntimeError("rank 1 ran out of memory")
    monkeypatch.setattr(llm, "step", failing_step)
    monkeypatch.setattr(llm.config, "tensor_parallel_size", 2)  # as if it were
    engine.start()

    async def scenario():
        stream = await engine.submit(prepare(llm, [5, 6, 7], sampling={"max_tokens": 4}))
        with pytest.raises(EngineError, match="out of memory"):
            async for _ in stream.events():
                pass
        with pytest.raises(EngineError, match="restart the server"):
            await engine.submit(prepare(llm, [5, 6, 7], sampling={"max_tokens": 4}))
    try:
        asyncio.run(scenario())
        assert not engine.is_alive and "out of step" in engine.broken
    finally:
        engine.stop()
        monkeypatch.setattr(llm.config, "tensor_parallel_size", 1)
        close_llm(llm)
