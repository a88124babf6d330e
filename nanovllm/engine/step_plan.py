"""One step flattened to plain lists: what every tensor-parallel rank needs to run it (plain Python; no torch)."""
from dataclasses import dataclass, field

from nanovllm.engine.scheduler import SchedulerOutput
from nanovllm.engine.sequence import PLACEHOLDER_TOKEN, Sequence


@dataclass
class StepPlan:
    """Built once on rank 0 from a SchedulerOutput and sent to the other ranks; small and picklable."""
    input_ids: list[int] = field(default_factory=list)  # [num_tokens]
    positions: list[int] = field(default_factory=list)  # [num_tokens]
    slot_mapping: list[int] = field(default_factory=list)  # [num_tokens]: gpu_block_id * block_size + offset
    query_lens: list[int] = field(default_factory=list)  # [B]
    seq_lens: list[int] = field(default_factory=list)  # [B]: context length after this step
    block_tables: list[list[int]] = field(default_factory=list)  # [B][num_blocks] gpu_block_ids (unpadded)
    logits_indices: list[int] = field(default_factory=list)  # token rows whose next token is sampled
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block_id, cpu_block_id)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block_id, gpu_block_id)
    new_gpu_block_ids: list[int] = field(default_factory=list)
    # asynchronous scheduling: input_ids[placeholder_rows[i]] is the token sampled by the previous step at row
    # placeholder_sources[i]; the runner copies it over on the device
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_sources: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return len(self.input_ids) == len(self.query_lens)


def make_plan(out: SchedulerOutput, block_size: int) -> tuple[StepPlan, list[Sequence]]:
    """Returns the plan and the sequences that sample a token this step (in logits_indices order)."""
    plan = StepPlan(swap_out=out.swap_out, swap_in=out.swap_in, new_gpu_block_ids=out.new_gpu_block_ids)
    sample_seqs = []
    bs = block_size
    for seq, n, samples in zip(out.seqs, out.num_new_tokens, out.samples):
        start, end, table = seq.num_computed_tokens, seq.num_computed_tokens + n, seq.block_table
        if n == 1:
            if seq.token_ids[start] == PLACEHOLDER_TOKEN:
                plan.placeholder_rows.append(len(plan.input_ids))
                plan.placeholder_sources.append(seq.sample_row)
            plan.input_ids.append(seq.token_ids[start])
            plan.positions.append(start)
            plan.slot_mapping.append(table[start // bs] * bs + start % bs)
        else:
            plan.input_ids.extend(seq.token_ids[start:end])
            plan.positions.extend(range(start, end))
            plan.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        plan.query_lens.append(n)
        plan.seq_lens.append(end)
        plan.block_tables.append(table)
        if samples:
            plan.logits_indices.append(len(plan.input_ids) - 1)
            sample_seqs.append(seq)
    return plan, sample_seqs
