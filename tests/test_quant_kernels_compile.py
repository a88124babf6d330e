"""The quantized linear kernels compile for an H100/H200 (sm_90) and an RTX 40-series GPU (sm_89) on a machine without
a GPU, within the shared memory a block may use there: every plan the dispatch can pick (decode split-K, the CUDA-
core kernels, the 128-row tile, per-element groups, both 16-bit dtypes, the FP8 GEMM with block and per-token
scales, the activation quantizer), and the decode kernels adding into a residual (ADD_OUT). Triton's interpreter,
which tests/test_quant_kernels.py runs them in, does not type-check, so a kernel it runs may still fail to compile;
and a tile that fits an H100's 227 KB of shared memory per block may not fit an RTX 4070's 99 KB. The launches
become compiles under a stand-in CUDA driver (the same approach as tests/test_triton_compile.py, from
tests/triton_standin.py), in a subprocess: the driver is process-wide."""
import pytest
import torch
from triton_standin import run_compile_script

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile and run the kernels")

COMPILE_ALL = r"""
import sys

import torch
from triton_standin import compile_instead_of_launching

TARGET_CC, SHARED_LIMIT_BYTES, NUM_SMS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
compiled = compile_instead_of_launching(TARGET_CC, SHARED_LIMIT_BYTES)

from nanovllm.kernels import quant_gemm, quant_plans
from nanovllm.kernels import quant_matmul as qm
from nanovllm.utils.switches import SWITCHES

limits = quant_plans.DeviceLimits(NUM_SMS, SHARED_LIMIT_BYTES)
K, N = 4096, 4096  # Qwen3-8B o_proj: plans with several K steps per program, as the engine runs them
for bits, group, dtype, rows in [(4, 128, torch.bfloat16, (1, 2, 16, 48, 256)), (4, 128, torch.float16, (1, 256)),
                                 (8, 32, torch.bfloat16, (4, 256)), (8, 16, torch.float16, (256,)),
                                 (4, 8, torch.bfloat16, (2, 256))]:
    qweight = torch.zeros(N, K // 8 if bits == 4 else K, dtype=torch.int32 if bits == 4 else torch.int8)
    scales, mins = torch.ones(N, K // group, dtype=torch.float16), torch.zeros(N, K // group)
    for M in rows:
        kind = quant_gemm.KIND_INT4 if bits == 4 else quant_gemm.KIND_INT8
        plan = qm.plan_weight_only(M, N, K, group, limits, kind)
        qm.weight_only_linear(torch.zeros(M, K, dtype=dtype), qweight, scales, mins, kind, 1, group, plan)
wq = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
for M in (1, 3, 64):  # the CUDA-core kernel, the 16-row tile, the 64-row tile
    x = torch.zeros(M, K, dtype=torch.bfloat16)
    qm.weight_only_linear(x, wq, torch.ones(N // 128, K // 128), None, quant_gemm.KIND_FP8, 128, 128,
                          qm.plan_weight_only(M, N, K, 128, limits, quant_gemm.KIND_FP8, 128))
qm.weight_only_linear(torch.zeros(1, K, dtype=torch.bfloat16), torch.zeros(N, K, dtype=torch.int8), torch.ones(N, 1),
                      None, quant_gemm.KIND_INT8, 1, K, qm.plan_weight_only(1, N, K, K, limits, quant_gemm.KIND_INT8))
x = torch.zeros(2, K, dtype=torch.float16)  # per-channel, two rows on the CUDA cores
qm.weight_only_linear(x, wq, torch.ones(N, 1), None, quant_gemm.KIND_FP8, 1, K,
                      qm.plan_weight_only(2, N, K, K, limits, quant_gemm.KIND_FP8, 1))
for bits, group, dtype in [(4, 128, torch.bfloat16), (8, 32, torch.float16)]:  # the large-M dequantization
    qweight = torch.zeros(N, K // 8 if bits == 4 else K, dtype=torch.int32 if bits == 4 else torch.int8)
    kind = quant_gemm.KIND_INT4 if bits == 4 else quant_gemm.KIND_INT8
    qm.dequantize_int_weight(qweight, torch.ones(N, K // group, dtype=torch.float16), torch.zeros(N, K // group),
                             kind, group, dtype)
# adding into a residual (ADD_OUT): each kernel that o_proj and down_proj take at decode, and the multi-row one
w4 = (torch.zeros(N, K // 8, dtype=torch.int32), torch.ones(N, K // 128, dtype=torch.float16), quant_gemm.KIND_INT4, 1)
fp8 = (wq, torch.ones(N // 128, K // 128), quant_gemm.KIND_FP8, 128)
rows = quant_plans.plan_w4_decode(4, N, K, 128, quant_plans.DecodeTiles(4, "rows", 64, 64, 4, 4), limits)
for M, (w, sc, kind, group_n), plan in [(1, w4, None), (2, w4, None), (8, w4, None), (24, w4, None), (4, w4, rows),
                                        (1, fp8, None), (3, fp8, None)]:
    plan = plan or qm.plan_weight_only(M, N, K, 128, limits, kind, group_n)
    qm.weight_only_linear(torch.zeros(M, K, dtype=torch.bfloat16), w, sc, None, kind, group_n, 128, plan,
                          residual=torch.zeros(M, N, dtype=torch.bfloat16))
SWITCHES.split_k_reduce = "launch"  # split-K's second launch (the kernels above reduce their splits themselves)
plan = qm.plan_weight_only(1, N, K, 128, limits, quant_gemm.KIND_FP8, 128)
qm.weight_only_linear(torch.zeros(1, K, dtype=torch.bfloat16), wq, torch.ones(N // 128, K // 128), None,
                      quant_gemm.KIND_FP8, 128, 128, plan)
qm.weight_only_linear(torch.zeros(1, K, dtype=torch.bfloat16), wq, torch.ones(N // 128, K // 128), None,
                      quant_gemm.KIND_FP8, 128, 128, plan, residual=torch.zeros(1, N, dtype=torch.bfloat16))
x = torch.zeros(256, K, dtype=torch.bfloat16)
qm.fp8_w8a8_linear(x, wq, torch.ones(N // 128, K // 128), 128, 128, use_scaled_mm=False, limits=limits)
qm.fp8_w8a8_linear(x, wq, torch.ones(N, 1), 1, K, use_scaled_mm=False, limits=limits)
print(" ".join(sorted(compiled)))
"""


# (compute capability, the most shared memory a block may use there, SMs): an H100 SXM, an RTX 4070 Laptop
@pytest.mark.parametrize("cc, shared_limit_bytes, num_sms", [(90, 232448, 132), (89, 101376, 36)],
                         ids=["sm90-h100", "sm89-rtx4070"])
def test_every_quant_kernel_compiles_within_shared_memory(cc, shared_limit_bytes, num_sms):
    proc = run_compile_script(COMPILE_ALL, [cc, shared_limit_bytes, num_sms], timeout_s=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["_byte_gemv_kernel", "_dequant_int_kernel", "_fp8_gemm_kernel", "_int4_gemv_kernel",
                                   "_int4_gemv_rows_kernel", "_quantize_act_kernel", "_sum_splits_kernel",
                                   "_w4_swapped_gemm_kernel", "_wo_gemm_kernel"]
