"""What makes a KV block's bytes what they are, as one 128-bit fingerprint (no torch).

A block's prefix-chain hash names its tokens; the fingerprint names everything else that decides its bytes: the
model (config.json and the weights), the compute dtype, the KV cache dtype and its scale layout, the block size,
the layout (layers, KV heads, head dim) and the tensor-parallel size and rank. The disk tier keeps one directory
per fingerprint and writes the fingerprint into every block file, so another model, dtype or layout never hits.
"""
import dataclasses
import json
import os
import struct

import xxhash

# Bytes of each weight tensor that go into the model's identity. Fine-tuning (LoRA merges included) changes every
# element of the tensors it touches, so the first bytes of each tensor tell two checkpoints of one architecture
# apart, at the cost of a few hundred small reads instead of hashing gigabytes at every start.
SAMPLE_BYTES_PER_TENSOR = 4096
# a GGUF file (one file, no config.json): its header is hashed whole up to this size, its data sampled
GGUF_HEADER_BYTES, GGUF_SAMPLES = 8 << 20, 256
LAYOUT = "block-major: (num_layers, 2, block_size, num_kv_heads, head_dim)"


@dataclasses.dataclass(frozen=True, slots=True)
class Fingerprint:
    """digest: 16 bytes (xxh3-128 of `meta` as canonical JSON); meta: what went into it, human-readable, saved as
    meta.json next to the blocks; block_bytes: the payload of one block file (fixed per fingerprint)."""
    digest: bytes
    meta: dict
    block_bytes: int

    @property
    def hex(self) -> str:
        return self.digest.hex()


def make_fingerprint(identity: dict, block_bytes: int, info: dict | None = None) -> Fingerprint:
    """identity: what decides the bytes (hashed); info: what only helps a person (shown by ls, not hashed)."""
    identity = dict(identity, block_bytes=block_bytes, layout=identity.get("layout", LAYOUT))
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    return Fingerprint(xxhash.xxh3_128_digest(canonical), dict(identity, **(info or {})), block_bytes)


def kv_fingerprint(model_dir: str, *, dtype: str, kv_cache_dtype: str, block_size: int, num_layers: int,
                   num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int, block_bytes: int,
                   kv_scale_layout: str | None = None, layout: str = LAYOUT, load_format: str = "auto",
                   seed: int = 0) -> Fingerprint:
    """The fingerprint of one rank's KV blocks. `layout` and `kv_scale_layout` describe how a block's bytes are
    arranged (an FP8 block is values and per-token-head scales per (layer, K or V), K Hadamard-rotated: another
    arrangement must get another string). `load_format="dummy"` weights are random from `seed`, so the seed stands
    in for the weights."""
    identity = {
        "model_identity": model_identity(model_dir, include_weights=load_format != "dummy"),
        "dummy_weights_seed": seed if load_format == "dummy" else None,
        "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "kv_scale_layout": kv_scale_layout,
        "block_size": block_size, "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "tp_size": tp_size, "tp_rank": tp_rank, "layout": layout,
    }
    return make_fingerprint(identity, block_bytes, info={"model_name": os.path.basename(os.path.normpath(model_dir)),
                                                        "model_path": os.path.abspath(model_dir)})


def model_identity(model_dir: str, include_weights: bool = True) -> str:
    """xxh3-128 hex of config.json and, per *.safetensors file: its name, size, header (tensor names, dtypes,
    shapes, offsets) and the first SAMPLE_BYTES_PER_TENSOR bytes of every tensor. Moving or copying the model
    keeps its identity; another checkpoint of the same architecture gets another."""
    h = xxhash.xxh3_128()
    if os.path.isfile(model_dir):  # a GGUF file: its config and tensor table are in its header
        _hash_file(model_dir, h, include_weights)
        return h.hexdigest()
    with open(os.path.join(model_dir, "config.json"), "rb") as f:
        h.update(f.read())
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors")) if include_weights else []
    for name in names:
        h.update(name.encode() + b"\0")
        _hash_safetensors(os.path.join(model_dir, name), h)
    return h.hexdigest()


def _hash_file(path: str, h, include_weights: bool):
    """A single-file model (GGUF): its size, its first GGUF_HEADER_BYTES (the metadata and the tensor table, for the
    usual vocabularies) and, with the weights, SAMPLE_BYTES_PER_TENSOR at GGUF_SAMPLES evenly spaced offsets."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(struct.pack("<Q", size))
        h.update(f.read(GGUF_HEADER_BYTES))
        for i in range(GGUF_SAMPLES if include_weights else 0):
            f.seek(size * i // GGUF_SAMPLES)
            h.update(f.read(SAMPLE_BYTES_PER_TENSOR))


def _hash_safetensors(path: str, h):
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        h.update(struct.pack("<Q", size))
        prefix = f.read(8)
        if len(prefix) < 8:
            return
        (header_bytes,) = struct.unpack("<Q", prefix)
        header_raw = f.read(min(header_bytes, size))
        h.update(header_raw)
        try:
            header = json.loads(header_raw)
        except ValueError:
            return  # not a readable safetensors file: its bytes so far still count
        data_start = 8 + header_bytes
        offsets = sorted(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
        for offset in offsets:
            f.seek(data_start + offset)
            h.update(f.read(SAMPLE_BYTES_PER_TENSOR))
