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
    # decode rows longest context first (the Triton decode launch order): computed on the device by the first
    # layer's attention of each forward (so a CUDA graph recomputes it on replay), read by the others
    decode_row_order: torch.Tensor | None = None


_context: AttentionMetadata | None = None


def get_context() -> AttentionMetadata:
    return _context


def set_context(metadata: AttentionMetadata | None):
    global _context
    _context = metadata


def reset_context():
    set_context(None)
