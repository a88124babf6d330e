"""`nanovllm chat` on SmolLM2: one turn per line of stdin, the history kept, and each turn's prompt (the whole
history) served from the prefix cache up to the new message."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from conftest import close_llm, smollm2_llm_kwargs
from nanovllm import LLM, SamplingParams
from nanovllm.entrypoints.chat import run_chat
from nanovllm.engine.tokenizer import chat_token_ids

TURNS = ["What is the capital of France?", "And of Italy?"]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def chat_llm(smollm2_dir):
    """One engine for the in-process sessions; each test starts from an empty prefix cache."""
    llm = LLM(smollm2_dir, **smollm2_llm_kwargs(swap_space=0))
    yield llm
    close_llm(llm)


def test_each_turn_answers_the_whole_history_and_reuses_its_kv(chat_llm):
    llm = chat_llm
    llm.reset_prefix_cache()
    hits_before = llm.stats()["prefix_cache_hit_tokens"]
    out = io.StringIO()
    history = run_chat(llm, PARAMS, io.StringIO("\n".join([TURNS[0], "", TURNS[1], "/exit", "not read"])), out,
                       system="Answer in one sentence.")
    assert [m["role"] for m in history] == ["system", "user", "assistant", "user", "assistant"]
    assert [m["content"] for m in history if m["role"] == "user"] == TURNS
    assert out.getvalue().splitlines() == [history[2]["content"], history[4]["content"]]
    turn_2_prompt = chat_token_ids(llm.tokenizer, history[:4], llm.config.model)
    hits = llm.stats()["prefix_cache_hit_tokens"] - hits_before
    # the second prompt starts with the first turn (system, question, answer): its blocks came from the cache
    turn_1 = chat_token_ids(llm.tokenizer, history[:3], llm.config.model, add_generation_prompt=False)
    assert turn_2_prompt[:len(turn_1) - 1] == turn_1[:-1]  # the template renders an earlier turn the same way
    block = llm.config.kvcache_block_size
    assert hits >= (len(turn_1) - 2) // block * block > 0, (hits, len(turn_1))
    # the answers are the model's to these histories, as llm.chat gives them
    llm.reset_prefix_cache()
    assert llm.chat(history[:2], PARAMS, use_tqdm=False)[0]["text"] == history[2]["content"]
    assert llm.chat(history[:4], PARAMS, use_tqdm=False)[0]["text"] == history[4]["content"]


def test_reset_starts_over(chat_llm):
    history = run_chat(chat_llm, PARAMS, io.StringIO(f"{TURNS[0]}\n/reset\n{TURNS[1]}\n"), io.StringIO())
    assert [m["content"] for m in history if m["role"] == "user"] == [TURNS[1]]


def test_the_command_reads_piped_stdin(smollm2_dir):
    cmd = [sys.executable, "-m", "nanovllm.entrypoints.cli", "chat", "--model", smollm2_dir, "--device", "cpu",
           "--max-tokens", "8", "--max-model-len", "256", "--kvcache-block-size", "8", "--num-kvcache-blocks", "64",
           "--enforce-eager", "--stats"]
    done = subprocess.run(cmd, input="\n".join(TURNS) + "\n", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    answers, stats = out[:out.index("{")].splitlines(), json.loads(out[out.index("{"):])
    assert len(answers) == 2 and all(answers), out
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["num_cpu_blocks"] == 0, stats
