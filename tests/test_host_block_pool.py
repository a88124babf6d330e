"""Host block pool: allocation, freeing, dedup of shared blocks, the full-pool answer (no torch needed)."""
from metadata_factories import BLOCK_SIZE, make_seq
from nanovllm.core.block_manager import BlockManager
from nanovllm_offload.host_block_pool import HostBlockPool


def landed(host: HostBlockPool, copies: list[tuple[int, int]]):
    """The copies into these host blocks went out and landed: RESERVED -> WRITING -> READY."""
    cpu_block_ids = [cpu_block_id for _, cpu_block_id in copies]
    host.begin_writes(cpu_block_ids)
    host.finish_writes(cpu_block_ids)


def computed(bm: BlockManager, seq, num_tokens: int):
    assert bm.allocate(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.cache_full_blocks(seq)


def test_swap_out_maps_each_computed_block_to_a_host_block():
    bm, host = BlockManager(8, BLOCK_SIZE), HostBlockPool(4)
    a = make_seq(10)
    computed(bm, a, 10)
    copies = host.swap_out(a, bm.computed_block_ids(a))
    assert copies == [(0, 0), (1, 1), (2, 2)]
    assert a.cpu_block_table == [0, 1, 2] and list(host.free_block_ids) == [3]
    host.check_invariants([a])


def test_full_pool_answers_none_and_changes_nothing():
    bm, host = BlockManager(8, BLOCK_SIZE), HostBlockPool(2)
    a = make_seq(10)
    computed(bm, a, 10)
    assert not host.can_swap_out(a, 3)
    assert host.swap_out(a, bm.computed_block_ids(a)) is None
    assert a.cpu_block_table == [] and host.num_free_blocks == 2
    host.check_invariants([a])


def test_shared_prefix_is_copied_once():
    bm, host = BlockManager(8, BLOCK_SIZE), HostBlockPool(8)
    a, b = make_seq(10), make_seq(10)
    computed(bm, a, 10)
    hits = bm.find_cached_prefix(b)
    assert bm.allocate(b, 2, hits)
    b.num_computed_tokens = 10
    bm.cache_full_blocks(b)
    assert b.block_table == [0, 1, 3]
    landed(host, host.swap_out(a, bm.computed_block_ids(a)))
    # b shares the two full blocks: only its own partial block is copied
    copies = host.swap_out(b, bm.computed_block_ids(b))
    assert copies == [(3, 3)]
    landed(host, copies)
    assert b.cpu_block_table == [0, 1, 3] and host.ref_counts[:4] == [2, 2, 1, 1]
    host.check_invariants([a, b])
    host.free(a)
    assert host.ref_counts[:4] == [1, 1, 0, 1]
    host.free(b)
    # hashed blocks stay findable at the tail (last-freed first); unhashed ones go to the head
    assert list(host.free_block_ids)[:2] == [3, 2] and list(host.free_block_ids)[-2:] == [1, 0]
    host.check_invariants([])


def test_free_after_swap_in_keeps_hashed_blocks_cached():
    bm, host = BlockManager(8, BLOCK_SIZE), HostBlockPool(4)
    a = make_seq(8)
    computed(bm, a, 8)
    landed(host, host.swap_out(a, bm.computed_block_ids(a)))
    host.free(a)
    b = make_seq(8)
    b.num_computed_tokens = 8
    b.block_hashes = list(a.block_hashes)
    assert host.swap_out(b, [5, 6]) == []  # both blocks are still on the host: nothing to copy
    assert b.cpu_block_table == [0, 1]
    host.check_invariants([b])


def test_swap_out_takes_its_cached_host_blocks_before_handing_out_free_ones():
    """a's block 2 is still on the host, block 1 is not, and block 2's host copy is at the head of the free queue:
    block 1 must not be copied over it (that evicted it and cost a second copy for block 2)."""
    bm, host = BlockManager(8, BLOCK_SIZE), HostBlockPool(4)
    a = make_seq(12)
    computed(bm, a, 12)
    copies = host.swap_out(a, bm.computed_block_ids(a))
    assert copies == [(0, 0), (1, 1), (2, 2)]
    landed(host, copies)
    host.free(a)  # swapped in again
    assert list(host.free_block_ids) == [3, 2, 1, 0]
    host.free_block_ids.move_to_end(1, last=False)  # least recently used: the next swap-out evicts it
    c = make_seq(4, start=900)
    computed(bm, c, 4)
    assert host.swap_out(c, bm.computed_block_ids(c)) == [(3, 1)]
    host.free_block_ids.move_to_end(2, last=False)
    assert list(host.free_block_ids) == [2, 3, 0]
    assert host.swap_out(a, bm.computed_block_ids(a)) == [(1, 3)]
    assert a.cpu_block_table == [0, 3, 2]
    host.check_invariants([a, c])
