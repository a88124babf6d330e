"""The weight-only kernels adding into the residual (ADD_OUT, quant_gemm.py's docstring): with `residual` the kernel
writes residual + x @ dequant(W).T into it, the two added in fp32 and rounded once, under Triton's interpreter.

Every kernel that can take the add, split along K (the last program's reduction, and the second launch of
SWITCHES.split_k_reduce = "launch") and unsplit (the kernel's own store adds it): the CUDA-core 4-bit kernel at one
and two rows, the 8-bit one (FP8 blocks, the int8 head), the dot tiles (16 rows and the 128-row dequantized tile),
the multi-row and the swapped-operand 4-bit kernels. For each:
  - its bits are those of the same kernel's fp32 result plus the residual, rounded once to the dtype (as the
    interpreter rounds: bf16 by truncation, fp16 to nearest; tests/test_quant_kernels.py's docstring);
  - it is within tests/test_quant_kernels.py's bound of x @ W.T + residual in float64, the bound taken of the sum;
  - the residual is the tensor written and returned.
The public wrappers (int_linear, fp8_linear) add into a residual of any leading dimensions, also where no
weight-only kernel runs (the dequantized weight's GEMM, the FP8 GEMM: a separate add), and name a wrong one; a
quantized RowParallelLinear on the kernels' path hands its residual to the kernel.
tests/test_quant_kernels_gpu.py runs the same checks on CUDA.
"""
import dataclasses

import pytest
import torch
from scripts_in_one_process import script_result
from test_quant_kernels import (
    EPS,
    dequant_fp8,
    dequant_int,
    interpret_all,
    make_fp8_weight,
    make_int_weight,
)

pytest.importorskip("triton")


def errors_with_residual(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor) -> dict:
    """Max |y - (x w^T + residual)| against float64, the largest |x w^T + residual| and the largest sum |x| |w|."""
    ref = x.double() @ w.double().T + residual.double()
    return {"err": (y.double() - ref).abs().max().item(), "max_ref": ref.abs().max().item(),
            "abs_dot": (x.double().abs() @ w.double().abs().T).max().item()}


def round_once(z: torch.Tensor, dtype: torch.dtype, truncate_bf16: bool) -> torch.Tensor:
    """fp32 z rounded to dtype as the kernel's store does: to nearest, or (Triton's interpreter) bf16 truncated."""
    if truncate_bf16 and dtype == torch.bfloat16:
        return (z.view(torch.int32) & -65536).view(torch.float32).to(dtype)  # exact: the low 16 bits are zero
    return z.to(dtype)


def fused_case(qm, x, qweight, scales, mins, kind: int, group_n: int, group_k: int, plan, residual,
               truncate_bf16: bool) -> dict:
    """weight_only_linear into a copy of residual against the same kernel's fp32 result plus residual."""
    fused = residual.clone()
    returned = qm.weight_only_linear(x, qweight, scales, mins, kind, group_n, group_k, plan, residual=fused)
    y32 = torch.empty(fused.shape, dtype=torch.float32, device=x.device)
    qm._write_weight_only(x, qweight, scales, mins, kind, group_n, group_k, plan, y32, False)
    want = round_once(y32 + residual.float(), residual.dtype, truncate_bf16)
    return {"fused": fused, "returned": returned is fused, "same_bits": bool(torch.equal(fused, want)),
            "changed": not torch.equal(fused, residual)}


KERNEL_CASES = [  # what, weight kind, M, N, K, group (n, k), x dtype, mins, plan: kernel weight_kind or "rows"
    ("4-bit CUDA cores, 1 row", 0, 1, 72, 1024, (1, 128), "bfloat16", True, 0),
    ("4-bit CUDA cores, 2 rows", 0, 2, 72, 1024, (1, 128), "float16", True, 0),
    ("FP8 CUDA cores, 1 row", 2, 1, 72, 1024, (128, 128), "bfloat16", False, 2),
    ("int8 head CUDA cores, 1 row", 1, 1, 72, 1024, (1, 1024), "float16", False, 1),
    ("dot tile, 5 rows", 0, 5, 72, 1024, (1, 128), "bfloat16", True, None),
    ("FP8 dot tile, 3 rows", 2, 3, 72, 1024, (128, 128), "float16", False, 2),
    ("128-row dequantized tile, 70 rows", 1, 70, 72, 512, (1, 64), "bfloat16", True, 1),
    ("multi-row 4-bit, 3 rows", 0, 3, 72, 512, (1, 128), "bfloat16", True, "rows"),
    ("swapped 4-bit, 5 rows", 0, 5, 72, 1024, (1, 128), "float16", False, 0),
]


def case_weights(kind: int, N: int, K: int, group_n: int, group_k: int, with_mins: bool):
    """(qweight, scales, mins or None, the dequantized weight in fp32) of a KERNEL_CASES entry."""
    if kind == 2:
        qweight, scales = make_fp8_weight(N, K, group_n, group_k)
        return qweight, scales, None, dequant_fp8(qweight, scales, group_n, group_k)
    qweight, q, scales, mins = make_int_weight(N, K, group_k, 4 if kind == 0 else 8, torch.float16,
                                               torch.float32 if with_mins else None)
    return qweight, scales, mins, dequant_int(q, scales, mins, group_k)


def case_plans(plan_kind, M: int, N: int, K: int, group_n: int, group_k: int, with_mins: bool, limits) -> tuple:
    """The case's tiles split along K in two, and unsplit (one split of all K steps)."""
    from nanovllm.kernels import quant_plans
    if plan_kind == "rows":
        plan = quant_plans.TilePlan(4, 32, 128, 2, 2, 4, 1, False, True, cuda_cores=True, multi_row=True)
    else:
        plan = quant_plans.plan_weight_only(M, N, K, group_k, limits, plan_kind, group_n, with_mins)
    num_k_steps = -(-K // plan.block_k)
    assert num_k_steps > 1, (plan, K)  # K takes two splits of the plan's steps
    return (dataclasses.replace(plan, num_splits=2, num_k_steps=-(-num_k_steps // 2)),
            dataclasses.replace(plan, num_splits=1, num_k_steps=num_k_steps))


def run_kernel_cases(device: str, truncate_bf16: bool) -> dict:
    """Every KERNEL_CASES entry, split and unsplit, with each split-K reduction, on device: fused_case's checks and
    errors_with_residual's numbers a run, and whether the counters of the in-kernel reduction are back at 0."""
    from nanovllm.kernels import quant_matmul as qm
    from nanovllm.utils.switches import SWITCHES
    res, default_reduce = [], SWITCHES.split_k_reduce
    for what, kind, M, N, K, (group_n, group_k), x_dtype, with_mins, plan_kind in KERNEL_CASES:
        qweight, scales, mins, w = case_weights(kind, N, K, group_n, group_k, with_mins)
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(getattr(torch, x_dtype))
        r = (torch.randn(M, N, generator=torch.Generator().manual_seed(M + 1)) * 4).to(x.dtype)
        args = [t if t is None else t.to(device) for t in (x, qweight, scales, mins)]
        for plan in case_plans(plan_kind, M, N, K, group_n, group_k, with_mins, qm.device_limits(args[0].device)):
            fused = {}
            for mode in ("kernel", "launch")[:1 + (plan.num_splits > 1)]:  # unsplit: no reduction to choose
                SWITCHES.split_k_reduce = mode
                case = fused_case(qm, *args, kind, group_n, group_k, plan, r.to(device), truncate_bf16)
                fused[mode] = case.pop("fused").cpu()
                res.append(dict(errors_with_residual(fused[mode], x, w, r), **case, what=what, mode=mode,
                                dtype=str(x.dtype), splits=plan.num_splits, cuda_cores=plan.cuda_cores,
                                multi_row=plan.multi_row, swap_ab=plan.swap_ab, block_m=plan.block_m,
                                scale_after_dot=plan.scale_after_dot))
            if plan.num_splits > 1:
                res[-1]["modes_equal"] = bool(torch.equal(fused["kernel"], fused["launch"]))
    SWITCHES.split_k_reduce = default_reduce  # as it was, for the scripts (or tests) run after these
    locks = qm._split_locks.get(torch.empty(0, device=device).device)  # cuda as cuda:0, the kernels' key
    return {"cases": res, "locks_zero": locks is None or bool((locks == 0).all())}


def check_kernel_cases(results: dict):
    """run_kernel_cases' results: within the bound, the bits of one rounding, the residual written and returned,
    both reductions alike; every case run split and unsplit, each on the kernel it names."""
    assert results["locks_zero"]
    for res in results["cases"]:
        eps = EPS[getattr(torch, res["dtype"].removeprefix("torch."))]
        bound = eps * res["max_ref"] + (0.0 if res["scale_after_dot"] else eps * res["abs_dot"])
        assert res["err"] <= 1.01 * bound, res  # NaN fails too
        assert res["same_bits"] and res["returned"] and res["changed"], res
        assert res.get("modes_equal", True), res
    by_what = {}
    for res in results["cases"]:
        by_what.setdefault(res["what"], set()).add(res["splits"] > 1)
    assert all(split_or_not == {True, False} for split_or_not in by_what.values()), by_what  # both ways each
    kernels = {(r["what"], r["cuda_cores"], r["multi_row"], r["swap_ab"], r["block_m"]) for r in results["cases"]}
    assert kernels == {("4-bit CUDA cores, 1 row", True, False, False, 1),
                       ("4-bit CUDA cores, 2 rows", True, False, False, 1),
                       ("FP8 CUDA cores, 1 row", True, False, False, 1),
                       ("int8 head CUDA cores, 1 row", True, False, False, 1),
                       ("dot tile, 5 rows", False, False, False, 16),
                       ("FP8 dot tile, 3 rows", False, False, False, 16),
                       ("128-row dequantized tile, 70 rows", False, False, False, 128),
                       ("multi-row 4-bit, 3 rows", True, True, False, 4),
                       ("swapped 4-bit, 5 rows", False, False, True, 16)}


KERNEL_SCRIPT = """
import json
from test_quant_kernels_residual import run_kernel_cases
print(json.dumps(run_kernel_cases("cpu", truncate_bf16=True)))
"""

WRAPPER_SCRIPT = """
import json
import torch
from test_quant_kernels import make_fp8_weight, make_int_weight
from nanovllm.kernels import quant_gemm, quant_matmul as qm
qweight, q, scales, mins = make_int_weight(40, 256, 64, 4, torch.float16, torch.float32)
wq, ws = make_fp8_weight(40, 256, 16, 64)
res = {}
# (rows, which path): the weight-only kernels add in their epilogue; the dequantized weight's GEMM (int, from
# DEQUANT_GEMM_MIN_ROWS) and the FP8 GEMM (from FP8_ACT_QUANT_MIN_ROWS) are followed by an add
for rows in (3, qm.DEQUANT_GEMM_MIN_ROWS[quant_gemm.KIND_INT4]):
    for name, linear in (("int", lambda x, r=None: qm.int_linear(x, qweight, scales, mins, 4, 64, r)),
                         ("fp8", lambda x, r=None: qm.fp8_linear(x, wq, ws, (16, 64), r))):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        r = torch.randn(rows, 40, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        fused = r.clone().view(1, rows, 40)  # leading dimensions: [1, rows, N] residual for x [1, rows, K]
        returned = linear(x.view(1, rows, 256), fused)
        if rows > 3:  # no weight-only kernel: the product rounded, then added
            want = r.clone().add_(linear(x))
        else:
            want = qm.weight_only_linear(x, *((qweight, scales, mins, 0, 1, 64) if name == "int" else
                                              (wq, ws, None, quant_gemm.KIND_FP8, 16, 64)), residual=r.clone())
        res[f"{name}_{rows}"] = dict(returned=returned is fused, equal=bool(torch.equal(fused[0], want)))
errors = []
x = torch.randn(2, 3, 256).to(torch.bfloat16)
for bad in (torch.zeros(6, 40, dtype=torch.bfloat16), torch.zeros(2, 3, 40),  # [2, 3, 40] bf16 wanted
            torch.zeros(2, 40, 3, dtype=torch.bfloat16).transpose(1, 2)):
    try:
        qm.int_linear(x, qweight, scales, mins, 4, 64, bad)
    except ValueError as e:
        errors.append(str(e))
res["errors"] = errors
# a row-parallel layer (o_proj, down_proj) on the kernels' path: its residual added in the kernel's epilogue
from nanovllm.layers.linear import RowParallelLinear
from nanovllm.layers.quantization import method
from nanovllm.utils.loader import process_weights_after_loading
from nanovllm.utils.quant_spec import layout_spec
row = RowParallelLinear(256, 40, quant_spec=layout_spec(4, 64, True), prefix="o")
for name, tensor in (("qweight", qweight), ("scales", scales), ("mins", mins)):
    getattr(row, name).weight_loader(getattr(row, name), tensor)
process_weights_after_loading(torch.nn.ModuleList([row]))
use_kernels, method.use_kernels = method.use_kernels, lambda x: x.dtype in method.KERNEL_DTYPES  # as on CUDA
x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
r = torch.randn(3, 40, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
fused = r.clone()
returned = row(x, fused)
method.use_kernels = use_kernels
want = qm.weight_only_linear(x, row.qweight, row.scales, row.mins, 0, 1, 64, residual=r.clone())
res["layer"] = dict(returned=returned is fused, equal=bool(torch.equal(fused, want)))
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """The module's two kernel scripts, run once in one interpreter process."""
    return interpret_all({"kernels": KERNEL_SCRIPT, "wrappers": WRAPPER_SCRIPT})


def test_every_kernel_adds_the_residual_rounding_once(interpreted):
    check_kernel_cases(script_result(interpreted, "kernels"))


def test_the_wrappers_add_into_the_residual_and_name_a_wrong_one(interpreted):
    res = script_result(interpreted, "wrappers")
    errors = res.pop("errors")
    assert res == {f"{name}_{rows}": dict(returned=True, equal=True) for rows in (3, 128) for name in ("int", "fp8")
                   } | {"layer": dict(returned=True, equal=True)}
    assert len(errors) == 3 and all(e.startswith("residual is") for e in errors), errors
    assert "[6, 40]" in errors[0] and "torch.float32" in errors[1] and "contiguous: False" in errors[2], errors


def test_a_wrong_residual_raises_before_any_kernel_runs():
    from nanovllm.kernels import quant_matmul as qm
    qweight, _, scales, mins = make_int_weight(8, 64, 32, 4, torch.float16, None)
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"residual is torch.bfloat16 \[2, 7\].*\[2, 8\]"):
        qm.weight_only_linear(x, qweight, scales, mins, 0, 1, 32, residual=torch.zeros(2, 7, dtype=torch.bfloat16))
