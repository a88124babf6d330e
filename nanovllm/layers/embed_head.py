"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary.

With `int8_weight` (Config.quantize_lm_head="int8") the vocabulary weight is rounded to int8 once loaded, with a
float32 scale per vocabulary row: the layout.py "int" kind at 8 bits with one group per row (G = hidden size, no
mins), half the bytes of bf16. The LM head reads it with the int8 kernel on CUDA (nanovllm/kernels/quant_matmul.py)
and otherwise as `scale[v] * (x @ q[v])` over chunks of rows, so no bf16 copy of the whole head is ever made.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.quantization.method import quant_matmul, use_kernels
from nanovllm.utils.distributed import tp_rank, tp_size

INT8_MAX = 127  # symmetric rounding: -127..127, so that -w rounds to -q
HEAD_CHUNK_ROWS = 8192  # vocabulary rows converted at a time where no int8 kernel runs (8192 x 4096 x 4 B: 128 MiB)


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[V, H] float -> (int8 [V, H], float32 scales [V, 1]), round to nearest with a scale of max|row| / 127.
    HEAD_CHUNK_ROWS rows at a time: a float32 copy of a whole vocabulary (2.3 GiB for Qwen3-8B's) would not fit
    beside the weights inside an 8 GiB budget."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty((weight.size(0), 1), dtype=torch.float32, device=weight.device)
    for start in range(0, weight.size(0), HEAD_CHUNK_ROWS):
        w = weight[start:start + HEAD_CHUNK_ROWS].float()
        row_scales = w.abs().amax(1, keepdim=True) / INT8_MAX
        row_scales = torch.where(row_scales > 0, row_scales, torch.ones_like(row_scales))  # all-zero rows stay zero
        q[start:start + HEAD_CHUNK_ROWS] = torch.round(w / row_scales).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        scales[start:start + HEAD_CHUNK_ROWS] = row_scales
    return q, scales


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, int8_weight: bool = False, on_host: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.num_embeddings = num_embeddings
        self.num_per_rank = (num_embeddings + self.tp_size - 1) // self.tp_size
        self.vocab_start = self.num_per_rank * self.tp_rank
        # on_host (Config.offload_embedding, on a GPU): the table is made and loaded in host memory, never on the
        # GPU, and pinned once loaded (pin_host_table), where the GPU's gather reads it
        self.on_host = on_host
        self.weight = nn.Parameter(torch.empty(self.num_per_rank, embedding_dim, device="cpu" if on_host else None),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.int8_weight = int8_weight
        self.dtype = self.weight.dtype  # the model's: what the embedding returns, also from int8 rows
        self.register_parameter("scales", None)  # [num_per_rank, 1] float32 once the weight is int8

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor):
        if loaded.shape != (self.num_embeddings, param.size(1)):
            raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's "
                             f"{(self.num_embeddings, param.size(1))} (vocab_size x hidden_size)")
        shard = loaded[self.vocab_start:self.vocab_start + self.num_per_rank]
        param.data.zero_()
        param.data[:shard.size(0)].copy_(shard)

    def quantize_weight(self):
        """The loaded weight -> int8 with a scale per row (once; a tied LM head then shares both)."""
        if self.int8_weight and self.scales is None:
            q, scales = quantize_rows_int8(self.weight.data)
            self.weight = nn.Parameter(q, requires_grad=False)
            self.scales = nn.Parameter(scales, requires_grad=False)

    def pin_host_table(self):
        """Once loaded (and rounded to int8, if asked): a host table into pinned memory, which the GPU can read."""
        if self.on_host and not self.weight.is_pinned():
            self.weight = nn.Parameter(self.weight.data.pin_memory(), requires_grad=False)
            if self.scales is not None:
                self.scales = nn.Parameter(self.scales.data.pin_memory(), requires_grad=False)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return F.embedding(ids, self.weight)
        rows = F.embedding(ids, self.weight).to(torch.float32) * F.embedding(ids, self.scales)  # q * s in float32
        return rows.to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_host:  # the GPU gathers the rows from the host table, other ranks' ids as zeros
            from nanovllm.kernels.host_embedding import gather_rows
            y = gather_rows(x, self.weight, self.scales, self.vocab_start, self.dtype)
        elif self.tp_size == 1:
            return self.lookup(x)
        else:
            local = x - self.vocab_start
            mask = (local >= 0) & (local < self.num_per_rank)
            y = self.lookup(local.clamp(0, self.num_per_rank - 1)) * mask.unsqueeze(-1)
        if self.tp_size > 1:
            dist.all_reduce(y)
        return y


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for the selected rows only; rank 0 receives the full vocabulary, other ranks return None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        logits = self.int8_logits(x) if self.scales is not None else F.linear(x, self.weight)  # [N, vocab_per_rank]
        if self.tp_size > 1:
            parts = [torch.empty_like(logits) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
            dist.gather(logits, parts, 0)
            logits = torch.cat(parts, -1) if self.tp_rank == 0 else None
        return None if logits is None else logits[:, :self.num_embeddings]

    def int8_logits(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):
            return quant_matmul.int_linear(x, self.weight, self.scales, None, 8, self.weight.size(1))
        chunks = []
        for start in range(0, self.weight.size(0), HEAD_CHUNK_ROWS):
            q, s = self.weight[start:start + HEAD_CHUNK_ROWS], self.scales[start:start + HEAD_CHUNK_ROWS]
            chunks.append((F.linear(x.float(), q.float()) * s.t()).to(x.dtype))  # the scale is the row's: after
        return torch.cat(chunks, -1)
