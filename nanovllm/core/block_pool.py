"""Block ids with ref counts, an LRU free queue and a hash index: the mechanics both tiers share (plain Python)."""
from collections import OrderedDict


class BlockPool:
    """`free_block_ids` is an OrderedDict used as an LRU queue: `pop_free` takes the head. A released block that
    holds a hashed full block keeps its hash and goes to the tail, so the cache loses the least recently released
    blocks first; a released block without a hash goes to the head. An OrderedDict (not a deque) so that a cache
    hit can take a free block out of the middle in O(1).
    NOTE: a block is in `free_block_ids` iff its ref_count is 0.
    NOTE: `hash_to_block_id[h] == b` implies `block_hash[b] == h`; a block loses its hash only when `pop_free`
          hands it out again.
    """
    tier = "block"  # names the ids in error messages ("gpu block", "cpu block")

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_revived(self, block_ids) -> int:
        """How many of these cached blocks `take` would pull out of the free queue."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def take(self, block_id: int):
        """One more reference to a block found by its hash."""
        if self.ref_counts[block_id] == 0:
            del self.free_block_ids[block_id]
        self.ref_counts[block_id] += 1

    def pop_free(self) -> int:
        """The least recently released block, with one reference; its old hash (if any) is evicted."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        h = self.block_hash[block_id]
        if h is not None:
            if self.hash_to_block_id.get(h) == block_id:
                del self.hash_to_block_id[h]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def set_hash(self, block_id: int, h: int):
        self.block_hash[block_id] = h
        self.hash_to_block_id.setdefault(h, block_id)

    def release(self, block_id: int, owner: int) -> bool:
        """Drop one reference (owner: the seq id, for the error); True when the block became free."""
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] < 0:
            raise RuntimeError(f"{type(self).__name__}: {self.tier} {block_id} of seq {owner} freed twice")
        if self.ref_counts[block_id]:
            return False
        self.free_block_ids[block_id] = None
        if self.block_hash[block_id] is None:
            self.free_block_ids.move_to_end(block_id, last=False)
        return True

    def can_reset_cache(self) -> bool:
        return self.num_free_blocks == self.num_blocks

    def reset_cache(self) -> bool:
        """Forget every cached hash. Refused (False, nothing forgotten) while any block is referenced."""
        if not self.can_reset_cache():
            return False
        self.hash_to_block_id.clear()
        self.block_hash = [None] * self.num_blocks
        return True

    def check_invariants(self, block_tables: list[list[int]]):
        """For tests: no table holds a block twice; ref counts equal the number of table entries; the free queue is
        the unreferenced set."""
        owners = [0] * self.num_blocks
        for table in block_tables:
            if len(set(table)) != len(table):
                twice = sorted({b for b in table if table.count(b) > 1})
                raise RuntimeError(f"{type(self).__name__}.check_invariants: {self.tier}s {twice} appear twice in "
                                   f"one block table {table}")
            for block_id in table:
                owners[block_id] += 1
        if owners != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if owners[b] != self.ref_counts[b]]
            raise RuntimeError(f"ref_counts disagree with block tables for {self.tier}s {bad}")
        free = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        if free != set(self.free_block_ids):
            raise RuntimeError(f"free queue {sorted(self.free_block_ids)} != unreferenced {self.tier}s {sorted(free)}")
        for h, b in self.hash_to_block_id.items():
            if self.block_hash[b] != h:
                raise RuntimeError(f"hash index points at {self.tier} {b} whose hash is {self.block_hash[b]}")
