"""Loads Hugging Face safetensors (sharded or not) into the packed, tensor-parallel layers.

Every tensor of the checkpoint must land in a parameter: a tensor no parameter takes is an error (a format the
engine does not read must not run as if it did), except the few names known to hold nothing the engine needs
(SKIPPED_SUFFIXES). A tensor is cast only between the ordinary float dtypes (fp32, bf16, fp16): an FP8 or integer
tensor that lands in a float parameter has a scale or packing the parameter does not hold."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn

# checkpoint tensors that hold nothing the engine reads: rotary tables the engine computes itself
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
ORDINARY_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def load_weights(model: nn.Module, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors files")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    spec = getattr(model, "quant_spec", None)
    skipped = SKIPPED_SUFFIXES + (spec.skipped_tensors if spec else ())
    loaded = set()
    shards = {}  # packed parameter -> the shard ids loaded into it
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            names = list(f.keys())
        for name in names:
            target, shard_id = _map_name(name, packed)
            param = params.get(target)
            if param is None:
                if name.endswith(skipped):
                    continue
                raise ValueError(f"checkpoint {path!r}: no parameter of the model takes tensor {name!r}"
                                 f"{_unknown_tensor_hint(name, spec)}")
            # NOTE: the file is mapped while it is open, and every page read stays in the process's RSS until it
            # is closed: opened per tensor, only one tensor's pages are mapped at a time (SmolLM2-135M's CLI demo
            # peaks at 1.0 GB instead of 1.5 GB; the header is read again each time, which costs nothing measurable)
            with safe_open(file, "pt", "cpu") as f:
                tensor = f.get_tensor(name)
            try:
                _check_dtype(param, tensor)
                if shard_id is None:
                    getattr(param, "weight_loader", _copy_whole)(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
                    shards.setdefault(target, set()).add(shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint {path!r}, weight {name!r}: {e}") from None
            loaded.add(target)
    check_all_loaded(model, params, loaded, shards, packed, f"checkpoint {path!r}")
    process_weights_after_loading(model)


def check_all_loaded(model: nn.Module, params: dict, loaded: set, shards: dict, packed: dict, source: str):
    """ValueError naming `source` and the first missing weights: a required parameter nothing loaded, or a packed
    one that got only some of its parts (a tied head counts as loaded)."""
    if getattr(model, "tie_word_embeddings", False):
        loaded.add("lm_head.weight")
    required = {name for name, param in params.items() if not getattr(param, "is_optional", False)}
    missing = sorted(required - loaded) + _missing_shards(shards, packed)
    if missing:
        raise ValueError(f"{source} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def process_weights_after_loading(model: nn.Module):
    """Quantized layers turn their loaded checkpoint tensors into the engine's layout; then the model's own step
    (the int8 vocabulary weights)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()


def _check_dtype(param: nn.Parameter, tensor: torch.Tensor):
    if tensor.dtype != param.dtype and (tensor.dtype not in ORDINARY_FLOATS or param.dtype not in ORDINARY_FLOATS):
        hint = " (is quantization_config missing from config.json?)" if param.dtype in ORDINARY_FLOATS else ""
        raise ValueError(f"dtype {tensor.dtype} does not match the parameter's {param.dtype}{hint}")


def _unknown_tensor_hint(name: str, spec) -> str:
    if spec is None and name.endswith(("scale", "scale_inv", "qweight", "qzeros", "scales", "weight_packed")):
        return " (a quantized checkpoint needs its quantization_config in config.json)"
    if spec is not None:
        return f" (quantization_config.quant_method={spec.method!r}: this tensor is not part of that format)"
    return ""


def copy_exact(dst: torch.Tensor, loaded: torch.Tensor):
    """dst.copy_(loaded) without broadcasting: a checkpoint tensor of another shape is an error."""
    if dst.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match the parameter's {tuple(dst.shape)}")
    dst.copy_(loaded)


def _copy_whole(param: nn.Parameter, loaded: torch.Tensor):
    copy_exact(param.data, loaded)


def _missing_shards(shards: dict, packed: dict) -> list[str]:
    """Packed parameters (qkv_proj, gate_up_proj) that got some of their checkpoint tensors but not all."""
    packs = {}  # our packed module -> every shard id it holds
    for ours, shard_id in packed.values():
        packs.setdefault(ours, set()).add(shard_id)
    missing = []
    for target, got in shards.items():
        want = next(ids for ours, ids in packs.items() if f".{ours}." in target)
        if got != want:
            missing.append(f"{target} shards {sorted(map(str, want - got))}")
    return missing


def _map_name(name: str, packed: dict) -> tuple[str, object]:
    for hf_part, (ours, shard_id) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{ours}."), shard_id
    return name, None


def init_dummy_weights(model: nn.Module, seed: int):
    """Random weights from config.json alone, for benchmarks: normal(0, 0.02), norms at 1; quantized layers get
    random values of their layout with about the same spread (QuantLinearMethod.init_dummy)."""
    generators = {}  # device -> its generator: an offloaded embedding is drawn in host memory (offload_embedding)

    def generator(device: torch.device) -> torch.Generator:
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(seed)
        return generators[device]

    quantized = set()
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is not None and method.is_quantized:
            method.init_dummy(module, generator(next(module.parameters()).device))
            quantized.update(f"{prefix}.{name}" for name, _ in module.named_parameters(recurse=False))
    for name, param in model.named_parameters():
        if name in quantized and not name.endswith(".bias"):
            continue
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator(param.device))
    if hasattr(model, "process_weights_after_loading"):
        model.process_weights_after_loading()
