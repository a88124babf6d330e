"""The host pool as a second-level prefix cache: write-back, LRU, hits on admission, competition with swapped
sequences. Metadata tests with exact ids (no torch), then the real engine on CPU."""
import pytest

from metadata_factories import check, make_scheduler, make_seq, run_step
from nanovllm.core.hashing import content_hash
from nanovllm_offload.host_block_pool import HostBlockPool


def host_cached_scheduler(num_gpu_blocks=4, num_cpu_blocks=8):
    s = make_scheduler(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks, mode="swap")
    s.offload.prefix_cache = True
    return s


def finish(s, seq):
    while not seq.is_finished:
        run_step(s)


def test_freed_blocks_are_written_back_and_hit_after_gpu_eviction():
    s = host_cached_scheduler(num_gpu_blocks=4)
    a = make_seq(9, max_tokens=1)  # 9 prompt tokens: blocks 0, 1 full, 2 partial
    s.add(a)
    finish(s, a)
    out, _ = run_step(s)  # nothing to run, but a's two full blocks are written back
    assert out.swap_out == [(1, 0), (0, 1)]  # freed last-first; host blocks handed out in order
    assert s.stats.blocks_offloaded == 2
    b = make_seq(16, start=500, max_tokens=1)  # unrelated, takes all 4 GPU blocks: a's GPU cache is gone
    s.add(b)
    finish(s, b)
    assert s.block_manager.find_cached_prefix(make_seq(9)) == []
    c = make_seq(9, max_tokens=2)  # a's prompt again: both full blocks come from the host
    s.add(c)
    out, _ = run_step(s)
    assert c not in out.seqs and c.num_computed_tokens == 8  # copies first; prefill starts next step
    assert out.swap_in == [(1, c.block_table[0]), (0, c.block_table[1])]
    # queried: a's 2 full blocks, b's 3 (its 4th holds the last token), c's 2; hit: c's 2
    assert s.stats.host_prefix_hit_tokens == 8 and s.stats.host_prefix_query_tokens == 28
    out, _ = run_step(s)
    assert out.seqs == [c] and out.num_new_tokens == [1]  # only the last prompt token is computed
    finish(s, c)
    check(s)


def test_a_hit_covering_the_whole_prompt_still_computes_the_last_token():
    s = host_cached_scheduler(num_gpu_blocks=4)
    a = make_seq(8, max_tokens=1)  # exactly two full blocks
    s.add(a)
    finish(s, a)
    run_step(s)
    s.add(b := make_seq(16, start=500, max_tokens=1))
    finish(s, b)
    c = make_seq(8, max_tokens=1)
    s.add(c)
    out, _ = run_step(s)
    # only block 0 may hit: block 1 holds the last prompt token, which must be computed for logits
    assert len(out.swap_in) == 1 and c.num_computed_tokens == 4
    out, _ = run_step(s)
    assert out.num_new_tokens == [4]


def test_a_prompt_resuming_after_host_hits_runs_behind_the_decode_rows():
    s = host_cached_scheduler(num_gpu_blocks=8, num_cpu_blocks=16)
    a = make_seq(9, max_tokens=1)
    s.add(a)
    finish(s, a)
    run_step(s)  # a's two full blocks are written back
    s.add(b := make_seq(32, start=500, max_tokens=1))  # takes all 8 GPU blocks: a's GPU cache is gone
    finish(s, b)
    c = make_seq(14, max_tokens=2, token_ids=list(range(100, 108)) + list(range(600, 606)))  # a's 8 + 6 new
    d = make_seq(3, start=700, max_tokens=2)
    s.add(c)
    s.add(d)
    out, _ = run_step(s)  # c's two blocks are copied in; d is admitted behind it and prefills
    assert out.seqs == [d] and len(out.swap_in) == 2 and [x.seq_id for x in s.running] == [c.seq_id, d.seq_id]
    out = s.schedule()  # running order is c (6 prompt tokens), d (a decode): the decode row goes first
    check(s)
    assert out.seqs == [d, c] and out.num_new_tokens == [1, 6] and out.samples == [True, True]
    s.postprocess(out, [71, 72])  # sampled rows follow the batch order
    assert d.completion_token_ids == [7, 71] and c.completion_token_ids == [72]
    check(s)


def stored(host: HostBlockPool, block_hash: int) -> int | None:
    """host.store, and its copy landing (the store's hold released)."""
    cpu_block_id = host.store(block_hash)
    if cpu_block_id is not None:
        host.begin_writes([cpu_block_id])
        host.finish_writes([cpu_block_id])
        host.release(cpu_block_id, -1)
    return cpu_block_id


def test_host_lru_order_and_eviction_when_full():
    host = HostBlockPool(3)
    seqs = [make_seq(4, start=100 * i) for i in range(4)]
    for seq in seqs:
        seq.num_computed_tokens = 4
    h = [content_hash(seq, 0) for seq in seqs]
    assert [stored(host, x) for x in h[:3]] == [0, 1, 2]
    assert host.store(h[0]) is None  # already cached
    assert host.find_cached_prefix(seqs[0], 0, 1) == [0]
    host.touch([0])  # 0 becomes most recently used
    assert list(host.free_block_ids) == [1, 2, 0]
    assert stored(host, h[3]) == 1  # evicts the LRU entry (seq 1's block)
    assert host.find_cached_prefix(seqs[1], 0, 1) == []
    assert list(host.free_block_ids) == [2, 0, 1]
    host.check_invariants([])


def test_a_stored_block_is_found_and_evicted_only_once_its_copy_has_landed():
    """The host block a store fills is RESERVED, then WRITING, held by the store: no lookup finds it, and no other
    store or swap-out can evict it and copy over it, until the copy engine reports the store."""
    host = HostBlockPool(2)
    seqs = [make_seq(4, start=100 * i) for i in range(3)]
    for seq in seqs:
        seq.num_computed_tokens = 4
    h = [content_hash(seq, 0) for seq in seqs]
    assert host.store(h[0]) == 0 and host.store(h[1]) == 1
    host.begin_writes([0, 1])
    assert host.find_cached_prefix(seqs[0], 0, 1) == [] and host.store(h[2]) is None  # nothing evictable
    assert host.num_free_blocks == 0 and host.state[0].name == "WRITING"
    with pytest.raises(RuntimeError, match="cpu block 0 became free .* while WRITING"):
        host.release(0, -1)
    host.ref_counts[0] = 1  # (undo the failed release's count)
    host.free_block_ids.pop(0)
    host.finish_writes([0, 1])
    host.release(0, -1)
    host.release(1, -1)
    assert host.find_cached_prefix(seqs[0], 0, 1) == [0] and host.state[0].name == "READY"
    with pytest.raises(RuntimeError, match="cpu block 0 is READY, not WRITING"):
        host.finish_writes([0])
    host.check_invariants([])


def test_swapped_sequences_and_cached_blocks_compete_for_the_host_pool():
    s = host_cached_scheduler(num_gpu_blocks=5, num_cpu_blocks=3)
    a = make_seq(8, max_tokens=1)
    s.add(a)
    finish(s, a)
    run_step(s)
    assert s.host_pool.num_free_blocks == 3 and len(s.host_pool.hash_to_block_id) == 2  # cached, evictable
    # two new sequences fill the GPU; the newest is swapped out and claims host blocks, evicting cached ones
    b, c = make_seq(8, start=300), make_seq(8, start=500)
    s.add(b)
    s.add(c)
    run_step(s)
    out, _ = run_step(s)
    assert c.status.name == "SWAPPED" and c.cpu_block_table == [2, 0]  # the unhashed head, then the LRU entry
    assert s.host_pool.ref_counts == [1, 0, 1] and list(s.host_pool.free_block_ids) == [1]
    check(s)
    # a cached block can never take a pinned one: the pool can still store one more, then reports full
    finish(s, b)
    finish(s, c)
    check(s)
    assert s.stats.recomputed_tokens == 0


@pytest.fixture(scope="module")
def host_cache_runs(qwen3_dir):
    """The same shared-prefix prompts, one at a time, with a GPU cache too small to keep the prefix."""
    from conftest import close_llm, greedy, shared_prefix_prompts, tiny_llm_kwargs
    from nanovllm import LLM
    prompts = shared_prefix_prompts(48, [5, 9, 3, 12])
    results = {}
    for name, options in {"no cache": dict(enable_prefix_caching=False),
                          "host cache": dict(host_cache_policy="write_back"),
                          "write-through": dict(host_cache_policy="write_through")}.items():
        llm = LLM(qwen3_dir, **tiny_llm_kwargs(num_kvcache_blocks=20, swap_space=0.01, **options))
        try:
            outs = []
            for i, prompt in enumerate(prompts):
                outs.append(llm.generate([prompt], greedy(12), use_tqdm=False)[0]["token_ids"])
                llm.generate([[7 + i] * 75], greedy(4), use_tqdm=False)  # 20 blocks: evicts everything on the GPU
            results[name] = (outs, llm.stats())
        finally:
            close_llm(llm)
    return results


@pytest.mark.slow  # 2-6 CPU-seconds: out of `make test-fast`
@pytest.mark.parametrize("name", ["host cache", "write-through"])
def test_engine_host_hits_give_the_same_tokens(host_cache_runs, name):
    outs, stats = host_cache_runs[name]
    assert outs == host_cache_runs["no cache"][0]
    # prompts 2..4 get the 12 blocks of the shared prefix back from the host, none from the GPU
    assert stats["host_prefix_hit_tokens"] == 3 * 48 and stats["prefix_cache_hit_tokens"] == 0
    assert stats["blocks_onloaded"] * 4 == stats["host_prefix_hit_tokens"]
    assert stats["blocks_offloaded"] > 0


def test_a_host_hit_waits_for_its_store_to_land_and_holds_its_block_until_its_load_lands():
    """The store of a freed cached block is not a hit until the copy engine reports it; a hit is then held by its
    load (not evictable by a store of the same step) until that load is reported."""
    from nanovllm_offload.transfer_report import TransferReport
    s = host_cached_scheduler(num_gpu_blocks=4, num_cpu_blocks=2)
    a = make_seq(9, max_tokens=1)
    s.add(a)
    finish(s, a)
    stored, _ = run_step(s, land_copies=False)  # a's two full blocks go to host blocks 0 and 1, still WRITING
    assert stored.swap_out == [(1, 0), (0, 1)] and s.offload.pool.state[0].name == "WRITING"
    s.add(b := make_seq(16, start=500, max_tokens=1))  # takes all 4 GPU blocks: a's GPU cache is gone
    finish(s, b)
    assert run_step(s)[0].swap_out == []  # b's freed blocks find no host room: the store in flight holds both
    c = make_seq(9, max_tokens=2)
    assert s.offload.lookup(c, 0) == []  # not READY: no hit
    s.offload.complete(TransferReport([stored.store_id]))
    assert s.offload.lookup(c, 0) == [1, 0] and s.offload.pool.num_free_blocks == 2
    s.add(c)
    loaded, _ = run_step(s, land_copies=False)
    assert c.num_computed_tokens == 8 and loaded.swap_in and s.offload.pool.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="transfer 99 is not in flight"):
        s.offload.complete(TransferReport([99]))
    s.offload.complete(TransferReport([loaded.load_id]))
    assert s.offload.pool.num_free_blocks == 2 and not s.block_manager.loading
    finish(s, c)
    check(s)
