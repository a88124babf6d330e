"""GPU block manager: allocation order, prefix-cache hits and eviction, exact block ids (no torch needed)."""
import pytest

from metadata_factories import BLOCK_SIZE, make_seq
from nanovllm.core.block_manager import BlockManager
from nanovllm_offload.swap_in_allocation import allocate_for_swap_in


def test_allocate_takes_blocks_from_the_head_in_order():
    bm = BlockManager(6, BLOCK_SIZE)
    a, b = make_seq(6), make_seq(9, start=200)
    assert bm.allocate(a, 6)
    assert bm.allocate(b, 9)
    assert a.block_table == [0, 1] and b.block_table == [2, 3, 4]
    assert list(bm.free_block_ids) == [5]
    bm.check_invariants([a, b])


def test_allocate_is_all_or_nothing_when_short():
    bm = BlockManager(3, BLOCK_SIZE)
    a = make_seq(16)
    assert not bm.allocate(a, 16)  # needs 4 blocks, 3 exist
    assert a.block_table == [] and bm.num_free_blocks == 3
    assert not bm.allocate(make_seq(8), 8, num_reserved_blocks=2)  # 2 needed + 2 reserved > 3
    bm.check_invariants([])


def test_prefix_hit_reuses_computed_full_blocks_but_not_the_last_token():
    bm = BlockManager(8, BLOCK_SIZE)
    a = make_seq(10)
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # blocks 0 and 1 are full -> cached; block 2 (2 tokens) is not
    assert bm.hash_to_block_id == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    b = make_seq(9)  # same first 9 tokens: two full blocks, but the 9th token must be computed
    assert bm.find_cached_prefix(b) == [0, 1]
    c = make_seq(8)  # exactly two blocks: the last block holds the last token, so only block 0 hits
    assert bm.find_cached_prefix(c) == [0]
    assert bm.allocate(b, 1, [0, 1])
    assert b.block_table == [0, 1, 3] and b.num_computed_tokens == 8
    assert bm.ref_counts[:4] == [2, 2, 1, 1]
    bm.check_invariants([a, b])


def test_blocks_not_yet_computed_are_never_hits():
    bm = BlockManager(8, BLOCK_SIZE)
    a = make_seq(12)
    assert bm.allocate(a, 12)  # allocated, not computed
    assert bm.find_cached_prefix(make_seq(12)) == []


def test_free_keeps_hashed_blocks_at_the_tail_and_eviction_is_lru():
    bm = BlockManager(4, BLOCK_SIZE)
    a = make_seq(10)
    assert bm.allocate(a, 10)  # blocks 0, 1, 2
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    bm.free(a)
    # the partial block 2 has no hash: head; full blocks are freed last-first and keep their hashes
    assert list(bm.free_block_ids) == [2, 3, 1, 0]
    b = make_seq(5, start=500)  # unrelated: takes 2 and 3, the prefix cache survives
    assert bm.allocate(b, 5)
    assert b.block_table == [2, 3] and len(bm.hash_to_block_id) == 2
    c = make_seq(3, start=900)  # takes block 1: its hash is evicted, block 0 stays cached
    assert bm.allocate(c, 3)
    assert c.block_table == [1] and list(bm.hash_to_block_id.values()) == [0]
    assert bm.find_cached_prefix(make_seq(10)) == [0]
    bm.check_invariants([b, c])


def test_hit_on_a_free_cached_block_revives_it():
    bm = BlockManager(4, BLOCK_SIZE)
    a = make_seq(9)
    assert bm.allocate(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.free(a)
    b = make_seq(9)
    hits = bm.find_cached_prefix(b)
    assert hits == [0, 1]
    assert bm.allocate(b, 1, hits)
    assert b.block_table == [0, 1, 2] and bm.ref_counts == [1, 1, 1, 0]
    assert list(bm.free_block_ids) == [3]
    bm.check_invariants([b])


def test_swap_in_reuses_gpu_cached_blocks_and_copies_the_rest():
    bm = BlockManager(6, BLOCK_SIZE)
    a = make_seq(10)
    assert bm.allocate(a, 10)
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    bm.free(a)  # as a swap-out would: blocks 0, 1 stay cached on the GPU
    a.cpu_block_table = [7, 8, 9]
    copies = allocate_for_swap_in(a, bm)
    assert a.block_table == [0, 1, 2]  # 2 was at the head of the free queue (no hash)
    assert copies == [(9, 2)]  # only the partial block crosses the link
    bm.check_invariants([a])


def test_swap_in_takes_its_cached_blocks_before_handing_out_free_ones():
    """Block 2 of `a` is still cached while block 1 was reused: the copy for block 1 must not land in block 2,
    which sits at the head of the free queue (a bug found by the GPU swap test: table [8, 5, 5])."""
    bm = BlockManager(7, BLOCK_SIZE)
    a, b = make_seq(12), make_seq(16, start=500)
    assert bm.allocate(a, 12) and bm.allocate(b, 16)  # a: [0, 1, 2], b: [3, 4, 5, 6]
    a.num_computed_tokens, b.num_computed_tokens = 12, 16
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    bm.free_swapped_out(a, [2])  # swapped out while the forward in flight writes block 2
    bm.free(b)
    assert list(bm.free_block_ids) == [1, 0, 2, 6, 5, 4, 3]
    c = make_seq(4, start=900)
    assert bm.allocate(c, 4) and c.block_table == [1]  # a's block 1 loses its hash; 0 and 2 stay cached
    a.cpu_block_table = [7, 8, 9]
    copies = allocate_for_swap_in(a, bm)
    assert a.block_table == [0, 6, 2] and copies == [(8, 6)]
    bm.check_invariants([a, c])


def test_double_free_is_a_bug_naming_the_block():
    bm = BlockManager(2, BLOCK_SIZE)
    a = make_seq(3)
    assert bm.allocate(a, 3)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(RuntimeError, match="block 0 of seq"):
        bm.free(a)


def _finished_with_tail(bm: BlockManager):
    """A finished 7-token sequence (6 prompt tokens computed, 1 sampled): block 0 full and cached, block 1 its
    tail holding the KV of tokens 104 and 105."""
    a = make_seq(6)
    assert bm.allocate(a, 6)
    a.num_computed_tokens = 6
    a.token_ids.append(106)  # the last sampled token never gets KV
    bm.cache_full_blocks(a)
    bm.free(a, keep_tail=True)
    return a


def test_a_finished_sequence_keeps_its_partial_block_for_the_next_turn():
    bm = BlockManager(8, BLOCK_SIZE)
    a = _finished_with_tail(bm)
    # the tail waits behind the free blocks, and ahead of the full block before it (evicted after it)
    assert list(bm.free_block_ids) == [2, 3, 4, 5, 6, 7, 1, 0]
    assert bm.tail_by_parent == {a.block_hashes[0]: 1} and bm.tail_tokens == {1: (a.block_hashes[0], [104, 105])}
    bm.check_invariants([])
    b = make_seq(token_ids=[100, 101, 102, 103, 104, 105, 106, 300, 301])  # the next turn continues a
    hits = bm.find_cached_prefix(b)
    assert hits == [0]
    tail = bm.find_cached_tail(b, len(hits))
    assert tail == (1, 2)
    assert bm.allocate(b, 3, hits, tail=tail)
    assert b.block_table == [0, 1, 2] and b.num_computed_tokens == 6
    assert bm.tail_by_parent == {} and bm.tail_tokens == {}  # taken over, not shared
    assert bm.ref_counts[:3] == [1, 1, 1]
    bm.check_invariants([b])


def test_a_tail_matches_up_to_the_first_different_token_and_never_the_last_prompt_token():
    bm = BlockManager(8, BLOCK_SIZE)
    _finished_with_tail(bm)
    diverging = make_seq(token_ids=[100, 101, 102, 103, 104, 999, 7, 8])
    assert bm.find_cached_tail(diverging, 1) == (1, 1)
    assert bm.allocate(diverging, 3, bm.find_cached_prefix(diverging), tail=(1, 1))
    assert diverging.block_table == [0, 1] and diverging.num_computed_tokens == 5
    bm.check_invariants([diverging])

    bm = BlockManager(8, BLOCK_SIZE)
    _finished_with_tail(bm)
    assert bm.find_cached_tail(make_seq(token_ids=[100, 101, 102, 103, 104, 105]), 1) == (1, 1)  # 105 is last
    assert bm.find_cached_tail(make_seq(token_ids=[100, 101, 102, 103, 104]), 1) is None  # only the last token
    assert bm.find_cached_tail(make_seq(token_ids=[100, 101, 102, 103, 555, 105, 1]), 1) is None
    assert bm.find_cached_tail(make_seq(token_ids=[100, 101, 102, 103, 104, 105, 1]), 0) is None  # other parent
    assert bm.find_cached_tail(make_seq(token_ids=[100, 101, 102, 9, 104, 105, 1]), 0) is None
    bm.check_invariants([])


def test_handing_out_a_tail_block_forgets_the_tail_and_a_newer_tail_replaces_an_older_one():
    bm = BlockManager(8, BLOCK_SIZE)
    _finished_with_tail(bm)
    c = make_seq(28, start=500)  # 7 blocks: the six free ones, then the tail block 1
    assert bm.allocate(c, 28)
    assert c.block_table == [2, 3, 4, 5, 6, 7, 1]
    assert bm.tail_by_parent == {} and bm.tail_tokens == {}
    assert bm.find_cached_tail(make_seq(token_ids=[100, 101, 102, 103, 104, 105, 106]), 1) is None
    bm.check_invariants([c])

    bm = BlockManager(8, BLOCK_SIZE)
    _finished_with_tail(bm)
    d = make_seq(token_ids=[100, 101, 102, 103, 104, 77, 78])  # same parent, other tail
    assert bm.allocate(d, 3, bm.find_cached_prefix(d))  # (no tail taken) blocks 0 and 2
    d.num_computed_tokens = 6
    bm.free(d, keep_tail=True)
    parent = d.block_hashes[0]
    assert bm.tail_by_parent == {parent: 2} and bm.tail_tokens == {2: (parent, [104, 77])}
    bm.check_invariants([])


def test_free_without_keep_tail_and_with_prefix_caching_off_keeps_no_tail():
    bm = BlockManager(8, BLOCK_SIZE)
    a = make_seq(6)
    assert bm.allocate(a, 6)
    a.num_computed_tokens = 6
    bm.free(a)  # preemption or swap-out: the block table goes elsewhere
    assert bm.tail_tokens == {}
    bm = BlockManager(8, BLOCK_SIZE, False)
    _finished_with_tail(bm)
    assert bm.tail_tokens == {} and bm.find_cached_tail(make_seq(token_ids=list(range(100, 108))), 0) is None


def test_free_swapped_out_returns_the_order_the_free_queue_hands_the_blocks_out():
    """The swap-out copies a victim's blocks in the order this returns; it must be the order pop_free then hands
    them out, the blocks the step in flight writes last."""
    bm = BlockManager(8, BLOCK_SIZE)
    a = make_seq(14)  # blocks 0, 1, 2 full, 3 partial
    assert bm.allocate(a, 14)
    a.num_computed_tokens = 14
    bm.cache_full_blocks(a)
    order = bm.free_swapped_out(a, hand_out_last=[1])
    assert order == [3, 2, 0, 1]
    handed_out = [bm.pop_free() for _ in range(bm.num_free_blocks)]
    assert [b for b in handed_out if b in order] == order


def test_a_loading_block_is_held_by_its_load_and_is_no_prefix_hit():
    """A gpu block is loading from the moment its load is prepared until the copy engine reports it: its load
    holds it, so freeing its sequence meanwhile (an abort) does not hand it out, and no lookup finds it."""
    bm = BlockManager(6, BLOCK_SIZE)
    a = make_seq(10)
    assert bm.allocate(a, 10) and a.block_table == [0, 1, 2]
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)  # blocks 0 and 1 are cached
    bm.begin_loads([1, 2])  # say a came back from the host and blocks 1 and 2 are being filled
    assert bm.loading == {1, 2} and bm.ref_counts[:3] == [1, 2, 2]
    assert bm.find_cached_prefix(make_seq(9)) == [0]  # block 1 holds a's second block, but not yet
    bm.check_invariants([a])  # the loads' references count
    bm.free(a)  # aborted while loading: only block 0 is free
    assert list(bm.free_block_ids) == [3, 4, 5, 0] and bm.ref_counts[:3] == [0, 1, 1]
    b = make_seq(12, start=500)
    assert not bm.allocate(b, 20)  # 5 blocks wanted, 4 free: the loading ones are not among them
    bm.finish_loads([1, 2])  # landed: block 2 (unhashed) goes to the head, block 1 (cached) to the tail
    assert not bm.loading and list(bm.free_block_ids) == [2, 3, 4, 5, 0, 1]
    assert bm.find_cached_prefix(make_seq(9)) == [0, 1]
    bm.check_invariants([])


def test_loading_states_are_asserted_on_the_block():
    bm = BlockManager(4, BLOCK_SIZE)
    a = make_seq(4)
    assert bm.allocate(a, 4) and a.block_table == [0]
    bm.begin_loads([0])
    with pytest.raises(RuntimeError, match="gpu block 0 is already loading"):
        bm.begin_loads([0])
    with pytest.raises(RuntimeError, match="gpu block 3 is not loading"):
        bm.finish_loads([3])
    bm.loading.add(1)  # a broken invariant: a loading block in the free queue
    with pytest.raises(RuntimeError, match="gpu block 1 is loading but was in the free queue"):
        bm.allocate(make_seq(8, start=300), 8)


def test_a_swap_in_does_not_reuse_a_cached_block_that_is_still_loading():
    bm = BlockManager(6, BLOCK_SIZE)
    a, b = make_seq(8), make_seq(8)  # the same two full blocks
    assert bm.allocate(a, 8) and a.block_table == [0, 1]
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert bm.hash_to_block_id == {a.block_hashes[0]: 0, a.block_hashes[1]: 1}
    bm.begin_loads([1])  # block 1 is cached (a's second block) but still being filled
    b.num_computed_tokens, b.cpu_block_table = 8, [4, 5]  # b is SWAPPED with the same KV on the host
    b.block_hashes = list(a.block_hashes)  # hashed when it computed them
    assert allocate_for_swap_in(b, bm) == [(5, 2)] and b.block_table == [0, 2]
    bm.check_invariants([a, b])
