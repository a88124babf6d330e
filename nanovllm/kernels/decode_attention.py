"""Decode attention over the paged KV cache (split-K / flash-decoding): one query per sequence.

Program ``(kv_head, b, split)`` runs the ``GROUP`` query heads of one kv head (padded to 16 rows for ``tl.dot``; the
FP8 step takes them transposed, padded to a power of two) over
one slice of row ``row_order[b]``'s context and writes a partial output and its log-sum-exp; the reduce kernel merges
the slices. The number of splits depends only on shapes (batch, kv heads, block-table width), never on ``seq_lens``
values, so the launch is CUDA-graph capturable. Each row cuts its own length into that many slices in the kernel (a
graph's table is max_model_len wide, and cutting that width would leave a short row one live slice); slices past a
sequence's end exit at once. With a single split the first kernel writes the output directly (no reduce launch).

The launch order: a sequence's kv heads side by side in the grid (programs running together read neighbouring bytes
of the same cache rows, since a token's row holds every kv head) and rows longest context first (no long row starts
last and leaves the GPU to a few programs; the engine's first layer sorts the rows by length on the device, inside
the graph, and the others reuse the order). Together, and with per-row splits, they beat the plain (row, head) grid
in batch order and cutting the table width in every engine measurement (the benchmark log's runs of the launch order
and of per-row splits): on ragged contexts at 128 rows (Qwen3-0.6B's shape) the launch order took a layer from 165
to 146 us, and at one row and a 40,960-token table per-row slices took it from 22.6 to 10.3 us.
"""

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged_common import LOG2E, KernelConfig, attend_tile, attend_tile_fp8_halves, check_cache, \
    head_pointers, query_for_cache, scale_args, tile_from_env


# One piece: the GROUP query rows and their running softmax state stay in registers from the load through the key
# loop to the store of the output or the partials, and the per-tile work already lives in attend_tile.
@triton.jit(do_not_specialize=["num_splits", "stride_btb"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, seq_lens_ptr, block_tables_ptr, row_order_ptr,
    out_ptr, part_o_ptr, part_lse_ptr,
    qk_scale, num_heads, num_splits,
    stride_qb, stride_qh, stride_qd,
    stride_ob, stride_oh, stride_od,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_sb, stride_st,
    stride_btb,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr,
    D_HALVES: tl.constexpr, MIN_SLICE: tl.constexpr,
):
    kvh = tl.program_id(0)  # a row's kv heads side by side in the grid
    b = tl.load(row_order_ptr + tl.program_id(1))  # the grid's row index -> batch row (longest context first)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if SPLIT:  # this row's own context in num_splits slices
        tokens_per_split = _row_split_tokens(seq_len, num_splits, BLOCK_N, MIN_SLICE)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, seq_len)
        if start >= end:  # slice past the end of this sequence: the reduce ignores it
            return
    else:
        start = 0
        end = seq_len

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head = kvh * GROUP + offs_g  # [BLOCK_G] query heads of this kv head
    qo_mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_G, BLOCK_D]
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=qo_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
    q, qk_scale = query_for_cache(q, qk_scale, FP8)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_btb
    k_head, v_head, ks_head, vs_head = head_pointers(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kvh,
                                                     stride_kh, stride_vh)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    if D_HALVES:  # FP8 with an fp16 q: transposed, head_dim in two halves (attend_tile_fp8_halves)
        HALF_D: tl.constexpr = BLOCK_D // 2
        q_lo, q_hi = tl.split(tl.permute(tl.reshape(q, (BLOCK_G, 2, HALF_D)), (0, 2, 1)))  # [BLOCK_G, HALF_D] each
        qT_lo, qT_hi = tl.trans(q_lo), tl.trans(q_hi)  # [HALF_D, BLOCK_G]
        accT_lo = tl.zeros([HALF_D, BLOCK_G], tl.float32)
        accT_hi = tl.zeros([HALF_D, BLOCK_G], tl.float32)
        v_unit = tl.full((), 1.0, tl.float32)  # the accumulators' unit (attend_tile_fp8_halves): any, while zero
        for n in range(start, end, BLOCK_N):
            accT_lo, accT_hi, m_i, l_i, v_unit = attend_tile_fp8_halves(
                accT_lo, accT_hi, m_i, l_i, v_unit, qT_lo, qT_hi, k_head, v_head, ks_head, vs_head, bt_row, n, end,
                stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale, BLOCK_SIZE, BLOCK_N, HALF_D)
        acc_lo, acc_hi = tl.trans(accT_lo), tl.trans(accT_hi)  # [BLOCK_G, HALF_D]
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        norm = v_unit / l_safe[:, None]  # [BLOCK_G, 1]
        offs_h = tl.arange(0, HALF_D)
        g_rows = (offs_g < GROUP)[:, None]  # [BLOCK_G, 1]
        _store_output(acc_lo * norm, offs_h, b, head, split, g_rows, out_ptr, part_o_ptr,
                      num_heads, num_splits, stride_ob, stride_oh, stride_od, SPLIT, BLOCK_D)
        _store_output(acc_hi * norm, offs_h + HALF_D, b, head, split, g_rows, out_ptr,
                      part_o_ptr, num_heads, num_splits, stride_ob, stride_oh, stride_od, SPLIT, BLOCK_D)
    else:
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for n in range(start, end, BLOCK_N):
            acc, m_i, l_i = attend_tile(acc, m_i, l_i, q, k_head, v_head, ks_head, vs_head, bt_row, n, m_i, end,
                                        stride_kb, stride_kt, stride_vb, stride_vt, stride_sb, stride_st, qk_scale,
                                        HEAD_DIM, BLOCK_SIZE, BLOCK_N, BLOCK_D, True, False, FP8)
        l_safe = tl.where(l_i > 0, l_i, 1.0)
        _store_output(acc / l_safe[:, None], offs_d, b, head, split, qo_mask, out_ptr, part_o_ptr,
                      num_heads, num_splits, stride_ob, stride_oh, stride_od, SPLIT, BLOCK_D)
    if SPLIT:  # part_lse [B, H, num_splits], log2 domain
        part = (b * num_heads + head).to(tl.int64) * num_splits + split  # [BLOCK_G]
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_safe), mask=offs_g < GROUP)


@triton.jit
def _store_output(o, offs_d, b, head, split, mask, out_ptr, part_o_ptr, num_heads, num_splits,
                  stride_ob, stride_oh, stride_od, SPLIT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns offs_d of the rows' output o [BLOCK_G, len(offs_d)]: into out, or with splits into the partials
    part_o [B, H, num_splits, BLOCK_D]; mask covers the real query heads ([BLOCK_G, 1] or the tile's shape)."""
    if not SPLIT:
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = (b * num_heads + head).to(tl.int64) * num_splits + split  # [BLOCK_G]
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + offs_d[None, :], o, mask=mask)


@triton.jit
def _row_split_tokens(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_SLICE: tl.constexpr):
    """Slice length when each row cuts its own context into at most num_splits slices: a multiple of BLOCK_N, at
    least MIN_SLICE (a multiple of BLOCK_N), so a short row takes fewer slices than a long one."""
    return tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N, MIN_SLICE)


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_o_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    num_heads, num_splits,
    stride_ob, stride_oh, stride_od,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_SLICE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    tokens_per_split = _row_split_tokens(seq_len, num_splits, BLOCK_N, MIN_SLICE)
    num_valid = (seq_len + tokens_per_split - 1) // tokens_per_split
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = (offs_s < num_valid) & (offs_s < num_splits)  # [BLOCK_S]
    base = (b * num_heads + h).to(tl.int64) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))  # [BLOCK_S]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # empty sequence (seq_len 0): output zeros
    w = tl.exp2(lse - m)  # [BLOCK_S]
    denom = tl.sum(w, 0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :],
                mask=s_mask[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    o = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [BLOCK_D]
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)



# Split policy constants (see plan_decode_launch). Programs per SM are what keep HBM busy: where the batch alone
# gives an SM fewer than _PROGRAMS_PER_SM, rows are cut into slices until it has that many. The one-warp FP8 tile
# leaves an SM 16 slots (128 registers a thread), which its rows fill instead, in slices of at least
# _FP8_MIN_SLICE_TOKENS so that short rows stay whole: filling them with one-tile slices measured slower at 32-256
# short rows, slices of >= 256 tokens faster at the laptop's 10-40 long rows (docs/benchmarks.md, FP8 decode attention).
_PROGRAMS_PER_SM = 4
_FP8_PROGRAMS_PER_SM = 16
_FP8_MIN_SLICE_TOKENS = 256
_MAX_SPLITS = 64  # bounds the scratch buffers and the reduce tile
# One reduce tile for every split count: the count follows the block-table width, which differs between graph
# replays (max_model_len wide) and eager mixed steps (the step's own width), so a tile sized per count compiled a
# new variant in the middle of a run (0.2 s on an H200). Slices past num_splits are masked loads that read nothing.
_REDUCE_BLOCK_S = triton.next_power_of_2(_MAX_SPLITS)
SPLIT_PLAN_BLOCK_N = 64  # the default plan's slices are multiples of this (every default decode block_n divides it)
# the bf16/fp16 tile of unsplit decode launches (full batches) at block sizes below 128 from NANOVLLM_DECODE_TILE,
# "block_m,block_n,num_warps,num_stages" (block_m is ignored: a GQA group is padded to 16 rows); side-by-side runs
# of bench.py
_DECODE_TILE = tile_from_env("NANOVLLM_DECODE_TILE")


# The FP8 tile. Reading FP8 costs work bf16 does not (each value converted to fp16, V read as byte pairs and
# converted in registers): one warp per program (no softmax reductions across warps through shared memory), the step
# transposed so the GQA group is the dots' narrow dimension (attend_tile_fp8_halves), K and V in two head_dim halves,
# 32 keys a step, 6 stages, registers capped at 128 (16 resident programs per SM). These tiles rank by registers per
# program (resident warps per SM), not by instructions (docs/benchmarks.md).
_FP8_DECODE_TILE = KernelConfig(block_m=16, block_n=32, num_warps=1, num_stages=6, max_registers=128, fp8_d_halves=True)
# Full grids take 16 keys a step (90 registers, 21 resident programs per SM): from 24 programs per SM waiting, half
# again the default tile's slots, its extra residents pay; with a thinner second wave they do not (docs/benchmarks.md).
_FP8_FULL_GRID_TILE = KernelConfig(block_m=16, block_n=16, num_warps=1, num_stages=4, fp8_d_halves=True)
_FP8_FULL_GRID_PROGRAMS_PER_SM = 24


@dataclasses.dataclass(frozen=True)
class DecodeLaunch:
    """How one decode call runs: slices per row, the tile, and the shortest slice (a multiple of the tile's keys;
    a row shorter than `splits` slices of it takes fewer)."""
    splits: int
    config: KernelConfig
    min_slice_tokens: int


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's number of SMs, which the split plan fills; 132 (an H100/H200) for CPU and interpreter runs."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def decode_split_plan(batch: int, num_kv_heads: int, max_blocks: int, block_size: int, slice_tokens: int,
                      num_sms: int, num_splits: int | None = None, programs_per_sm: int = _PROGRAMS_PER_SM) -> int:
    """num_splits from shapes only, never from seq_lens values (graph capture).

    Programs are (kv_heads x batch x splits). When batch x kv_heads alone reaches _PROGRAMS_PER_SM programs per SM
    there is one split. Otherwise each row's context is cut (in the kernel) into enough slices to reach
    `programs_per_sm`, at most _MAX_SPLITS and no more than the table width (max_blocks * block_size tokens) has
    `slice_tokens`-token pieces. A given `num_splits` (tests, benchmarks) is only clamped to [1, _MAX_SPLITS].
    """
    if num_splits is not None:
        return max(1, min(num_splits, _MAX_SPLITS))
    ctas = max(1, batch * num_kv_heads)
    if ctas >= _PROGRAMS_PER_SM * num_sms:
        return 1
    return min(triton.cdiv(programs_per_sm * num_sms, ctas), _MAX_SPLITS,
               triton.cdiv(max(1, max_blocks * block_size), slice_tokens))


def decode_config(dtype: torch.dtype, head_dim: int, block_size: int, split: bool, fp8: bool = False,
                  programs_per_sm: float = 0.0) -> KernelConfig:
    """The decode kernel's default tile for this query dtype, head size, cache block size, launch kind, cache and
    programs per SM of an unsplit launch."""
    if dtype == torch.float32 or head_dim > 128:
        return KernelConfig(block_m=16, block_n=32, num_warps=4, num_stages=2)
    if fp8:
        full_grid = not split and programs_per_sm >= _FP8_FULL_GRID_PROGRAMS_PER_SM
        return _FP8_FULL_GRID_TILE if full_grid else _FP8_DECODE_TILE
    # H200 sweep, bf16 D=128 B=256 ctx=1024: (128, 4 warps, 2 stages) ~96% of copy bw with block_size 256
    # but ~92% with block_size 16, where (64, 4, 3) gives ~96%. The big tile fits one program per SM,
    # so for split (small-batch) launches, where the wave tail matters, the smaller tile is used.
    if split or block_size < 128:
        if not split and _DECODE_TILE is not None:
            return dataclasses.replace(_DECODE_TILE, block_m=16)
        return KernelConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)
    return KernelConfig(block_m=16, block_n=128, num_warps=4, num_stages=2)


def plan_decode_launch(dtype: torch.dtype, head_dim: int, batch: int, num_kv_heads: int, max_blocks: int,
                       block_size: int, num_sms: int, fp8: bool, num_splits: int | None = None,
                       config: KernelConfig | None = None, min_split_tokens: int | None = None) -> DecodeLaunch:
    """The decode launch from shapes only (graph capture). `num_splits`, `config` and `min_split_tokens` override
    the plan's choices (tests and benchmarks); the shortest slice defaults to one tile, and to
    _FP8_MIN_SLICE_TOKENS for the one-warp FP8 tile, whose rows fill _FP8_PROGRAMS_PER_SM slots."""
    split_tile = config or decode_config(dtype, head_dim, block_size, True, fp8)
    one_warp_fp8 = fp8 and split_tile.num_warps == 1
    if min_split_tokens is None:
        min_split_tokens = _FP8_MIN_SLICE_TOKENS if one_warp_fp8 else 1
    plan_block_n = config.block_n if config is not None else SPLIT_PLAN_BLOCK_N
    splits = decode_split_plan(batch, num_kv_heads, max_blocks, block_size, max(plan_block_n, min_split_tokens),
                               num_sms, num_splits, _FP8_PROGRAMS_PER_SM if one_warp_fp8 else _PROGRAMS_PER_SM)
    cfg = config or decode_config(dtype, head_dim, block_size, splits > 1, fp8, batch * num_kv_heads / num_sms)
    return DecodeLaunch(splits, cfg, triton.cdiv(max(1, min_split_tokens), cfg.block_n) * cfg.block_n)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: torch.Tensor,
                           block_tables: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                           num_splits: int | None = None, config: KernelConfig | None = None,
                           row_order: torch.Tensor | None = None,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           min_split_tokens: int | None = None) -> torch.Tensor:
    """One query per sequence (at its last position) over its paged context. Returns [B, H, D] (`out` when given).

    CUDA-graph safe: no host sync, scratch sized from shapes only. ``num_splits``/``config``/``min_split_tokens``
    override the plan (plan_decode_launch; tests and benchmarks). ``row_order`` [B] int32, the rows longest context
    first (the engine sorts them once per forward); None sorts them here. With FP8 caches, `k_scale`/`v_scale`
    [num_blocks, block_size, num_kv_heads] hold each token's scales.
    """
    batch, num_heads, head_dim = q.shape  # [B, H, D]
    check_cache(k_cache, v_cache, k_cache.shape[2], head_dim)
    assert num_heads % k_cache.shape[2] == 0
    if out is None:
        out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)  # [B, H, D]
    assert out.shape == (batch, num_heads, head_dim)
    if batch == 0:
        return out
    launch = plan_decode_launch(q.dtype, head_dim, batch, k_cache.shape[2], block_tables.shape[1], k_cache.shape[1],
                                sm_count(q.device), k_scale is not None, num_splits, config, min_split_tokens)
    if row_order is None:
        row_order = torch.argsort(seq_lens, descending=True).to(torch.int32)
    _launch_decode(q, k_cache, v_cache, seq_lens, block_tables, row_order, scale, out, launch, k_scale, v_scale)
    return out


def _launch_decode(q, k_cache, v_cache, seq_lens, block_tables, row_order, scale: float, out, launch: DecodeLaunch,
                   k_scale, v_scale) -> None:
    """The decode kernel on a (kv_heads, batch, splits) grid, then, with splits, the reduce into `out`."""
    splits, cfg, min_slice = launch.splits, launch.config, launch.min_slice_tokens
    batch, num_heads, head_dim = q.shape  # [B, H, D]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    if splits > 1:
        part_o = torch.empty((batch, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    fp8 = k_scale is not None
    # the transposed FP8 step takes the group's heads as the dots' narrow dimension, which needs no padding to 16
    d_halves = fp8 and cfg.fp8_d_halves and q.dtype != torch.float32 and block_d == head_dim
    k_scale, v_scale, scale_strides = scale_args(k_cache, k_scale, v_scale)
    _decode_kernel[(num_kv_heads, batch, splits)](
        q, k_cache, v_cache, k_scale, v_scale, seq_lens, block_tables, row_order,
        out, part_o, part_lse,
        scale * LOG2E, num_heads, splits,
        *q.stride(), *out.stride(),
        *k_cache.stride()[:3], *v_cache.stride()[:3], *scale_strides,
        block_tables.stride(0),
        HEAD_DIM=head_dim, GROUP=group, BLOCK_SIZE=k_cache.shape[1], SPLIT=splits > 1,
        BLOCK_G=triton.next_power_of_2(group) if d_halves else max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg.block_n, BLOCK_D=block_d, FP8=fp8, D_HALVES=d_halves,
        MIN_SLICE=min_slice, **cfg.launch_options(),
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            part_o, part_lse, seq_lens, out,
            num_heads, splits,
            *out.stride(),
            HEAD_DIM=head_dim, BLOCK_S=_REDUCE_BLOCK_S, BLOCK_D=block_d, BLOCK_N=cfg.block_n,
            MIN_SLICE=min_slice, num_warps=4,
        )
