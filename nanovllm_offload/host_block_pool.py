"""Host block ids for swapped-out KV (plain Python; no torch)."""
from collections import OrderedDict

from nanovllm.engine.block_manager import content_hash
from nanovllm.engine.sequence import Sequence


class HostBlockPool:
    """Owns the cpu_block_ids of the host tier.

    One pool, two roles. A cpu block is pinned (ref_count > 0) while a SWAPPED sequence owns it. A free block that
    holds a hashed full block is a second-level prefix cache entry: findable by its prefix-chain hash, evicted in
    LRU order from the head of `free_block_ids`. So swapped sequences can claim the whole pool, and the prefix cache
    gets whatever they do not hold. A full block is stored once, so two swapped sequences sharing a prefix share
    the host copy ("never copied twice"), and a cached copy is reused by a later swap-out.
    NOTE: a block is in `free_block_ids` iff its ref_count is 0.
    NOTE: `hash_to_block_id[h] == b` implies `block_hash[b] == h`.
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block_id: dict[int, int] = {}
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int | None]:
        """The content hash of each of seq's first num_blocks blocks; None for the partial last block."""
        num_full = seq.num_computed_tokens // seq.block_size
        known = seq.block_hashes[:min(num_full, num_blocks)]
        return known + [None] * (num_blocks - len(known))

    def can_swap_out(self, seq: Sequence, num_blocks: int) -> bool:
        found = [self.hash_to_block_id.get(h) for h in self._hashes(seq, num_blocks) if h is not None]
        found = [b for b in found if b is not None]
        num_revived = sum(1 for b in found if self.ref_counts[b] == 0)
        return num_blocks - len(found) + num_revived <= self.num_free_blocks

    def swap_out(self, seq: Sequence, gpu_block_ids: list[int]) -> list[tuple[int, int]] | None:
        """Give seq host blocks for its computed GPU blocks. Returns the (gpu_block_id, cpu_block_id) copies to make
        (blocks already on the host need none), or None when the pool is short; all or nothing."""
        if not self.can_swap_out(seq, len(gpu_block_ids)):
            return None
        copies = []
        for gpu_block_id, h in zip(gpu_block_ids, self._hashes(seq, len(gpu_block_ids))):
            cpu_block_id = self.hash_to_block_id.get(h) if h is not None else None
            if cpu_block_id is not None:
                self._take(cpu_block_id)
            else:
                cpu_block_id = self._pop_free()
                copies.append((gpu_block_id, cpu_block_id))
                if h is not None:
                    self.block_hash[cpu_block_id] = h
                    self.hash_to_block_id.setdefault(h, cpu_block_id)
            seq.cpu_block_table.append(cpu_block_id)
        return copies

    # --- the prefix-cache role
    def find_cached_prefix(self, seq: Sequence, start_block: int, num_blocks: int) -> list[int]:
        """Host blocks holding seq's full blocks start_block, start_block + 1, ... (at most num_blocks of them);
        each hit becomes the most recently used."""
        cpu_block_ids = []
        for i in range(start_block, start_block + num_blocks):
            cpu_block_id = self.hash_to_block_id.get(content_hash(seq, i))
            if cpu_block_id is None:
                break
            if cpu_block_id in self.free_block_ids:
                self.free_block_ids.move_to_end(cpu_block_id)
            cpu_block_ids.append(cpu_block_id)
        return cpu_block_ids

    def store(self, block_hash: int) -> int | None:
        """A host block for a copy of a cached GPU block: evicts the least recently used cached host block.
        Returns None when the hash is already here or every host block is held by a swapped sequence."""
        if block_hash in self.hash_to_block_id or not self.free_block_ids:
            return None
        cpu_block_id = self._pop_free()
        self.ref_counts[cpu_block_id] = 0  # cached, not owned: stays evictable
        self.block_hash[cpu_block_id] = block_hash
        self.hash_to_block_id[block_hash] = cpu_block_id
        self.free_block_ids[cpu_block_id] = None
        return cpu_block_id

    def free(self, seq: Sequence):
        """Release seq's host blocks (after its swap-in was issued, or when it finishes or is aborted while SWAPPED).
        Hashed blocks stay cached at the tail of the free queue; the rest go to the head."""
        for cpu_block_id in reversed(seq.cpu_block_table):
            self.ref_counts[cpu_block_id] -= 1
            if self.ref_counts[cpu_block_id] < 0:
                raise RuntimeError(f"HostBlockPool.free: cpu block {cpu_block_id} of seq {seq.seq_id} freed twice")
            if self.ref_counts[cpu_block_id] == 0:
                self.free_block_ids[cpu_block_id] = None
                if self.block_hash[cpu_block_id] is None:
                    self.free_block_ids.move_to_end(cpu_block_id, last=False)
        seq.cpu_block_table = []

    def _take(self, cpu_block_id: int):
        if self.ref_counts[cpu_block_id] == 0:
            del self.free_block_ids[cpu_block_id]
        self.ref_counts[cpu_block_id] += 1

    def _pop_free(self) -> int:
        cpu_block_id, _ = self.free_block_ids.popitem(last=False)
        h = self.block_hash[cpu_block_id]
        if h is not None:
            if self.hash_to_block_id.get(h) == cpu_block_id:
                del self.hash_to_block_id[h]
            self.block_hash[cpu_block_id] = None
        self.ref_counts[cpu_block_id] = 1
        return cpu_block_id

    def check_invariants(self, seqs: list[Sequence] = ()):
        """For tests: ref counts equal the number of host block-table entries; the free queue is the unreferenced set."""
        owners = [0] * self.num_blocks
        for seq in seqs:
            for cpu_block_id in seq.cpu_block_table:
                owners[cpu_block_id] += 1
        if owners != self.ref_counts:
            bad = [b for b in range(self.num_blocks) if owners[b] != self.ref_counts[b]]
            raise RuntimeError(f"host ref_counts disagree with cpu block tables for cpu blocks {bad}")
        free = {b for b in range(self.num_blocks) if self.ref_counts[b] == 0}
        if free != set(self.free_block_ids):
            raise RuntimeError(f"host free queue {sorted(self.free_block_ids)} != unreferenced {sorted(free)}")
        for h, b in self.hash_to_block_id.items():
            if self.block_hash[b] != h:
                raise RuntimeError(f"host hash index points at cpu block {b} whose hash is {self.block_hash[b]}")
