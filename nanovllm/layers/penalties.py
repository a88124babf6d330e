"""vLLM's presence, frequency and repetition penalties (v1 `apply_penalties`) on the rows of a step's logits that
have one. What stays while the batch holds the same sequences (the rows, their values, their prompts' tokens) goes
to the device once (BatchPenalties, kept with the batch's SamplingTensors); each step sends only the rows' output
tokens. The counts are built a chunk of rows at a time, so nothing of vocabulary size outlives the step."""
import itertools

import numpy as np
import torch


class BatchPenalties:
    """The penalized rows, their penalties and their prompts' tokens on the device, from a step's PenaltyRows
    (nanovllm/engine/penalties.py) built with its prompts; later steps of the same batch build theirs without."""

    def __init__(self, step, device: torch.device):
        self.num_rows = len(step.rows)
        self.prompt_offsets = step.prompt_offsets  # host: the chunks slice the prompt ids by them
        prompt_lens = [b - a for a, b in itertools.pairwise(step.prompt_offsets)]
        parts = [step.rows, step.prompt_token_ids, prompt_lens]
        self.rows, self.prompt_ids, self.prompt_lens = _to_device(parts, device).split([len(p) for p in parts])
        values = step.presence + step.frequency + step.repetition
        self.presence, self.frequency, self.repetition = _to_device([values], device, np.float32).view(3, -1)


def apply_penalties(logits: torch.Tensor, step, last_sampled: torch.Tensor | None, max_elements: int,
                    batch: BatchPenalties | None = None) -> torch.Tensor:
    """logits [B, V] -> float32 logits [B, V] with the rows of `step` (a PenaltyRows) penalized and the others'
    values kept (in place when logits are float32). vLLM penalizes and samples float32 logits: rounded back to
    bf16, a penalized logit can tie its neighbour and flip a greedy choice. The float32 copy of a bf16 batch
    (155 MiB at 256 rows of a 152k vocabulary) is the one transient the start-up profile does not size; it comes
    out of the headroom gpu_memory_utilization leaves. `batch`: the batch's BatchPenalties (None: from `step`,
    which then holds the prompts). `last_sampled`: the previous step's sampled ids, which hold the tokens the host
    has not read back yet."""
    logits = logits.float()
    vocab, device = logits.size(1), logits.device
    batch = batch if batch is not None else BatchPenalties(step, device)
    output_lens = [b - a for a, b in itertools.pairwise(step.output_offsets)]
    parts = [step.output_token_ids, output_lens, step.placeholder_indices, step.placeholder_sources]
    output_ids, output_lens, placeholder_indices, placeholder_sources = _to_device(parts, device).split(
        [len(part) for part in parts])
    if step.placeholder_indices:  # tokens sampled by the previous step, never read back to the host
        if last_sampled is None:
            raise RuntimeError(f"apply_penalties: rows {step.rows} count tokens not read back, and no step sampled")
        output_ids[placeholder_indices] = last_sampled[placeholder_sources]
    chunk_rows = max(1, max_elements // vocab)
    out, prompt = step.output_offsets, batch.prompt_offsets
    for start in range(0, batch.num_rows, chunk_rows):
        end = min(start + chunk_rows, batch.num_rows)
        chunk = batch.rows[start:end]
        output_rows = _row_of_each(output_lens[start:end], out[end] - out[start])
        prompt_rows = _row_of_each(batch.prompt_lens[start:end], prompt[end] - prompt[start])
        logits[chunk] = penalize(logits[chunk], output_rows, output_ids[out[start]:out[end]], prompt_rows,
                                 batch.prompt_ids[prompt[start]:prompt[end]], batch.presence[start:end],
                                 batch.frequency[start:end], batch.repetition[start:end])
    return logits


def penalize(logits: torch.Tensor, output_rows: torch.Tensor, output_ids: torch.Tensor, prompt_rows: torch.Tensor,
             prompt_ids: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor,
             repetition: torch.Tensor) -> torch.Tensor:
    """logits [R, V] float32, penalized in vLLM's order: the repetition penalty where a token is in the row's
    prompt or output (a positive logit divided by it, any other multiplied), then the frequency penalty times the
    token's count in the output, then the presence penalty where that count is not 0. output_rows / prompt_rows:
    the row (0..R-1) of each entry of output_ids / prompt_ids; the penalties are [R]."""
    vocab = logits.size(1)
    counts = torch.zeros_like(logits)  # [R, V]: each token's count in the row's output
    counts.view(-1).index_add_(0, output_rows * vocab + output_ids, torch.ones_like(output_ids, dtype=counts.dtype))
    in_output = counts > 0  # [R, V]
    seen = in_output.clone()
    seen.view(-1)[prompt_rows * vocab + prompt_ids] = True
    repetition = repetition.unsqueeze(1)
    logits = torch.where(seen, torch.where(logits > 0, logits / repetition, logits * repetition), logits)
    logits -= frequency.unsqueeze(1) * counts
    logits -= presence.unsqueeze(1) * in_output
    return logits


def _row_of_each(lens: torch.Tensor, total: int) -> torch.Tensor:
    """[0] * lens[0] + [1] * lens[1] + ...; `total` (their sum, known on the host) spares a device sync."""
    return torch.repeat_interleave(torch.arange(len(lens), device=lens.device), lens, output_size=total)


def _to_device(parts: list[list], device: torch.device, np_dtype=np.int64) -> torch.Tensor:
    """The lists, concatenated, in one tensor on the device; through pinned memory on CUDA so the copy does not
    wait for the forward (asynchronous scheduling)."""
    host = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(parts), dtype=np_dtype,
                                        count=sum(map(len, parts))))
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
