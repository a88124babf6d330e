"""The quantized linear kernels on CUDA (nanovllm/kernels/quant_matmul.py): every path against the contract's
dequantization (the reference and tolerances of tests/test_quant_kernels.py, where the CPU interpreter runs the
same cases), then under CUDA graph capture and torch.compile, and run to run bit-identical (split-K sums its
partials in a fixed order). Skipped without CUDA; the FP8 tensor-core paths need sm_89+."""
import pytest
import torch
from test_quant_kernels import (
    EPS,
    dequant_fp8,
    dequant_int,
    errors,
    make_fp8_weight,
    make_int_weight,
    quantize_act_ref,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the quantized kernels need a CUDA GPU")

ROWS = [1, 2, 7, 16, 33, 200]  # CUDA-core 4-bit, 16-row split-K tiles, the 64-row tile, the 128-row tile


def _qm():
    from nanovllm.kernels import quant_matmul
    return quant_matmul


def _fp8_tensor_cores() -> bool:
    return torch.cuda.get_device_capability() >= (8, 9)


# FP8 tensor cores (sm_89, sm_90) add their products in 22-bit floats (13 mantissa bits) over runs of up to 128
# before fp32 takes the sum (cuBLASLt's and CUTLASS's default accumulation, Triton's FP8 dot likewise), so a W8A8
# output also carries a few 2^-13 of its |products|' sum; on an H100: 0.129 at 33 rows with per-channel weight
# scales, 1.3e-3 of the 97.6 that sum reached, past the one output rounding (0.091) that bounds the bf16 paths
FP8_TENSOR_CORE_SUM_EPS = 2 ** -8


def _check(y, x, w, scale_after_dot: bool, x_ref=None, sum_eps: float = 0.0):
    """The bounds of tests/test_quant_kernels.py, as a fraction of the largest output (plus sum_eps of the largest
    sum of |products|: FP8_TENSOR_CORE_SUM_EPS for the FP8 tensor cores)."""
    eps = EPS[y.dtype]
    res = errors(y.cpu(), x.cpu(), w.cpu(), None if x_ref is None else x_ref.cpu())
    bound = eps * res["max_ref"] + (0.0 if scale_after_dot else eps * res["abs_dot"]) + sum_eps * res["abs_dot"]
    assert res["err"] <= 1.01 * bound, res


@pytest.mark.parametrize("bits, group, scale_dtype, min_dtype, x_dtype", [
    (4, 128, torch.float16, torch.float32, torch.bfloat16),  # AWQ / GPTQ 4-bit
    (4, 32, torch.float16, torch.float16, torch.float16),  # GGUF Q4_1, fp16 activations
    (4, 32, torch.float32, torch.float32, torch.bfloat16),  # Q4_K
    (8, 16, torch.float32, None, torch.bfloat16),  # Q6_K
    (8, 128, torch.float16, torch.float32, torch.bfloat16),  # GPTQ 8-bit
    (8, 2048, torch.float32, None, torch.bfloat16),  # the int8 LM head: per channel (one row on the CUDA cores)
    (4, 8, torch.bfloat16, None, torch.bfloat16),  # per-element dequantization
])
@pytest.mark.parametrize("M", ROWS)
def test_int_linear_matches_the_reference(M, bits, group, scale_dtype, min_dtype, x_dtype):
    qm = _qm()
    N, K = 1000, 2048  # N ragged against every tile
    qweight, q, scales, mins = make_int_weight(N, K, group, bits, scale_dtype, min_dtype)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(x_dtype)
    y = qm.int_linear(x.cuda(), qweight.cuda(), scales.cuda(), None if mins is None else mins.cuda(), bits, group)
    assert y.dtype == x_dtype and y.shape == (M, N)
    plan = qm.plan_weight_only(M, N, K, group, qm.device_limits(y.device))
    _check(y, x, dequant_int(q, scales, mins, group), plan.scale_after_dot)


@pytest.mark.parametrize("block", [(128, 128), (1, 2048), (1000, 2048), (16, 48)],
                         ids=["block", "per-channel", "per-tensor", "block-16x48"])
@pytest.mark.parametrize("M", ROWS + [300])
def test_fp8_linear_matches_the_reference(M, block):
    qm = _qm()
    N, K = 1000, 2048
    qweight, scales = make_fp8_weight(N, K, *block)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
    y = qm.fp8_linear(x.cuda(), qweight.cuda(), scales.cuda(), block)
    w = dequant_fp8(qweight, scales, *block)
    if qm._w8a8_applies(x.cuda(), K, block[1]):  # per-token (and per-bk-column) FP8 activations
        _check(y, x, w, True, quantize_act_ref(x, block[1] if scales.shape[1] > 1 else K), FP8_TENSOR_CORE_SUM_EPS)
        res = errors(y.cpu(), x, w)
        assert res["err"] <= 2 ** -4 * res["abs_dot"], res
    else:
        _check(y, x, w, qm.plan_weight_only(M, N, K, block[1], qm.device_limits(y.device)).scale_after_dot)


@pytest.mark.skipif(not torch.cuda.is_available() or not _fp8_tensor_cores(), reason="FP8 tensor cores: sm_89+")
def test_fp8_per_channel_triton_gemm_and_scaled_mm_agree():
    qm = _qm()
    N, K, M = 512, 1024, 384
    qweight, scales = (t.cuda() for t in make_fp8_weight(N, K, 1, K))
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    triton_y = qm.fp8_w8a8_linear(x, qweight, scales, 1, K, use_scaled_mm=False)
    scaled_mm_y = qm.fp8_w8a8_linear(x, qweight, scales, 1, K, use_scaled_mm=True)
    # the same FP8 operands and scales: the two differ only in fp32 summation order and the final rounding
    assert ((triton_y.float() - scaled_mm_y.float()).abs().max() <= 2 ** -7 * scaled_mm_y.float().abs().max())


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="cuBLASLt's 128 x 128 block scaling runs on sm_90 only")
def test_fp8_block_scaled_mm_agrees_with_the_triton_gemm():
    qm = _qm()
    N, K, M = 512, 1024, 384
    qweight, scales = (t.cuda() for t in make_fp8_weight(N, K, 128, 128))
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    triton_y = qm.fp8_w8a8_linear(x, qweight, scales, 128, 128, use_scaled_mm=False)
    try:
        scaled_mm_y = qm.fp8_w8a8_linear(x, qweight, scales, 128, 128, use_scaled_mm=True)
    except (RuntimeError, NotImplementedError) as e:  # a torch or CUDA without block scaling: the Triton GEMM runs
        pytest.skip(f"torch._scaled_mm has no 1 x 128 / 128 x 128 block scaling here: {e}")
    assert ((triton_y.float() - scaled_mm_y.float()).abs().max() <= 2 ** -7 * scaled_mm_y.float().abs().max())


def _layer_calls(M: int):
    """A closure running every kernel path once on a static input, and the input to refill."""
    qm = _qm()
    qweight, _, scales, mins = (t if t is None else t.cuda() for t in make_int_weight(768, 1024, 128, 4,
                                                                                      torch.float16, torch.float32))
    q8, _, s8, _ = (t if t is None else t.cuda() for t in make_int_weight(768, 1024, 32, 8, torch.float32, None))
    wq, ws = (t.cuda() for t in make_fp8_weight(768, 1024, 128, 128))
    x = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16)

    def run():
        return (qm.int_linear(x, qweight, scales, mins, 4, 128), qm.int_linear(x, q8, s8, None, 8, 32),
                qm.fp8_linear(x, wq, ws, (128, 128)))
    return run, x


@pytest.mark.parametrize("M", [3, 300])  # split-K decode; the 128-row tile and FP8 activations
def test_kernels_replay_under_cuda_graphs_bit_identical(M):
    run, x = _layer_calls(M)
    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x.dtype))
        graph.replay()
        eager = run()
        for got, want in zip(outs, eager, strict=True):
            assert torch.equal(got, want)  # same kernels, same order of sums: the same bits


def test_kernels_compile_with_inductor_without_graph_breaks():
    run, _x = _layer_calls(5)
    compiled = torch.compile(run, fullgraph=True)
    for got, want in zip(compiled(), run(), strict=True):
        assert torch.equal(got, want)


def _nan_padded(t: torch.Tensor, extra: int = 4) -> torch.Tensor:
    """t as a view into a buffer with `extra` NaN columns after each row: a load past a row's end shows as NaN."""
    buf = torch.full((t.shape[0], t.shape[1] + extra), float("nan"), dtype=t.dtype, device=t.device)
    buf[:, :t.shape[1]] = t
    return buf[:, :t.shape[1]]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("M", [1, 2, 3, 12, 16, 24, 48, 100, 300])  # the engine's warm-up rows among them
def test_qwen3_8b_qkv_ragged_splits_read_nothing_past_k(M, bits):
    """Qwen3-8B's qkv (N = 6144, K = 4096, G = 128) is the layer whose decode splits do not divide K's steps (5
    splits of 7 steps of 32): the last split must stop at K. Its scales and mins sit in NaN-padded buffers, so a
    read past a row's last group turns outputs into NaN (W8 at 16 rows gave NaN, and AWQ crashed the warm-up)."""
    qm = _qm()
    N, K, G = 6144, 4096, 128
    qweight, q, scales, mins = make_int_weight(N, K, G, bits, torch.float16, torch.float32)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16)
    kind = 0 if bits == 4 else 1
    # weight_only_linear, not int_linear: the custom op makes the scales contiguous, which would drop the padding
    y = qm.weight_only_linear(x.cuda(), qweight.cuda(), _nan_padded(scales.cuda()), _nan_padded(mins.cuda()), kind,
                              1, G)
    assert not y.isnan().any()
    plan = qm.plan_weight_only(M, N, K, G, qm.device_limits(y.device), kind)
    _check(y, x, dequant_int(q, scales, mins, G), plan.scale_after_dot)


def test_every_kernel_adds_the_residual_rounding_once():
    """tests/test_quant_kernels_residual.py's cases on CUDA (each kernel adding into the residual, split and unsplit,
    both reductions): the bits of the same kernel's fp32 result plus the residual rounded once (to nearest here),
    within the bound of the float64 sum. The bits hold while the compiler fuses no product of the kernel's last step
    with the residual's add into an fma (sm_90 SASS of the 8-bit per-channel kernel, Triton 3.9: an FMUL, then the
    FADD)."""
    from test_quant_kernels_residual import check_kernel_cases, run_kernel_cases
    check_kernel_cases(run_kernel_cases("cuda", truncate_bf16=False))


@pytest.mark.parametrize("M", [1, 2, 5])  # the CUDA-core kernels, the swapped 16-row tile
def test_the_residual_add_replays_under_cuda_graphs_bit_identical(M):
    qm = _qm()
    qweight, _, scales, mins = (t.cuda() for t in make_int_weight(768, 1024, 128, 4, torch.float16, torch.float32))
    wq, ws = (t.cuda() for t in make_fp8_weight(768, 1024, 128, 128))
    x = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(M, 768, device="cuda", dtype=torch.bfloat16)

    def run():  # o_proj then down_proj, as a layer adds them
        qm.int_linear(x, qweight, scales, mins, 4, 128, residual=residual)
        return qm.fp8_linear(x, wq, ws, (128, 128), residual=residual)
    run()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in (1, 2):
        gen = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(x.shape, generator=gen).to(x.dtype))
        start = torch.randn(residual.shape, generator=gen).to(residual.dtype).cuda()
        residual.copy_(start)
        graph.replay()
        replayed = residual.clone()
        residual.copy_(start)
        assert run() is residual and torch.equal(replayed, residual)
