"""Host block ids for swapped-out KV and the host prefix cache (plain Python; no torch)."""
from nanovllm.core.hashing import content_hash
from nanovllm.core.block_pool import BlockPool
from nanovllm.core.sequence import Sequence


class HostBlockPool(BlockPool):
    """Owns the cpu_block_ids of the host tier, on the shared pool mechanics (see BlockPool).

    One pool, two roles. A cpu block is pinned (ref_count > 0) while a SWAPPED sequence owns it. A free block that
    holds a hashed full block is a second-level prefix cache entry: findable by its prefix-chain hash, evicted in
    LRU order from the head of `free_block_ids`. So swapped sequences can claim the whole pool, and the prefix cache
    gets whatever they do not hold. A full block is stored once, so two swapped sequences sharing a prefix share
    the host copy ("never copied twice"), and a cached copy is reused by a later swap-out.
    """
    tier = "cpu block"

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int | None]:
        """The content hash of each of seq's first num_blocks blocks; None for the partial last block."""
        num_full = seq.num_computed_tokens // seq.block_size
        known = seq.block_hashes[:min(num_full, num_blocks)]
        return known + [None] * (num_blocks - len(known))

    # --- the swap role
    def can_swap_out(self, seq: Sequence, num_blocks: int) -> bool:
        found = [self.hash_to_block_id.get(h) for h in self._hashes(seq, num_blocks) if h is not None]
        found = [b for b in found if b is not None]
        return num_blocks - len(found) + self.num_revived(found) <= self.num_free_blocks

    def swap_out(self, seq: Sequence, gpu_block_ids: list[int]) -> list[tuple[int, int]] | None:
        """Give seq host blocks for its computed GPU blocks. Returns the (gpu_block_id, cpu_block_id) copies to make
        (blocks already on the host need none), or None when the pool is short; all or nothing."""
        if not self.can_swap_out(seq, len(gpu_block_ids)):
            return None
        hashes = self._hashes(seq, len(gpu_block_ids))
        found = [self.hash_to_block_id.get(h) if h is not None else None for h in hashes]
        for cpu_block_id in found:  # before any pop_free, which could hand out (and evict) a later hit
            if cpu_block_id is not None:
                self.take(cpu_block_id)
        copies = []
        for gpu_block_id, h, cpu_block_id in zip(gpu_block_ids, hashes, found):
            if cpu_block_id is None:
                cpu_block_id = self.pop_free()
                copies.append((gpu_block_id, cpu_block_id))
                if h is not None:
                    self.set_hash(cpu_block_id, h)
            seq.cpu_block_table.append(cpu_block_id)
        return copies

    def free(self, seq: Sequence):
        """Release seq's host blocks (after its swap-in was issued, or when it finishes or is aborted while SWAPPED).
        Hashed blocks stay cached at the tail of the free queue; the rest go to the head."""
        for cpu_block_id in reversed(seq.cpu_block_table):
            self.release(cpu_block_id, seq.seq_id)
        seq.cpu_block_table = []

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
        cpu_block_id = self.pop_free()
        self.set_hash(cpu_block_id, block_hash)
        self.release(cpu_block_id, owner=-1)  # cached, not owned: evictable, at the tail
        return cpu_block_id

    def check_invariants(self, seqs: list[Sequence] = ()):
        """For tests: ref counts match the sequences' host block tables; see BlockPool.check_invariants."""
        super().check_invariants([seq.cpu_block_table for seq in seqs])
