"""The quantized linear kernels (nanovllm/kernels/quant_matmul.py) against a dequantization written here from the
layout contract, on the CPU under Triton's interpreter (TRITON_INTERPRET=1 before triton is imported: the kernel
checks run in a subprocess). tests/test_quant_kernels_gpu.py runs the same reference on CUDA.

Tolerances, as a fraction of the largest output (eps = 2^-7 for bf16 outputs, 2^-10 for fp16):
  - scale after the dot (the decode tiles, up to 32 rows, and the 4-bit CUDA-core kernel at 1-2 rows): integers
    and e4m3 values are exact in the 16-bit dot (and 1 + q / 16 times x in fp32), the products are summed in fp32
    and the result is rounded once, so the error is one output rounding: eps (the interpreter truncates to bf16
    where the GPU rounds to nearest, hence a whole eps);
  - a dequantized tile (prefill tiles, and groups no dot step can align with): each weight is rounded to x's dtype
    before the dot, so eps of the output plus eps of sum |x| |w| over the row;
  - FP8 activations: against the reference fed the same e4m3 activations (quantized here), eps; against the
    unquantized activations, 2^-4 of sum |x| |w| (e4m3 keeps 3 mantissa bits).
The interpreter computes bf16 dots and int-to-bf16 casts wrongly and rounds some values to the wrong e4m3 binade:
the kernels run their dots in fp32 there and let torch round the activations to e4m3 (quant_matmul.py); the GPU
file checks the real instructions.
"""
import os

import pytest
import torch
from interpreter_support import interpreter_env, skip_unless_the_interpreter_loops
from scripts_in_one_process import run_scripts, script_result

pytest.importorskip("triton")

EPS = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10}


# ----------------------------------------------------------------- the reference, from the layout contract
def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> int32 [N, K // 8]; value k is bits 4 * (k % 8) .. +3 of word k // 8."""
    N, K = q.shape
    nibbles = q.to(torch.int64).view(N, K // 8, 8)
    words = sum(nibbles[..., j] << (4 * j) for j in range(8))
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)  # the same 32 bits, signed


def dequant_int(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """w = f32(q) * f32(scale), then + f32(min): two float32 roundings, no fma (the contract's formula)."""
    w = q.float() * scales.float().repeat_interleave(group_size, 1)
    return w if mins is None else w + mins.float().repeat_interleave(group_size, 1)


def dequant_fp8(qweight: torch.Tensor, scales: torch.Tensor, block_n: int, block_k: int) -> torch.Tensor:
    N, K = qweight.shape
    return qweight.float() * scales.repeat_interleave(block_n, 0)[:N].repeat_interleave(block_k, 1)[:, :K]


def quantize_act_ref(x: torch.Tensor, group_cols: int) -> torch.Tensor:
    """x with each (token, group_cols columns) group rounded to e4m3 at scale max|x| / 448, back in fp32."""
    out = torch.empty(x.shape)
    for start in range(0, x.shape[1], group_cols):
        group = x[:, start:start + group_cols].float()
        scale = group.abs().amax(1, keepdim=True).clamp(min=1e-12) / 448.0
        out[:, start:start + group_cols] = (group / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    return out


def make_int_weight(N: int, K: int, group_size: int, bits: int, scale_dtype, min_dtype, seed: int = 0):
    """(qweight in the contract's layout, the raw q [N, K], scales, mins or None)."""
    gen = torch.Generator().manual_seed(seed)
    if bits == 4:
        q = torch.randint(0, 16, (N, K), generator=gen)
    else:
        q = torch.randint(-128, 128, (N, K), generator=gen)
    scales = (torch.rand(N, K // group_size, generator=gen) * 0.02 + 0.002).to(scale_dtype)
    mins = None if min_dtype is None else (torch.randn(N, K // group_size, generator=gen) * 0.05).to(min_dtype)
    qweight = pack_int4(q) if bits == 4 else q.to(torch.int8)
    return qweight, q, scales, mins


def make_fp8_weight(N: int, K: int, block_n: int, block_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qweight = (torch.randn(N, K, generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(-(-N // block_n), -(-K // block_k), generator=gen) * 1e-3 + 1e-4
    return qweight, scales


def errors(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, x_ref: torch.Tensor | None = None) -> dict:
    """Max |y - x w^T| against the exact product (float64), the largest |output| and the largest sum |x| |w|."""
    x_ref = x.double() if x_ref is None else x_ref.double()
    ref = x_ref @ w.double().T
    return {"err": (y.double() - ref).abs().max().item(), "max_ref": ref.abs().max().item(),
            "abs_dot": (x.double().abs() @ w.double().abs().T).max().item()}


# ----------------------------------------------------------------- the interpreter runs
INT_CASES = [  # M, N, K, group, bits, x dtype, scale dtype, min dtype, what it covers
    (3, 40, 1024, 128, 4, "bfloat16", "float16", "float32", "decode split-K, AWQ-like, N ragged"),
    (1, 24, 128, 32, 4, "float16", "bfloat16", None, "one row on the CUDA cores, symmetric"),
    (1, 200, 1024, 128, 4, "bfloat16", "float16", "float32", "one row on the CUDA cores, split-K, N ragged"),
    (2, 72, 512, 64, 4, "float16", "float32", "bfloat16", "two rows on the CUDA cores"),
    (4, 24, 128, 32, 4, "float16", "bfloat16", None, "four rows, fp16 offset"),
    (5, 33, 96, 32, 8, "bfloat16", "float32", "bfloat16", "8-bit, Q5_K-like mins"),
    (4, 20, 64, 16, 8, "float16", "float32", None, "8-bit Q6_K-like group 16"),
    (2, 16, 384, 384, 4, "bfloat16", "float16", "float32", "per-channel group = K, not a power of two"),
    (70, 72, 128, 64, 4, "bfloat16", "float16", "float16", "prefill 128 x 128 tile, M and N ragged"),
    (7, 24, 64, 8, 4, "bfloat16", "float16", "float32", "group 8: per-element dequantization"),
    (6, 40, 96, 24, 8, "float16", "float16", "float16", "group 24: per-element, K ragged vs the K step"),
    (1, 200, 256, 256, 8, "bfloat16", "float32", None, "8-bit per channel, one row on the CUDA cores (int8 LM head)"),
    (1, 40, 256, 64, 8, "float16", "float32", "float32", "8-bit with mins, one row: the dot kernel"),
]

INT_SCRIPT = """
import json, sys
import torch
from test_quant_kernels import INT_CASES, dequant_int, errors, make_int_weight
from nanovllm.kernels import quant_matmul as qm
res = []
for M, N, K, G, bits, x_dtype, s_dtype, m_dtype, _ in INT_CASES:
    qweight, q, scales, mins = make_int_weight(N, K, G, bits, getattr(torch, s_dtype),
                                               m_dtype and getattr(torch, m_dtype))
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(getattr(torch, x_dtype))
    y = qm.int_linear(x, qweight, scales, mins, bits, G)
    plan = qm.plan_weight_only(M, N, K, G, weight_kind=0 if bits == 4 else 1, has_mins=mins is not None)
    res.append(dict(errors(y, x, dequant_int(q, scales, mins, G)), dtype=str(y.dtype), shape=list(y.shape),
                    splits=plan.num_splits, per_element=plan.per_element, block_m=plan.block_m,
                    scale_after_dot=plan.scale_after_dot, cuda_cores=plan.cuda_cores))
# explicit small tiles: several K steps per program, several programs along M and N, both modes, fp16 and bf16
for x_dtype, scale_after_dot, splits in [(torch.float16, False, 1), (torch.bfloat16, False, 1),
                                         (torch.bfloat16, True, 2), (torch.float16, True, 1)]:
    qweight, q, scales, mins = make_int_weight(50, 256, 64, 4, torch.float16, torch.float32, seed=3)
    x = torch.randn(40, 256, generator=torch.Generator().manual_seed(1)).to(x_dtype)
    plan = qm.TilePlan(16 if scale_after_dot else 32, 32, 32, splits, 8 // splits, 4, 2, False, scale_after_dot)
    y = qm.weight_only_linear(x, qweight, scales, mins, 0, 1, 64, plan)
    res.append(dict(errors(y, x, dequant_int(q, scales, mins, 64)), dtype=str(y.dtype), shape=list(y.shape),
                    splits=splits, per_element=False, block_m=plan.block_m, scale_after_dot=scale_after_dot))
print(json.dumps(res))
"""

FP8_CASES = [  # M, N, K, (bn, bk), x dtype, what it covers
    (3, 200, 320, (128, 128), "bfloat16", "block FP8 decode, N and K ragged"),
    (1, 200, 320, (128, 128), "bfloat16", "block FP8, one row on the CUDA cores"),
    (2, 48, 160, (1, 160), "float16", "per-channel, two rows: the dot kernel"),
    (1, 40, 96, (40, 96), "bfloat16", "per-tensor, one row on the CUDA cores"),
    (2, 30, 160, (16, 48), "float16", "16-row blocks, two rows: the dot kernel"),
    (4, 48, 160, (1, 160), "float16", "per-channel decode"),
    (4, 40, 96, (40, 96), "bfloat16", "per-tensor decode"),
    (5, 30, 160, (16, 48), "float16", "block 48: 16-column K steps"),
    (5, 30, 160, (16, 40), "float16", "block 40: per-element dequantization"),
    (70, 136, 256, (128, 128), "bfloat16", "W8A8 block from 33 rows: a mid-size step"),
    (259, 136, 320, (128, 128), "bfloat16", "W8A8 block, FP8 activations per 128 columns"),
    (256, 48, 160, (1, 160), "float16", "W8A8 per-channel, per-token activations"),
    (260, 40, 96, (40, 96), "bfloat16", "W8A8 per-tensor"),
]

FP8_SCRIPT = """
import json
import torch
from test_quant_kernels import FP8_CASES, dequant_fp8, errors, make_fp8_weight, quantize_act_ref
from nanovllm.kernels import quant_matmul as qm
res = []
for M, N, K, (bn, bk), x_dtype, _ in FP8_CASES:
    qweight, scales = make_fp8_weight(N, K, bn, bk)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(getattr(torch, x_dtype))
    y = qm.fp8_linear(x, qweight, scales, (bn, bk))
    w = dequant_fp8(qweight, scales, bn, bk)
    w8a8 = qm._w8a8_applies(x, K, bk)
    x_ref = quantize_act_ref(x, bk if scales.shape[1] > 1 else K) if w8a8 else None
    plan = qm.plan_weight_only(M, N, K, bk, weight_kind=2, group_n=bn)
    res.append(dict(errors(y, x, w, x_ref), unquantized=errors(y, x, w), w8a8=w8a8, dtype=str(y.dtype),
                    scale_after_dot=not w8a8 and plan.scale_after_dot, cuda_cores=not w8a8 and plan.cuda_cores))
print(json.dumps(res))
"""


def interpret_all(scripts: dict[str, str]) -> dict[str, dict]:
    """Several scripts under the interpreter in one subprocess (tests/scripts_in_one_process.py)."""
    skip_unless_the_interpreter_loops()
    return run_scripts(scripts, interpreter_env())


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """The module's kernel scripts, run once in one interpreter process."""
    return interpret_all({"int": INT_SCRIPT, "fp8": FP8_SCRIPT, "act": ACT_SCRIPT, "split": SPLIT_SCRIPT,
                          "ops": OPS_SCRIPT})


def _eps(dtype_name: str) -> float:
    return EPS[getattr(torch, dtype_name.removeprefix("torch."))]


def test_int_linear_matches_the_contract_dequantization(interpreted):
    results = script_result(interpreted, "int")
    cases = INT_CASES + [(40, 50, 256, 64, 4, "", "", "", f"explicit tile {i}") for i in range(4)]
    for (M, N, *_, what), res in zip(cases, results, strict=True):
        eps = _eps(res["dtype"])
        assert res["shape"] == [M, N], what
        bound = eps * res["max_ref"] + (0.0 if res["scale_after_dot"] else eps * res["abs_dot"])
        assert res["err"] <= 1.01 * bound, (what, res)
    by_what = dict(zip([c[-1] for c in INT_CASES], results))
    assert by_what["decode split-K, AWQ-like, N ragged"]["splits"] > 1  # the split-K path ran, with its reduction
    assert by_what["decode split-K, AWQ-like, N ragged"]["scale_after_dot"]
    assert by_what["one row on the CUDA cores, split-K, N ragged"]["cuda_cores"]
    assert by_what["one row on the CUDA cores, split-K, N ragged"]["splits"] > 1
    assert by_what["two rows on the CUDA cores"]["cuda_cores"]
    assert not by_what["four rows, fp16 offset"]["cuda_cores"]
    assert by_what["8-bit per channel, one row on the CUDA cores (int8 LM head)"]["cuda_cores"]
    assert not by_what["8-bit with mins, one row: the dot kernel"]["cuda_cores"]  # the CUDA-core kernel has no mins
    assert by_what["prefill 128 x 128 tile, M and N ragged"]["block_m"] == 128
    assert by_what["group 8: per-element dequantization"]["per_element"]
    assert not by_what["per-channel group = K, not a power of two"]["per_element"]


def test_fp8_linear_matches_the_contract_dequantization(interpreted):
    results = script_result(interpreted, "fp8")
    for (*_, what), res in zip(FP8_CASES, results, strict=True):
        eps = _eps(res["dtype"])
        dequantized = not res["w8a8"] and not res["scale_after_dot"]
        bound = eps * res["max_ref"] + (eps * res["abs_dot"] if dequantized else 0.0)
        assert res["err"] <= 1.01 * bound, (what, res)
        assert res["w8a8"] == what.startswith("W8A8"), what
        assert res["cuda_cores"] == ("CUDA cores" in what), what
        if res["w8a8"]:  # e4m3 activations: each rounded by at most 2^-4 relative
            assert res["unquantized"]["err"] <= 2 ** -4 * res["unquantized"]["abs_dot"], (what, res)


ACT_SCRIPT = """
import json
import torch
from test_quant_kernels import quantize_act_ref
from nanovllm.kernels import quant_w8a8
res = []
x = torch.randn(7, 320, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
x[2, 64:128] = 0  # an all-zero group: scale 1e-12 / 448, values 0
default_chunk_cols = quant_w8a8._QUANT_CHUNK_COLS
for group_cols, chunk_cols, column_major, pad in [(320, 16384, False, 1), (320, 128, False, 1),
                                                  (64, 16384, False, 1), (64, 128, True, 4), (32, 64, False, 1)]:
    quant_w8a8._QUANT_CHUNK_COLS = chunk_cols  # several chunks a row: both per-token passes and the per-group loop
    xq, xs = quant_w8a8.quantize_activations(x, group_cols, scales_column_major=column_major, pad_rows_to=pad)
    num_groups = -(-320 // group_cols)
    back = xq[:7].float() * xs[:7].repeat_interleave(group_cols, 1)[:, :320]
    res.append(dict(equal=torch.equal(back, quantize_act_ref(x, group_cols)), rows=xq.shape[0],
                    scales_shape=list(xs.shape), scales_stride=list(xs.stride()),
                    pad_zero=bool((xq[7:].float() == 0).all()), num_groups=num_groups))
quant_w8a8._QUANT_CHUNK_COLS = default_chunk_cols  # as it was, for the scripts run after this one
print(json.dumps(res))
"""


def test_activation_quantization_matches_the_reference_bit_for_bit(interpreted):
    res = script_result(interpreted, "act")
    assert [r["equal"] for r in res] == [True] * 5
    assert [r["scales_shape"] for r in res] == [[7, 1], [7, 1], [7, 5], [8, 5], [7, 10]]
    assert res[3]["rows"] == 8 and res[3]["pad_zero"] and res[3]["scales_stride"] == [1, 8]  # cuBLASLt's layout


SPLIT_SCRIPT = """
import json
import torch
from test_quant_kernels import make_fp8_weight, make_int_weight
from nanovllm.kernels import quant_gemm
from nanovllm.kernels import quant_matmul as qm
from nanovllm.utils.switches import SWITCHES
qweight, q, scales, mins = make_int_weight(200, 1024, 128, 4, torch.float16, torch.float32)
wq, ws = make_fp8_weight(200, 1024, 128, 128)
cases = [(1, qweight, scales, mins, quant_gemm.KIND_INT4, 1, 0), (1, wq, ws, None, quant_gemm.KIND_FP8, 128, 2),
         (5, qweight, scales, mins, quant_gemm.KIND_INT4, 1, None)]  # CUDA-core int4, CUDA-core FP8, dot tiles
res = []
for M, w, sc, mn, kind, group_n, plan_kind in cases:
    x = torch.randn(M, 1024, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
    plan = qm.plan_weight_only(M, 200, 1024, 128, weight_kind=plan_kind, group_n=group_n)
    outs = {}
    for mode in ("launch", "kernel", "kernel"):  # twice in the kernel: the counters must be back at 0
        SWITCHES.split_k_reduce = mode
        outs.setdefault(mode, []).append(qm.weight_only_linear(x, w, sc, mn, kind, group_n, 128, plan))
    locks = qm._split_locks[torch.device("cpu")]
    res.append(dict(splits=plan.num_splits, cuda_cores=plan.cuda_cores, locks_zero=bool((locks == 0).all()),
                    equal=all(torch.equal(outs["launch"][0], y) for y in outs["kernel"])))
print(json.dumps(res))
"""


def test_split_k_reduced_in_the_kernel_equals_the_second_launch_bit_for_bit(interpreted):
    res = script_result(interpreted, "split")
    assert [(r["splits"] > 1, r["cuda_cores"]) for r in res] == [(True, True), (True, True), (True, False)]
    assert all(r["equal"] and r["locks_zero"] for r in res), res


OPS_SCRIPT = """
import json
import torch
from test_quant_kernels import make_fp8_weight, make_int_weight
from nanovllm.kernels.quant_matmul import fp8_linear, int_linear
qweight, q, scales, mins = make_int_weight(24, 64, 32, 4, torch.float16, torch.float32)
x = torch.randn(2, 3, 64).to(torch.bfloat16)
res = {"leading_dims": list(int_linear(x, qweight, scales, mins, 4, 32).shape),
       "empty": list(int_linear(x[:0, 0], qweight, scales, None, 4, 32).shape)}
torch.library.opcheck(torch.ops.nanovllm.int_linear.default, (x[0], qweight, scales, mins, 4, 32))
torch.library.opcheck(torch.ops.nanovllm.int_linear.default, (x[0], qweight, scales, None, 4, 32))
wq, ws = make_fp8_weight(24, 64, 16, 32)
# test_schema compares inputs before and after with allclose, which has no CPU kernel for float8
torch.library.opcheck(torch.ops.nanovllm.fp8_linear.default, (x[0], wq, ws, 16, 32),
                      test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

def layer(x):
    return int_linear(x, qweight, scales, mins, 4, 32) + fp8_linear(x, wq, ws, (16, 32))

compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
res["compiled_equal"] = torch.equal(compiled(x[0]), layer(x[0])) and torch.equal(compiled(x[1, :2]), layer(x[1, :2]))
# the ops adding into a residual: they mutate it and return nothing
r = torch.randn(3, 24).to(torch.bfloat16)
torch.library.opcheck(torch.ops.nanovllm.int_linear_add_.default, (x[0], qweight, scales, mins, 4, 32, r))
torch.library.opcheck(torch.ops.nanovllm.fp8_linear_add_.default, (x[0], wq, ws, 16, 32, r),
                      test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))

def layer_add(x, r):
    int_linear(x, qweight, scales, mins, 4, 32, residual=r)
    return fp8_linear(x, wq, ws, (16, 32), residual=r)

compiled_add = torch.compile(layer_add, fullgraph=True, backend="aot_eager", dynamic=True)
r_compiled, r_eager = r.clone(), r.clone()
res["compiled_add_equal"] = (compiled_add(x[0], r_compiled) is r_compiled and layer_add(x[0], r_eager) is r_eager
                             and torch.equal(r_compiled, r_eager) and not torch.equal(r_eager, r))
print(json.dumps(res))
"""


def test_custom_ops_pass_opcheck_and_compile_without_graph_breaks(interpreted):
    res = script_result(interpreted, "ops")  # opcheck raises on a schema, fake-tensor or dispatch problem
    assert res == {"leading_dims": [2, 3, 24], "empty": [0, 24], "compiled_equal": True, "compiled_add_equal": True}


# ----------------------------------------------------------------- argument errors (no kernel runs)
def test_bad_arguments_raise_value_errors_naming_the_value():
    from nanovllm.kernels.quant_matmul import fp8_linear, int_linear
    qweight, _, scales, mins = make_int_weight(8, 64, 32, 4, torch.float16, None)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bits=3"):
        int_linear(x, qweight, scales, mins, 3, 32)
    with pytest.raises(ValueError, match="group_size=48"):
        int_linear(x, qweight, scales, mins, 4, 48)
    with pytest.raises(ValueError, match="bits=8 needs qweight int8"):
        int_linear(x, qweight, scales, mins, 8, 32)
    with pytest.raises(ValueError, match=r"scales has shape \(8, 4\)"):
        int_linear(x, qweight, torch.ones(8, 4), None, 4, 32)
    with pytest.raises(ValueError, match="float32"):
        int_linear(x.float(), qweight, scales, mins, 4, 32)
    wq, ws = make_fp8_weight(8, 64, 128, 128)
    with pytest.raises(ValueError, match=r"block_size=\(1, 64\)"):
        fp8_linear(x, wq, ws, (1, 64))
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="CUDA only"):
            int_linear(x, qweight, scales, mins, 4, 32)
