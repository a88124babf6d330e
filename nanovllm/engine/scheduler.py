"""The scheduler: decides what each step computes and whom to preempt. It owns the queues and nothing else; what
happens in the tiers (swap-out, swap-in, host prefix hits, stores, disk admission, blocks in flight) is the offload
manager's, through its methods (plain Python; no torch)."""
import time
from collections import deque

from nanovllm.config import Config
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import PLACEHOLDER_TOKEN, Sequence, SequenceStatus
from nanovllm.engine.min_tokens import MinTokens
from nanovllm.engine.scheduler_output import SchedulerOutput, SchedulerStats
from nanovllm_offload.host_block_pool import HostBlockPool
from nanovllm_offload.offload_manager import OffloadManager


class Scheduler:
    """Queues: `waiting` (FIFO; recompute victims go back to the front), `running` (batch order: oldest first,
    victims are taken from the back), `swapped` (FIFO; resumed before any new prefill is admitted).

    NOTE: every sequence is in exactly one queue until it finishes; its status names the queue.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int], offload: OffloadManager | None = None):
        self.block_manager = block_manager
        self.offload = offload  # the one door to the tiers below the GPU; None: victims are recomputed
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        # blocks kept free when admitting or resuming, so running sequences can grow a little before preemption; kept
        # with a host tier too: admitting without it (as vLLM does) measured no faster (docs/swap_tier.md, Admission)
        self.num_watermark_blocks = max(1, block_manager.num_blocks // 100)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.stats = SchedulerStats()
        self.min_tokens = MinTokens(eos_token_ids)

    @classmethod
    def from_config(cls, config: Config, num_gpu_blocks: int, offload: OffloadManager | None,
                    eos_token_ids: set[int]) -> "Scheduler":
        """The scheduler and GPU block manager that the engine runs for `config` (bench_swap.py --simulate runs the
        same ones without a model)."""
        block_manager = BlockManager(num_gpu_blocks, config.kvcache_block_size, config.enable_prefix_caching,
                                     write_through=config.host_cache_policy == "write_through")
        scheduler = cls(block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.max_model_len,
                        eos_token_ids, offload)
        return scheduler

    @property
    def host_pool(self) -> HostBlockPool | None:
        """The host tier's block pool (read-only; for counters and tests)."""
        return self.offload.pool if self.offload is not None else None

    def add(self, seq: Sequence):
        seq.max_num_tokens = min(seq.max_num_tokens, self.max_model_len)
        self.waiting.append(seq)
        self.min_tokens.add(seq)

    def banned_token_ids(self, sample_seqs: list[Sequence]) -> list[tuple[int, list[int]]]:
        """(sample row, token ids) that this step may not sample (min_tokens.py)."""
        return self.min_tokens.banned_token_ids(sample_seqs)

    def is_finished(self) -> bool:
        return not (self.waiting or self.running or self.swapped or self.num_disk_waiting)

    def reset_prefix_cache(self) -> bool:
        """Forget the GPU and host prefix caches, both or neither; refused (False) while any of their blocks is held."""
        self._take_loaded_from_disk()
        tiers = [self.block_manager] + ([self.offload] if self.offload is not None else [])
        if self.running or self.swapped or not all(tier.can_reset_cache() for tier in tiers):
            return False
        return all([tier.reset_cache() for tier in tiers])

    @property
    def num_disk_waiting(self) -> int:
        """Waiting sequences that are out of the queue while their prefix is read from disk."""
        return self.offload.num_disk_waiting if self.offload is not None else 0

    @property
    def num_loads_in_flight(self) -> int:
        """Host->GPU loads not reported yet. Their GPU blocks stay held (loading) even when their sequence is gone
        (aborted, preempted), so a step that can schedule nothing may only be waiting for one to land: like a disk
        load, a reason to wait rather than a lack of progress."""
        return len(self.offload.transfers.loads) if self.offload is not None else 0

    def _take_loaded_from_disk(self):
        """Sequences whose disk loads landed go back to the front of `waiting`, where their blocks are host hits."""
        if self.offload is not None:
            self.waiting.extendleft(reversed(self.offload.take_loaded_from_disk()))

    def schedule(self) -> SchedulerOutput:
        """One step: copies for the host prefix cache, then the running sequences (preempting when blocks run out),
        then new prefills and swap-ins, which wait while anything was preempted this step."""
        out = SchedulerOutput()
        self.block_manager.begin_step()
        self._store_cached_blocks()  # blocks freed by the last step, before anything can evict them
        self._take_loaded_from_disk()
        budget, num_preempted = self._schedule_running(out, self.max_num_batched_tokens)
        if not num_preempted:
            self._admit_waiting(out, budget)
            self._resume_swapped(out)
        out.new_gpu_block_ids = self.block_manager.new_gpu_block_ids
        out.one_token_rows_first()
        out.name_written_blocks(self.block_manager.block_size)
        if self.offload is not None:  # this step's copies, and those of preempt() calls since the last step
            out.swap_out, out.store_id, out.swap_in, out.load_id = self.offload.end_step(out.written_gpu_block_ids)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> tuple[int, int]:
        """One decode token, or the next prompt chunk, per running sequence, oldest first; when blocks run out,
        preempt from the back (the newest whose KV is not loading: pop_victim) until this one fits. Returns (token
        budget left, sequences preempted). This loop runs once per row of every decode step: its hot path reads
        fields, not properties."""
        num_preempted = 0
        hold_arriving = self.offload.seq_ids_to_hold(self.running) if self.offload is not None else ()
        running, allocate = self.running, self.block_manager.allocate
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_tokens = len(seq.token_ids)
            if seq.num_unresolved_tokens and num_tokens >= seq.max_num_tokens:
                i += 1  # done sampling: its last token is still being read back, and resolve() finishes it
                continue
            if seq.seq_id in hold_arriving:
                i += 1  # its KV is still being copied in; the others run meanwhile
                continue
            num_new = min(num_tokens - seq.num_computed_tokens, budget)
            while not allocate(seq, num_new):
                victim = pop_victim(running, hold_arriving)
                self._preempt(victim)
                num_preempted += 1
                if victim is seq:
                    break
            else:
                self._add_to_batch(out, seq, num_new)
                budget -= num_new
                i += 1
                continue
            break
        return budget, num_preempted

    def _admit_waiting(self, out: SchedulerOutput, budget: int):
        """New prefills, only while nothing is swapped (swapped sequences resume first). A prompt whose next blocks
        are in the host prefix cache gets GPU blocks for them now and prefills from the next step, after the copies."""
        while self.waiting and budget > 0 and not self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached_block_ids, host_block_ids, tail = self._find_prefix_hits(seq)
            num_hits = len(cached_block_ids) + len(host_block_ids)
            if self.offload and not seq.needs_prompt_logprobs and self.offload.start_disk_load(seq, num_hits,
                                                                                         host_block_ids):
                self.waiting.popleft()  # out of the queue until its blocks are read into the host pool
                continue
            num_cached = len(cached_block_ids) * self.block_manager.block_size + (tail[1] if tail else 0)
            num_new = min(seq.num_uncomputed_tokens - num_cached, budget)
            if host_block_ids:  # blocks for the host hits only
                num_new = len(host_block_ids) * self.block_manager.block_size
            reserve = self.num_watermark_blocks if self.running else 0
            if not self.block_manager.allocate(seq, num_new, cached_block_ids, reserve, tail):
                break
            self.waiting.popleft()
            self._count_prefix_lookup(seq, len(cached_block_ids), tail[1] if tail else 0)
            seq.metrics.mark_scheduled(time.perf_counter())
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if host_block_ids:  # it waits out of the batch until they land
                self.offload.load_prefix_hits(seq, host_block_ids, self.block_manager)
                self.stats.host_prefix_hit_tokens += len(host_block_ids) * self.block_manager.block_size
                self.stats.blocks_onloaded += len(host_block_ids)
                continue
            self._add_to_batch(out, seq, num_new)
            budget -= num_new

    def _resume_swapped(self, out: SchedulerOutput):
        """Swapped sequences, oldest first, get GPU blocks and swap-in copies; they join the batch from the next step,
        so the copies overlap this step's forward."""
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            reserve = self.num_watermark_blocks if self.running else 0  # alone, it may take every block
            num_copied = self.offload.swap_in(seq, self.block_manager, reserve, self.max_num_batched_tokens)
            if num_copied is None:
                break
            self.swapped.popleft()
            out.num_resumed += 1
            self.stats.blocks_swapped_in += num_copied
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _find_prefix_hits(self, seq: Sequence) -> tuple[list[int], list[int], tuple[int, int] | None]:
        """A waiting seq's (GPU hits, host hits, cached tail). None for a request whose prompt tokens still need
        their logprobs: a hit would skip the positions that give them (vLLM skips the lookup too)."""
        if seq.needs_prompt_logprobs:
            return [], [], None
        cached_block_ids = self.block_manager.find_cached_prefix(seq)  # a waiting seq holds no blocks
        host_block_ids = self.offload.lookup(seq, len(cached_block_ids)) if self.offload else []
        if host_block_ids:
            self.offload.touch(host_block_ids)
        # a finished sequence's partial block that continues the GPU hits (not after host hits)
        tail = None if host_block_ids else self.block_manager.find_cached_tail(seq, len(cached_block_ids))
        return cached_block_ids, host_block_ids, tail

    # --- the host prefix cache (decided by the offload manager; counted here)
    def _count_prefix_lookup(self, seq: Sequence, num_gpu_hits: int, num_tail_hits: int = 0):
        """Counted once per admission (a lookup whose allocation failed is repeated, not counted twice)."""
        block_size = self.block_manager.block_size
        self.stats.prefix_cache_hit_tokens += num_gpu_hits * block_size + num_tail_hits
        if self.offload is not None and not seq.needs_prompt_logprobs:  # no lookup was made
            self.stats.host_prefix_query_tokens += self.offload.num_prefix_candidates(seq, num_gpu_hits) * block_size

    def _store_cached_blocks(self):
        """Newly evictable (write-back) or newly cached (write-through) GPU blocks go to the host prefix cache."""
        candidates = self.block_manager.take_offload_candidates()  # drained with or without a host tier
        if self.offload is not None:
            self.stats.blocks_offloaded += self.offload.store_cached_blocks(candidates)

    def _add_to_batch(self, out: SchedulerOutput, seq: Sequence, num_new: int):
        out.seqs.append(seq)
        out.num_new_tokens.append(num_new)
        end, num_tokens = seq.num_computed_tokens + num_new, len(seq.token_ids)
        out.samples.append(end == num_tokens)
        if num_new > 1 and end <= num_tokens - seq.num_unresolved_tokens:
            # a chunk of known tokens: its full blocks are shared from now on (sequences admitted after it in this
            # step hit them instead of computing the same prefix, e.g. a system prompt of many new requests)
            self.block_manager.cache_full_blocks(seq, end)
        if seq.num_recompute_pending:
            start = seq.num_computed_tokens
            self.stats.recomputed_tokens += max(0, min(start + num_new, seq.num_recompute_pending) - start)
            if start + num_new >= seq.num_recompute_pending:
                seq.num_recompute_pending = 0

    def preempt(self, seq: Sequence, mode: str | None = None):
        """Preempt a RUNNING seq between steps (verify_swap.py and tests use it to swap a chosen sequence);
        `mode` "swap" / "recompute" overrides the policy. Its swap-out copies go out with the next step."""
        if seq.status != SequenceStatus.RUNNING:
            raise ValueError(f"seq {seq.seq_id} is {seq.status.name}, only a RUNNING sequence can be preempted")
        self.running.remove(seq)
        self._preempt(seq, mode)

    def _preempt(self, seq: Sequence, mode: str | None = None):
        """Swap seq out when the policy says so and the host pool has room; else recompute it later."""
        self.stats.preemptions += 1
        if self.offload is not None and self.offload.wants_swap(seq, mode):
            num_copied = self.offload.swap_out(seq, self.block_manager)
            if num_copied is not None:
                seq.status = SequenceStatus.SWAPPED
                self.swapped.appendleft(seq)  # victims go newest first: the oldest resumes first, as with recompute
                self.stats.preemptions_swap += 1
                self.stats.blocks_swapped_out += num_copied
                return
            self.stats.swap_fallback_recomputes += 1  # no room in the host pool (the manager says so once)
        self.stats.preemptions_recompute += 1
        self.block_manager.free(seq)
        seq.num_recompute_pending = max(seq.num_recompute_pending, seq.num_computed_tokens)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def postprocess(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[Sequence]:
        """advance + resolve for a step whose tokens are already known. Returns the sequences that finished."""
        return self.resolve(self.advance(out), sampled_token_ids)[1]

    def advance(self, out: SchedulerOutput) -> list[tuple[Sequence, int] | None]:
        """Account for a launched step: computed tokens move forward, and each sequence that samples gets a
        placeholder token until `resolve` fills it in. Returns, per sampled row of the step, (seq, token index),
        or None for a row whose sequence finished in the meantime (its token will be dropped)."""
        rows = []
        stats = self.stats
        stats.steps += bool(out.seqs)
        for seq, num_new, samples in zip(out.seqs, out.num_new_tokens, out.samples):
            if seq.is_finished:  # finished by the resolve of the step before (asynchronous scheduling)
                if samples:
                    rows.append(None)
                continue
            num_tokens = len(seq.token_ids)
            if num_new == 1 and num_tokens > seq.num_prompt_tokens and seq.num_computed_tokens == num_tokens - 1:
                stats.decode_tokens += 1
            else:
                stats.prefill_tokens += num_new
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens % self.block_manager.block_size == 0 or num_new > 1:
                self.block_manager.cache_full_blocks(seq)  # a block just filled up
            if not samples:
                continue  # a prompt chunk: nothing sampled yet
            seq.sample_row = len(rows)
            rows.append((seq, len(seq.token_ids)))
            seq.token_ids.append(PLACEHOLDER_TOKEN)
            seq.num_unresolved_tokens += 1
        return rows

    def resolve(self, rows: list[tuple[Sequence, int] | None], token_ids: list[int], now: float | None = None):
        """Fill in the tokens of a finished step (rows from `advance`), all computed at `now` (None: now), and finish
        sequences on EOS, stop tokens or length. Returns (those that got a token and go on, those that finished)."""
        updated, finished = [], []
        now = time.perf_counter() if now is None else now
        for row, token_id in zip(rows, token_ids):
            if row is None or row[0].is_finished:
                continue
            seq, index = row
            seq.token_ids[index] = token_id
            seq.metrics.mark_token(now)
            seq.num_unresolved_tokens -= 1
            reason = self._finish_reason(seq, token_id, index + 1)
            if reason:
                del seq.token_ids[index + 1:]  # tokens sampled after the end are dropped
                seq.num_unresolved_tokens = 0
                self.finish(seq, reason)
                finished.append(seq)
            else:
                updated.append(seq)
        return updated, finished

    def _finish_reason(self, seq: Sequence, token_id: int, num_tokens: int) -> str | None:
        """Why seq ends with token_id as its num_tokens-th token, or None."""
        params = seq.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in params.stop_token_ids:
            seq.stop_reason = token_id
            return "stop"
        if num_tokens >= seq.max_num_tokens:  # max_tokens generated, or max_model_len reached
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str):
        """Remove seq from its queue and release its blocks on both tiers (also used for aborts)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        self.block_manager.free(seq, keep_tail=True)
        was_loading = self.offload is not None and self.offload.free(seq)  # then it is in no queue
        if seq.status == SequenceStatus.WAITING and not was_loading:
            self.waiting.remove(seq)
        self.min_tokens.discard(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.mark_finished(time.perf_counter())


def pop_victim(running: list[Sequence], seq_ids_loading: set[int]) -> Sequence:
    """Take the newest running sequence whose KV is not loading. Preempting one whose KV is loading frees none of
    the loading blocks until the copy lands (its load holds them) and wastes the copy, so it is passed over, as
    vLLM keeps a request whose KV loads out of its running queue. The sequence being scheduled is never loading,
    so there always is one."""
    for j in range(len(running) - 1, -1, -1):
        if running[j].seq_id not in seq_ids_loading:
            return running.pop(j)
    raise RuntimeError(f"Scheduler: every running sequence {[seq.seq_id for seq in running]} is loading")
