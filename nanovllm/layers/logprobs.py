"""Raw log-probabilities of chosen tokens and their top-k alternatives, on the device, as small [rows, k + 1]
tensors for the host (never a full-vocabulary copy)."""
import torch


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """The model's distribution before any sampling transform (vLLM's "raw_logprobs"), in float32: [R, V]."""
    return logits.float().log_softmax(-1)


def chosen_and_top(logprobs: torch.Tensor, chosen_ids: torch.Tensor, num_top: int):
    """logprobs [R, V], chosen_ids [R] -> ids [R, 1 + num_top] (column 0: the chosen token, then the top tokens in
    rank order), their logprobs [R, 1 + num_top] float32, and the chosen tokens' 1-based ranks [R] (the count of
    tokens at least as likely, as vLLM counts)."""
    chosen_ids = chosen_ids.long().unsqueeze(1)  # [R, 1]
    chosen = logprobs.gather(1, chosen_ids)  # [R, 1]
    ranks = (logprobs >= chosen).sum(-1)  # [R]
    if num_top == 0:
        return chosen_ids, chosen, ranks
    top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [R, k], descending
    return torch.cat([chosen_ids, top_ids], 1), torch.cat([chosen, top_values], 1), ranks


# Rows of float32 log-probabilities alive at once in logprobs_of: 16 MiB, where all 256 rows of a 151,936-token
# vocabulary (148 MiB) sat beside the sampler's own chunks at the profiling step's peak (memory_profile.py).
LOGPROB_CHUNK_ELEMENTS = 1 << 22


def logprobs_of(logits: torch.Tensor, chosen_ids: torch.Tensor, num_top: int):
    """chosen_and_top(raw_logprobs(logits), chosen_ids, num_top), the same numbers, computed in row chunks: every
    op of both is row by row, so only one chunk's log-softmax need be alive."""
    rows = max(1, LOGPROB_CHUNK_ELEMENTS // logits.size(1))
    if logits.size(0) <= rows:
        return chosen_and_top(raw_logprobs(logits), chosen_ids, num_top)
    parts = [chosen_and_top(raw_logprobs(logits[i:i + rows]), chosen_ids[i:i + rows], num_top)
             for i in range(0, logits.size(0), rows)]
    return tuple(torch.cat(columns) for columns in zip(*parts))
