"""Every plan family of the weight-only kernels (quant_matmul.plan_weight_only: the 1-2-row CUDA-core kernels, the
16-, 32- and 64-row decode tiles, the 128-row tiles) at ragged row counts and with K steps that the split-K
slices do not divide evenly, under Triton's interpreter; and the plans' grid and offset arithmetic at the engine's
largest shapes (Qwen3-8B layers at M up to 16,384, the warm-up's prefill size), checked on the host only.

The interpreter runs read memory beside each tensor: the scales, mins, x and 4-bit words are views into buffers
padded with NaN (or, for the words, with nonzero nibbles), so a load past a row's last group, column or word, such
as a split reading K steps past K, turns the output into NaN or a wrong value instead of passing unseen.
"""
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402
from scripts_in_one_process import script_result  # noqa: E402
from test_quant_kernels import interpret_all  # noqa: E402

from nanovllm.kernels import quant_gemm  # noqa: E402
from nanovllm.kernels import quant_matmul as qm  # noqa: E402
from nanovllm.kernels import quant_plans  # noqa: E402

# Each family's first and last row counts and one between (1-2 CUDA-core rows, 3-16, 17-32, 33-64 and 65+ row
# tiles under LIMITS), and 100 and 300 across several 128-row tiles: inside a family the kernels differ only in the
# row mask's cut, so every row count between two of these runs the same code as its neighbours
RAGGED_M = [1, 2, 3, 9, 16, 17, 25, 32, 33, 47, 64, 65, 100, 300]

PLANS_SCRIPT = """
import json
import torch
from test_quant_kernels import dequant_fp8, dequant_int, errors, make_fp8_weight, make_int_weight
from nanovllm.kernels import quant_gemm, quant_plans, quant_matmul as qm

LIMITS = quant_plans.DeviceLimits(64, 232448)  # few tiles here: 64 SMs make the decode and 128-row plans split K

def padded(t, pad_value, extra=4):
    # t as a view into a buffer with `extra` more columns of pad_value after each row
    buf = torch.full((t.shape[0], t.shape[1] + extra), pad_value, dtype=t.dtype)
    buf[:, :t.shape[1]] = t
    return buf[:, :t.shape[1]]

def run(M, N, K, kind, group_k, group_n, qweight, scales, mins, w):
    x = padded(torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16), float("nan"))
    plan = qm.plan_weight_only(M, N, K, group_k, LIMITS, kind, group_n)
    y = qm.weight_only_linear(x, qweight, scales, mins, kind, group_n, group_k, plan)
    steps = -(-K // plan.block_k)
    return dict(errors(y, x, w), M=M, kind=kind, block_m=plan.block_m, cuda_cores=plan.cuda_cores,
                scale_after_dot=plan.scale_after_dot, splits=plan.num_splits,
                ragged=plan.num_splits > 1 and steps % plan.num_k_steps != 0)

res = []
N, K, G = 72, 352, 32  # 11 K steps of 32 columns: two splits of 6 and 5
qweight, q, scales, mins = make_int_weight(N, K, G, 4, torch.float16, torch.float32)
w = dequant_int(q, scales, mins, G)
words = padded(qweight, 0x77777777)
scales, mins = padded(scales, float("nan")), padded(mins, float("nan"))
for M in MS:
    res.append(run(M, N, K, quant_gemm.KIND_INT4, G, 1, words, scales, mins, w))
qweight, q, scales, mins = make_int_weight(N, K, G, 8, torch.bfloat16, None)
w = dequant_int(q, scales, None, G)
for M in (1, 2, 16, 17, 33, 65, 100):
    res.append(run(M, N, K, quant_gemm.KIND_INT8, G, 1, qweight, padded(scales, float("nan")), None, w))
N, K = 136, 1408  # FP8 blocks of 64 x 128: 11 K steps of 128 at 1-32 rows
qweight, scales = make_fp8_weight(N, K, 64, 128)
w = dequant_fp8(qweight, scales, 64, 128)
for M in (1, 2, 3, 17, 40):
    res.append(run(M, N, K, quant_gemm.KIND_FP8, 128, 64, qweight, padded(scales, float("nan")), None, w))
print(json.dumps(res))
"""


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    """The module's two kernel scripts, run once in one interpreter process."""
    return interpret_all({"plans": PLANS_SCRIPT.replace("MS", repr(RAGGED_M)), "dequant": DEQUANT_SCRIPT})


def test_every_plan_family_at_ragged_rows_and_ragged_splits(interpreted):
    results = script_result(interpreted, "plans")
    eps = 2 ** -7
    for res in results:
        bound = eps * res["max_ref"] + (0.0 if res["scale_after_dot"] else eps * res["abs_dot"])
        assert res["err"] <= 1.01 * bound, res  # NaN fails too
    int4 = [r for r in results if r["kind"] == quant_gemm.KIND_INT4]
    families = {(r["cuda_cores"], r["block_m"]) for r in int4 if r["ragged"]}
    assert families == {(True, 1), (False, 16), (False, 32), (False, 64), (False, 128)}, families
    assert any(r["ragged"] and r["cuda_cores"] for r in results if r["kind"] == quant_gemm.KIND_FP8)
    assert any(r["ragged"] for r in results if r["kind"] == quant_gemm.KIND_INT8)


# the Qwen3-8B layers (N, K) and the row counts the engine runs: decode graphs, piecewise buckets, warm-up
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
ENGINE_M = sorted(set(range(1, 2049)) | {3000, 4096, 8192, 16383, 16384})
INT32_MAX = 2 ** 31 - 1
MAX_GRID_Y = 65535


def _check_plan(plan: qm.TilePlan, M: int, N: int, K: int, what: str):
    steps = -(-K // plan.block_k)
    # the splits cover K, and none starts at or past K (an empty split would leave its partials unwritten)
    assert plan.num_splits * plan.num_k_steps >= steps, what
    assert (plan.num_splits - 1) * plan.num_k_steps < steps, what
    grid_x = -(-M // plan.block_m) * -(-N // plan.block_n) if not plan.cuda_cores else -(-N // plan.block_n)
    assert grid_x <= INT32_MAX and plan.num_splits <= MAX_GRID_Y, what
    # every element offset fits int32, so none depends on the kernels' int64 casts of row offsets: x's, the
    # weights', the output's and a split's partials (a K step past K is never formed: _split_steps)
    partials = plan.num_splits * M * N if plan.num_splits > 1 else 0
    for value in (M * K, N * K, M * N, partials, grid_x * plan.block_m, N + plan.block_n):
        assert value <= INT32_MAX, (what, value)


@pytest.mark.parametrize("kind", [quant_gemm.KIND_INT4, quant_gemm.KIND_INT8, quant_gemm.KIND_FP8])
def test_plans_at_the_engines_shapes_keep_int32_offsets_and_cover_k(kind):
    group_k, group_n = (128, 128) if kind == quant_gemm.KIND_FP8 else (128, 1)
    for name, (N, K) in QWEN3_8B.items():
        for M in ENGINE_M:
            plan = qm.plan_weight_only(M, N, K, group_k, quant_plans.H100_LIMITS, kind, group_n)
            _check_plan(plan, M, N, K, f"{name} M={M} {plan}")



DEQUANT_SCRIPT = """
import json
import torch
from test_quant_kernels import dequant_int, errors, make_int_weight
from nanovllm.kernels import quant_gemm, quant_plans, quant_matmul as qm
res = []
# N ragged against the 32-row programs, K against the 256-column ones; groups that are and are not powers of two
for N, K, G, bits, x_dtype, s_dtype, m_dtype in [(300, 352, 32, 4, "bfloat16", "float16", "float32"),
                                                 (40, 264, 24, 4, "float16", "bfloat16", None),
                                                 (33, 300, 20, 8, "bfloat16", "float32", "bfloat16"),
                                                 (50, 512, 128, 8, "float16", "float16", None)]:
    qweight, q, scales, mins = make_int_weight(N, K, G, bits, getattr(torch, s_dtype),
                                               m_dtype and getattr(torch, m_dtype))
    kind = quant_gemm.KIND_INT4 if bits == 4 else quant_gemm.KIND_INT8
    dtype = getattr(torch, x_dtype)
    # float32 out: the formula's bits (the interpreter truncates fp32 to bf16 where the GPU rounds to nearest)
    w = qm.dequantize_int_weight(qweight, scales, mins, kind, G, torch.float32)
    ref = dequant_int(q, scales, mins, G)
    M = qm.DEQUANT_GEMM_MIN_ROWS[kind] + 3
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    y = qm.int_linear(x, qweight, scales, mins, bits, G)
    qm.set_dequant_scratch_max_bytes(1)  # 128-row chunks: several for N > 128, written into their output columns
    y_chunked = qm.int_linear(x, qweight, scales, mins, bits, G)
    qm.set_dequant_scratch_max_bytes(None)
    res.append(dict(errors(y, x, ref), exact=bool(torch.equal(w, ref)), dtype=str(y.dtype),
                    shape=list(y.shape), M=M, N=N, chunked_equal=bool(torch.equal(y, y_chunked))))
print(json.dumps(res))
"""


def test_large_m_dequantizes_the_weight_exactly_then_multiplies(interpreted):
    """From DEQUANT_GEMM_MIN_ROWS rows on, int_linear is F.linear on the weight dequantized by the contract's
    formula and rounded once to x's dtype: the dequantized weight (in fp32) equals the reference's bit for bit, and the
    product is within a dequantized tile's bound (eps of the output and of sum |x| |w|)."""
    for res in script_result(interpreted, "dequant"):
        eps = 2 ** -7 if res["dtype"] == "torch.bfloat16" else 2 ** -10
        assert res["exact"] and res["chunked_equal"], res
        assert res["shape"] == [res["M"], res["N"]], res
        assert res["err"] <= 1.01 * (eps * res["max_ref"] + eps * res["abs_dot"]), res


@pytest.mark.parametrize("budget_gib, chunk_rows", [(8, {"qkv": 6144, "o": 4096, "gate_up": 10368, "down": 3456}),
                                                    (80, {"qkv": 6144, "o": 4096, "gate_up": 24576, "down": 4096})])
def test_the_dequantization_scratch_is_bounded_by_the_memory_budget(monkeypatch, budget_gib, chunk_rows):
    """1% of the card (or budget): inside 8 GiB (85,899,345 bytes) Qwen3-8B's gate_up (192 MiB in bf16) is
    dequantized 10,368 rows at a time and down_proj (96 MiB) 3,456, qkv and o whole; an 80 GiB card takes every
    layer in one pass. Without the engine's setter nothing bounds it."""
    from nanovllm.engine import memory_profile
    monkeypatch.setattr(memory_profile, "card_bytes", lambda config, device: budget_gib << 30)
    try:
        max_bytes = memory_profile.bound_dequant_scratch(None, torch.device("cuda"))
        assert max_bytes == int((budget_gib << 30) * 0.01)
        assert {name: qm.dequant_chunk_rows(N, K, 2) for name, (N, K) in QWEN3_8B.items()} == chunk_rows
        assert memory_profile.bound_dequant_scratch(None, torch.device("cpu")) is None
    finally:
        qm.set_dequant_scratch_max_bytes(None)
    assert qm.dequant_chunk_rows(24576, 4096, 2) == 24576
    with pytest.raises(ValueError, match="max_bytes=-1"):
        qm.set_dequant_scratch_max_bytes(-1)


def test_8_bit_weights_with_mins_never_take_the_cuda_core_kernel_which_has_no_min_term():
    """int8 at one row runs on the CUDA cores only without mins (the LM head's layout); with mins the plan is the dot
    kernel's, and a CUDA-core plan handed in with mins is refused before any launch, naming the option."""
    without = quant_plans.plan_weight_only(1, 4096, 4096, 4096, weight_kind=quant_gemm.KIND_INT8)
    with_mins = quant_plans.plan_weight_only(1, 4096, 4096, 128, weight_kind=quant_gemm.KIND_INT8, has_mins=True)
    assert without.cuda_cores and not with_mins.cuda_cores
    assert quant_plans.plan_weight_only(2, 4096, 4096, 4096, weight_kind=quant_gemm.KIND_INT8).cuda_cores is False
    q, scales, mins = torch.zeros(64, 128, dtype=torch.int8), torch.ones(64, 1), torch.zeros(64, 1)
    with pytest.raises(ValueError, match="has_mins=True"):
        qm.weight_only_linear(torch.zeros(1, 128), q, scales, mins, quant_gemm.KIND_INT8, 1, 128, without)
