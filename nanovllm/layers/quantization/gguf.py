"""GGUF weights in the "int" layout (layout.py): each linear layer's layout from its GGUF tensors' block types, the
linear method that holds them, and the loading of a GGUF's tensors into the model (nanovllm/utils/gguf_loader.py
reads them from the file).

A GGUF stores every tensor in its own block type, and a Q4_K_M file mixes them inside one merged layer (q and k in
Q4_K, v in Q6_K in some layers). A merged layer holds one layout: the one that every part's values fit exactly,
with the most bits, the smallest group, the widest scale dtype, and mins when any part has them. Widening a part
changes no value: 4-bit codes become int8, each scale is repeated over the smaller groups, fp16 becomes fp32, and
a part without mins gets zeros (q * s + 0 is q * s).
"""
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.layers.quantization.layout import dequantize_int, unpack_int4
from nanovllm.layers.quantization.method import QuantLinearMethod, UnquantizedLinearMethod, new_param
from nanovllm.utils.gguf_blocks import IntGroups
from nanovllm.utils.gguf_loader import iter_gguf_tensors
from nanovllm.utils.gguf_model import FLOAT_TYPES, GGUFSpec, close_gguf, open_gguf
from nanovllm.utils.loader import _copy_whole, _map_name, check_all_loaded, process_weights_after_loading
from nanovllm.utils.quant_spec import QuantSpec


@dataclass(frozen=True)
class IntLayout:
    """The shape of one layer's "int" layout: what its qweight, scales and mins tensors are."""
    bits: int
    group_size: int
    scales_dtype: torch.dtype
    mins_dtype: torch.dtype | None  # None: symmetric (no mins)


# GGUF block type -> its layout (gguf_blocks.py's table)
TYPE_LAYOUTS = {
    "Q4_0": IntLayout(4, 32, torch.float16, torch.float16),
    "Q4_1": IntLayout(4, 32, torch.float16, torch.float16),
    "Q8_0": IntLayout(8, 32, torch.float16, None),
    "Q4_K": IntLayout(4, 32, torch.float32, torch.float32),
    "Q5_K": IntLayout(8, 32, torch.float32, torch.float32),
    "Q6_K": IntLayout(8, 16, torch.float32, None),
}


def _widest(dtypes) -> torch.dtype | None:
    dtypes = [d for d in dtypes if d is not None]
    if not dtypes:
        return None
    return torch.float32 if torch.float32 in dtypes else torch.float16


def merged_layout(type_names: list[str]) -> IntLayout:
    """The layout that holds every part of a merged layer exactly (groups of 16 and 32: the smaller divides)."""
    layouts = [TYPE_LAYOUTS[t] for t in type_names]
    return IntLayout(max(lay.bits for lay in layouts), min(lay.group_size for lay in layouts),
                     _widest(lay.scales_dtype for lay in layouts), _widest(lay.mins_dtype for lay in layouts))


def gguf_linear_method(spec: GGUFSpec, checkpoint_names: list[str]):
    """The method of a layer made of the GGUF's weights checkpoint_names (Hugging Face names, q_proj, k_proj and
    v_proj of a qkv_proj): plain when they are all float tensors, else GGUFLinearMethod."""
    types = [spec.tensor_types.get(f"{name}.weight") for name in checkpoint_names]
    if None in types:
        missing = [name for name, t in zip(checkpoint_names, types) if t is None]
        raise ValueError(f"the GGUF has no tensor for {missing} (Hugging Face names)")
    if all(t in FLOAT_TYPES for t in types):
        return UnquantizedLinearMethod()
    if any(t in FLOAT_TYPES for t in types):
        parts = dict(zip(checkpoint_names, types))
        raise ValueError(f"the GGUF mixes float and quantized parts in one layer: {parts}; supported: all parts of "
                         f"a merged layer quantized, or all float")
    return GGUFLinearMethod(merged_layout(types))


class GGUFLinearMethod(QuantLinearMethod):
    """A layer whose parameters are the layout itself: the loader copies each GGUF part's qweight, scales and mins
    (widened to the layer's layout) into them, so nothing is repacked after loading."""

    def __init__(self, layout: IntLayout):
        super().__init__(QuantSpec("gguf", "int", layout.bits, layout.group_size, layout.mins_dtype is not None))
        self.layout = layout

    def create_weights(self, layer: nn.Module):
        lay, n, k = self.layout, layer.output_size, layer.input_size
        if k % lay.group_size:
            raise ValueError(f"a GGUF layer's input size {k} (per rank) is not a multiple of its block types' group "
                             f"size {lay.group_size}; use a tensor_parallel_size that keeps whole groups")
        layer.bits, layer.group_size, layer.block_size = lay.bits, lay.group_size, None
        per_word = 8 if lay.bits == 4 else 1
        layer.qweight = new_param((n, k // per_word), torch.int32 if lay.bits == 4 else torch.int8,
                                  ((0, "out", 1), (1, "in", per_word)))
        group_dims = ((0, "out", 1), (1, "in", lay.group_size))
        layer.scales = new_param((n, k // lay.group_size), lay.scales_dtype, group_dims)
        if lay.mins_dtype is None:
            layer.register_parameter("mins", None)
        else:
            layer.mins = new_param((n, k // lay.group_size), lay.mins_dtype, group_dims)
        layer.checkpoint_names = [name for name in ("qweight", "scales", "mins") if getattr(layer, name) is not None]

    def process_weights_after_loading(self, layer: nn.Module):
        pass  # the parameters are the layout already

    def layout_tensors(self, part: IntGroups) -> dict[str, torch.Tensor]:
        """One GGUF part widened to this layer's layout: parameter name -> full tensor (the loader shards it)."""
        lay = self.layout
        if part.group_size % lay.group_size or part.bits > lay.bits:
            raise ValueError(f"a part of {part.bits} bits in groups of {part.group_size} does not fit the layer's "
                             f"{lay.bits} bits in groups of {lay.group_size}")
        repeat = part.group_size // lay.group_size
        qweight = part.qweight if part.bits == lay.bits else unpack_int4(part.qweight).to(torch.int8)
        tensors = {"qweight": qweight,
                   "scales": _exact_cast(part.scales.repeat_interleave(repeat, dim=1), lay.scales_dtype)}
        if lay.mins_dtype is not None:
            mins = part.mins if part.mins is not None else torch.zeros_like(part.scales)
            tensors["mins"] = _exact_cast(mins.repeat_interleave(repeat, dim=1), lay.mins_dtype)
        return tensors


def _exact_cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    cast = values.to(dtype)
    if not torch.equal(cast.to(values.dtype), values):
        raise ValueError(f"{values.dtype} scales do not fit the layer's {dtype} exactly")
    return cast


def load_gguf_weights(model: nn.Module, path: str):
    """Every tensor of the GGUF into the model: quantized parts into their layer's layout (widened where a merged
    layer's parts differ, layers/quantization/gguf.py), float tensors as in load_weights. A quantized tensor whose
    parameter is plain (the embedding, an untied head) is dequantized, exactly in float32."""
    params = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules_mapping", {})
    loaded, shards = set(), {}
    try:
        reader = open_gguf(path)
        for (name, value), tensor in zip(iter_gguf_tensors(reader), reader.tensors):
            target, shard_id = _map_name(name, packed)
            layer_name = target.rpartition(".")[0]
            method = getattr(modules.get(layer_name), "quant_method", None)
            try:
                if isinstance(value, IntGroups) and isinstance(method, GGUFLinearMethod):
                    parts = {f"{layer_name}.{p}": t for p, t in method.layout_tensors(value).items()}
                else:
                    parts = {target: _dequantize(value) if isinstance(value, IntGroups) else value}
                for param_name, part in parts.items():
                    _load_part(params, param_name, part, shard_id)
            except ValueError as e:
                raise ValueError(f"GGUF {path!r}, tensor {tensor.name!r}: {e}") from None
            loaded.update(parts)
            if shard_id is not None:
                shards.setdefault(target, set()).add(shard_id)
    finally:
        close_gguf()
    check_all_loaded(model, params, loaded, shards, packed, f"GGUF {path!r}")
    process_weights_after_loading(model)  # no repacking for GGUF layers; the int8 vocabulary option


def _load_part(params: dict, name: str, tensor: torch.Tensor, shard_id):
    param = params.get(name)
    if param is None:
        raise ValueError(f"no parameter of the model takes it (as {name!r})")
    if shard_id is None:
        getattr(param, "weight_loader", _copy_whole)(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


def _dequantize(value: IntGroups) -> torch.Tensor:
    return dequantize_int(value.qweight, value.scales, value.mins, value.bits, value.group_size)
