"""The server's routes that do not generate (/version, /tokenize, /detokenize, vLLM's bodies), /v1/models' `created`
through the official `openai` client, and `nanovllm serve --port` checked before any model loads."""
from __future__ import annotations

import socket
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

import nanovllm  # noqa: E402
from conftest import close_llm, serving, smollm2_llm_kwargs  # noqa: E402
from nanovllm import LLM  # noqa: E402
from nanovllm.engine.tokenizer import chat_token_ids  # noqa: E402
from nanovllm.entrypoints import cli  # noqa: E402
from nanovllm.entrypoints.server import build_app  # noqa: E402

API_KEY = "test-key"
MODEL = "smollm2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def served(smollm2_dir):
    """(base_url, llm, the time before the server started)."""
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(swap_space=0))
    started = int(time.time())
    try:
        with serving(build_app(llm, MODEL, api_key=API_KEY)) as port:
            yield f"http://127.0.0.1:{port}", llm, started
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def client(served):
    with openai.OpenAI(base_url=f"{served[0]}/v1", api_key=API_KEY, max_retries=0, timeout=60) as c:
        yield c


def post(served, path: str, body, headers=AUTH) -> httpx.Response:
    return httpx.post(f"{served[0]}{path}", json=body, headers=headers, timeout=60)


def test_models_say_when_they_were_created(served, client):
    (card,) = client.models.list().data
    assert card.id == MODEL and served[2] <= card.created <= time.time()


def test_version_is_the_packages_and_needs_no_key(served):
    r = httpx.get(f"{served[0]}/version")
    assert r.status_code == 200 and r.json() == {"version": nanovllm.__version__}
    assert nanovllm.__version__ not in ("", "unknown")


def test_tokenize_a_prompt(served):
    llm = served[1]
    r = post(served, "/tokenize", {"model": MODEL, "prompt": "The capital of France is", "return_token_strs": True})
    assert r.status_code == 200, r.text
    expected = llm.tokenizer.encode("The capital of France is")
    assert r.json() == {"count": len(expected), "max_model_len": 512, "tokens": expected,
                        "token_strs": llm.tokenizer.convert_ids_to_tokens(expected)}
    r = post(served, "/tokenize", {"prompt": "Hi"})  # no model: the served one; no token_strs unless asked
    assert r.json()["token_strs"] is None and r.json()["tokens"] == llm.tokenizer.encode("Hi")


def test_tokenize_messages_counts_what_a_chat_completion_sends(served, client):
    r = post(served, "/tokenize", {"messages": MESSAGES})
    assert r.status_code == 200, r.text
    llm = served[1]
    assert r.json()["tokens"] == chat_token_ids(llm.tokenizer, MESSAGES, llm.config.model)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert reply.usage.prompt_tokens == r.json()["count"]
    without = post(served, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without["count"] < r.json()["count"]


def test_detokenize_inverts_tokenize(served):
    text = "Paris is the capital of France."
    tokens = post(served, "/tokenize", {"prompt": text}).json()["tokens"]
    r = post(served, "/detokenize", {"model": MODEL, "tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": text}


@pytest.mark.parametrize("path, body, status, message", [
    ("/detokenize", {"tokens": [49152]}, 400, "token id 49152 is outside the vocabulary [0, 49152)"),
    ("/detokenize", {"tokens": [1.0]}, 400, "tokens.0: Input should be a valid integer"),
    ("/tokenize", {"model": "other", "prompt": "Hi"}, 404, "model 'other' is not served here"),
    ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model 'other' is not served here"),
    ("/tokenize", {"text": "Hi"}, 400, "prompt: Field required"),
    ("/tokenize", {"messages": []}, 400, "messages is empty"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message=true"),
    ("/tokenize", [1, 2], 400, "must be a JSON object"),
], ids=["out-of-vocab", "float-token", "tokenize-model", "detokenize-model", "no-prompt", "no-messages",
        "continue-final", "not-an-object"])
def test_bad_requests_say_why(served, path, body, status, message):
    r = post(served, path, body)
    assert r.status_code == status and message in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_token_routes_need_the_key(served, path):
    assert post(served, path, {"prompt": "Hi", "tokens": [1]}, headers={}).status_code == 401


# ------------------------------------------------------------------------------------------------ --port

@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if `serve` gets as far as finding or loading a model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was looked up before --port was checked")
    monkeypatch.setattr(cli, "resolve_model", refuse)


def test_a_port_out_of_range_is_one_error_line(capsys, no_model_load):
    assert cli.main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --port 70000 must be in [0, 65535]\n"


def test_a_port_in_use_is_one_error_line_before_the_model_loads(capsys, no_model_load):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert cli.main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --port {port}: cannot listen on 127.0.0.1:{port} (Address already in use)")
    assert err.count("\n") == 1 and "Traceback" not in err
