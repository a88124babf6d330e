"""Which copies wait for which forward, and which forward waits for which copies (rules 1-3 of
nanovllm_offload/copy_engine.py), with stand-in events."""
from nanovllm_offload.copy_engine import InFlightStep, contiguous_runs, events_to_wait, split_by_last_forward


class Event:
    def __init__(self, name: str, done: bool = False):
        self.name, self.done = name, done

    def query(self) -> bool:
        return self.done


def names(events) -> list[str]:
    return sorted(e.name for e in events)


def test_a_forward_waits_only_for_copies_of_blocks_it_uses():
    out_a, out_b, in_c = Event("out_a"), Event("out_b"), Event("in_c")
    reading = {4: out_a, 5: out_a, 9: out_b}  # swap-outs still reading gpu blocks 4, 5 (one run) and 9
    arriving = {12: in_c, 13: in_c}  # a swap-in still filling gpu blocks 12, 13
    # handed block 5 to write, reads tables without 12/13: only the run holding block 5
    assert names(events_to_wait([5], [[1, 2, 5]], reading, arriving)) == ["out_a"]
    # a resumed sequence with blocks 12, 13 in the batch: its swap-in, once
    assert names(events_to_wait([], [[1], [12, 13]], reading, arriving)) == ["in_c"]
    # nothing of theirs used: no wait
    assert events_to_wait([7], [[1, 7]], reading, arriving) == []


def test_finished_copies_are_not_waited_for():
    done = Event("done", done=True)
    assert events_to_wait([3], [[3]], {3: done}, {3: done}) == []


def test_contiguous_runs_merge_only_when_both_ids_advance():
    assert contiguous_runs([(4, 0), (5, 1), (6, 2), (9, 3), (10, 5)]) == [(4, 0, 3), (9, 3, 1), (10, 5, 1)]


def test_a_swap_out_waits_for_the_last_forward_only_for_the_blocks_it_writes():
    # the step in flight writes blocks 5 and 2 (its plan's written_gpu_block_ids)
    stale, hot = split_by_last_forward([(4, 0), (5, 1), (2, 2), (7, 3)], {5, 2})
    assert stale == [(4, 0), (7, 3)] and hot == [(5, 1), (2, 2)]
    # no forward before the step in flight: everything waits for all compute issued so far
    assert split_by_last_forward([(4, 0)], None) == ([], [(4, 0)])


def test_the_step_in_flight_is_counted_in_steps_so_a_step_without_a_forward_writes_nothing():
    """Rule 1's bookkeeping: stale swap-outs wait for the forwards before the step in flight, hot ones (blocks that
    step writes) for its forward. A step without a forward becomes the step in flight too: it writes nothing."""
    steps = InFlightStep()
    steps.step_issued()  # step 1: no forward before it
    steps.forward_issued(Event("forward 1"), [5, 6])
    assert steps.split([(5, 0), (7, 1)]) == ([], [(5, 0), (7, 1)])  # (step 1's copies: nothing before it)
    steps.step_issued()  # step 2: step 1 is in flight
    assert steps.forwards_before is None and steps.split([(5, 0), (7, 1)]) == ([], [(5, 0), (7, 1)])
    steps.forward_issued(Event("forward 2"), [7])
    steps.step_issued()  # step 3: step 2 (writes 7) in flight; forward 1 (wrote 5) is before it
    assert steps.forwards_before.name == "forward 1"
    assert steps.split([(5, 0), (7, 1)]) == ([(5, 0)], [(7, 1)])
    # step 3 launched only copies (no forward); step 4's copies: step 3, which writes nothing, is in flight, and
    # forward 2 (which wrote 7) is before it
    steps.step_issued()
    assert steps.forwards_before.name == "forward 2" and steps.written == []
    assert steps.split([(5, 0), (7, 1)]) == ([(5, 0), (7, 1)], [])


def test_get_finished_names_each_steps_transfers_once():
    """The one completion API: the ids of the copies that landed (on the CPU, every copy has when it is issued),
    each once, with the copies' timings; an engine that does not report (ranks other than 0) keeps none."""
    import torch

    from nanovllm_offload.copy_engine import CopyEngine
    gpu_kv, host_kv = torch.arange(4 * 6.0).view(4, 6), torch.zeros(3, 6)
    engine = CopyEngine(gpu_kv, host_kv, block_size=2)
    engine.issue_step_copies([(1, 0), (2, 1)], [], [], [], store_id=5)
    engine.issue_step_copies([], [(0, 3)], [], [[3]], load_id=6)
    report = engine.get_finished()
    assert report.finished_ids == [5, 6] and [n for n, _ in report.copies] == [2 * 24, 24]
    assert torch.equal(host_kv[:2], gpu_kv[1:3]) and torch.equal(gpu_kv[3], gpu_kv[1])
    assert engine.get_finished().finished_ids == []
    silent = CopyEngine(gpu_kv, host_kv, block_size=2, reports_completions=False)
    silent.issue_step_copies([(1, 0)], [], [], [], store_id=7)
    assert silent.get_finished().finished_ids == [] and silent.in_flight == []
