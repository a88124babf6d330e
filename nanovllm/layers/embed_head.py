"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.utils.distributed import tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.num_per_rank = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.num_per_rank * self.tp_rank
        self.weight = nn.Parameter(torch.empty(self.num_per_rank, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if loaded.shape != (self.num_embeddings, param.size(1)):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's "
                             f"{(self.num_embeddings, param.size(1))} (vocab_size x hidden_size)")
        shard = loaded[self.vocab_start:self.vocab_start + self.num_per_rank]
        param.data.zero_()
        param.data[:shard.size(0)].copy_(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(x, self.weight)
        local = x - self.vocab_start
        mask = (local >= 0) & (local < self.num_per_rank)
        y = F.embedding(local.clamp(0, self.num_per_rank - 1), self.weight) * mask.unsqueeze(-1)
        dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the selected rows only; rank 0 receives the full vocabulary, other ranks return None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(x, self.weight)  # [N, vocab_per_rank]
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(logits, parts, 0)
            logits = torch.cat(parts, -1) if self.tp_rank == 0 else None
        return None if logits is None else logits[:, :self.num_embeddings]
