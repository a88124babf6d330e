"""Round-to-nearest quantization of a float checkpoint into a published quantized format, so users and tests make
quantized checkpoints without a hub (`nanovllm convert --quantize`).

The decoder's linear weights (q/k/v/o_proj, gate/up/down_proj) are quantized; the embedding, the LM head, the norms
and the biases stay as they are. Formats, each as its own tools write it:

- "fp8": block FP8 as in Qwen's `*-FP8` checkpoints: `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32
  [ceil(N / G), ceil(K / G)] (the scale of a block is its absolute maximum / 448), quantization_config
  {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic, weight_block_size: [G, G]};
- "fp8-channel": per-channel FP8 as llm-compressor writes it: `weight` e4m3 and `weight_scale` float32 [N, 1],
  compressed-tensors "float-quantized" with a "channel" strategy (weights only: input_activations null);
- "w4": AWQ GEMM as AutoAWQ writes it: asymmetric 4-bit groups of G along K, `qweight` int32 [K, N / 8] and
  `qzeros` int32 [K / G, N / 8] with eight outputs per word in AWQ's order (0, 2, 4, 6, 1, 3, 5, 7), `scales` fp16
  [K / G, N]; w = (q - z) * s.

Round-to-nearest by default; with Hessians of calibration text, GPTQ's error-compensated rounding (calibrate.py),
into the same tensors. Each source shard becomes one output shard, so memory holds one shard at a time.
"""
from __future__ import annotations

import json
import os
import shutil

import torch

FORMATS = ("fp8", "fp8-channel", "w4")
QUANTIZED_SUFFIXES = tuple(f".{m}.weight" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"))
FP8_MAX = 448.0  # the largest float8_e4m3fn
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i of a word holds output 8j + AWQ_ORDER[i]
# Hessian factors (float32 [K, K]) that one batch of alike layers holds at once (GPTQ rounds the batch in one
# column loop): all of a small model's layers (SmolLM2's 30 down_proj: 283 MB), one at a time for an 8B's (0.8 GB)
GPTQ_BATCH_BYTES = 512 << 20


def quantization_config(fmt: str, group_size: int) -> dict:
    """config.json's quantization_config of a format."""
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [group_size, group_size]}
    if fmt == "fp8-channel":
        weights = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False,
                   "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax"}
        return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                              "output_activations": None}},
                "ignore": ["lm_head"], "kv_cache_scheme": None}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def quantize_weight(name: str, weight: torch.Tensor, fmt: str, group_size: int,
                    hessian: torch.Tensor | None = None, factor: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """One linear weight [N, K] -> its tensors in the format, named as in the checkpoint (prefix.qweight, ...).
    Without a hessian each value rounds to its nearest grid point; with one, GPTQ chooses (calibrate.py), with the
    hessian's inverse_factor if given."""
    return quantize_groups([{name: weight}], fmt, group_size, None if hessian is None else [hessian],
                           None if factor is None else [factor])


def quantize_groups(groups: list[dict[str, torch.Tensor]], fmt: str, group_size: int,
                    hessians: list[torch.Tensor] | None = None,
                    factors: list[torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Groups of linear weights [N_i, K], a group's weights reading one input (q/k/v, gate/up: one Hessian), the
    groups alike in shape (one projection of several layers), with a Hessian (and its factor) per group -> their
    tensors, as quantize_weight gives each. Every grid parameter and GPTQ update is a row's own (FP8 blocks: whole
    blocks of a weight's rows, check_group_size), so a group is rounded stacked [sum N_i, K] and the groups in one
    batch (calibrate.gptq_batch): one column loop of larger ops."""
    from nanovllm.utils.calibrate import gptq_batch, select
    stacks = [torch.cat([weight.to(torch.float32) for weight in weights.values()]) for weights in groups]
    k = stacks[0].size(1)
    group = k if fmt == "fp8-channel" else group_size
    block_rows = 1 if fmt == "fp8-channel" else group  # FP8 blocks are square; a channel is one row
    fit, round_to_grid = (_fit_awq, _round_awq) if fmt == "w4" else (_fp8_fit(block_rows), _round_fp8)
    if hessians is None:
        params = [[fit(w[:, i:i + group]) for i in range(0, k, group)] for w in stacks]
    else:
        stacks, params = gptq_batch(stacks, hessians, group, fit, round_to_grid, factors)
    tensors = {}
    for weights, w, w_params in zip(groups, stacks, params):
        first_row = 0
        for name, weight in weights.items():
            rows = slice(first_row, first_row + weight.size(0))
            first_row = rows.stop
            tensors.update(_format_tensors(name.removesuffix(".weight"), w[rows], [select(p, rows) for p in w_params],
                                           fmt, group, block_rows))
    return tensors


def _format_tensors(prefix: str, w: torch.Tensor, params: list, fmt: str, group: int,
                    block_rows: int) -> dict[str, torch.Tensor]:
    if fmt == "w4":
        qweight, qzeros, scales = awq_tensors(w, params, group)
        return {f"{prefix}.qweight": qweight, f"{prefix}.qzeros": qzeros, f"{prefix}.scales": scales}
    q, scales = fp8_tensors(w, params, group, block_rows)
    scale_name = "weight_scale_inv" if fmt == "fp8" else "weight_scale"
    return {f"{prefix}.weight": q, f"{prefix}.{scale_name}": scales}


# Each format's grid: fit(values [N, G]) -> the group's parameters (one per row), round(column [N], params) -> the
# column on the grid. Round-to-nearest fits every group on the weight itself; GPTQ on the weight as its rounding
# errors have moved it.

def _fit_awq(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's asymmetric rule (pseudo_quantize_tensor with zero_point): (scale rounded to fp16, zero) per row."""
    w_max, w_min = values.amax(dim=-1), values.amin(dim=-1)
    scale = ((w_max - w_min).clamp(min=1e-5) / 15).to(torch.float16).to(torch.float32)
    return scale, (-torch.round(w_min / scale)).clamp(0, 15)


def _round_awq(column: torch.Tensor, params) -> torch.Tensor:
    scale, zero = params
    return ((torch.round(column / scale) + zero).clamp(0, 15) - zero) * scale


def _fp8_fit(block_rows: int):
    def fit(values: torch.Tensor) -> torch.Tensor:
        """A scale per row: the absolute maximum of its block of block_rows rows (one row per channel) / 448."""
        amax = values.reshape(*values.shape[:-2], values.size(-2) // block_rows, -1).abs().amax(dim=-1)
        return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).repeat_interleave(block_rows, dim=-1)
    return fit


def _round_fp8(column: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (column / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale


def fp8_tensors(w: torch.Tensor, params: list, group: int, block_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values [N, K] and float32 scales [N / block_rows, K / group] of the weight w (on the grid or not)."""
    scales = torch.stack(params, dim=1)  # [N, K / group], one per row
    q = (w / scales.repeat_interleave(group, dim=1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scales[::block_rows].contiguous()


def awq_tensors(w: torch.Tensor, params: list, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ GEMM's qweight, qzeros and fp16 scales of the weight w (on the grid or not) with each group's params."""
    scales = torch.stack([p[0] for p in params], dim=1)  # [N, K / G]
    zeros = torch.stack([p[1] for p in params], dim=1)
    q = (torch.round(w / scales.repeat_interleave(group, dim=1)) + zeros.repeat_interleave(group, dim=1)).clamp(0, 15)
    return (pack_awq(q.t().to(torch.int32)), pack_awq(zeros.t().to(torch.int32)),
            scales.to(torch.float16).t().contiguous())


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, N] integers 0..15 -> int32 [rows, N / 8]: nibble i of word j holds column 8j + AWQ_ORDER[i]."""
    rows, n = values.shape
    ordered = values.reshape(rows, n // 8, 8)[..., list(AWQ_ORDER)].to(torch.int64)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    words = (ordered << shifts).sum(-1)  # disjoint bits: the sum is the bitwise or, in 0 .. 2**32 - 1
    return (words - (words >= 1 << 31).to(torch.int64) * (1 << 32)).to(torch.int32)  # the same bits as int32


def check_group_size(fmt: str, group_size: int, shapes: dict[str, tuple[int, int]]):
    """ValueError naming the first weight that the group (or block) does not divide: the engine runs a layer only
    in whole groups along K (and, for FP8 blocks, whole blocks of each merged part's outputs)."""
    if not isinstance(group_size, int) or group_size < 1 or (fmt == "w4" and group_size % 8):
        raise ValueError(f"--group-size {group_size} must be a positive int{' multiple of 8' if fmt == 'w4' else ''}")
    if fmt == "fp8-channel":
        return

    def fits(g: int, n: int, k: int) -> bool:
        return not k % g and (not n % g if fmt == "fp8" else not n % 8)
    for name, (n, k) in shapes.items():
        if not fits(group_size, n, k):
            fitting = [g for g in (128, 64, 32, 16) if all(fits(g, *shape) for shape in shapes.values())]
            raise ValueError(f"--group-size {group_size} does not divide {name} [{n}, {k}]; pass a group size that "
                             f"divides every layer's shape{f', e.g. {fitting[0]}' if fitting else ''}")


def quantize_checkpoint(src_dir: str, out_dir: str, fmt: str, group_size: int = 128,
                        hessians: dict[str, torch.Tensor] | None = None,
                        factors: dict[str, torch.Tensor] | None = None) -> str:
    """Writes src_dir's float safetensors checkpoint, quantized, into out_dir (with its config, tokenizer and other
    files). hessians (calibrate.collect_hessians): GPTQ's rounding instead of round-to-nearest; factors
    (calibrate.inverse_factors of those hessians), if the caller makes several formats from them: otherwise each
    is computed here, once per layer's input. Returns out_dir."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    if fmt not in FORMATS:
        raise ValueError(f"--quantize {fmt!r} is not supported; supported: {list(FORMATS)}")
    files = sorted(f for f in os.listdir(src_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{src_dir!r} has no *.safetensors files to quantize")
    config = _read_json(os.path.join(src_dir, "config.json"))
    if config.get("quantization_config"):
        raise ValueError(f"{src_dir!r} is quantized already ({config['quantization_config'].get('quant_method')}); "
                         f"pass a float checkpoint")
    check_group_size(fmt, group_size, _linear_shapes(src_dir, files))
    hessians = hessians or {}
    os.makedirs(out_dir, exist_ok=True)
    weight_map = {}
    for file in files:
        tensors = {}
        with safe_open(os.path.join(src_dir, file), "pt", "cpu") as f:
            for batch in _batches(f, hessians):
                if batch[0][0].endswith(QUANTIZED_SUFFIXES):
                    weights = [{name: f.get_tensor(name) for name in names} for names in batch]
                    tensors.update(_quantize_batch(weights, fmt, group_size, hessians, factors or {}))
                else:
                    tensors[batch[0][0]] = f.get_tensor(batch[0][0])
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    _copy_other_files(src_dir, out_dir)
    if len(files) > 1:
        _write_json(os.path.join(out_dir, "model.safetensors.index.json"), {"metadata": {}, "weight_map": weight_map})
    config["quantization_config"] = quantization_config(fmt, group_size)
    _write_json(os.path.join(out_dir, "config.json"), config)
    return out_dir


def _batches(f, hessians: dict[str, torch.Tensor]) -> list[list[list[str]]]:
    """A shard's tensor names in batches of groups: the linear weights that share one Hessian tensor (q/k/v, gate/up:
    calibrate.py) in one group, groups of one shape (a projection of each layer) in one batch of at most
    GPTQ_BATCH_BYTES of Hessian factors, every other tensor in a batch of its own."""
    groups: dict = {}
    for name in f.keys():
        hessian = hessians.get(name) if name.endswith(QUANTIZED_SUFFIXES) else None
        groups.setdefault(name if hessian is None else id(hessian), []).append(name)
    alike: dict = {}
    for names in groups.values():
        shapes = tuple(tuple(f.get_slice(name).get_shape()) for name in names)
        key = (names[0] in hessians, *shapes) if names[0].endswith(QUANTIZED_SUFFIXES) else names[0]
        alike.setdefault(key, []).append(names)
    batches = []
    for key, same in alike.items():
        size = max(1, GPTQ_BATCH_BYTES // (4 * key[1][1] ** 2)) if isinstance(key, tuple) else 1
        batches += [same[i:i + size] for i in range(0, len(same), size)]
    return batches


def _quantize_batch(batch: list[dict[str, torch.Tensor]], fmt: str, group_size: int, hessians: dict,
                    factors: dict) -> dict[str, torch.Tensor]:
    from nanovllm.utils.calibrate import inverse_factor
    names = [next(iter(weights)) for weights in batch]
    if names[0] not in hessians:
        return quantize_groups(batch, fmt, group_size)
    batch_hessians, batch_factors = [hessians[name] for name in names], []
    for name, hessian in zip(names, batch_hessians):
        factor = factors.get(name)
        batch_factors.append(inverse_factor(hessian) if factor is None else factor)  # one per group: one input
    return quantize_groups(batch, fmt, group_size, batch_hessians, batch_factors)


def _linear_shapes(src_dir: str, files: list[str]) -> dict[str, tuple[int, int]]:
    from safetensors import safe_open
    shapes = {}
    for file in files:
        with safe_open(os.path.join(src_dir, file), "pt", "cpu") as f:
            for name in f.keys():
                if name.endswith(QUANTIZED_SUFFIXES):
                    shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def _copy_other_files(src_dir: str, out_dir: str):
    """Everything but the weights, their index and config.json (tokenizer, generation config, chat template)."""
    for name in os.listdir(src_dir):
        path = os.path.join(src_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(path, os.path.join(out_dir, name))


def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _write_json(path: str, value: dict):
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
