"""Scheduler state machine with the host tier: every step checks all invariants (no torch needed).

Block size 4 throughout; `run_step` samples token 7 for every sequence that completes its prompt."""
import pytest

from nanovllm_offload.transfer_report import TransferReport
from metadata_factories import check, make_scheduler, make_seq, run_step, run_step_async


def test_prefill_then_decode_with_exact_blocks():
    s = make_scheduler(num_gpu_blocks=8)
    a, b = make_seq(6), make_seq(3, start=200)
    s.add(a)
    s.add(b)
    out, _ = run_step(s)
    assert [x.seq_id for x in out.seqs] == [a.seq_id, b.seq_id] and out.num_new_tokens == [6, 3]
    assert a.block_table == [0, 1] and b.block_table == [2]
    out, _ = run_step(s)  # decode: a writes token 7 at position 6 (block 1), b at position 3 (block 2)
    assert out.num_new_tokens == [1, 1] and out.is_decode_only
    assert a.block_table == [0, 1] and b.block_table == [2]
    out, _ = run_step(s)  # b now needs a second block
    assert b.block_table == [2, 3]
    assert s.stats.prefill_tokens == 9 and s.stats.decode_tokens == 4 and s.stats.steps == 3


def test_chunked_prefill_respects_the_token_budget():
    s = make_scheduler(max_num_batched_tokens=5)
    a, b = make_seq(12), make_seq(3, start=300)
    s.add(a)
    s.add(b)
    out, _ = run_step(s)
    assert out.num_new_tokens == [5] and a.num_computed_tokens == 5 and a.block_table == [0, 1]
    out, _ = run_step(s)  # a continues with 5, then the budget is spent
    assert [x.seq_id for x in out.seqs] == [a.seq_id] and a.num_computed_tokens == 10
    out, _ = run_step(s)  # a's last 2 tokens (sampled), b's 3
    assert out.num_new_tokens == [2, 3] and a.num_completion_tokens == 1 and b.num_completion_tokens == 1


def swap_scenario():
    """Two 8-token prompts on 5 GPU blocks: after 1 decode step each needs a third block, only one is free."""
    s = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=8, mode="swap")
    a, b = make_seq(8), make_seq(8, start=200)
    s.add(a)
    s.add(b)
    run_step(s)  # prefill: a [0, 1], b [2, 3]; both sample a 9th token
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    return s, a, b


def test_preemption_swaps_out_the_newest_and_resumes_it_without_recompute():
    s, a, b = swap_scenario()
    out, _ = run_step(s)  # a takes block 4; b cannot grow: b is swapped out
    assert a.block_table == [0, 1, 4]
    assert b.status.name == "SWAPPED" and b.cpu_block_table == [0, 1]
    assert out.swap_out == [(3, 1), (2, 0)] and out.swap_in == []  # in the order they are handed out again
    assert s.stats.preemptions_swap == 1 and b.num_computed_tokens == 8
    # while b is swapped, a new prefill is not admitted
    c = make_seq(2, start=900)
    s.add(c)
    out, _ = run_step(s)
    assert c.status.name == "WAITING"
    # a finishes after 8 tokens: its blocks free up and b comes back, copied into new blocks
    while not a.is_finished:
        out, _ = run_step(s)
    out, _ = run_step(s)
    # block 2 (b's first block) is still in the GPU prefix cache: reused without a copy; block 3 was reused by a
    assert b.status.name == "RUNNING" and b.block_table == [2, 3] and out.swap_in == [(1, 3)]
    assert b not in out.seqs  # it joins one step after its copy was issued
    while not b.is_finished:
        run_step(s)
    assert s.stats.recomputed_tokens == 0 and b.num_completion_tokens == 8


def test_host_pool_full_falls_back_to_recompute():
    s = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=1, mode="swap")
    a, b = make_seq(8), make_seq(8, start=200)
    s.add(a)
    s.add(b)
    run_step(s)
    run_step(s)
    assert b.status.name == "WAITING" and b.num_computed_tokens == 0 and b.block_table == []
    assert s.stats.preemptions_recompute == 1 and s.stats.preemptions_swap == 0
    assert b.num_recompute_pending == 8
    while not (a.is_finished and b.is_finished):
        run_step(s)
    assert s.stats.recomputed_tokens > 0


def test_recompute_mode_never_touches_the_host_pool():
    s = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=8, mode="recompute")
    a, b = make_seq(8), make_seq(8, start=200)
    s.add(a)
    s.add(b)
    run_step(s)
    out, _ = run_step(s)
    assert out.swap_out == [] and b.status.name == "WAITING" and s.host_pool.num_free_blocks == 8


def test_sequence_in_chunked_prefill_swaps_only_its_computed_blocks():
    s = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=8, max_num_batched_tokens=6, mode="swap")
    a = make_seq(14)
    s.add(a)
    run_step(s)  # 6 tokens computed, blocks [0, 1]
    assert a.num_computed_tokens == 6 and a.block_table == [0, 1]
    s.preempt(a, mode="swap")
    check(s)
    assert a.cpu_block_table == [0, 1] and a.num_computed_tokens == 6
    out, _ = run_step(s)  # the copies go out with the next step; a comes straight back (room is plenty)
    assert out.swap_out == [(1, 1), (0, 0)]  # the unhashed partial block first: it is handed out first
    assert a.status.name == "RUNNING"
    while not a.is_finished:
        run_step(s)
    assert s.stats.recomputed_tokens == 0 and a.num_completion_tokens == 8


def test_shared_blocks_stay_on_the_gpu_and_cross_once():
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, mode="swap")
    a = make_seq(9)
    s.add(a)
    run_step(s)  # a computes 9 tokens: blocks 0, 1 full and cached
    b = make_seq(9)  # same prompt: hits blocks 0 and 1
    s.add(b)
    run_step(s)
    assert b.block_table[:2] == [0, 1] and s.stats.prefix_cache_hit_tokens == 8
    s.preempt(b, mode="swap")
    check(s)
    assert s.block_manager.ref_counts[0] == 1 and s.block_manager.ref_counts[1] == 1  # a still owns them
    out, _ = run_step(s)
    # the shared blocks are copied (b must own its KV on the host), each once, plus b's own partial block, last:
    # the step before wrote it (see test_blocks_the_step_in_flight_writes_are_copied_and_handed_out_last)
    assert out.swap_out == [(1, 1), (0, 0), (3, 2)]
    assert a.block_table == [0, 1, 2] and s.block_manager.ref_counts[:3] == [2, 2, 1]  # b is back already


def test_finish_and_abort_while_swapped_release_host_blocks():
    s, a, b = swap_scenario()
    run_step(s)
    assert b.status.name == "SWAPPED"
    s.finish(b, "abort")
    check(s, extra=[b])
    assert b.status.name == "FINISHED" and b.cpu_block_table == [] and s.host_pool.num_free_blocks == 8
    assert not s.swapped


def test_eos_and_stop_token_ids_finish_with_stop():
    s = make_scheduler()
    a = make_seq(3)
    a.sampling_params.stop_token_ids = [7]
    s.add(a)
    _, finished = run_step(s, sampled_token=7)
    assert finished == [a] and a.finish_reason == "stop" and a.block_table == []


def test_min_tokens_bans_stop_tokens_and_eos_until_reached():
    """Rows of sequences short of min_tokens may not sample their stop tokens or EOS (id 0 here), unless
    ignore_eos; the ban lifts once min_tokens tokens exist (a placeholder counts), and with the finish."""
    from nanovllm import SamplingParams
    from nanovllm.core.sequence import Sequence
    s = make_scheduler()
    a = Sequence([1, 2, 3], SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=[9, 5]), 4)
    b = make_seq(3)  # no min_tokens
    c = Sequence([4, 5], SamplingParams(max_tokens=8, min_tokens=1, ignore_eos=True, stop_token_ids=[6]), 4)
    d = Sequence([4, 5], SamplingParams(max_tokens=8, min_tokens=3, ignore_eos=True), 4)  # nothing to ban
    for seq in (a, b, c, d):
        s.add(seq)
    assert s.min_tokens.pending_seq_ids == {a.seq_id, c.seq_id, d.seq_id}
    assert s.banned_token_ids([a, b, c, d]) == [(0, [0, 5, 9]), (2, [6])]
    s.finish(d, "abort")
    a.token_ids.append(11)  # one completion token: a is still short, c would not be
    c.token_ids.append(12)
    assert s.banned_token_ids([b, c, a]) == [(2, [0, 5, 9])] and s.min_tokens.pending_seq_ids == {a.seq_id}
    s.finish(a, "abort")
    assert s.min_tokens.pending_seq_ids == set() and s.banned_token_ids([a]) == []


def test_a_swapped_sequence_that_needs_every_block_still_resumes():
    s = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap")
    a = make_seq(14, max_tokens=2)  # 14 tokens + 1 sampled: 4 blocks, the whole pool
    s.add(a)
    run_step(s)
    s.preempt(a, mode="swap")
    out, _ = run_step(s)  # the copies go out, and with nothing running a takes all 4 blocks back
    assert a.status.name == "RUNNING" and len(a.block_table) == 4
    while not a.is_finished:
        run_step(s)
    assert s.stats.recomputed_tokens == 0


def test_requests_admitted_in_one_step_share_a_prefix_that_step_computes():
    """Prompt blocks are cached when scheduled: the second request of the same step hits the first one's two
    full blocks (the forward stores them before any attention reads them) and computes only its own tokens."""
    s = make_scheduler(num_gpu_blocks=8)
    system = list(range(100, 108))  # two full blocks
    a, b = make_seq(token_ids=system + [1, 2]), make_seq(token_ids=system + [3])
    s.add(a)
    s.add(b)
    out, _ = run_step(s)
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert out.seqs == [b, a] and out.num_new_tokens == [1, 10]  # one-token rows first in the batch
    assert s.stats.prefix_cache_hit_tokens == 8 and s.stats.prefill_tokens == 11


def test_a_chunk_caches_only_the_blocks_it_completes():
    s = make_scheduler(num_gpu_blocks=8, max_num_batched_tokens=6)
    a = make_seq(token_ids=list(range(100, 110)))
    s.add(a)
    run_step(s)  # tokens 0-5: block 0 is full, block 1 is not
    assert a.num_cached_blocks == 1 and s.block_manager.block_hash[1] is None
    b = make_seq(token_ids=list(range(100, 110)))
    s.add(b)
    out, _ = run_step(s)  # a's last 4 tokens complete block 1; b, admitted after a, hits blocks 0 and 1
    assert out.num_new_tokens == [4, 2] and b.block_table[:2] == a.block_table[:2] == [0, 1]


def test_a_swap_out_copies_first_the_block_its_next_owner_gets():
    """No free block: a grows into a block of the victim b. That block is copied first, so a's forward waits
    for one block's copy, not for all of b's. b's block 4, which the step before wrote, is copied and handed out
    last: with asynchronous scheduling that step's forward may still be running."""
    for prefix_caching, expected_swap_out, expected_table in (
            (True, [(3, 1), (2, 0), (4, 2)], [0, 1, 3]),  # hashed blocks, last first; then block 4
            (False, [(2, 0), (3, 1), (4, 2)], [0, 1, 2])):  # no hashes: table order
        s = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=8, mode="swap", prefix_caching=prefix_caching)
        a, b = make_seq(7), make_seq(8, start=200)
        s.add(a)
        s.add(b)
        run_step(s)  # a [0, 1], b [2, 3]
        run_step(s)  # b's 9th token takes block 4: no block is free now
        out, _ = run_step(s)  # a's 9th token needs a block: b is swapped out
        assert b.status.name == "SWAPPED" and b.cpu_block_table == [0, 1, 2]
        assert out.swap_out == expected_swap_out and a.block_table == expected_table


def test_blocks_the_step_in_flight_writes_are_copied_and_handed_out_last():
    """The victim's block that the step before wrote goes to the end of the free queue and of the copies: with
    asynchronous scheduling the copy engine can copy the other blocks while that step's forward still runs."""
    s = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=8, mode="swap")
    a, b = make_seq(7), make_seq(12, start=200)
    s.add(a)
    s.add(b)
    run_step(s)  # a [0, 1]; b [2, 3, 4], all three full and cached
    run_step(s)  # a writes position 7 into block 1; b position 12 into a new block 5: none is free now
    assert b.block_table == [2, 3, 4, 5] and s.block_manager.num_free_blocks == 0
    assert s.offload._blocks_in_flight(b) == [5] and s.offload._blocks_in_flight(a) == [1]
    out, _ = run_step(s)  # a's position 8 needs a block: b is swapped out, a gets b's last full block
    assert b.status.name == "SWAPPED" and b.cpu_block_table == [0, 1, 2, 3]
    assert out.swap_out == [(4, 2), (3, 1), (2, 0), (5, 3)] and a.block_table == [0, 1, 4]
    assert list(s.block_manager.free_block_ids) == [3, 2, 5]
    check(s)


def test_a_resumed_sequence_stays_out_of_the_batch_until_its_kv_has_landed():
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, mode="swap")
    a, b = make_seq(6), make_seq(6, start=200)
    s.add(a)
    s.add(b)
    run_step(s)
    s.preempt(b, mode="swap")
    # b's swap-out goes out, and b is swapped straight back in: its copies are in flight
    swapped, _ = run_step(s, land_copies=False)
    assert swapped.swap_in and b.status.name == "RUNNING" and s.offload.seq_ids_to_hold(s.running) == {b.seq_id}
    assert b.block_table == [2, 4] and s.block_manager.loading == {4}  # its full block 2 was still cached
    out, _ = run_step(s)
    assert out.seqs == [a]  # a runs; b waits for its KV instead of stalling the forward
    s.offload.complete(TransferReport([swapped.store_id]))
    out, _ = run_step(s)
    assert out.seqs == [a]  # its swap-out landed, its swap-in not yet
    s.offload.complete(TransferReport([swapped.load_id]))
    out, _ = run_step(s)
    assert out.seqs == [a, b] and not s.block_manager.loading


def test_a_sequence_waiting_for_its_kv_runs_when_nothing_else_can():
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, mode="swap")
    b = make_seq(6, start=200)
    s.add(b)
    run_step(s)
    s.preempt(b, mode="swap")
    run_step(s, land_copies=False)  # swapped out and straight back in
    out, _ = run_step(s)
    # alone: it runs, and the forward waits for the copy into block 2 on the device (rule 3)
    assert out.seqs == [b] and b.block_table == [0, 2] and s.block_manager.loading == {2}


@pytest.mark.parametrize("asynchronous", [False, True])
def test_max_model_len_ends_a_sequence_before_max_tokens(asynchronous):
    """A sequence stops for "length" at max_model_len tokens even when max_tokens allows more, and with
    asynchronous scheduling nothing is scheduled for it past that length."""
    s = make_scheduler(num_gpu_blocks=16, max_model_len=12)
    seq = make_seq(num_tokens=6, max_tokens=20)
    s.add(seq)
    in_flight, num_scheduled = [], 0
    for _ in range(12):
        if asynchronous:
            out = run_step_async(s, in_flight)
        else:
            out, _ = run_step(s)
        num_scheduled += sum(out.num_new_tokens)
        if seq.is_finished and not in_flight:
            break
    assert seq.finish_reason == "length" and seq.num_tokens == 12
    assert num_scheduled == 11  # the 6 prompt tokens, then one per decode step up to the 11th token


def test_scheduler_without_a_policy_recomputes():
    """The engine always passes a policy; a Scheduler built without one (its default) recomputes its victims
    instead of failing on the first preemption."""
    s = make_scheduler(num_gpu_blocks=6, num_cpu_blocks=8)
    s.offload.policy = None
    a = make_seq(8)
    s.add(a)
    run_step(s)
    s.preempt(a)
    check(s)
    assert a.status.name == "WAITING" and a.num_computed_tokens == 0 and s.stats.preemptions_recompute == 1
    run_step(s)  # an explicit mode still swaps
    s.preempt(a, mode="swap")
    assert a.status.name == "SWAPPED" and s.stats.preemptions_swap == 1


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_running_stays_in_arrival_order_through_preemptions(mode):
    """Victims leave from the back of `running` (newest first) and must come back oldest first, by swap-in as by
    recompute, so that the next preemption again takes the newest. Random workloads on a tight pool keep two or
    more victims waiting to resume at once, preempted in one step or in steps one after the other."""
    import random
    num_steps_with_two_victims = 0
    for seed in range(10):
        rng = random.Random(seed)
        s = make_scheduler(num_gpu_blocks=12, num_cpu_blocks=64, mode=mode, max_num_seqs=6,
                           max_num_batched_tokens=64, max_model_len=64)
        for i in range(8):
            s.add(make_seq(rng.randint(3, 9), start=1000 + 50 * i, max_tokens=rng.randint(5, 20)))
        for _ in range(300):
            run_step(s)
            ids = [q.seq_id for q in s.running]
            assert ids == sorted(ids), (seed, ids)
            victims = list(s.swapped) + [q for q in s.waiting if q.num_recompute_pending]
            num_steps_with_two_victims += len(victims) >= 2
            if s.is_finished():
                break
        assert s.is_finished()
    assert num_steps_with_two_victims > 0


def test_reset_prefix_cache_forgets_both_tiers_or_neither():
    """A host block held (here as a disk write holds one) refuses the reset, and the GPU cache is kept too."""
    s = make_scheduler(prefix_caching=True)
    seq = make_seq(9)
    assert s.block_manager.allocate(seq, 9, [], 0, None)
    seq.num_computed_tokens = 9
    s.block_manager.cache_full_blocks(seq)
    s.block_manager.free(seq)
    cached = dict(s.block_manager.hash_to_block_id)
    assert len(cached) == 2
    cpu_block_id = s.offload.pool.store(12345)  # RESERVED: held by its store
    assert not s.reset_prefix_cache() and s.block_manager.hash_to_block_id == cached
    s.offload.pool.begin_writes([cpu_block_id])
    s.offload.pool.finish_writes([cpu_block_id])
    s.offload.pool.release(cpu_block_id, -1)
    assert s.reset_prefix_cache() and not s.block_manager.hash_to_block_id and not s.offload.pool.hash_to_block_id
    assert s.offload.pool.state[cpu_block_id].name == "FREE"
    s.offload.check_invariants([])


def test_a_swapped_sequence_resumes_only_with_room_for_its_next_chunk():
    """Resumed as soon as its own blocks fit, a sequence in chunked prefill found no room for its next chunk, was
    preempted again by it and swapped in and out every other step. It waits until its blocks, the next chunk's and
    the watermark are free."""
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=16, max_num_batched_tokens=7, mode="swap")
    a = make_seq(13, max_tokens=14)  # 27 tokens: 7 blocks at most
    s.add(a)
    run_step(s)
    run_step(s)
    b = make_seq(28, start=200, max_tokens=4)
    s.add(b)
    run_step(s)
    run_step(s)
    assert a.block_table == [0, 1, 2, 3] and b.block_table == [4, 5, 6] and b.num_computed_tokens == 12
    s.preempt(b, mode="swap")
    out, _ = run_step(s)  # b's 3 blocks + 2 for its next 7 tokens + 1 of watermark > the 4 free: it stays out
    assert out.swap_out == [(4, 0), (6, 2), (5, 1)] and out.swap_in == [] and b.status.name == "SWAPPED"
    while not b.is_finished:
        run_step(s)
    assert a.is_finished and s.stats.preemptions == 1 and s.stats.recomputed_tokens == 0


def test_an_aborted_victims_host_blocks_stay_held_until_its_swap_out_lands():
    """A sequence aborted right after it was swapped out: the copies into its host blocks still go out with the
    next step, so those blocks stay held (RESERVED, then WRITING) until the copy engine reports them; only then
    are they free for another store or swap-out."""
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=4, mode="swap")
    a, b = make_seq(6), make_seq(6, start=200)
    s.add(a)
    s.add(b)
    run_step(s)
    s.preempt(b, mode="swap")
    assert b.cpu_block_table == [0, 1] and s.offload.pool.state[0].name == "RESERVED"
    s.finish(b, "abort")
    assert s.host_pool.num_free_blocks == 2  # b's references are gone; its store's are not
    out, _ = run_step(s, land_copies=False)
    assert out.swap_out == [(3, 1), (2, 0)] and s.offload.pool.state[1].name == "WRITING"  # hand-out order
    assert s.host_pool.num_free_blocks == 2
    s.offload.complete(TransferReport([out.store_id]))
    # the full block stays cached (READY, findable), the partial one is FREE
    assert s.host_pool.num_free_blocks == 4 and [st.name for st in s.offload.pool.state] == ["READY"] + ["FREE"] * 3
    check(s)


def test_settle_drops_the_holds_of_copies_that_were_never_issued():
    """A step that raised between scheduling and launch leaves transfers no copy engine will report; once the copy
    engine has synchronized, settle drops them: the stores' blocks hold nothing (FREE, unhashed), the loads'
    blocks are released, so the prefix caches can be reset again."""
    class NothingIssued:
        def synchronize(self):
            pass

        def get_finished(self):
            return TransferReport()

    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=4, mode="swap")
    s.offload.prefix_cache = True
    a, b = make_seq(6), make_seq(6, start=200)
    s.add(a)
    s.add(b)
    run_step(s)
    s.preempt(b, mode="swap")
    out = s.schedule()  # b swapped out and straight back in; the step is never launched
    assert out.store_id >= 0 and out.load_id >= 0 and not s.reset_prefix_cache()
    s.finish(a, "abort")
    s.finish(b, "abort")
    s.offload.settle(NothingIssued())
    pool = s.host_pool
    assert pool.num_free_blocks == 4 and not pool.hash_to_block_id and {st.name for st in pool.state} == {"FREE"}
    assert s.reset_prefix_cache()
    check(s)


def test_a_sequence_aborted_while_its_kv_loads_frees_its_gpu_blocks_when_the_load_lands():
    """The load holds the blocks it fills: handed out before the copy landed, they would be overwritten by it."""
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, mode="swap")
    a, b = make_seq(6), make_seq(6, start=200)
    s.add(a)
    s.add(b)
    run_step(s)  # a [0, 1], b [2, 3]
    s.preempt(b, mode="swap")
    swapped, _ = run_step(s, land_copies=False)  # b's swap-out, and its swap-in of the partial block
    assert b.block_table == [2, 4] and swapped.swap_in == [(1, 4)] and s.block_manager.loading == {4}
    s.finish(b, "abort")
    assert 4 not in s.block_manager.free_block_ids and s.block_manager.ref_counts[4] == 1
    s.offload.complete(TransferReport([swapped.store_id, swapped.load_id]))
    assert not s.block_manager.loading and 4 in s.block_manager.free_block_ids
    check(s)


def test_the_scheduler_names_the_blocks_each_step_writes():
    """SchedulerOutput.written_gpu_block_ids: one block per row in a decode step, each row's blocks otherwise;
    the offload manager and the copy engine read this list, nothing recomputes it."""
    s = make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, max_num_batched_tokens=64)
    a, b = make_seq(6), make_seq(9, start=200)
    s.add(a)
    s.add(b)
    out, _ = run_step(s)
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4] and out.written_gpu_block_ids == [0, 1, 2, 3, 4]
    out, _ = run_step(s)  # a's position 6 in block 1, b's position 9 in block 4
    assert out.written_gpu_block_ids == [1, 4]
    assert s.offload._blocks_in_flight(a) == [1] and s.offload._blocks_in_flight(b) == [4]


def test_a_prompt_waits_for_the_blocks_a_load_holds_after_its_sequence_was_aborted():
    """The blocks of a sequence aborted while its KV loads come free when the load lands; until then a prompt
    that needs them is not admitted, and the scheduler says a load is in flight (a reason to wait)."""
    s = make_scheduler(num_gpu_blocks=4, num_cpu_blocks=8, mode="swap")
    b = make_seq(6, start=200, max_tokens=20)
    s.add(b)
    run_step(s)  # b [0, 1]: block 0 full (cached), block 1 partial
    s.preempt(b, mode="swap")
    swapped, _ = run_step(s, land_copies=False)  # back in: block 0 still cached, the partial block copied to 2
    assert b.block_table == [0, 2] and swapped.swap_in == [(1, 2)] and s.block_manager.loading == {2}
    assert s.num_loads_in_flight == 1
    s.finish(b, "abort")  # blocks 0 and 3 are free (and 1, which b left); block 2 stays with the load
    assert list(s.block_manager.free_block_ids) == [3, 1, 0] and s.block_manager.ref_counts[2] == 1
    c = make_seq(13, start=500)  # needs 4 blocks
    s.add(c)
    out, _ = run_step(s)
    assert out.seqs == [] and list(s.waiting) == [c] and s.num_loads_in_flight == 1
    s.offload.complete(TransferReport([swapped.store_id, swapped.load_id]))
    assert s.num_loads_in_flight == 0 and s.block_manager.num_free_blocks == 4
    out, _ = run_step(s)
    assert out.seqs == [c]


def test_a_sequence_whose_kv_is_loading_is_passed_over_as_a_victim():
    """Preempting c while its swap-in is in flight would free none of its loading blocks (the load holds them):
    b, the newest sequence not loading, is preempted instead (here b itself, which needed the block)."""
    s = make_scheduler(num_gpu_blocks=7, num_cpu_blocks=16, mode="swap", prefix_caching=False)
    a, b, c = make_seq(6), make_seq(6, start=200), make_seq(6, start=300)
    for seq in (a, b, c):
        s.add(seq)
    run_step(s)  # a [0, 1], b [2, 3], c [4, 5]
    s.preempt(c, mode="swap")
    out, _ = run_step(s, land_copies=False)  # c out of [4, 5] and back into [6, 4]
    assert out.swap_in == [(0, 6), (1, 4)] and s.block_manager.loading == {4, 6}
    out, _ = run_step(s, land_copies=False)  # a and b decode; c waits for its KV
    assert out.seqs == [a, b] and list(s.block_manager.free_block_ids) == [5]
    out, _ = run_step(s, land_copies=False)  # a takes block 5; b needs one: c is passed over
    assert out.seqs == [a] and b.status.name == "SWAPPED" and c.status.name == "RUNNING"
    assert out.swap_out == [(2, 2), (3, 3)] and s.block_manager.loading == {4, 6}
