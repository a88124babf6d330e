"""vLLM's presence, frequency and repetition penalties, the plain-Python half: which sample rows of a step have one,
and the tokens each row counts (plain Python; the sampler turns them into tensors, nanovllm/layers/penalties.py)."""
from dataclasses import dataclass, field

from nanovllm.core.sequence import PLACEHOLDER_TOKEN, Sequence


def penalized_rows(seqs: list[Sequence]) -> list[int]:
    """The rows whose request has a penalty; the runner computes this once per batch composition (with the sampling
    tensors), so a step of requests without penalties spends nothing on them."""
    return [row for row, seq in enumerate(seqs) if seq.sampling_params.has_penalties]


@dataclass(slots=True)
class PenaltyRows:
    """One step's penalized rows and the tokens they count, as flat lists, row after row (row i's output tokens are
    output_token_ids[output_offsets[i]:output_offsets[i + 1]], likewise the prompt's). Built per step on rank 0 and
    dropped after it: nothing of vocabulary size lives between steps.
    NOTE: with asynchronous scheduling a row's last completion token may not be read back yet: its entry is
    PLACEHOLDER_TOKEN, and the device fills it from the previous step's sampled ids (placeholder_sources), as
    prepare_step_inputs does for the input ids."""
    rows: list[int] = field(default_factory=list)  # sample rows (of the step's logits) with a penalty
    presence: list[float] = field(default_factory=list)  # per row, as in SamplingParams
    frequency: list[float] = field(default_factory=list)
    repetition: list[float] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)  # completion tokens: presence, frequency, repetition
    output_offsets: list[int] = field(default_factory=lambda: [0])  # [num_rows + 1]
    # prompt tokens, which only the repetition penalty counts (none for a row without one)
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_offsets: list[int] = field(default_factory=lambda: [0])  # [num_rows + 1]
    placeholder_indices: list[int] = field(default_factory=list)  # entries of output_token_ids not read back yet
    placeholder_sources: list[int] = field(default_factory=list)  # their rows in the previous step's sampled ids


def step_penalties(sample_seqs: list[Sequence], rows: list[int], with_prompts: bool = True) -> PenaltyRows | None:
    """The penalized `rows` of sample_seqs (penalized_rows) with their tokens; None when there are none. The
    prompts only with_prompts: they stay on the device while the batch holds the same sequences (BatchPenalties),
    so later steps send only the outputs."""
    if not rows:
        return None
    step = PenaltyRows()
    for row in rows:
        seq = sample_seqs[row]
        params, token_ids, num_prompt = seq.sampling_params, seq.token_ids, seq.num_prompt_tokens
        step.rows.append(row)
        step.presence.append(params.presence_penalty)
        step.frequency.append(params.frequency_penalty)
        step.repetition.append(params.repetition_penalty)
        if with_prompts and params.repetition_penalty != 1.0:
            step.prompt_token_ids += token_ids[:num_prompt]
        step.prompt_offsets.append(len(step.prompt_token_ids))
        step.output_token_ids += token_ids[num_prompt:]
        step.output_offsets.append(len(step.output_token_ids))
        if seq.num_unresolved_tokens:
            if seq.num_unresolved_tokens != 1 or token_ids[-1] != PLACEHOLDER_TOKEN:
                raise RuntimeError(f"step_penalties: sequence {seq.seq_id} has {seq.num_unresolved_tokens} tokens "
                                   f"not read back (at most its last one may be)")
            step.placeholder_indices.append(len(step.output_token_ids) - 1)
            step.placeholder_sources.append(seq.sample_row)
    return step
