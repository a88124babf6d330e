"""The input embedding's rows gathered by the GPU from a table in pinned host memory (Config.offload_embedding).

A step reads only its tokens' rows of the embedding (a decode step of 256 rows reads 2 MB of Qwen3-8B's 1.2 GB),
so the table can stay in host memory, as llama.cpp keeps its token embedding, and give its GPU memory to the KV
cache. With unified addressing, pinned host memory has one address for the host and the GPU, and a kernel reads it
over PCIe without a copy first: so the ids never leave the GPU (async scheduling feeds a step's sampled tokens to
the next step on the device) and a CUDA graph captures the gather like any kernel.
"""
import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns per program


@triton.jit
def _gather_rows_kernel(ids_ptr, table_ptr, scales_ptr, out_ptr, row_start, num_rows, hidden_size,
                        HAS_SCALES: tl.constexpr, BLOCK: tl.constexpr):
    """out[t] = table[ids[t] - row_start] (times that row's scale for int8 rows, in float32), or zeros where the
    id is outside [row_start, row_start + num_rows): another tensor-parallel rank's rows."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(ids_ptr + token).to(tl.int64) - row_start
    inside = (row >= 0) & (row < num_rows)
    row = tl.where(inside, row, 0)
    in_row = cols < hidden_size
    read_cols = tl.where(inside, hidden_size, 0)  # a row outside reads no column
    values = tl.load(table_ptr + row * hidden_size + cols, mask=cols < read_cols, other=0)
    if HAS_SCALES:
        values = values.to(tl.float32) * tl.load(scales_ptr + row)
    tl.store(out_ptr + token * hidden_size + cols, values.to(out_ptr.dtype.element_ty), mask=in_row)


def gather_rows(ids: torch.Tensor, table: torch.Tensor, scales: torch.Tensor | None, row_start: int,
                out_dtype: torch.dtype) -> torch.Tensor:
    """ids [T] on the GPU; table [rows, hidden] contiguous (pinned host memory, or any memory the GPU reads);
    scales [rows, 1] float32 for an int8 table, else None. Returns [T, hidden] out_dtype on the ids' device."""
    num_rows, hidden_size = table.shape
    assert table.is_contiguous() and (scales is None or scales.is_contiguous()), "gather_rows: contiguous tables"
    out = torch.empty((ids.numel(), hidden_size), dtype=out_dtype, device=ids.device)
    if ids.numel():
        grid = (ids.numel(), triton.cdiv(hidden_size, BLOCK))
        _gather_rows_kernel[grid](ids.reshape(-1), table, table if scales is None else scales, out, row_start,
                                  num_rows, hidden_size, HAS_SCALES=scales is not None, BLOCK=BLOCK, num_warps=4)
    return out
