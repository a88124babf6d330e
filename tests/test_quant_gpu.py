"""Quantized checkpoints on a CUDA GPU, each engine in its own subprocess: in float32 the layers run the reference
(dequantize, then F.linear) and must match transformers on the dequantized weights as on the CPU; in bfloat16 they
run the Triton kernels (nanovllm/kernels/quant_matmul.py) under CUDA graphs, and their logprobs may be no further
from the float32 reference than the unquantized model's in bfloat16 (twice as far, plus 0.02 nats). Skipped
without CUDA."""
import json
import os
import subprocess
import sys

import pytest
import torch

from test_quant_formats import PROMPTS, hf_log_softmax, quant_pair

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FLOAT32_TOLERANCE = 1e-3  # nats: CUDA's float32 GEMMs sum in another order than the CPU's
RUN = """
import json, sys
from nanovllm import LLM, SamplingParams
model, prompts, kwargs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
with LLM(model, **kwargs) as llm:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    lps = [[None] + [next(iter(e.values())).logprob for e in o["prompt_logprobs"][1:]] for o in outs]
    print(json.dumps({"token_ids": [o["token_ids"] for o in outs], "prompt_logprobs": lps,
                      "weights_bytes": llm.memory_breakdown["weights"]}))
"""


def run(model: str, **kwargs) -> dict:
    kwargs = {**dict(device="cuda", kvcache_block_size=16, max_model_len=256, max_num_seqs=4,
                     gpu_memory_budget_gib=6), **kwargs}  # a budget: xdist's workers may share the GPU
    proc = subprocess.run([sys.executable, "-c", RUN, model, json.dumps(PROMPTS), json.dumps(kwargs)],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def max_error(out: dict, ref_dir: str) -> float:
    """The largest distance of a prompt token's logprob from HF's float32 on the dequantized weights."""
    error = 0.0
    for prompt, lps in zip(PROMPTS, out["prompt_logprobs"]):
        reference = hf_log_softmax(ref_dir, prompt)
        error = max(error, max(abs(lps[j] - reference[j - 1, prompt[j]].item()) for j in range(1, len(prompt))))
    return error


# steps of at most 32 rows: FP8 weights keep bfloat16 activations there; from 33 rows on (quant_matmul's
# FP8_ACT_QUANT_MIN_ROWS) the activations are rounded to FP8 too (W8A8), which the bound below, made for weight-only
# errors, does not allow for; test_quant_kernels_gpu.py bounds the W8A8 GEMM against FP8-rounded activations
WEIGHT_ONLY_STEPS = dict(max_num_batched_tokens=32)


@pytest.mark.parametrize("case", ["awq-g32", "gptq8-asym-g64", "ct-w4-asym-g64", "fp8-block128", "ct-fp8-channel"])
def test_quantized_checkpoint_on_cuda(quant_root, bases, case):
    quant_dir, ref_dir = quant_pair(quant_root, bases, case)
    assert max_error(run(quant_dir, dtype="float32"), ref_dir) < FLOAT32_TOLERANCE
    quantized = run(quant_dir, dtype="bfloat16", **WEIGHT_ONLY_STEPS)
    unquantized = run(ref_dir, dtype="bfloat16", **WEIGHT_ONLY_STEPS)
    assert max_error(quantized, ref_dir) <= 2 * max_error(unquantized, ref_dir) + 0.02


def test_int8_lm_head_on_cuda(bases):
    """The int8 head through the kernel (bfloat16) and through the chunked reference (float32) agree."""
    kernel = run(bases["llama"], dtype="bfloat16", quantize_lm_head="int8")
    reference = run(bases["llama"], dtype="float32", quantize_lm_head="int8")
    error = max(abs(a - b) for x, y in zip(kernel["prompt_logprobs"], reference["prompt_logprobs"])
                for a, b in zip(x[1:], y[1:]))
    unquantized_error = max(abs(a - b) for x, y in zip(run(bases["llama"], dtype="bfloat16")["prompt_logprobs"],
                                                       run(bases["llama"], dtype="float32")["prompt_logprobs"])
                            for a, b in zip(x[1:], y[1:]))
    assert error <= 2 * unquantized_error + 0.02


@pytest.mark.parametrize("quantize_lm_head", [None, "int8"])
def test_an_offloaded_embedding_changes_nothing_but_the_gpu_memory(bases, quantize_lm_head):
    """offload_embedding: the GPU gathers the untied Llama's embedding rows from pinned host memory, under CUDA
    graphs and async scheduling. The same tokens and logprobs, exactly, and the table's bytes off the GPU."""
    on_gpu = run(bases["llama"], dtype="bfloat16", quantize_lm_head=quantize_lm_head)
    on_host = run(bases["llama"], dtype="bfloat16", quantize_lm_head=quantize_lm_head, offload_embedding=True)
    assert on_host["token_ids"] == on_gpu["token_ids"] and on_host["prompt_logprobs"] == on_gpu["prompt_logprobs"]
    with open(os.path.join(bases["llama"], "config.json")) as f:
        hf = json.load(f)
    row_bytes = hf["hidden_size"] + 4 if quantize_lm_head == "int8" else 2 * hf["hidden_size"]  # + a float32 scale
    assert on_gpu["weights_bytes"] - on_host["weights_bytes"] == pytest.approx(hf["vocab_size"] * row_bytes, abs=1024)
