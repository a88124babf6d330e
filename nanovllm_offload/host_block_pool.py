"""Host block ids for swapped-out KV and the host prefix cache, and the state of each host block (plain Python; no
torch)."""
import enum

from nanovllm.core.block_pool import BlockPool
from nanovllm.core.hashing import content_hash
from nanovllm.core.sequence import Sequence


class HostBlockState(enum.IntEnum):
    """What a host block holds, as SGLang's host pool tracks it. Only the copy engine's and the disk's completions
    move a block from WRITING to READY (OffloadManager.complete)."""
    FREE = 0  # holds nothing anyone wants; in the free queue
    RESERVED = 1  # handed out (pop_free) as the destination of a copy the step being scheduled will issue
    WRITING = 2  # a copy from the GPU, or a disk read, is filling it
    READY = 3  # holds its KV: findable by its hash when it has one, evictable once no one holds it


class HostBlockPool(BlockPool):
    """Owns the cpu_block_ids of the host tier, on the shared pool mechanics (see BlockPool).

    One pool, two roles. A cpu block is pinned (ref_count > 0) while a SWAPPED sequence owns it. A free block that
    holds a hashed full block is a second-level prefix cache entry: findable by its prefix-chain hash, evicted in
    LRU order from the head of `free_block_ids`. So swapped sequences can claim the whole pool, and the prefix cache
    gets whatever they do not hold. A full block is stored once, so two swapped sequences sharing a prefix share
    the host copy ("never copied twice"), and a cached copy is reused by a later swap-out.
    NOTE: states. pop_free makes a block RESERVED; the manager makes it WRITING when its step's copies go out and
          READY when they land. A RESERVED or WRITING block is held by its transfer (one reference), so it is
          never in the free queue: it cannot be evicted, handed out twice or found by find_cached_prefix, and a
          block that becomes free in either state is a broken invariant (RuntimeError naming the id).
    NOTE: swap_out shares a hashed block in any state: the swap-in that reads it is a copy too, and the copy
          engine orders it after the store that fills it (its rule 4).
    """
    tier = "cpu block"

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks)
        self.state = [HostBlockState.FREE] * num_blocks

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int | None]:
        """The content hash of each of seq's first num_blocks blocks; None for the partial last block."""
        num_full = seq.num_computed_tokens // seq.block_size
        known = seq.block_hashes[:min(num_full, num_blocks)]
        return known + [None] * (num_blocks - len(known))

    # --- states
    def pop_free(self) -> int:
        cpu_block_id = super().pop_free()
        if self.state[cpu_block_id] not in (HostBlockState.FREE, HostBlockState.READY):
            raise RuntimeError(f"HostBlockPool.pop_free: cpu block {cpu_block_id} is "
                               f"{self.state[cpu_block_id].name} but was in the free queue")
        self.state[cpu_block_id] = HostBlockState.RESERVED
        return cpu_block_id

    def begin_writes(self, cpu_block_ids: list[int]):
        """RESERVED -> WRITING: the copies (or disk reads) into these blocks are issued."""
        self._advance(cpu_block_ids, HostBlockState.RESERVED, HostBlockState.WRITING)

    def finish_writes(self, cpu_block_ids: list[int]):
        """WRITING -> READY: the copies (or disk reads) into these blocks have landed."""
        self._advance(cpu_block_ids, HostBlockState.WRITING, HostBlockState.READY)

    def abandon_writes(self, cpu_block_ids: list[int]):
        """WRITING -> FREE for copies that were never issued (a step that raised before its launch): the blocks hold
        nothing, so their hashes go too."""
        self._advance(cpu_block_ids, HostBlockState.WRITING, HostBlockState.FREE)
        for cpu_block_id in cpu_block_ids:
            h, self.block_hash[cpu_block_id] = self.block_hash[cpu_block_id], None
            if h is not None and self.hash_to_block_id.get(h) == cpu_block_id:
                del self.hash_to_block_id[h]

    def _advance(self, cpu_block_ids: list[int], old: HostBlockState, new: HostBlockState):
        state = self.state
        for cpu_block_id in cpu_block_ids:
            if state[cpu_block_id] != old:
                raise RuntimeError(f"HostBlockPool: cpu block {cpu_block_id} is {state[cpu_block_id].name}, not "
                                   f"{old.name}, and cannot become {new.name}")
            state[cpu_block_id] = new

    def release(self, block_id: int, owner: int) -> bool:
        if not super().release(block_id, owner):
            return False
        if self.state[block_id] in (HostBlockState.RESERVED, HostBlockState.WRITING):
            raise RuntimeError(f"HostBlockPool: cpu block {block_id} became free (owner {owner}) while "
                               f"{self.state[block_id].name}: its transfer must hold it until it lands")
        if self.block_hash[block_id] is None:
            self.state[block_id] = HostBlockState.FREE
        return True

    def reset_cache(self) -> bool:
        """Forget every cached hash (refused while any block is held): every block is FREE again."""
        if not super().reset_cache():
            return False
        self.state = [HostBlockState.FREE] * self.num_blocks
        return True

    # --- the swap role
    def can_swap_out(self, seq: Sequence, num_blocks: int) -> bool:
        found = [self.hash_to_block_id.get(h) for h in self._hashes(seq, num_blocks) if h is not None]
        found = [b for b in found if b is not None]
        return num_blocks - len(found) + self.num_revived(found) <= self.num_free_blocks

    def swap_out(self, seq: Sequence, gpu_block_ids: list[int]) -> list[tuple[int, int]] | None:
        """Give seq host blocks for its computed GPU blocks. Returns the (gpu_block_id, cpu_block_id) copies to make
        (blocks already on the host need none), or None when the pool is short; all or nothing. The copies'
        destinations are RESERVED."""
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
        """Release seq's host blocks (after its swap-in landed, or when it finishes or is aborted while SWAPPED).
        Hashed blocks stay cached at the tail of the free queue; the rest go to the head."""
        self.release_all(seq.cpu_block_table, seq.seq_id)
        seq.cpu_block_table = []

    def release_all(self, cpu_block_ids: list[int], owner: int):
        """Drop one reference to each, last block first (so a prefix's first blocks are the last evicted)."""
        for cpu_block_id in reversed(cpu_block_ids):
            self.release(cpu_block_id, owner)

    # --- the prefix-cache role
    def find_cached_prefix(self, seq: Sequence, start_block: int, num_blocks: int) -> list[int]:
        """READY host blocks holding seq's full blocks start_block, start_block + 1, ... (at most num_blocks of
        them): a block whose copy has not landed is not a hit."""
        cpu_block_ids = []
        for i in range(start_block, start_block + num_blocks):
            cpu_block_id = self.hash_to_block_id.get(content_hash(seq, i))
            if cpu_block_id is None or self.state[cpu_block_id] != HostBlockState.READY:
                break
            cpu_block_ids.append(cpu_block_id)
        return cpu_block_ids

    def touch(self, cpu_block_ids: list[int]):
        """These hits become the most recently used."""
        for cpu_block_id in cpu_block_ids:
            if cpu_block_id in self.free_block_ids:
                self.free_block_ids.move_to_end(cpu_block_id)

    def store(self, block_hash: int) -> int | None:
        """A RESERVED host block for a copy of a cached GPU block, held by the copy (one reference) until it lands;
        evicts the least recently used cached host block. Returns None when the hash is already here or every host
        block is held."""
        if block_hash in self.hash_to_block_id or not self.free_block_ids:
            return None
        cpu_block_id = self.pop_free()
        self.set_hash(cpu_block_id, block_hash)
        return cpu_block_id

    def check_invariants(self, seqs: list[Sequence] = (), num_transfer_holds: list[int] | None = None):
        """For tests: ref counts match the sequences' host block tables (plus `num_transfer_holds`, the references
        transfers in flight hold per block); a free block is READY when hashed, FREE otherwise; a RESERVED or
        WRITING block is held. See BlockPool.check_invariants."""
        tables = [seq.cpu_block_table for seq in seqs]
        if num_transfer_holds is not None:
            tables += [[b] for b, n in enumerate(num_transfer_holds) for _ in range(n)]
        super().check_invariants(tables)
        for cpu_block_id in self.free_block_ids:
            want = HostBlockState.FREE if self.block_hash[cpu_block_id] is None else HostBlockState.READY
            if self.state[cpu_block_id] != want:
                raise RuntimeError(f"free cpu block {cpu_block_id} is {self.state[cpu_block_id].name}, not {want.name}")
