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
