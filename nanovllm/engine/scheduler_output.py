"""What the scheduler hands the runner each step (ids and counts, no tensors) and the counters it keeps (plain
Python; no torch)."""
from dataclasses import dataclass, field, fields

from nanovllm.core.sequence import Sequence


@dataclass
class SchedulerOutput:
    """One step, as ids and counts. The runner turns it into tensors and copies."""
    seqs: list[Sequence] = field(default_factory=list)  # sequences that compute tokens this step, in batch order
    num_new_tokens: list[int] = field(default_factory=list)  # per seq: 1 for a decode, a chunk for a prefill
    samples: list[bool] = field(default_factory=list)  # per seq: this step completes its input, so it samples
    # (gpu_block_id, cpu_block_id): KV of swapped-out victims and of blocks stored in the host prefix cache;
    # copied before any new owner writes the gpu block. Each cpu block at most once: a host block is held by its
    # copy until the copy lands (OffloadManager), so the copy engine may issue them in its own order
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (cpu_block_id, gpu_block_id): KV of resumed sequences and of host prefix hits; they join the batch once the
    # copy engine reports the load landed, so the copy overlaps this step's forward
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # the transfer ids of swap_out and swap_in (-1: no copies), which the copy engine reports back when they land
    store_id: int = -1
    load_id: int = -1
    # gpu blocks handed out this step: of the blocks this step's forward and swap-ins write, the only ones a
    # swap-out still in flight may be reading (the others were handed out in earlier steps, which waited for theirs)
    new_gpu_block_ids: list[int] = field(default_factory=list)
    # gpu blocks this step's forward writes KV into (`name_written_blocks`), the one place that is computed: a
    # victim's ones are handed out last by the offload manager, and the copy engine makes the next step's
    # swap-outs of them wait for this step's forward (its rule 1). One per row, in batch order, in a decode-only
    # step (make_plan computes the rows' slots from them)
    written_gpu_block_ids: list[int] = field(default_factory=list)
    num_resumed: int = 0  # swapped sequences made RUNNING (with copies or, all their blocks cached, without)

    @property
    def is_empty(self) -> bool:
        """Nothing to launch. A step that only resumed sequences is empty, but it was progress (num_resumed)."""
        return not (self.seqs or self.swap_out or self.swap_in)

    @property
    def transfer_ids(self) -> list[int]:
        """The ids of this step's copies (a simulation without a copy engine lands them all after the step)."""
        return [transfer_id for transfer_id in (self.store_id, self.load_id) if transfer_id >= 0]

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_new_tokens)

    def name_written_blocks(self, block_size: int):
        """Fill written_gpu_block_ids, once the batch order is final and before `Scheduler.advance` moves the
        sequences' computed tokens on."""
        self.written_gpu_block_ids = written_gpu_block_ids(self.seqs, self.num_new_tokens, block_size)

    def one_token_rows_first(self):
        """Batch order of a mixed step: rows computing one token (decodes) first, prompt chunks after, each in
        scheduling order. The runner then sends the leading rows through the decode kernel and only the rest
        through the prefill kernel, whose query tiles would be almost empty for one-token rows."""
        num_one = self.num_new_tokens.count(1)
        if self.num_new_tokens[:num_one].count(1) == num_one:
            return  # already in order (every decode-only step)
        order = sorted(range(len(self.seqs)), key=lambda i: self.num_new_tokens[i] != 1)  # stable
        self.seqs = [self.seqs[i] for i in order]
        self.num_new_tokens = [self.num_new_tokens[i] for i in order]
        self.samples = [self.samples[i] for i in order]


def written_gpu_block_ids(seqs: list[Sequence], num_new_tokens: list[int], block_size: int) -> list[int]:
    """The gpu blocks that computing num_new_tokens more tokens of each seq writes KV into: one per row when every
    row computes one token (the common decode step: one comprehension, no per-row slicing), else each row's blocks
    in order."""
    if num_new_tokens.count(1) == len(num_new_tokens):
        return [seq.block_table[seq.num_computed_tokens // block_size] for seq in seqs]
    written = []
    for seq, num_new in zip(seqs, num_new_tokens):
        start = seq.num_computed_tokens
        written += seq.block_table[start // block_size:(start + num_new + block_size - 1) // block_size]
    return written


@dataclass
class SchedulerStats:
    prefill_tokens: int = 0  # tokens computed for prompts (and for recomputed outputs)
    decode_tokens: int = 0
    steps: int = 0  # steps launched that compute tokens (decode_tokens / steps: the mean decode batch)
    prefix_cache_hit_tokens: int = 0
    preemptions: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
    recomputed_tokens: int = 0  # tokens computed a second time because of a recompute preemption
    # preemptions that the policy (or mode) meant to swap but recomputed: no room in the host pool
    swap_fallback_recomputes: int = 0
    blocks_swapped_out: int = 0
    blocks_swapped_in: int = 0
    host_prefix_query_tokens: int = 0  # prompt tokens looked up in the host prefix cache (past the GPU hits)
    host_prefix_hit_tokens: int = 0
    blocks_offloaded: int = 0  # cached GPU blocks copied to the host prefix cache
    blocks_onloaded: int = 0  # host prefix-cache hits copied back to the GPU

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

