"""Which copies wait for which forward, and which forward waits for which copies (rules 1-3 of
nanovllm_offload/copy_engine.py), with stand-in events."""
from nanovllm_offload.copy_engine import contiguous_runs, events_to_wait, split_by_last_forward, written_block_ids


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
    # block size 4; the last forward wrote slots 21 (block 5), 8 and 9 (block 2); -1 is graph padding
    written = written_block_ids([21, 8, 9, -1], 4)
    assert written == {5, 2}
    stale, hot = split_by_last_forward([(4, 0), (5, 1), (2, 2), (7, 3)], written)
    assert stale == [(4, 0), (7, 3)] and hot == [(5, 1), (2, 2)]
    # no forward before the last one: everything waits for the last
    assert split_by_last_forward([(4, 0)], None) == ([], [(4, 0)])


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
