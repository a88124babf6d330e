"""Random workloads through the scheduler, the GPU block manager and the host pool, with every invariant checked
after every step: random prompt lengths and shared prefixes, tight GPU and host pools, all three preemption
modes, the host prefix cache on and off, swap-ins that land late, forced preemptions and aborts at random
moments. At the end every block on both tiers must be free again."""
import random

import pytest

from metadata_factories import ShadowKV, check, make_scheduler, make_seq, run_step, run_step_async
from nanovllm_offload.transfer_report import TransferReport


def run_random_workload(seed: int):
    rng = random.Random(seed)
    mode = ["swap", "recompute", "auto"][seed % 3]
    s = make_scheduler(num_gpu_blocks=rng.randint(10, 16), num_cpu_blocks=rng.choice([0, 4, 16, 64]), mode=mode,
                       max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.choice([8, 16, 64]),
                       max_model_len=40)
    s.offload.prefix_cache = seed % 2 == 0
    # copies that take a random number of steps to land: arriving sequences are held back, and host blocks stay
    # WRITING (held, not findable) meanwhile
    lands_late, copies_in_flight, num_held = seed % 4 == 1 and s.offload is not None, [], 0
    prefix = [rng.randrange(1, 500) for _ in range(12)]
    pending = []
    for _ in range(rng.randint(10, 20)):
        body = [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]
        pending.append(make_seq(token_ids=(prefix if rng.random() < 0.5 else []) + body,
                                max_tokens=rng.randint(1, 16)))
    seqs = list(pending)
    aborted = []
    shadow = ShadowKV()
    asynchronous, in_flight = seed % 5 >= 2, []  # the engine's loop: step N-1 is read back after N is launched
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            s.add(pending.pop(0))
        if s.running and rng.random() < 0.1:  # force a preemption of a random running sequence
            s.preempt(rng.choice(s.running), mode=rng.choice(["swap", "recompute"]))
            check(s)
        unfinished = [q for q in seqs if q.status.name in ("WAITING", "RUNNING", "SWAPPED") and q not in pending]
        if unfinished and rng.random() < 0.03:  # abort in any state
            victim = rng.choice(unfinished)
            s.finish(victim, "abort")
            aborted.append(victim)
            check(s, extra=[victim])
        if asynchronous:
            out = run_step_async(s, in_flight, sampled_token=rng.randrange(1, 500), shadow=shadow,
                                 land_copies=not lands_late)
        else:
            out, _ = run_step(s, sampled_token=rng.randrange(1, 500), shadow=shadow, land_copies=not lands_late)
        if lands_late:
            copies_in_flight += out.transfer_ids
            landed = [i for i in copies_in_flight if rng.random() < 0.4]
            copies_in_flight = [i for i in copies_in_flight if i not in landed]
            s.offload.complete(TransferReport(landed))
            num_held += len(copies_in_flight)
            check(s)
        if not pending and s.is_finished() and not in_flight:
            break
    else:
        raise AssertionError(f"seed {seed}: not finished after 2000 steps: {s.waiting} {s.running} {s.swapped}")
    if copies_in_flight:
        s.offload.complete(TransferReport(copies_in_flight))
    for q in seqs:
        assert q.is_finished and not q.block_table and not q.cpu_block_table
        if q not in aborted:
            assert q.num_completion_tokens == min(q.sampling_params.max_tokens, 40 - q.num_prompt_tokens)
    bm = s.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(r == 0 for r in bm.ref_counts)
    if s.host_pool is not None:
        assert s.host_pool.num_free_blocks == s.host_pool.num_blocks
    return s.stats, num_held


SEEDS = range(200)


@pytest.mark.parametrize("seed", SEEDS)
def test_random_workload_keeps_every_invariant(seed):
    run_random_workload(seed)


def test_random_workloads_cover_every_path():
    """The workloads above really reach the paths they are meant to stress."""
    runs = [run_random_workload(seed) for seed in SEEDS]
    stats = [st for st, _ in runs]
    assert sum(num_held for _, num_held in runs) > 0  # copies did land late
    for field in ("preemptions_swap", "preemptions_recompute", "blocks_swapped_in", "prefix_cache_hit_tokens",
                  "host_prefix_hit_tokens", "blocks_offloaded", "recomputed_tokens"):
        assert sum(getattr(st, field) for st in stats) > 0, field
