"""The Triton kernel that applies structured outputs' packed token bitmask (nanovllm/kernels/token_bitmask.py)
against the unpacked torch path, and the runner's TokenBitmask buffer end to end on CUDA: on the GPU when there is
one, else the kernel alone in Triton's interpreter on the CPU (a subprocess, since TRITON_INTERPRET is read when
kernels are defined)."""
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton", reason="needs triton (the test-triton extra)")
pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # the kernel under the interpreter, in a process

CHECK = r"""
import numpy as np
import torch
from nanovllm.kernels.token_bitmask import BLOCK, apply_token_bitmask_
from nanovllm.layers.token_bitmask import TokenBitmask, unpack_bits

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
rng = np.random.default_rng(0)


def reference(logits, bitmask, rows):
    out = logits.clone()
    allowed = unpack_bits(bitmask, logits.size(1))
    for i, row in enumerate(rows):
        out[row] = out[row].masked_fill(~allowed[i], float("-inf"))
    return out


# a vocabulary that is not a multiple of 32 and spans two programs; rows out of order and a free row (1); words with
# the sign bit set, all bits set and none
vocab, rows = BLOCK + 901, [3, 0, 2]
bitmask = rng.integers(-2**31, 2**31, size=(len(rows), (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
bitmask[0, :4], bitmask[1, 5:9] = -1, 0
for dtype in (torch.float32, torch.bfloat16):
    logits = torch.randn(4, vocab, device=device).to(dtype)
    want = reference(logits, torch.from_numpy(bitmask).to(device), rows)
    got = apply_token_bitmask_(logits.clone(), torch.from_numpy(bitmask).to(device),
                               torch.tensor(rows, dtype=torch.int32, device=device))
    assert torch.equal(got, want), (dtype, (got != want).nonzero()[:5])
    assert torch.isfinite(got[1]).all() and torch.isinf(got[3]).any()
if device.type == "cuda":  # the runner's buffer: masks written in place, one copy, the kernel; then refilled
    buffer = TokenBitmask(max_rows=8, vocab_size=vocab, device=device)
    for step_rows in (rows, [0, 1, 2, 3]):
        masks = buffer.host_masks()
        masks[:len(step_rows)] = rng.integers(-2**31, 2**31, size=(len(step_rows), masks.shape[1]),
                                              dtype=np.int64).astype(np.int32)
        expected = torch.from_numpy(masks[:len(step_rows)].copy()).to(device)
        logits = torch.randn(4, vocab, device=device)
        want = reference(logits, expected, step_rows)
        assert torch.equal(buffer.apply(logits, step_rows), want) and buffer.use_triton
print("ok")
"""


def test_the_bitmask_kernel_matches_the_torch_path():
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
