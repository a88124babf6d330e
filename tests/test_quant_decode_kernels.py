"""The 4-bit decode kernels that the plan table (quant_plans.W4_DECODE_TILES) can name besides the shipped ones:
the multi-row CUDA-core kernel (nanovllm/kernels/quant_gemv_rows.py) and the swapped-operand dot kernel
(quant_gemm_swapped.py), against the contract's dequantization under Triton's interpreter and compiled for sm_90
and sm_89; and the table itself on the host.

The kernels run on inputs that are views into buffers padded with NaN (x, scales, mins) or nonzero nibbles (the
words), so a load past a row, a group or a split's last K step shows as NaN or a wrong value. Their bound is the
scale-after-dot kernels' (tests/test_quant_kernels.py's docstring): one output rounding, eps of the largest output.
"""
import dataclasses

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from interpreter_support import interpret  # noqa: E402
from triton_standin import run_compile_script  # noqa: E402

from nanovllm.kernels import quant_gemm  # noqa: E402
from nanovllm.kernels import quant_plans as qp  # noqa: E402

DECODE_CASES = [  # kernel, M, rows a program, N, K, group, BLOCK_N, BLOCK_K, splits wanted, x, scale, min dtypes
    ("rows", 2, 2, 40, 256, 64, 32, 64, 1, "bfloat16", "float16", "float32"),  # two rows, N ragged, one split
    ("rows", 3, 4, 72, 512, 128, 32, 128, 2, "bfloat16", "float16", "float32"),  # AWQ-like, rows, N ragged, split
    ("rows", 4, 4, 24, 128, 32, 16, 32, 4, "float16", "bfloat16", None),  # symmetric, fp16 offset, 4 splits
    ("rows", 5, 8, 48, 352, 32, 16, 32, 2, "bfloat16", "float32", "bfloat16"),  # 11 steps: splits of 6 and 5
    ("rows", 8, 8, 33, 192, 64, 64, 64, 3, "float16", "float16", "float16"),  # BLOCK_N past N: one ragged program
    ("rows", 16, 16, 20, 256, 128, 16, 64, 2, "bfloat16", "float16", None),  # 16 rows, BLOCK_K half the group
    ("rows", 11, 16, 40, 384, 384, 32, 128, 3, "float16", "float16", "float32"),  # group = K, not a power of two
    ("swapped", 3, 16, 72, 512, 128, 64, 128, 2, "bfloat16", "float16", "float32"),  # AWQ-like, N ragged, split
    ("swapped", 16, 16, 40, 256, 64, 32, 32, 4, "float16", "bfloat16", None),  # symmetric fp16, 8 steps in 4
    ("swapped", 20, 16, 48, 352, 32, 16, 32, 2, "bfloat16", "float32", "bfloat16"),  # two row tiles, 6 + 5 steps
    ("swapped", 9, 32, 24, 384, 384, 16, 128, 1, "float16", "float16", "float32"),  # a 32-row tile, group = K
]

DECODE_SCRIPT = """
import json
import torch
from test_quant_kernels import dequant_int, errors, make_int_weight
from nanovllm.kernels import quant_plans, quant_matmul as qm
from nanovllm.utils.switches import SWITCHES

def padded(t, pad_value, extra=4):
    buf = torch.full((t.shape[0], t.shape[1] + extra), pad_value, dtype=t.dtype)
    buf[:, :t.shape[1]] = t
    return buf[:, :t.shape[1]]

res = []
for kernel, M, rows, N, K, G, bn, bk, splits, x_dtype, s_dtype, m_dtype in CASES:
    qweight, q, scales, mins = make_int_weight(N, K, G, 4, getattr(torch, s_dtype),
                                               m_dtype and getattr(torch, m_dtype))
    w = dequant_int(q, scales, mins, G)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(getattr(torch, x_dtype))
    x = padded(x, float("nan"))
    steps = K // bk
    num_k_steps = -(-steps // splits)
    plan = quant_plans.TilePlan(rows, bn, bk, -(-steps // num_k_steps), num_k_steps, 4, 1, False, True,
                                cuda_cores=kernel == "rows", multi_row=kernel == "rows", swap_ab=kernel != "rows")
    args = (padded(qweight, 0x77777777), padded(scales, float("nan")),
            mins if mins is None else padded(mins, float("nan")))
    outs = {}
    for mode in ("kernel", "launch"):  # the split-K reduction in the last program, and by a second launch
        SWITCHES.split_k_reduce = mode
        outs[mode] = qm.weight_only_linear(x, *args, 0, 1, G, plan)
    res.append(dict(errors(outs["kernel"], x, w), dtype=str(x.dtype), shape=list(outs["kernel"].shape),
                    splits=plan.num_splits, same_bits=bool(torch.equal(outs["kernel"], outs["launch"]))))
# the table drives the plan: a "rows" entry makes int_linear run the kernel, from the plan alone
quant_plans.W4_DECODE_TILES = (quant_plans.DecodeTiles(1, "gemv", 128, 128, 4, 4),
                               quant_plans.DecodeTiles(8, "rows", 32, 64, 4, 4))
qweight, q, scales, mins = make_int_weight(40, 512, 128, 4, torch.float16, torch.float32)
x = torch.randn(6, 512, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
plan = quant_plans.plan_weight_only(6, 40, 512, 128, weight_kind=0)
y = qm.int_linear(x, qweight, scales, mins, 4, 128)
res.append(dict(errors(y, x, dequant_int(q, scales, mins, 128)), dtype=str(y.dtype), shape=list(y.shape),
                splits=plan.num_splits, same_bits=True, multi_row=plan.multi_row, block_m=plan.block_m,
                block_n=plan.block_n, block_k=plan.block_k))
print(json.dumps(res))
"""


def test_decode_kernels_match_the_contract_dequantization():
    results = interpret(DECODE_SCRIPT.replace("CASES", repr(DECODE_CASES)))
    for case, res in zip(DECODE_CASES + [("rows", 6, 8, 40)], results, strict=True):
        eps = 2 ** -7 if res["dtype"] == "torch.bfloat16" else 2 ** -10
        assert res["shape"] == [case[1], case[3]], (case, res)
        assert res["err"] <= 1.01 * eps * res["max_ref"], (case, res)  # NaN fails too
        assert res["same_bits"], (case, res)
    assert [r["splits"] for r in results[:-1]] == [1, 2, 4, 2, 3, 2, 3, 2, 4, 2, 1]
    assert {k: results[-1][k] for k in ("multi_row", "block_m", "block_n", "block_k")} == {
        "multi_row": True, "block_m": 8, "block_n": 32, "block_k": 64}


GEMV_MAGNITUDES_SCRIPT = """
import json
import torch
from test_quant_kernels import dequant_int, errors, make_int_weight
from nanovllm.kernels import quant_plans, quant_matmul as qm
res = []
BF16_MAGNITUDES, FP16_MAGNITUDES = (2.0 ** -40, 2.0 ** -20, 1.0, 2.0 ** 20, 2.0 ** 40), (2.0 ** -10, 1.0, 2.0 ** 11)
for M, x_dtype, mins_dtype, magnitudes in [(1, torch.bfloat16, torch.float32, BF16_MAGNITUDES),
                                           (2, torch.bfloat16, None, BF16_MAGNITUDES),
                                           (1, torch.float16, None, FP16_MAGNITUDES),
                                           (2, torch.float16, torch.float32, FP16_MAGNITUDES)]:
    qweight, q, scales, mins = make_int_weight(48, 512, 128, 4, torch.float16, mins_dtype)
    w = dequant_int(q, scales, mins, 128)
    for magnitude in magnitudes:
        x = (torch.randn(M, 512, generator=torch.Generator().manual_seed(M)) * magnitude).to(x_dtype)
        plan = quant_plans.plan_weight_only(M, 48, 512, 128, weight_kind=0)
        y = qm.weight_only_linear(x, qweight, scales, mins, 0, 1, 128, plan)
        res.append(dict(errors(y, x, w), dtype=str(x.dtype), cuda_cores=plan.cuda_cores, magnitude=magnitude))
print(json.dumps(res))
"""


def test_the_one_and_two_row_kernel_is_exact_to_an_output_rounding_at_any_activation_magnitude():
    """Its products are q x 2^-69 of subnormal nibble floats (quant_gemv._int4_row_dot): exact and normal from
    |x q| = 2^-57 to |x| = 2^48. bf16 activations of 2^-40 to 2^40 and fp16 ones across fp16's range stay within one
    output rounding of the exact product, at one and two rows, with and without mins."""
    for res in interpret(GEMV_MAGNITUDES_SCRIPT):
        eps = 2 ** -7 if res["dtype"] == "torch.bfloat16" else 2 ** -10
        assert res["cuda_cores"], res
        assert 0 < res["max_ref"] and res["err"] <= 1.01 * eps * res["max_ref"], res

def test_default_table_is_the_sweeps_winners():
    """The table as shipped (benchmarks/sweep_w4.py's winners on an H200): the CUDA-core kernel at 1-2 rows (128
    columns, 4 warps, 1 stage); at 3-16 rows the 16-row dot tile of 64 columns (4 warps, 4 stages) with the weights
    as the dot's first operand (swap_ab: wgmma takes them from registers), 1.5x the plain dot's rate there; 4
    programs per SM; and 17+ rows the generic tiles."""
    for M in range(1, 33):
        plan = qp.plan_weight_only(M, 6144, 4096, 128, qp.H100_LIMITS, quant_gemm.KIND_INT4)
        generic = qp.plan_weight_only(M, 6144, 4096, 128, qp.H100_LIMITS, None)
        if M <= 2:
            splits, steps = qp.split_k(M, 6144, 4096, 1, 128, 128, qp.H100_LIMITS, 4)
            assert plan == qp.TilePlan(1, 128, 128, splits, steps, 4, 1, False, True, cuda_cores=True), M
        elif M <= 16:
            assert not generic.swap_ab and plan == dataclasses.replace(generic, swap_ab=True), M
        else:
            assert plan == generic, M
    assert qp.CUDA_CORE_MAX_ROWS[quant_gemm.KIND_INT4] == 2
    sm89 = qp.DeviceLimits(128, 101376)
    assert qp.plan_weight_only(8, 4096, 4096, 128, sm89, quant_gemm.KIND_INT4) == dataclasses.replace(
        qp.plan_weight_only(8, 4096, 4096, 128, sm89, None), swap_ab=True)  # 64-column K steps: small shared memory


def test_multi_row_plans_round_rows_up_to_a_power_of_two(monkeypatch):
    monkeypatch.setattr(qp, "W4_DECODE_TILES", (qp.DecodeTiles(1, "gemv", 256, 64, 8, 2),
                                                 qp.DecodeTiles(4, "rows", 64, 128, 4, 8),
                                                 qp.DecodeTiles(16, "dot", 128, 64, 8, 2, num_stages=3)))
    assert qp.plan_weight_only(1, 4096, 4096, 128, weight_kind=quant_gemm.KIND_INT4) == qp.TilePlan(
        1, 256, 64, 16, 4, 8, 1, False, True, cuda_cores=True)  # 64 steps: 16 splits of 4 steps, 2 per SM
    plan = qp.plan_weight_only(3, 4096, 4096, 128, weight_kind=quant_gemm.KIND_INT4)
    assert (plan.block_m, plan.block_n, plan.multi_row, plan.cuda_cores, plan.num_splits) == (4, 64, True, True, 8)
    plan = qp.plan_weight_only(9, 4096, 4096, 32, weight_kind=quant_gemm.KIND_INT4)
    assert (plan.block_m, plan.block_n, plan.block_k, plan.num_warps, plan.num_stages, plan.cuda_cores) == (
        16, 128, 32, 8, 3, False)  # group 32: the K step shrinks to the group
    assert qp.plan_weight_only(17, 4096, 4096, 128, weight_kind=quant_gemm.KIND_INT4).block_n == 64  # generic


@pytest.mark.parametrize("tiles, message", [
    ((qp.DecodeTiles(4, "gemv", 128, 128, 4, 4),), "within 2 for kernel 'gemv'"),
    ((qp.DecodeTiles(2, "gemv", 128, 128, 4, 4), qp.DecodeTiles(2, "dot", 64, 128, 4, 4)), "must exceed"),
    ((qp.DecodeTiles(8, "rows", 96, 128, 4, 4),), "block_n=96"),
    ((qp.DecodeTiles(8, "rows", 64, 8, 4, 4),), "block_k=8"),
    ((qp.DecodeTiles(8, "cuda", 64, 128, 4, 4),), "kernel 'cuda'"),
])
def test_a_bad_table_entry_is_named(tiles, message):
    with pytest.raises(ValueError, match=message):
        qp.check_decode_tiles(tiles)


COMPILE_SCRIPT = r"""
import sys

import torch
from triton_standin import compile_instead_of_launching

TARGET_CC, SHARED_LIMIT_BYTES = int(sys.argv[1]), int(sys.argv[2])
compiled = compile_instead_of_launching(TARGET_CC, SHARED_LIMIT_BYTES)

from nanovllm.kernels import quant_plans
from nanovllm.kernels import quant_matmul as qm

N, K = 4096, 4096
qweight = torch.zeros(N, K // 8, dtype=torch.int32)
scales, mins = torch.ones(N, K // 128, dtype=torch.float16), torch.zeros(N, K // 128)
for M, tiles, dtype in [(4, quant_plans.DecodeTiles(4, "rows", 64, 64, 4, 4), torch.bfloat16),
                        (16, quant_plans.DecodeTiles(16, "rows", 16, 64, 4, 4), torch.float16),
                        (16, quant_plans.DecodeTiles(16, "dot_swapped", 64, 128, 4, 4, 2), torch.bfloat16),
                        (8, quant_plans.DecodeTiles(8, "dot_swapped", 128, 64, 8, 4, 4), torch.float16)]:
    plan = quant_plans.plan_w4_decode(M, N, K, 128, tiles)
    qm.weight_only_linear(torch.zeros(M, K, dtype=dtype), qweight, scales, mins, 0, 1, 128, plan)
print(" ".join(sorted(compiled)))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs them (benchmarks/sweep_w4.py)")
@pytest.mark.parametrize("cc, shared_limit_bytes", [(90, 232448), (89, 101376)], ids=["sm90", "sm89"])
def test_decode_kernels_compile_for_the_gpus(cc, shared_limit_bytes):
    """The interpreter does not type-check: both kernels compile for an H100 and an RTX 40-series GPU, within their
    shared memory (tests/test_quant_kernels_compile.py's stand-in driver)."""
    proc = run_compile_script(COMPILE_SCRIPT, [cc, shared_limit_bytes], timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["_int4_gemv_rows_kernel", "_w4_swapped_gemm_kernel"]
