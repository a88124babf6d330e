"""Loads Hugging Face safetensors (sharded or not) into the packed, tensor-parallel layers."""
import glob
import os

import torch
from safetensors import safe_open
from torch import nn


def load_weights(model: nn.Module, path: str):
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model={path!r} has no *.safetensors files")
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules_mapping", {})
    loaded = set()
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            for name in f.keys():
                target, shard_id = _map_name(name, packed)
                param = params.get(target)
                if param is None:
                    continue  # e.g. rotary inv_freq buffers
                tensor = f.get_tensor(name)
                if shard_id is None:
                    getattr(param, "weight_loader", _copy_whole)(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
                loaded.add(target)
    if getattr(model, "tie_word_embeddings", False):
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def _copy_whole(param: nn.Parameter, loaded: torch.Tensor):
    if param.shape != loaded.shape:
        raise ValueError(f"weight shape {tuple(loaded.shape)} does not match parameter shape {tuple(param.shape)}")
    param.data.copy_(loaded)


def _map_name(name: str, packed: dict) -> tuple[str, object]:
    for hf_part, (ours, shard_id) in packed.items():
        if f".{hf_part}." in name:
            return name.replace(f".{hf_part}.", f".{ours}."), shard_id
    return name, None


def init_dummy_weights(model: nn.Module, seed: int):
    """Random weights from config.json alone, for benchmarks: normal(0, 0.02), norms at 1."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
