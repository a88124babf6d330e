"""Small GGUF files for the tests, written with the gguf package's GGUFWriter: blocks made by gguf.quants.quantize
(Q4_0, Q4_1, Q8_0) or random bytes in ggml-common.h's block layout (every type, the K-quants included)."""
import gguf
import numpy as np

T = gguf.GGMLQuantizationType
# byte offsets of each block type's fp16 scale fields (ggml-common.h), and the spread given to them in random
# blocks: finite (the comparisons are of numbers, not NaN payloads) and small enough that a model's weights are
# about 0.05 (a K-quant weight is d * scale * q with 6-bit scales)
FP16_FIELDS = {"Q4_0": ((0, 1e-2),), "Q4_1": ((0, 1e-2), (2, 5e-2)), "Q8_0": ((0, 1e-3),),
               "Q4_K": ((0, 2e-4), (2, 2e-4)), "Q5_K": ((0, 1e-4), (2, 2e-4)), "Q6_K": ((208, 3e-5),)}
QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")  # the types gguf.quants.quantize writes


def random_blocks(type_name: str, num_rows: int, num_cols: int, rng) -> np.ndarray:
    """uint8 [num_rows, bytes per row] of random blocks with finite, small fp16 scales."""
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[getattr(T, type_name)]
    raw = rng.integers(0, 256, size=(num_rows * num_cols // block_size, block_bytes), dtype=np.uint8)
    for offset, spread in FP16_FIELDS[type_name]:
        scale = (rng.standard_normal((raw.shape[0], 1)) * spread).astype(np.float16)
        raw[:, offset:offset + 2] = scale.view(np.uint8)
    return raw.reshape(num_rows, -1)


def write_gguf(path: str, arch: str, tensors: dict, metadata: dict | None = None) -> str:
    """tensors: GGUF name -> (data, type name); metadata: GGUFWriter adder name -> value (add_head_count=4, ...)."""
    writer = gguf.GGUFWriter(path, arch)
    for adder, value in (metadata or {"add_head_count": 4, "add_head_count_kv": 2}).items():
        getattr(writer, adder)(value)
    for name, (data, type_name) in tensors.items():
        if type_name in ("F32", "F16"):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, data, raw_dtype=getattr(T, type_name))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: what llama.cpp does to the q/k rows of a llama GGUF."""
    return (weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def hf_order(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """The inverse of llama_cpp_permute."""
    return (weights.reshape(num_heads, weights.shape[0] // num_heads // 2, 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))
