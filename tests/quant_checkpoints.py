"""Tiny quantized checkpoints written the way each format's own tools write them, independently of the engine's
loader: random float32 weights quantized with numpy/torch, packed as AutoAWQ (GEMM), AutoGPTQ (v1 zeros),
compressed-tensors (pack_to_int32) and Qwen's block FP8 do, saved with safetensors beside a config.json holding
the format's quantization_config. Each writer also returns the weights dequantized in float32, which
`write_pair` saves as an ordinary unquantized checkpoint: the reference the quantized engine must match."""
import json
import os

import numpy as np
import torch
from safetensors.torch import save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_groups(w: np.ndarray, group_size: int, bits: int, symmetric: bool, scale_dtype=torch.float16):
    """Round-to-nearest groups along K: unsigned q [N, K], zero points z [N, K // G] and scales s [N, K // G]
    (a torch tensor of scale_dtype) with w ~ (q - z) * s. Asymmetric zero points stay in 1..2**bits - 1
    (AutoGPTQ's v1 stores z - 1, which cannot hold 0)."""
    n, k = w.shape
    maxq = (1 << bits) - 1
    groups = w.reshape(n, k // group_size, group_size)
    if symmetric:
        z = np.full((n, k // group_size), 1 << (bits - 1), dtype=np.int64)
        s = np.abs(groups).max(-1) / ((1 << (bits - 1)) - 1)
    else:
        lo, hi = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)
        s = (hi - lo) / maxq
        z = np.clip(np.round(-lo / np.maximum(s, 1e-8)), 1, maxq).astype(np.int64)
    s = torch.from_numpy(np.maximum(s, 1e-6).astype(np.float32)).to(scale_dtype)
    s32 = s.float().numpy()
    q = np.clip(np.round(groups / s32[..., None]) + z[..., None], 0, maxq).astype(np.int64).reshape(n, k)
    deq = ((q.reshape(n, k // group_size, group_size) - z[..., None]) * s32[..., None]).reshape(n, k)
    return q, z, s, deq.astype(np.float32)


def _as_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(words.astype(np.uint32)).view(np.int32))


# --- AutoAWQ GEMM: WQLinear_GEMM.from_linear packs 8 outputs per int32 in the order [0, 2, 4, 6, 1, 3, 5, 7]
def awq_pack(int_kn: np.ndarray) -> torch.Tensor:
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, cols = int_kn.shape
    packed = np.zeros((rows, cols // 8), dtype=np.uint32)
    for col in range(cols // 8):
        for i in range(8):
            packed[:, col] |= int_kn[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
    return _as_int32(packed)


def awq_linear(w: np.ndarray, group_size: int):
    q, z, s, deq = quantize_groups(w, group_size, 4, symmetric=False)
    tensors = {"qweight": awq_pack(q.T), "qzeros": awq_pack(z.T), "scales": s.T.contiguous()}
    return tensors, deq


# --- AutoGPTQ: QuantLinear.pack packs along K (rows of qweight) and the zeros, minus 1, along N
def gptq_linear(w: np.ndarray, group_size: int, bits: int, symmetric: bool):
    q, z, s, deq = quantize_groups(w, group_size, bits, symmetric)
    per_word = 32 // bits
    intweight = q.T.astype(np.uint32)  # [K, N]
    qweight = np.zeros((intweight.shape[0] // per_word, intweight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(per_word):
            qweight[row] |= intweight[row * per_word + j] << (bits * j)
    zeros = (z.T - 1).astype(np.uint32)  # [K // G, N], v1: z - 1
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // per_word), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(per_word):
            qzeros[:, col] |= zeros[:, col * per_word + j] << (bits * j)
    k = w.shape[1]
    tensors = {"qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros), "scales": s.T.contiguous(),
               "g_idx": torch.tensor([i // group_size for i in range(k)], dtype=torch.int32)}
    return tensors, deq


# --- compressed-tensors pack-quantized: pack_to_int32 stores q + 2**(bits - 1) unsigned, value i at bits * i
def ct_pack(signed: np.ndarray, bits: int, packed_dim: int) -> torch.Tensor:
    value = (signed + (1 << (bits - 1))).astype(np.uint32)
    pack_factor = 32 // bits
    if packed_dim == 0:
        value = value.T
    packed = np.zeros((value.shape[0], value.shape[1] // pack_factor), dtype=np.uint32)
    for i in range(pack_factor):
        packed |= value[:, i::pack_factor] << (bits * i)
    return _as_int32(packed.T if packed_dim == 0 else packed)


def ct_int_linear(w: np.ndarray, group_size: int, bits: int, symmetric: bool):
    q, z, s, deq = quantize_groups(w, group_size, bits, symmetric, scale_dtype=torch.bfloat16)  # the model dtype
    half = 1 << (bits - 1)
    tensors = {"weight_packed": ct_pack(q - half, bits, 1),
               "weight_scale": s,
               "weight_shape": torch.tensor(w.shape, dtype=torch.int64)}
    if not symmetric:
        tensors["weight_zero_point"] = ct_pack(z - half, bits, 0)
    return tensors, deq


# --- FP8: e4m3 values with a float32 scale per block (Qwen's weight_scale_inv), per row or per tensor
def fp8_linear(w: np.ndarray, block: tuple[int, int] | None, per_tensor: bool = False):
    t = torch.from_numpy(w)
    n, k = t.shape
    if per_tensor:
        scale = (t.abs().max() / FP8_MAX).reshape(())
        per_element = scale.expand(n, k)
    elif block is None:
        scale = (t.abs().amax(1, keepdim=True) / FP8_MAX).to(torch.bfloat16)  # [N, 1], the model's dtype
        per_element = scale.float().expand(n, k)
    else:
        bn, bk = block
        padded = torch.zeros(-(-n // bn) * bn, -(-k // bk) * bk)
        padded[:n, :k] = t.abs()
        scale = padded.unflatten(0, (-1, bn)).unflatten(2, (-1, bk)).amax((1, 3)) / FP8_MAX  # [N / bn, K / bk]
        per_element = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    q = (t / per_element).to(torch.float8_e4m3fn)
    deq = (q.float() * per_element.float()).numpy()
    return {"weight": q, "weight_scale": scale}, deq


def write_pair(hf_dir: str, out_dir: str, quantize, quantization_config: dict, rename: dict | None = None,
               extra: dict | None = None) -> tuple[str, str]:
    """From a float32 checkpoint: (quantized dir, reference dir). quantize(name, w [N, K]) -> (tensors, deq), or
    None to keep the layer unquantized;
    rename maps a tensor suffix to the format's name (weight_scale -> weight_scale_inv); extra(name) adds tensors
    the format writes per layer (input_scale)."""
    from safetensors.torch import load_file
    state = {}
    for f in sorted(os.listdir(hf_dir)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(hf_dir, f)))
    quant_dir, ref_dir = os.path.join(out_dir, "quantized"), os.path.join(out_dir, "reference")
    quantized, reference = {}, {}
    for name, tensor in state.items():
        layer = name.rpartition(".")[0]
        if name.endswith(".weight") and layer.rpartition(".")[2] in LINEARS:
            result = quantize(name, tensor.float().numpy())
            if result is None:  # a layer the format leaves unquantized (modules_to_not_convert, ignore)
                quantized[name] = reference[name] = tensor
                continue
            tensors, deq = result
            for suffix, t in tensors.items():
                quantized[f"{layer}.{(rename or {}).get(suffix, suffix)}"] = t.contiguous()
            quantized.update((extra or (lambda _: {}))(layer))
            reference[name] = torch.from_numpy(deq)
        else:
            quantized[name] = reference[name] = tensor
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    for path, tensors, qc in ((quant_dir, quantized, quantization_config), (ref_dir, reference, None)):
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**config, **({"quantization_config": qc} if qc else {})}, f, indent=1)
    return quant_dir, ref_dir


def awq_config(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def gptq_config(bits: int, group_size: int, symmetric: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False, "sym": symmetric,
            "damp_percent": 0.01, "true_sequential": True, "static_groups": False, "checkpoint_format": "gptq"}


def ct_config(fmt: str, weights: dict, input_activations: dict | None = None) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": input_activations, "output_activations": None}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def ct_int_weights(bits: int, group_size: int, symmetric: bool) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": "group", "group_size": group_size,
            "dynamic": False, "actorder": None, "observer": "minmax"}


def fp8_config(block: list[int] | None, activation_scheme: str = "dynamic") -> dict:
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": activation_scheme}
    if block:
        config["weight_block_size"] = block
    return config


# conftest.VOCAB tokens; head_dim 64 with 2 KV heads: every merged part (q 256, k 128, v 128, gate/up 256) is whole
# 128-blocks (Qwen's FP8)
BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.25, bos_token_id=1,
            eos_token_id=2)


def write_base(kind: str, path: str) -> str:
    """A float32 checkpoint to quantize: a tied Qwen3, an untied Llama, or a Qwen2 (biases on q, k and v, which
    stay unquantized beside the quantized weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config
    if kind == "qwen3":
        config = Qwen3Config(**BASE, head_dim=64, rope_theta=1e5, tie_word_embeddings=True)
    elif kind == "qwen2":
        config = Qwen2Config(**BASE, rope_theta=1e5, tie_word_embeddings=False)
    else:  # untied lm_head, which stays unquantized
        config = LlamaConfig(**BASE, rope_theta=2e5, tie_word_embeddings=False)
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # transformers initialises biases to zero, which would hide one that is dropped
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.25)
    model.save_pretrained(path)
    return path
