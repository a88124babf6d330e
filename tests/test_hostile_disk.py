"""Hostile conditions for the disk tier (nanovllm_offload/disk_*.py): a file system that fills up, a directory
that cannot be written or is cleared under a running engine, and checkpoints that differ in one byte.

A full file system is a stand-in (no mount rights needed): `FakeFileSystem` makes every write under a directory
fail with ENOSPC once the files there, plus what "another program" wrote, pass a limit, and reports the free space
that is left, as statvfs would.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct

import numpy as np
import pytest

from conftest import greedy, random_prompts, tiny_llm_kwargs
from nanovllm_offload import disk_format, disk_space
from nanovllm_offload.disk_admin import clear, list_fingerprints
from nanovllm_offload.disk_fingerprint import make_fingerprint, model_identity
from nanovllm_offload.disk_format import HEADER_BYTES
from nanovllm_offload.disk_store import DiskStore

BLOCK_BYTES = 1024
FILE_BYTES = HEADER_BYTES + BLOCK_BYTES
FP = make_fingerprint({"model": "hostile", "dtype": "bfloat16"}, BLOCK_BYTES)


class FakeFileSystem:
    """A file system of `limit_bytes` under `root`: the files there plus `other_bytes` (another program's) count as
    used; a write past the limit raises ENOSPC after writing nothing, as a full disk does."""

    def __init__(self, root: str, limit_bytes: int, monkeypatch):
        self.root, self.limit_bytes, self.other_bytes = root, limit_bytes, 0
        real_write_all = disk_format._write_all

        def write_all(fd, data):
            if self.used_bytes() + len(memoryview(data).cast("B")) > self.limit_bytes:
                raise OSError(errno.ENOSPC, "No space left on device")
            real_write_all(fd, data)
        monkeypatch.setattr(disk_format, "_write_all", write_all)
        monkeypatch.setattr(disk_space, "free_disk_bytes", lambda path: max(0, self.limit_bytes - self.used_bytes()))

    def used_bytes(self) -> int:
        """The files' sizes now. The I/O threads rename and evict files while this walks: one that is gone before
        its size is read counts as nothing (its ENOENT used to fail the write that asked, without a retry)."""
        return self.other_bytes + sum(_size_or_zero(os.path.join(d, f)) for d, _, files in os.walk(self.root)
                                      for f in files)


def _size_or_zero(path: str) -> int:
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def block_bytes_for(block_hash: int) -> np.ndarray:
    return np.random.default_rng(block_hash).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)


def write_one_at_a_time(store: DiskStore, block_hashes) -> list:
    finished = []
    for h in block_hashes:
        assert store.write_async(h, block_bytes_for(h)) is not None
        assert store.wait_idle(10)
        finished += store.poll()
    return finished


def read_back(store: DiskStore, block_hashes) -> list[bool]:
    """Whether each block reads back whole with its own bytes."""
    buffers = [np.zeros(BLOCK_BYTES, np.uint8) for _ in block_hashes]
    handle = store.read_async(list(block_hashes), buffers)
    assert store.wait_idle(10)
    store.poll()
    return [s is disk_format.ReadStatus.OK and (b == block_bytes_for(h)).all()
            for s, b, h in zip(handle.statuses, buffers, block_hashes)]


# ------------------------------------------------------------------------------------------------ a full disk

def test_a_cap_larger_than_the_file_system_is_lowered_at_start(tmp_path, monkeypatch, caplog):
    """kv_disk_gib defaults to 64 GiB, more than a laptop often has free: the cap comes down to what fits (the
    tier's files + the free space, less the room of the writes in flight), with one warning naming kv_disk_gib."""
    FakeFileSystem(str(tmp_path), 30 * FILE_BYTES, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="nanovllm_offload.disk_store"):
        store = DiskStore(str(tmp_path), FP, 100 * FILE_BYTES)
    meta_bytes = os.path.getsize(tmp_path / FP.hex / "meta.json")
    assert store.stats()["disk_capacity_bytes"] == 30 * FILE_BYTES - meta_bytes - 2 * FILE_BYTES
    assert [r.getMessage() for r in caplog.records if "kv_disk_gib is more than" in r.getMessage()], caplog.text
    store.close()


def test_a_disk_that_fills_up_evicts_old_blocks_and_keeps_storing_new_ones(tmp_path, monkeypatch, caplog):
    """Another program fills the file system after start: each write that meets ENOSPC evicts the least recently
    used blocks and tries again, the cap comes down to what the disk holds (said once), every error is counted, and
    new blocks keep being stored (they used to fail quietly, for good)."""
    fs = FakeFileSystem(str(tmp_path), 40 * FILE_BYTES, monkeypatch)
    store = DiskStore(str(tmp_path), FP, 30 * FILE_BYTES)
    old = list(range(1, 11))
    assert all(w.is_ok for w in write_one_at_a_time(store, old)) and store.stats()["disk_write_errors"] == 0
    fs.other_bytes = fs.limit_bytes - fs.used_bytes()  # the disk is full now
    new = list(range(100, 120))
    with caplog.at_level(logging.WARNING, logger="nanovllm_offload.disk_store"):
        writes = write_one_at_a_time(store, new)
    assert all(w.is_ok for w in writes), [w.block_hash for w in writes if not w.is_ok]
    stats = store.stats()
    assert stats["blocks_written_to_disk"] == len(old) + len(new)
    assert stats["disk_write_errors"] >= 1 and stats["blocks_evicted_from_disk"] >= len(old)
    assert stats["disk_capacity_bytes"] < 30 * FILE_BYTES
    assert all(read_back(store, new[-5:]))  # the newest are stored whole
    assert not any(store.contains(h) for h in old)  # the oldest made room
    warnings = [r.getMessage() for r in caplog.records if "the file system is full" in r.getMessage()]
    assert len(warnings) == 1 and "cap lowered" in warnings[0], caplog.text
    assert fs.used_bytes() <= fs.limit_bytes
    store.close()


def test_an_engine_on_a_full_disk_keeps_storing_and_reports_its_errors(qwen3_dir, tmp_path, monkeypatch):
    """The engine's stats() (and so /metrics) carry disk_write_errors; blocks keep reaching the disk."""
    from nanovllm import LLM
    path = str(tmp_path / "kv")
    kwargs = tiny_llm_kwargs(swap_space=0.01, host_cache_policy="write_through", kv_disk_path=path)
    with LLM(qwen3_dir, **kwargs) as llm:
        file_bytes = HEADER_BYTES + llm.block_bytes
        fs = FakeFileSystem(path, 30 * file_bytes, monkeypatch)
        fs.other_bytes = 10 * file_bytes
        for seed in range(4):  # 4 x 3 prompts x 8 full blocks: more than the 20 files the disk has room for
            llm.generate(random_prompts((33, 33, 33), seed=100 + seed), greedy(2), use_tqdm=False)
            llm.host_tier.settle(llm.runner.copy_engine)
        stats = llm.stats()
    assert stats["disk_write_errors"] >= 1, stats
    # two writes in flight can each take the room the other made: one may still fail after its retries (counted)
    assert stats["blocks_written_to_disk"] >= 4 * 3 * 8 - 2, stats
    assert stats["blocks_evicted_from_disk"] >= 4 * 3 * 8 - 20, stats
    assert fs.used_bytes() <= fs.limit_bytes


# ------------------------------------------------------------------------------------------------ the directory

def test_a_kv_disk_path_that_cannot_be_written_is_a_value_error_before_the_weights_load(qwen3_dir, monkeypatch):
    """/sys refuses new files even to root. The error names the option, and comes before the weights load (it
    was a bare OSError after the KV was allocated)."""
    from nanovllm import LLM
    from nanovllm.engine import executor
    if not os.path.isdir("/sys"):
        pytest.skip("needs Linux's /sys")

    def no_weights(*args, **kwargs):
        raise AssertionError("the weights were loaded before kv_disk_path was checked")
    monkeypatch.setattr(executor, "ModelRunner", no_weights)
    with pytest.raises(ValueError, match=r"kv_disk_path='/sys' cannot be written \(.*\); pass a writable directory"):
        LLM(qwen3_dir, **tiny_llm_kwargs(swap_space=0.01, kv_disk_path="/sys"))


def test_a_failed_metadata_write_leaves_no_temporary_file(tmp_path, monkeypatch, caplog):
    """The disk is full when meta.json is written: the temporary file is removed (no scan would ever find it in
    the fingerprint directory), and the store still opens (its blocks do not need the metadata)."""
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_space.json, "dump", disk_full)
    with caplog.at_level(logging.WARNING, logger="nanovllm_offload.disk_space"):
        store = DiskStore(str(tmp_path), FP, 10 * FILE_BYTES)
    assert os.listdir(tmp_path / FP.hex) == [], os.listdir(tmp_path / FP.hex)
    assert "could not write" in caplog.text
    store.close()


def test_cache_clear_under_a_running_engine_writes_the_metadata_again(tmp_path):
    """`nanovllm cache clear` removes the fingerprint directory; the next write makes it again, with meta.json, so
    `cache ls` still names the model (it showed '?')."""
    store = DiskStore(str(tmp_path), FP, 10 * FILE_BYTES)
    write_one_at_a_time(store, [1])
    assert [i.fingerprint for i in clear(str(tmp_path))] == [FP.hex]
    write_one_at_a_time(store, [2])
    (info,) = list_fingerprints(str(tmp_path))
    assert info.meta.get("model") == "hostile" and info.num_blocks == 1, info
    with open(tmp_path / FP.hex / "meta.json") as f:
        assert json.load(f)["fingerprint"] == FP.hex
    store.close()


def test_a_disk_full_of_other_files_is_tried_three_times_and_leaves_nothing(tmp_path, monkeypatch):
    """Nothing of the tier's to evict: the write fails after a retry and a lowered cap, three errors counted."""
    fs = FakeFileSystem(str(tmp_path), 8 * FILE_BYTES, monkeypatch)
    store = DiskStore(str(tmp_path), FP, 100 * FILE_BYTES)
    fs.other_bytes = fs.limit_bytes  # nothing fits, and nothing of ours to evict
    (write,) = write_one_at_a_time(store, [7])
    assert not write.is_ok and store.stats()["disk_write_errors"] == 3  # tried, evicted, lowered the cap, tried
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    assert leftovers == []
    store.close()
    shutil.rmtree(tmp_path / FP.hex)


# ------------------------------------------------------------------------------------------------ the fingerprint

def tensor_spans(path: str) -> dict[str, tuple[int, int]]:
    """Each tensor's (start, end) file offsets in a safetensors file."""
    with open(path, "rb") as f:
        (header_bytes,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_bytes))
    return {name: (8 + header_bytes + v["data_offsets"][0], 8 + header_bytes + v["data_offsets"][1])
            for name, v in header.items() if name != "__metadata__"}


def flip_byte(path: str, offset: int):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))


def copy_with_one_byte_changed(src: str, dst: str, tensor: str, offset_in_tensor: int) -> str:
    shutil.copytree(src, dst)
    weights = os.path.join(dst, "model.safetensors")
    start, end = tensor_spans(weights)[tensor]
    flip_byte(weights, start + offset_in_tensor if offset_in_tensor >= 0 else end + offset_in_tensor)
    return dst


K_PROJ_0 = "model.layers.0.self_attn.k_proj.weight"


def test_a_checkpoint_that_differs_in_one_byte_anywhere_has_another_identity(qwen3_dir, tmp_path):
    """Past the first 4 KiB of a tensor (the old sample), in its last byte, in the file's last tensor: every byte
    counts."""
    spans = tensor_spans(os.path.join(qwen3_dir, "model.safetensors"))
    last_tensor = max(spans, key=lambda name: spans[name][1])
    changes = {"k_proj past 4 KiB": (K_PROJ_0, 4096 + 100), "k_proj's last byte": (K_PROJ_0, -1),
               "the file's last byte": (last_tensor, -1)}
    identities = {"original": model_identity(qwen3_dir)}
    for i, (what, (tensor, offset)) in enumerate(changes.items()):
        copy = copy_with_one_byte_changed(qwen3_dir, str(tmp_path / f"m{i}"), tensor, offset)
        identities[what] = model_identity(copy)
    assert len(set(identities.values())) == len(identities), identities
    assert model_identity(str(shutil.copytree(qwen3_dir, tmp_path / "same"))) == identities["original"]


def test_the_weights_are_hashed_once_per_file_version(qwen3_dir, tmp_path, monkeypatch):
    """The digests are kept by (real path, size, mtime_ns): a restart reads no weights, a changed file is hashed
    again, and a damaged cache file only costs a new hash."""
    from nanovllm_offload import disk_fingerprint
    model = shutil.copytree(qwen3_dir, tmp_path / "m")
    cache_path = str(tmp_path / "weight_hashes.json")
    hashed = []
    real_digest = disk_fingerprint.file_digest
    monkeypatch.setattr(disk_fingerprint, "file_digest", lambda path: hashed.append(path) or real_digest(path))
    first = model_identity(str(model), hash_cache_path=cache_path)
    assert model_identity(str(model), hash_cache_path=cache_path) == first and len(hashed) == 1
    flip_byte(str(model / "model.safetensors"), tensor_spans(str(model / "model.safetensors"))[K_PROJ_0][0] + 5000)
    changed = model_identity(str(model), hash_cache_path=cache_path)
    assert changed != first and len(hashed) == 2
    with open(cache_path, "w") as f:
        f.write("{not json")
    assert model_identity(str(model), hash_cache_path=cache_path) == changed and len(hashed) == 3
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_a_single_weights_file_is_hashed_whole(tmp_path):
    """A model given as one file (a GGUF checkpoint): its bytes are the identity."""
    path = tmp_path / "model.gguf"
    path.write_bytes(bytes(range(256)) * 100)
    first = model_identity(str(path))
    flip_byte(str(path), 20_000)
    assert model_identity(str(path)) != first


def test_two_checkpoints_one_byte_apart_share_no_disk_blocks(qwen3_dir, tmp_path):
    """The original stores a prompt's blocks; a copy whose layer-0 k_proj differs in one byte past its first 4 KiB
    (it had the same fingerprint, loaded the original's KV as hits and gave wrong tokens) finds none of them."""
    from nanovllm import LLM
    path = str(tmp_path / "kv")
    tuned = copy_with_one_byte_changed(qwen3_dir, str(tmp_path / "tuned"), K_PROJ_0, 4096 + 100)
    prompt = random_prompts((41,), seed=90)
    kwargs = tiny_llm_kwargs(swap_space=0.01, host_cache_policy="write_through", kv_disk_path=path)
    with LLM(qwen3_dir, **kwargs) as llm:
        llm.generate(prompt, greedy(2), use_tqdm=False)
        llm.host_tier.settle(llm.runner.copy_engine)
        assert llm.stats()["blocks_written_to_disk"] == 10
    with LLM(tuned, **kwargs) as llm:
        llm.generate(prompt, greedy(2), use_tqdm=False)
        assert llm.stats()["disk_hit_tokens"] == 0, llm.stats()
    with LLM(qwen3_dir, **kwargs) as llm:  # the original still hits its own blocks
        llm.generate(prompt, greedy(2), use_tqdm=False)
        assert llm.stats()["disk_hit_tokens"] == 40, llm.stats()
    assert len(list_fingerprints(path)) == 2
