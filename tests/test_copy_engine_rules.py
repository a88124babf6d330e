"""Which copies a forward waits for (rules 2 and 3 of nanovllm_offload/copy_engine.py), with stand-in events."""
from nanovllm_offload.copy_engine import contiguous_runs, events_to_wait


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
