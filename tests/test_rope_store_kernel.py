"""The fused norm + rope + KV-store Triton kernel against the torch path it replaces: on the GPU when there is one,
else in Triton's interpreter on the CPU (a subprocess, since TRITON_INTERPRET is read when kernels are defined)."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="needs triton (the test-triton extra)")
pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # the kernel under the interpreter, in a process

CHECK = r"""
import torch
from nanovllm.kernels.rope_store import rope_store_kvcache
from nanovllm.layers.layernorm import rms_norm
from nanovllm.layers.rotary_embedding import RotaryEmbedding, apply_rope

device = "cuda" if torch.cuda.is_available() else "cpu"


def reference(qkv, positions, cos_sin, H, K, D, k_cache, v_cache, slots, qw, kw, eps):
    q, k, v = qkv.split([H * D, K * D, K * D], dim=-1)
    q, k, v = q.view(-1, H, D), k.view(-1, K, D), v.view(-1, K, D)
    if qw is not None:
        q, k = rms_norm.fn(q, qw, eps), rms_norm.fn(k, kw, eps)
    q, k = apply_rope.fn(positions, q, k, cos_sin)
    bs = k_cache.size(1)
    valid = slots >= 0
    k_cache[slots[valid] // bs, slots[valid] % bs] = k[valid]
    v_cache[slots[valid] // bs, slots[valid] % bs] = v[valid]
    return q


torch.manual_seed(0)
with torch.device(device):
    for dtype in (torch.float32, torch.bfloat16):
        for H, K, D, norm in ((4, 2, 64, True), (3, 1, 128, False), (6, 2, 32, True), (16, 8, 128, True)):
            T, N, L, bs = 7, 6, 2, 4
            rope = RotaryEmbedding(D, 64, 10000.0)
            qkv = torch.randn(T, (H + 2 * K) * D).to(dtype) * 3
            positions = torch.tensor([0, 5, 9, 33, 2, 63, 17])
            slots = torch.tensor([0, 5, -1, 13, 22, 7, 23])  # -1: a padding row, nothing stored
            qw = torch.randn(D).to(dtype) if norm else None
            kw = torch.randn(D).to(dtype) if norm else None
            kv_ref = torch.zeros(N, L, 2, bs, K, D, dtype=dtype)
            kv_new = kv_ref.clone()
            q_ref = reference(qkv, positions, rope.cos_sin_cache, H, K, D, kv_ref[:, 1, 0], kv_ref[:, 1, 1], slots,
                              qw, kw, 1e-6)
            q_new = rope_store_kvcache(qkv, positions, rope.cos_sin_cache, H, K, D, kv_new[:, 1, 0],
                                       kv_new[:, 1, 1], slots, qw, kw, 1e-6)
            tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
            for got, want in ((q_new, q_ref), (kv_new, kv_ref)):
                err = (got.float() - want.float()).abs().max().item()
                assert torch.allclose(got.float(), want.float(), **tol), (dtype, H, K, D, norm, err)
            assert kv_new[:, 0].abs().sum() == 0  # the other layer's cache is untouched
print("ok")
"""


def test_fused_rope_store_matches_the_torch_path():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
