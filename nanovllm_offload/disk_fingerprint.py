"""What makes a KV block's bytes what they are, as one 128-bit fingerprint (no torch).

A block's prefix-chain hash names its tokens; the fingerprint names everything else that decides its bytes: the
model (config.json and every byte of the weights), what the engine does with it (rope scaling, the quantization of
the weights), the compute dtype, the KV cache dtype and its scale layout, the block size, the layout (layers, KV
heads, head dim) and the tensor-parallel size and rank. The disk tier keeps one directory per fingerprint and
writes the fingerprint into every block file, so another model, dtype or layout never hits.

NOTE: a fine-tune may change a few rows of a few tensors, so no sample of the weights is safe: every byte is hashed
      (xxh3-128, streamed in chunks), once per file version. The digests are kept by (real path, size, mtime_ns) in
      a small JSON file (`WEIGHT_HASHES_FILE` under kv_disk_path), so a restart hashes nothing.
"""
import dataclasses
import json
import logging
import os

import xxhash

from nanovllm_offload.disk_space import write_json_atomically

LAYOUT = "block-major: (num_layers, 2, block_size, num_kv_heads, head_dim)"
WEIGHT_HASHES_FILE = "weight_hashes.json"  # under kv_disk_path; no scan or `cache clear` touches it
HASH_CHUNK_BYTES = 8 << 20  # large reads: hashing runs at the file's read speed
logger = logging.getLogger(__name__)


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


def kv_fingerprint(model: str, *, dtype: str, kv_cache_dtype: str, block_size: int, num_layers: int,
                   num_kv_heads: int, head_dim: int, tp_size: int, tp_rank: int, block_bytes: int,
                   kv_scale_layout: str | None = None, layout: str = LAYOUT, load_format: str = "auto",
                   seed: int = 0, model_options: dict | None = None, hash_cache_path: str | None = None) -> Fingerprint:
    """The fingerprint of one rank's KV blocks. `layout` and `kv_scale_layout` describe how a block's bytes are
    arranged (an FP8 block is values and per-token-head scales per (layer, K or V), K Hadamard-rotated: another
    arrangement must get another string). `load_format="dummy"` weights are random from `seed`, so the seed stands
    in for the weights. `model_options`: what else decides the KV from the same files (rope scaling, the weights'
    quantization), as plain JSON data. `hash_cache_path`: the file that keeps the weights' digests (None: none)."""
    identity = {
        "model_identity": model_identity(model, include_weights=load_format != "dummy",
                                         hash_cache_path=hash_cache_path),
        "dummy_weights_seed": seed if load_format == "dummy" else None,
        "model_options": model_options or {},
        "dtype": dtype, "kv_cache_dtype": kv_cache_dtype, "kv_scale_layout": kv_scale_layout,
        "block_size": block_size, "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
        "tp_size": tp_size, "tp_rank": tp_rank, "layout": layout,
    }
    return make_fingerprint(identity, block_bytes, info={"model_name": os.path.basename(os.path.normpath(model)),
                                                        "model_path": os.path.abspath(model)})


def model_identity(model: str, include_weights: bool = True, hash_cache_path: str | None = None) -> str:
    """xxh3-128 hex of a model directory's config.json and, per weight file, its name, size and the xxh3-128 of all
    its bytes. The weight files are a directory's *.safetensors, or the model path itself when it is one file (a
    GGUF file carries its config too, so it is hashed even with include_weights=False). Moving or copying the model
    keeps its identity; a checkpoint that differs in one byte gets another."""
    h = xxhash.xxh3_128()
    is_dir = os.path.isdir(model)
    if is_dir:
        with open(os.path.join(model, "config.json"), "rb") as f:
            h.update(f.read())
    if not is_dir:
        paths = [model]
    elif include_weights:
        paths = sorted(os.path.join(model, n) for n in os.listdir(model) if n.endswith(".safetensors"))
    else:
        paths = []
    cache = WeightHashCache(hash_cache_path)
    for path in paths:
        if is_dir:  # a shard's name orders the directory's files; a single file's own name is only its place
            h.update(os.path.basename(path).encode() + b"\0")
        h.update(str(os.path.getsize(path)).encode() + b"\0")
        h.update(cache.digest(path))
    cache.save()
    return h.hexdigest()


def file_digest(path: str) -> bytes:
    """xxh3-128 of every byte of a file, read in HASH_CHUNK_BYTES chunks into one buffer."""
    h = xxhash.xxh3_128()
    buffer = bytearray(HASH_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while True:
            num_read = f.readinto(buffer)
            if not num_read:
                return h.digest()
            h.update(view[:num_read])


class WeightHashCache:
    """File digests by real path, valid while the file's size and mtime_ns stay the same: one JSON file of
    {real path: {"size", "mtime_ns", "xxh3_128"}}. An unreadable file is an empty cache, and a cache that cannot be
    written is only slower next time (both said in the log). Rewritten whole, by rename, when anything changed."""

    def __init__(self, path: str | None):
        self.path = path
        self.entries: dict[str, dict] = self._load() if path is not None else {}
        self.is_changed = False

    def digest(self, file_path: str) -> bytes:
        real = os.path.realpath(file_path)
        st = os.stat(real)
        entry = self.entries.get(real)
        if entry is not None and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
            try:
                return bytes.fromhex(entry["xxh3_128"])
            except (KeyError, TypeError, ValueError):
                pass  # a damaged entry: hashed again
        digest = file_digest(real)
        self.entries[real] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "xxh3_128": digest.hex()}
        self.is_changed = True
        return digest

    def save(self):
        if self.path is not None and self.is_changed:
            write_json_atomically(self.path, self.entries, "the next start hashes the weights again")

    def _load(self) -> dict:
        try:
            with open(self.path) as f:
                entries = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            logger.warning("disk tier: %s is unreadable (%s): the weights are hashed again", self.path, error)
            return {}
        return entries if isinstance(entries, dict) else {}
