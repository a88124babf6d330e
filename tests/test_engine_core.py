"""The engine's pieces on their own: the Executor's call order across ranks (fakes, no processes), and EngineCore's
step in flight under both scheduling modes (a tiny model on the CPU)."""
import pytest

from conftest import greedy, random_prompts, tiny_llm_kwargs
from nanovllm import LLM
from nanovllm.engine.executor import Executor


class FakeRank:
    """Records each call as (rank, method, args) in a shared log."""

    def __init__(self, log: list, rank: int):
        self.log, self.rank = log, rank

    def __getattr__(self, method):
        return lambda *args: self.log.append((self.rank, method, args)) or f"rank {self.rank}'s {method}"


class FakeWorkers:
    def __init__(self, log: list):
        self.log = log

    def send(self, method, *args):
        self.log.append((1, method, args))

    def wait(self):
        self.log.append((1, "reply", ()))

    def abandon_call(self, error):
        self.log.append((1, "abandon", (error,)))

    def close(self):
        self.log.append((1, "close", ()))


def fake_executor(num_ranks: int) -> tuple[Executor, list]:
    log = []
    executor = Executor.__new__(Executor)  # no model, no processes: the call order only
    executor.runner = FakeRank(log, 0)
    executor.workers = FakeWorkers(log) if num_ranks > 1 else None
    return executor, log


def test_a_call_reaches_the_workers_before_rank_0_runs_it_and_their_replies_are_in_before_it_returns():
    """The ranks' collectives pair up only if every rank runs the same calls in the same order."""
    executor, log = fake_executor(2)
    assert executor.call("allocate_kv_cache", 12) == "rank 0's allocate_kv_cache"
    assert log == [(1, "allocate_kv_cache", (12,)), (0, "allocate_kv_cache", (12,)), (1, "reply", ())]


def test_a_launch_leaves_the_workers_replies_for_wait():
    """A step's host work (reading back the previous step) overlaps the workers' step: their replies come later."""
    executor, log = fake_executor(2)
    executor.launch("plan", ["seq"])
    assert log == [(1, "run", ("plan",)), (0, "launch", ("plan", ["seq"], None))]
    executor.wait()
    executor.release([3])  # rank 0 only: only it samples
    assert log[2:] == [(1, "reply", ()), (0, "release", ([3],))]


def test_one_rank_needs_no_workers():
    executor, log = fake_executor(1)
    executor.call("capture_cuda_graphs")
    executor.launch("plan", [])
    executor.wait()
    executor.abandon_call(RuntimeError("a step failed"))
    assert log == [(0, "capture_cuda_graphs", ()), (0, "launch", ("plan", [], None))]


def test_close_stops_the_workers_before_rank_0_and_twice_is_a_no_op():
    executor, log = fake_executor(2)
    executor.close()
    executor.close()
    assert log == [(1, "close", ()), (0, "close", ())] and executor.runner is None and executor.workers is None


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_the_step_in_flight_is_one_step_behind_only_with_asynchronous_scheduling(qwen3_dir, asynchronous):
    """Synchronous scheduling reads every step back before step() returns; asynchronous scheduling leaves the
    launched step in flight, so a request's last token (and its finish) comes one step() later."""
    prompt = random_prompts([9], seed=45)[0]
    with LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=asynchronous)) as llm:
        seq_id = llm.add_request(prompt, greedy(3))
        num_steps, num_in_flight = 0, []
        while not llm.is_finished():
            finished = llm.step()
            num_steps += 1
            num_in_flight.append(llm.core._in_flight is not None)
        assert [seq.seq_id for seq in finished] == [seq_id]
        assert len(llm.requests[seq_id].completion_token_ids) == 3
        # a prefill step and two decode steps; async adds one step that only reads the last one back
        assert num_steps == (4 if asynchronous else 3)
        assert num_in_flight == ([True, True, True, False] if asynchronous else [False] * 3)


def test_each_prompt_is_checked_and_tokenized_once(qwen3_dir, monkeypatch):
    """generate() with n samples checks (and tokenizes) each prompt once, not once more per sample; the server
    checks in prepare(), off the loop thread, and the loop queues the samples without a second check."""
    from nanovllm.engine.request_intake import RequestIntake
    from nanovllm.entrypoints.server.prepare import prepare
    checked = []
    real = RequestIntake._prompt_token_ids
    monkeypatch.setattr(RequestIntake, "_prompt_token_ids",
                        lambda self, prompt, params: checked.append(len(prompt)) or real(self, prompt, params))
    prompts = random_prompts([9, 17], seed=45)
    with LLM(qwen3_dir, **tiny_llm_kwargs()) as llm:
        outs = llm.generate(prompts, greedy(2, n=3), use_tqdm=False)
        assert [len(o.outputs) for o in outs] == [3, 3] and checked == [9, 17]
        request = prepare(llm, prompts[0], sampling={"max_tokens": 2, "n": 2})
        assert checked == [9, 17, 9]
        seq_ids = [llm.add_checked_request(sample) for sample in request.samples()]
        while not llm.is_finished():
            llm.step()
        assert checked == [9, 17, 9]
        assert [len(llm.requests[seq_id].completion_token_ids) for seq_id in seq_ids] == [2, 2]
