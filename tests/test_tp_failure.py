"""A tensor-parallel worker that fails mid-step (killed, or raising) is noticed within seconds: rank 0 raises an
error that carries the worker's traceback or its signal, no worker process is left, and the engine refuses
further steps instead of running ranks that are out of step. On the CPU with gloo; the watchdog that aborts an
NCCL collective on the GPU is exercised here through its hook."""
import multiprocessing as mp
import os
import signal
import time

import pytest

from conftest import close_llm, greedy, random_prompts, tiny_llm_kwargs
from nanovllm import LLM
from nanovllm.engine import workers as workers_module

pytestmark = pytest.mark.subprocess  # tensor-parallel workers are processes

PROMPTS = random_prompts([9, 17, 30], seed=80)


@pytest.fixture()
def tp2(qwen3_dir, monkeypatch):
    aborts = []
    monkeypatch.setattr(workers_module, "abort_process_group", lambda: aborts.append(time.monotonic()))
    llm = LLM(qwen3_dir, **tiny_llm_kwargs(tensor_parallel_size=2))
    llm.aborts = aborts
    yield llm
    close_llm(llm)
    assert mp.active_children() == []


def fail_in_step(monkeypatch, llm, num_steps: int, how):
    """After num_steps steps, the next step's "run" reaches the worker and `how` breaks it mid-step."""
    pool, send, count = llm.executor.workers, llm.executor.workers.send, [0]

    def send_then_break(method, *args):
        if method == "run" and count[0] == num_steps:
            how(pool, send, args)
            return
        count[0] += method == "run"
        send(method, *args)
    monkeypatch.setattr(pool, "send", send_then_break)


def kill_worker(pool, send, args):
    send("run", *args)  # the step's own call: the worker is killed while both ranks run it
    os.kill(pool.procs[0].pid, signal.SIGKILL)


def worker_raises(pool, send, args):
    send("run", None)  # the worker's runner.run(None) raises AttributeError; rank 0 waits in its collective


@pytest.mark.parametrize("how, pattern", [
    (kill_worker, r"tensor-parallel worker rank 1 died \(killed by SIGKILL\)"),
    (worker_raises, r"tensor-parallel worker rank 1 failed:\nTraceback \(most recent call last\):(.|\n)*"
                    r"AttributeError: 'NoneType' object has no attribute"),
], ids=["killed", "raising"])
def test_a_worker_failing_mid_step_is_raised_on_rank_0(tp2, monkeypatch, how, pattern):
    want = [o["token_ids"] for o in tp2.generate(PROMPTS, greedy(8), use_tqdm=False)]
    assert len(want) == 3
    fail_in_step(monkeypatch, tp2, 3, how)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=pattern):
        tp2.generate(PROMPTS, greedy(8), use_tqdm=False)
    assert time.monotonic() - start < 10
    assert not any(p.is_alive() for p in tp2.executor.workers.procs) and mp.active_children() == []
    assert tp2.requests == {}
    with pytest.raises(RuntimeError, match=pattern):  # the ranks are out of step: no further step runs
        tp2.generate(PROMPTS, greedy(8), use_tqdm=False)


def test_the_watchdog_notices_a_worker_that_dies_while_rank_0_is_elsewhere(tp2):
    """Rank 0 blocked in an NCCL collective would never see the death itself: the watchdog thread does, stops the
    other workers and aborts rank 0's process group (a hook here)."""
    os.kill(tp2.executor.workers.procs[0].pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while not tp2.aborts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tp2.aborts, "the watchdog did not abort the process group"
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(killed by SIGKILL\)"):
        tp2.generate(PROMPTS, greedy(8), use_tqdm=False)
    assert mp.active_children() == []


def test_a_closed_pool_is_not_a_failure(tp2):
    tp2.close()
    assert tp2.aborts == [] and mp.active_children() == []
