"""Reads a GGUF file's tensors under their Hugging Face names, quantized ones kept in the engine's "int" layout
(layers/quantization/gguf.py loads them into the model).

- names: llama.cpp's (blk.N.attn_q.weight) -> Hugging Face's (model.layers.N.self_attn.q_proj.weight);
- order: llama.cpp stores the q and k rows of a "llama" GGUF permuted for its rope (convert_hf_to_gguf.py's
  `permute`); they are put back in Hugging Face's order, as transformers does. Rows move whole, so a quantized row's
  blocks move with it: the result is exact;
- values: F32, F16 and BF16 tensors come as torch tensors of that dtype; Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K
  tensors as IntGroups (gguf_blocks.py) with the codes and scales of the file, nothing rounded.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from nanovllm.utils.gguf_blocks import IntGroups, unpack_blocks
from nanovllm.utils.gguf_model import hf_name

FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# GGUF architectures whose q/k rows llama.cpp permuted (transformers' LlamaConverter undoes the same ones)
PERMUTED_ARCHITECTURES = ("llama", "mistral")


def iter_gguf_tensors(reader) -> Iterator[tuple[str, torch.Tensor | IntGroups]]:
    """(Hugging Face name, tensor or IntGroups) for every tensor of the file, q/k rows in Hugging Face's order."""
    head_counts = _permuted_head_counts(reader)
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        rows = _check_size(tensor)
        if head_counts:
            rows = _unpermute_qk(name, rows, *head_counts)
        type_name = tensor.tensor_type.name
        if type_name in FLOAT_DTYPES:
            yield name, _float_tensor(rows, type_name)
            continue
        try:
            groups = unpack_blocks(rows, type_name)
        except ValueError as e:  # a quantized tensor that is no whole blocks of rows (a 1-D one, say)
            raise ValueError(f"tensor {tensor.name!r}: {e}") from None
        yield name, groups


def _permuted_head_counts(reader) -> tuple[int, int] | None:
    """(query heads, kv heads) from the file's metadata when llama.cpp permuted its q/k rows, else None."""
    architecture = str(reader.fields["general.architecture"].contents())
    if architecture not in PERMUTED_ARCHITECTURES:
        return None
    num_heads = int(reader.fields[f"{architecture}.attention.head_count"].contents())
    kv_field = reader.fields.get(f"{architecture}.attention.head_count_kv")
    return num_heads, int(kv_field.contents()) if kv_field is not None else num_heads


def _check_size(tensor) -> np.ndarray:
    """The tensor's data as rows ([N, bytes or values per row], or [N] for a vector); ValueError naming a tensor
    whose bytes do not match its shape (a truncated file)."""
    from gguf import GGML_QUANT_SIZES
    block_size, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    expected = int(tensor.n_elements) // block_size * block_bytes
    if tensor.data.nbytes != expected or int(tensor.n_elements) % block_size:
        raise ValueError(f"GGUF tensor {tensor.name!r}: {tensor.data.nbytes} bytes, but shape "
                         f"{list(tensor.shape)} of {tensor.tensor_type.name} needs {expected}")
    return tensor.data


def _float_tensor(rows: np.ndarray, type_name: str) -> torch.Tensor:
    if type_name == "BF16":  # numpy has no bfloat16: the file's uint8 pairs are its bits
        return torch.from_numpy(np.ascontiguousarray(rows).view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.array(rows))


def _unpermute_qk(name: str, rows: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """Rows of q_proj/k_proj (weight or bias) back in Hugging Face's order: llama.cpp stored, per head, the rows of
    the first rope half and the second interleaved (row 2i is HF's row i, row 2i + 1 is HF's row half + i)."""
    if ".self_attn.q_proj." in name:
        heads = num_heads
    elif ".self_attn.k_proj." in name:
        heads = num_kv_heads
    else:
        return rows
    half = rows.shape[0] // heads // 2
    return np.ascontiguousarray(rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape))

