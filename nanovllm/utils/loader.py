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
    shards = {}  # packed parameter -> the shard ids loaded into it
    for file in files:
        with safe_open(file, "pt", "cpu") as f:
            names = list(f.keys())
        for name in names:
            target, shard_id = _map_name(name, packed)
            param = params.get(target)
            if param is None:
                continue  # e.g. rotary inv_freq buffers
            # NOTE: the file is mapped while it is open, and every page read stays in the process's RSS until it
            # is closed: opened per tensor, only one tensor's pages are mapped at a time (SmolLM2-135M's CLI demo
            # peaks at 1.0 GB instead of 1.5 GB; the header is read again each time, which costs nothing measurable)
            with safe_open(file, "pt", "cpu") as f:
                tensor = f.get_tensor(name)
            try:
                if shard_id is None:
                    getattr(param, "weight_loader", _copy_whole)(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
                    shards.setdefault(target, set()).add(shard_id)
            except ValueError as e:
                raise ValueError(f"checkpoint {path!r}, weight {name!r}: {e}") from None
            loaded.add(target)
    if getattr(model, "tie_word_embeddings", False):
        loaded.add("lm_head.weight")
    missing = sorted(set(params) - loaded) + _missing_shards(shards, packed)
    if missing:
        raise ValueError(f"checkpoint {path!r} lacks weights for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


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
    """Random weights from config.json alone, for benchmarks: normal(0, 0.02), norms at 1."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)
