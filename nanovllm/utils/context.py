"""Attention metadata for the current forward pass.

The runner sets it before the model runs and resets it after, so `model(input_ids, positions)` stays clean.
"""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    is_decode_only: bool  # every sequence computes one token: the decode kernel (and CUDA graphs) apply
    slot_mapping: torch.Tensor  # [num_tokens] int: gpu_block_id * block_size + offset where each new token's KV goes
    seq_lens: torch.Tensor  # [B] int32: context length of each sequence after this step
    block_tables: torch.Tensor  # [B, max_num_blocks] int32: gpu_block_ids, padded with -1
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32: query offsets (prefill / mixed steps)
    max_query_len: int = 1
    max_seq_len: int = 0
    query_lens_cpu: list[int] | None = None  # host copies for the torch reference backend
    seq_lens_cpu: list[int] | None = None
    # a mixed step whose first rows compute one token each: attention runs `decode_part` (those rows, through the
    # decode kernel) and `prefill_part` (the rest, cu_seqlens_q starting at 0) instead of one prefill over all
    decode_part: "AttentionMetadata | None" = None
    prefill_part: "AttentionMetadata | None" = None
    # decode rows longest context first (unless NANOVLLM_DECODE_LONGEST_FIRST=0): computed on the device by the first
    # layer's attention of each forward (so a CUDA graph recomputes it on replay), read by the others
    decode_row_order: torch.Tensor | None = None

    def decode_rows(self, start: int, end: int) -> "AttentionMetadata":
        """The metadata of one-token rows [start, end) (views, no copies): a mixed step's decode part."""
        seq_lens_cpu = self.seq_lens_cpu[start:end] if self.seq_lens_cpu is not None else None
        return AttentionMetadata(
            is_decode_only=True, slot_mapping=self.slot_mapping[start:end], seq_lens=self.seq_lens[start:end],
            block_tables=self.block_tables[start:end],
            max_seq_len=max(seq_lens_cpu) if seq_lens_cpu else self.max_seq_len,
            query_lens_cpu=self.query_lens_cpu[start:end] if self.query_lens_cpu is not None else None,
            seq_lens_cpu=seq_lens_cpu)


_context: AttentionMetadata | None = None


def get_context() -> AttentionMetadata:
    return _context


def set_context(metadata: AttentionMetadata | None):
    global _context
    _context = metadata


def reset_context():
    set_context(None)
