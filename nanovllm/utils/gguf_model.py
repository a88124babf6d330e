"""A GGUF file as a model: how the engine recognizes one, its Hugging Face config and tokenizer (both read from the
file's own metadata through transformers' GGUF support: no hub, nothing beside the file is needed), its tensors'
Hugging Face names, and its quantization (each weight's block type: a Q4_K_M file mixes Q4_K and Q6_K).

Torch-free: Config imports it. The weights are read by nanovllm/utils/gguf_loader.py.
"""
import contextlib
import copy
import functools
import os
from dataclasses import dataclass

GGUF_MAGIC = b"GGUF"
# transformers' model_type of a GGUF's config -> the architecture name Config checks (SUPPORTED_ARCHITECTURES)
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# tensor name inside a block (blk.N.<name>) -> the Hugging Face module under model.layers.N
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # kept quantized (gguf_blocks.py)
FLOAT_TYPES = ("F32", "F16", "BF16")  # loaded as plain weights


@dataclass
class GGUFSpec:
    """A GGUF's quantization, Config.quant_spec for a GGUF model: each weight's own block type. The linear layers
    take their layout from it (layers/quantization/gguf.py)."""
    tensor_types: dict[str, str]  # Hugging Face weight name -> GGUF type name (Q4_K, F32, ...)
    method: str = "gguf"
    kind: str = "int"


def is_gguf_file(path) -> bool:
    """A file that starts with GGUF's magic bytes (vLLM takes a .gguf path the same way)."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def file_version(path: str) -> tuple[str, int, int]:
    """(absolute path, mtime in ns, size): the key of what is kept from a file, so a rewritten file is read again."""
    stat = os.stat(path)
    return os.path.abspath(path), stat.st_mtime_ns, stat.st_size


def load_gguf_config(path: str):
    """The Hugging Face config that transformers builds from the GGUF's metadata. A copy of the last file's: `nanovllm
    generate` builds a Config to check its options and the engine another, and each build from the file reads every
    metadata value again (the vocabulary too: 0.3 CPU-s for SmolLM2)."""
    import importlib.util
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"model={path!r} is a GGUF file, and reading one needs the gguf package: pip install gguf "
                         f"(or the project's [convert] extra)")
    return copy.deepcopy(_gguf_config(*file_version(path)))


@functools.lru_cache(maxsize=1)
def _gguf_config(path: str, mtime_ns: int, size: int):
    from transformers import AutoConfig
    directory, name = os.path.split(path)
    try:
        with transformers_reads_the_kept_reader(path):
            return AutoConfig.from_pretrained(directory, gguf_file=name)
    except (ValueError, KeyError) as e:  # transformers' words for an architecture it cannot read from a GGUF
        raise ValueError(f"model={path!r}: transformers cannot read this GGUF's config ({e}); supported GGUF "
                         f"architectures: {sorted(GGUF_ARCHITECTURES)}") from None


def gguf_architecture(path: str, hf_config) -> str:
    """The architecture name of a GGUF's config; ValueError naming it when the engine does not run it."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in GGUF_ARCHITECTURES:
        raise ValueError(f"model={path!r} is a GGUF of architecture {model_type!r}; supported GGUF architectures: "
                         f"{sorted(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[model_type]


def load_gguf_tokenizer(path: str):
    """The tokenizer (with its chat template) that transformers builds from the GGUF's metadata; None when the file
    has none (then prompts are token ids, as for a directory without tokenizer files). A copy of the last file's:
    `nanovllm generate` tokenizes its prompts before the engine loads its own, and a build from the file reads the
    vocabulary again (0.55 CPU-s for SmolLM2; a copy 0.09)."""
    return copy.deepcopy(_gguf_tokenizer(*file_version(path)))


@functools.lru_cache(maxsize=1)
def _gguf_tokenizer(path: str, mtime_ns: int, size: int):
    if "tokenizer.ggml.model" not in open_gguf(path).fields:
        return None
    from transformers import AutoTokenizer
    directory, name = os.path.split(path)
    with transformers_reads_the_kept_reader(path):
        return AutoTokenizer.from_pretrained(directory, gguf_file=name)


@contextlib.contextmanager
def transformers_reads_the_kept_reader(path: str):
    """transformers' GGUF support opens its own GGUFReader (`from gguf import GGUFReader` inside the call) for the
    config, and again for the tokenizer; each parse of SmolLM2's metadata costs about 6 s of CPU (49,152 tokens and
    48,900 merges read string by string). Inside this block a GGUFReader of `path` is the one open_gguf keeps, so
    an engine parses its file once. Read-only use: transformers reads the fields, and the tensors only to load
    weights, which the engine does not ask of it. NOTE: not thread-safe (it swaps a module attribute); an engine
    is built on one thread."""
    import gguf
    kept_path, kept_reader = os.path.abspath(path), open_gguf(path)  # parsed (or kept) before the swap
    real_reader = gguf.GGUFReader

    def reader(file_path, *args, **kwargs):
        if os.path.abspath(file_path) == kept_path and not args and not kwargs:
            return kept_reader
        return real_reader(file_path, *args, **kwargs)
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real_reader


@functools.lru_cache(maxsize=1)
def _reader(path: str, mtime_ns: int, size: int):
    try:
        return _plain_array_reader()(path)
    except (ValueError, IndexError, KeyError) as e:  # numpy's words for a tensor past the end of the file
        raise ValueError(f"GGUF file {path!r} is truncated or corrupt ({e})") from None


@functools.cache
def _plain_array_reader():
    """GGUFReader over a plain ndarray view of its np.memmap: the parse slices the map once per value (2.7 million
    slices for SmolLM2's vocabulary and merges), and a memmap's slice runs np.memmap's Python __array_finalize__
    each time; a plain view's does not (2.0 -> 0.7 CPU-s a parse). The same bytes, still mapped, read when used."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself, never the swapped name (above)

    class PlainArrayReader(GGUFReader):
        @property
        def data(self):
            return self._mapped

        @data.setter
        def data(self, mapped):  # GGUFReader.__init__ assigns its np.memmap here
            self._mapped = np.asarray(mapped)
    return PlainArrayReader


def open_gguf(path: str):
    """A GGUFReader over the file (memory-mapped: a tensor is read when used). Parsing the metadata takes seconds
    (the vocabulary is read string by string), so the last file's reader is kept: Config reads the tensor types,
    the loader the tensors, from one parse; `close_gguf` lets it go. ValueError naming the file when it is shorter
    than its tensors need or otherwise unreadable."""
    return _reader(*file_version(path))


def close_gguf():
    """Drops the kept reader (and with it the file's mapping) once the weights are loaded."""
    _reader.cache_clear()


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name; None when the engine has no such weight."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{parts[1]}.{LAYER_NAMES[parts[2]]}.{suffix}"
    if base in TOP_NAMES:
        return f"{TOP_NAMES[base]}.{suffix}"
    return None


def gguf_tensor_types(reader) -> dict[str, str]:
    """Hugging Face name -> GGUF type name of every tensor; ValueError naming a tensor that no weight of the engine
    takes, or a type it cannot read, before any tensor is read."""
    types = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no weight in the engine's model (known: "
                             f"{sorted(TOP_NAMES)} and blk.N.{{{', '.join(LAYER_NAMES)}}})")
        type_name = tensor.tensor_type.name
        if type_name not in QUANTIZED_TYPES + FLOAT_TYPES:
            raise ValueError(f"GGUF tensor {tensor.name!r} has type {type_name}; supported: "
                             f"{list(QUANTIZED_TYPES + FLOAT_TYPES)}")
        types[name] = type_name
    return types


def gguf_quant_spec(path: str, option: str | None) -> GGUFSpec:
    """Config.quant_spec of a GGUF model. `option` is Config.quantization: None, "auto" or "gguf" (vLLM's name)."""
    if option not in (None, "auto", "gguf"):
        raise ValueError(f"quantization={option!r} does not match model={path!r}, a GGUF file; pass None, 'auto' "
                         f"or 'gguf'")
    return GGUFSpec(gguf_tensor_types(open_gguf(path)))
