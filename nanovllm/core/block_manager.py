"""The GPU block pool: ref counts, the free queue, and the prefix cache (plain Python; no torch)."""
from nanovllm.core.block_pool import BlockPool
from nanovllm.core.hashing import content_hash
from nanovllm.core.sequence import PLACEHOLDER_TOKEN, Sequence


LOAD_HOLD = -1  # the owner a load's reference on a gpu block is released under (in error messages)


class BlockManager(BlockPool):
    """Owns the GPU block ids: per-sequence allocation and the GPU prefix cache on top of the shared pool mechanics
    (ref counts, LRU free queue, hash index: see BlockPool).

    NOTE: a full block of known tokens gets its hash when the step that computes its KV is scheduled, so a
          sequence admitted later in the same step shares it (a forward stores every token's KV of a layer before
          that layer's attention reads any). A block that a decode token completes is hashed after that step was
          launched (`Scheduler.advance`), since under asynchronous scheduling its last token may not be known
          while it is scheduled.
    NOTE: `new_gpu_block_ids` lists the blocks handed out since `begin_step()`. This step's copies and forward also
          write blocks handed out in earlier steps (and tails taken over), but of what they write only these can be
          under a swap-out still reading them: earlier steps already waited for theirs.
    NOTE: `offload_candidate_ids` collects hashed blocks the host tier may want a copy of: blocks that became
          evictable (write-back) or, with write-through, blocks that were just cached. The scheduler drains it.
    NOTE: states. A gpu block is loading (in `loading`) from the moment a load into it is prepared (a swap-in or a
          host prefix hit: `begin_loads`) until the copy engine reports that load (`finish_loads`). Meanwhile the load
          holds it (one reference), so a sequence freed while its blocks load (aborted, preempted) cannot hand them
          out, and `find_cached_prefix` stops at it; a loading block in the free queue is a broken invariant
          (RuntimeError naming it).
    NOTE: tails. Prefix caching by full blocks recomputes the partial last block of every conversation turn (the
          next turn's prompt starts with the whole previous turn). So when a sequence finishes, its partial last
          block stays findable by the hash of the full block before it (`tail_by_parent`), with the tokens whose
          KV it holds (`tail_tokens`), and waits in the free queue like a cached block. A new sequence whose
          prompt continues that prefix takes the block over (it is not shared: it writes its own tokens after
          the matching ones). A tail entry exists only while its block is free; handing the block out drops it.
    """
    tier = "gpu block"

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 write_through: bool = False):
        super().__init__(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.new_gpu_block_ids: list[int] = []
        self.write_through = write_through
        self.offload_candidate_ids: list[int] = []
        self.tail_by_parent: dict[int, int] = {}  # hash of the full block before a tail -> gpu_block_id
        self.tail_tokens: dict[int, tuple[int, list[int]]] = {}  # gpu_block_id -> (parent hash, token ids)
        self.loading: set[int] = set()  # gpu blocks a load is filling (see the class NOTE on states)

    def begin_step(self):
        self.new_gpu_block_ids = []

    def reset_cache(self) -> bool:
        if not super().reset_cache():
            return False
        self.tail_by_parent.clear()
        self.tail_tokens.clear()
        self.offload_candidate_ids.clear()
        return True

    # --- prefix cache
    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """GPU blocks holding seq's leading full blocks. The last prompt token is never a hit: it must be computed
        to produce logits."""
        if not self.enable_prefix_caching:
            return []
        block_ids = []
        for i in range((seq.num_tokens - 1) // self.block_size):
            block_id = self.hash_to_block_id.get(content_hash(seq, i))
            if block_id is None or block_id in self.loading:
                break
            block_ids.append(block_id)
        return block_ids

    def find_cached_tail(self, seq: Sequence, num_hit_blocks: int) -> tuple[int, int] | None:
        """A finished sequence's partial block that continues seq's first `num_hit_blocks` (cached) blocks:
        (gpu_block_id, how many of seq's next tokens it holds), or None. Leaves the last prompt token out."""
        if not self.enable_prefix_caching:
            return None
        parent = content_hash(seq, num_hit_blocks - 1) if num_hit_blocks else 0
        block_id = self.tail_by_parent.get(parent)
        if block_id is None:
            return None
        start = num_hit_blocks * self.block_size
        limit = seq.num_tokens - 1 - start
        num_matching = 0
        for a, b in zip(self.tail_tokens[block_id][1][:limit], seq.token_ids[start:start + limit]):
            if a != b:
                break
            num_matching += 1
        return (block_id, num_matching) if num_matching else None

    def _tail_of(self, seq: Sequence) -> tuple[int, int, list[int]] | None:
        """(gpu_block_id, parent hash, token ids) of seq's partial last block with computed KV, if it has one."""
        num_valid = min(seq.num_computed_tokens, seq.num_tokens)
        num_full = num_valid // self.block_size
        tokens = seq.token_ids[num_full * self.block_size:num_valid]
        if PLACEHOLDER_TOKEN in tokens:  # an aborted sequence's unresolved tokens
            tokens = tokens[:tokens.index(PLACEHOLDER_TOKEN)]
        if not tokens or num_full >= len(seq.block_table):
            return None
        parent = content_hash(seq, num_full - 1) if num_full else 0
        return seq.block_table[num_full], parent, tokens

    def _keep_tail(self, block_id: int, parent: int, tokens: list[int]):
        """Index a just-freed partial block (the newest tail under a parent replaces an older one) and queue it
        where cached blocks wait, ahead of the blocks before it, which its owner frees next."""
        old = self.tail_by_parent.get(parent)
        if old is not None:
            del self.tail_tokens[old]
        self.tail_by_parent[parent] = block_id
        self.tail_tokens[block_id] = (parent, tokens)
        self.free_block_ids.move_to_end(block_id)

    def _drop_tail(self, block_id: int):
        if block_id in self.tail_tokens:
            parent, _ = self.tail_tokens.pop(block_id)
            del self.tail_by_parent[parent]

    def cache_full_blocks(self, seq: Sequence, num_tokens: int | None = None):
        """Register seq's full blocks among its first `num_tokens` (default: the computed ones) in the prefix
        cache; the caller guarantees that their KV is computed, or is computed by the step being scheduled."""
        if not self.enable_prefix_caching:
            return
        num_full = (seq.num_computed_tokens if num_tokens is None else num_tokens) // self.block_size
        for i in range(seq.num_cached_blocks, num_full):
            block_id = seq.block_table[i]
            if self.block_hash[block_id] is None:
                self.set_hash(block_id, content_hash(seq, i))
                if self.write_through:
                    self.offload_candidate_ids.append(block_id)
        seq.num_cached_blocks = max(seq.num_cached_blocks, num_full)

    # --- allocation
    def allocate(self, seq: Sequence, num_new_tokens: int, cached_block_ids: list[int] = (),
                 num_reserved_blocks: int = 0, tail: tuple[int, int] | None = None) -> bool:
        """Give seq the cached blocks (and a cached tail from find_cached_tail), then enough new blocks for
        `num_new_tokens` more tokens. All or nothing: returns False (and changes nothing) when fewer than
        `num_reserved_blocks` would stay free."""
        if not cached_block_ids and tail is None and \
                seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            return True  # the common decode step: the last block still has room
        tail_block_ids = [tail[0]] if tail else []
        num_cached_tokens = len(cached_block_ids) * self.block_size + (tail[1] if tail else 0)
        num_tokens = seq.num_computed_tokens + num_cached_tokens + num_new_tokens
        num_new_blocks = (seq.num_blocks_for(num_tokens) - len(seq.block_table) - len(cached_block_ids)
                          - len(tail_block_ids))
        num_revived = self.num_revived(cached_block_ids) + len(tail_block_ids)
        if num_new_blocks + num_revived + num_reserved_blocks > self.num_free_blocks:
            return False
        for block_id in cached_block_ids:
            self.take(block_id)
        seq.block_table.extend(cached_block_ids)
        seq.num_cached_blocks = len(seq.block_table) if cached_block_ids else seq.num_cached_blocks
        for block_id in tail_block_ids:  # taken over, not shared: seq writes its own tokens after the matching ones
            self._drop_tail(block_id)
            self.take(block_id)
            seq.block_table.append(block_id)
        seq.num_computed_tokens += num_cached_tokens
        seq.block_table.extend(self.pop_free() for _ in range(num_new_blocks))
        return True

    def pop_free(self) -> int:
        block_id = super().pop_free()
        if block_id in self.loading:
            raise RuntimeError(f"BlockManager.pop_free: gpu block {block_id} is loading but was in the free queue: "
                               f"its load must hold it until it lands")
        self._drop_tail(block_id)
        self.new_gpu_block_ids.append(block_id)
        return block_id

    # --- loads (the offload manager prepares them and completes them when the copy engine reports them)
    def begin_loads(self, gpu_block_ids: list[int]):
        """These blocks (each held by its sequence) are the destinations of a load: loading, and held by it."""
        for block_id in gpu_block_ids:
            if block_id in self.loading:
                raise RuntimeError(f"BlockManager.begin_loads: gpu block {block_id} is already loading")
            self.loading.add(block_id)
            self.take(block_id)

    def finish_loads(self, gpu_block_ids: list[int]):
        """Their load landed: no longer loading, and the load lets go (a block whose sequence was freed meanwhile
        becomes free now)."""
        for block_id in gpu_block_ids:
            if block_id not in self.loading:
                raise RuntimeError(f"BlockManager.finish_loads: gpu block {block_id} is not loading")
            self.loading.remove(block_id)
            self.release(block_id, LOAD_HOLD)

    def take_offload_candidates(self) -> list[tuple[int, int]]:
        """(gpu_block_id, hash) of the candidates that still hold their hashed block."""
        ids, self.offload_candidate_ids = self.offload_candidate_ids, []
        return [(b, self.block_hash[b]) for b in ids if self.block_hash[b] is not None]

    def computed_block_ids(self, seq: Sequence) -> list[int]:
        """The blocks that hold seq's computed KV (the ones a swap-out must copy)."""
        return seq.block_table[:seq.num_blocks_for(seq.num_computed_tokens)]

    def _reuse_order(self, block_ids: list[int]) -> list[int]:
        """Blocks without a hash go to the head of the free queue in table order; hashed ones to the tail, last
        block first (so the prefix survives longest)."""
        unhashed = [b for b in block_ids if self.block_hash[b] is None]
        hashed = [b for b in reversed(block_ids) if self.block_hash[b] is not None]
        return unhashed + hashed

    def free(self, seq: Sequence, keep_tail: bool = False):
        """Drop seq's references; its last blocks go to the free queue first so its prefix survives longest.
        keep_tail (a finished seq): its partial last block stays findable, see the class NOTE on tails."""
        self._release_all(seq, keep_tail)

    def free_swapped_out(self, seq: Sequence, hand_out_last: list[int]) -> list[int]:
        """Free a swapped-out seq's blocks and return them in the order the free queue hands them out again, so
        that its swap-out copies them in that order: the one place that order is decided. hand_out_last: blocks its
        swap-out can copy only after the forward in flight (which writes them); they go to the very end of the
        free queue, so that the next owners get blocks whose copies started earlier."""
        order = self._reuse_order(seq.block_table)  # the order _release_all queues them in (BlockPool.release)
        last = set(hand_out_last)
        order = [b for b in order if b not in last] + [b for b in order if b in last]
        self._release_all(seq, keep_tail=False)
        for block_id in order[len(order) - len(last):]:
            if block_id in self.free_block_ids:
                self.free_block_ids.move_to_end(block_id)
        return order

    def _release_all(self, seq: Sequence, keep_tail: bool):
        tail = self._tail_of(seq) if keep_tail and self.enable_prefix_caching else None
        for block_id in reversed(seq.block_table):
            if not self.release(block_id, seq.seq_id):
                continue
            if self.block_hash[block_id] is not None and not self.write_through:
                self.offload_candidate_ids.append(block_id)
            if tail and block_id == tail[0] and self.block_hash[block_id] is None:
                self._keep_tail(*tail)
        seq.block_table = []
        seq.num_cached_blocks = 0

    def check_invariants(self, seqs: list[Sequence] = ()):
        """For tests: ref counts match the sequences' GPU block tables; see BlockPool.check_invariants. A tail
        entry names a free, unhashed block, and the two tail maps agree."""
        super().check_invariants([seq.block_table for seq in seqs] + [[b] for b in self.loading])
        for block_id, (parent, tokens) in self.tail_tokens.items():
            if self.ref_counts[block_id] or self.block_hash[block_id] is not None or not tokens:
                raise RuntimeError(f"tail gpu block {block_id} is in use, hashed or empty")
            if self.tail_by_parent.get(parent) != block_id:
                raise RuntimeError(f"tail gpu block {block_id} is not indexed under its parent hash {parent}")
        if len(self.tail_by_parent) != len(self.tail_tokens):
            raise RuntimeError(f"tail index {self.tail_by_parent} disagrees with tail blocks {list(self.tail_tokens)}")
