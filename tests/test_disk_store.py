"""The disk tier's files and metadata (nanovllm_offload.disk_*): CPU only, no torch, exact."""
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from nanovllm_offload import disk_format
from nanovllm_offload.disk_admin import clear, format_listing, list_fingerprints
from nanovllm_offload.disk_fingerprint import kv_fingerprint, make_fingerprint, model_identity
from nanovllm_offload.disk_format import HEADER_BYTES, ReadStatus, remove_if_same_file
from nanovllm_offload.disk_index import block_path
from nanovllm_offload.disk_store import DiskRead, DiskStore, DiskWrite

BLOCK_BYTES = 1024
FILE_BYTES = HEADER_BYTES + BLOCK_BYTES
FP_A = make_fingerprint({"model": "a", "dtype": "bfloat16"}, BLOCK_BYTES)
FP_B = make_fingerprint({"model": "b", "dtype": "bfloat16"}, BLOCK_BYTES)


def block_bytes_for(block_hash: int, size: int = BLOCK_BYTES) -> np.ndarray:
    """Each block's content follows from its hash, so any reader can check what it got."""
    return np.random.default_rng(block_hash).integers(0, 256, size, dtype=np.uint8)


def open_store(path, fingerprint=FP_A, num_files: int = 100, **kwargs) -> DiskStore:
    return DiskStore(str(path), fingerprint, num_files * FILE_BYTES, **kwargs)


def write_blocks(store: DiskStore, block_hashes, one_at_a_time: bool = False) -> list:
    finished = []
    for h in block_hashes:
        assert store.write_async(h, block_bytes_for(h)) is not None
        if one_at_a_time:  # each write lands (and evicts) before the next: a deterministic LRU order
            assert store.wait_idle(10)
    assert store.wait_idle(10)
    finished += store.poll()
    return finished


def read_blocks(store: DiskStore, block_hashes) -> tuple[DiskRead, list[np.ndarray]]:
    buffers = [np.zeros(BLOCK_BYTES, np.uint8) for _ in block_hashes]
    handle = store.read_async(block_hashes, buffers)
    assert store.wait_idle(10)
    assert store.poll() == [handle]
    return handle, buffers


def file_of(store: DiskStore, block_hash: int) -> str:
    return block_path(store.path, (store.fingerprint.hex, block_hash))


def set_last_used(store: DiskStore, block_hashes):
    """Gives the files distinct last-use times, oldest first, in the past (as if written by an earlier run)."""
    base_s = time.time() - 1000
    for i, h in enumerate(block_hashes):
        os.utime(file_of(store, h), (base_s + i, base_s + i))


def stored_hashes(path, fingerprint=FP_A) -> list[int]:
    leaf_dirs = os.path.join(str(path), fingerprint.hex)
    names = [n for d in os.listdir(leaf_dirs) if len(d) == 2 for n in os.listdir(os.path.join(leaf_dirs, d))]
    return sorted(int(n[:16], 16) for n in names if n.endswith(".kvb"))


# --- round trip, async completion, stats
def test_write_and_read_complete_through_poll_with_exact_stats(tmp_path):
    store = open_store(tmp_path)
    writes = write_blocks(store, [11, 12, 13])
    assert sorted(w.block_hash for w in writes) == [11, 12, 13]
    assert all(isinstance(w, DiskWrite) and w.is_ok for w in writes)
    handle, buffers = read_blocks(store, [11, 12, 99, 13])
    # the missing block 99 ends the prefix; block 13 after it is still read
    assert handle.statuses == [ReadStatus.OK, ReadStatus.OK, ReadStatus.MISSING, ReadStatus.OK]
    assert handle.num_leading_ok == 2
    for h, buffer in zip([11, 12], buffers):
        assert np.array_equal(buffer, block_bytes_for(h))
    stats = store.stats()
    assert stats["blocks_written_to_disk"] == 3 and stats["disk_write_bytes"] == 3 * FILE_BYTES
    assert stats["blocks_read_from_disk"] == 3 and stats["disk_read_bytes"] == 3 * FILE_BYTES
    assert stats["disk_corrupt_blocks"] == 0 and stats["disk_write_errors"] == 0
    assert stats["disk_used_bytes"] == 3 * FILE_BYTES and stats["disk_num_blocks"] == 3
    assert store.poll() == []
    store.close()


def test_lookup_prefix_counts_leading_stored_blocks_and_writes_are_not_repeated(tmp_path):
    store = open_store(tmp_path)
    write_blocks(store, [1, 2, 3])
    assert store.lookup_prefix([1, 2, 5, 3]) == 2
    assert store.lookup_prefix([5, 1]) == 0
    assert store.lookup_prefix([]) == 0
    assert store.contains(3) and not store.contains(4)
    assert store.write_async(2, block_bytes_for(2)) is None  # stored already: nothing to do
    assert store.stats()["blocks_written_to_disk"] == 3


def test_numpy_views_and_memoryviews_are_accepted_and_sizes_are_checked(tmp_path):
    store = open_store(tmp_path)
    blocks = np.stack([block_bytes_for(h) for h in (1, 2)])  # (2, BLOCK_BYTES): rows as a host pool's blocks
    assert store.write_async(1, blocks[0]) is not None
    assert store.write_async(2, memoryview(blocks[1].view(np.float32))) is not None  # any dtype: bytes are bytes
    store.wait_idle(10)
    into = np.zeros((2, BLOCK_BYTES // 4), np.float32)
    handle = store.read_async([1, 2], [into[0], into[1]])
    store.wait_idle(10)
    assert handle.num_leading_ok == 2 and np.array_equal(into.view(np.uint8), blocks)
    with pytest.raises(ValueError, match="1,024 bytes, got 1,000"):
        store.write_async(3, bytes(1000))
    with pytest.raises(ValueError, match="not 1,024"):
        store.read_async([1], [bytearray(8)])
    with pytest.raises(ValueError, match="C-contiguous"):
        store.write_async(3, np.zeros((BLOCK_BYTES, 2), np.uint8)[:, 0])
    with pytest.raises(ValueError, match="kv_disk_gib"):
        DiskStore(str(tmp_path), FP_A, FILE_BYTES - 1)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="kv_disk_path=.* is not a directory"):
        open_store(tmp_path / "file")
    assert open_store(tmp_path / "new" / "dir").stats()["disk_num_blocks"] == 0  # created


# --- LRU and the cap
def test_cap_evicts_least_recently_used_and_a_hit_counts_as_a_use(tmp_path):
    store = open_store(tmp_path, num_files=3)
    write_blocks(store, [1, 2, 3], one_at_a_time=True)
    read_blocks(store, [1])  # 1 becomes the most recently used: 2 is the oldest now
    write_blocks(store, [4], one_at_a_time=True)
    assert stored_hashes(tmp_path) == [1, 3, 4]
    write_blocks(store, [5], one_at_a_time=True)
    assert stored_hashes(tmp_path) == [1, 4, 5]
    stats = store.stats()
    assert stats["blocks_evicted_from_disk"] == 2
    assert stats["disk_used_bytes"] == 3 * FILE_BYTES <= 3 * FILE_BYTES


def test_lru_order_survives_a_restart(tmp_path):
    store = open_store(tmp_path)
    write_blocks(store, [1, 2, 3, 4])
    set_last_used(store, [1, 2, 3, 4])  # written long ago, 1 first
    read_blocks(store, [1])  # a hit: its file's mtime is now
    store.close()
    # a new engine with room for 3 files evicts at start-up, oldest last use first: 2 (1 was used again)
    store = open_store(tmp_path, num_files=3)
    assert stored_hashes(tmp_path) == [1, 3, 4]
    assert store.lookup_prefix([1]) == 1 and not store.contains(2)
    assert store.stats()["blocks_evicted_from_disk"] == 1
    store.close()
    store = open_store(tmp_path, num_files=2)
    assert stored_hashes(tmp_path) == [1, 4]


def test_cap_counts_files_of_earlier_runs_and_other_fingerprints(tmp_path):
    other = open_store(tmp_path, fingerprint=FP_B)
    write_blocks(other, [100, 101])
    set_last_used(other, [100, 101])
    other.close()
    store = open_store(tmp_path, num_files=3)
    assert store.stats()["disk_used_bytes"] == 2 * FILE_BYTES
    write_blocks(store, [1, 2], one_at_a_time=True)  # 4 files for room for 3: B's oldest goes
    assert stored_hashes(tmp_path, FP_B) == [101]
    assert stored_hashes(tmp_path) == [1, 2]


# --- safety: another fingerprint, damaged files, foreign files
def test_another_fingerprint_never_hits(tmp_path):
    store_a, store_b = open_store(tmp_path), open_store(tmp_path, fingerprint=FP_B)
    write_blocks(store_a, [7])
    assert not store_b.contains(7) and store_b.lookup_prefix([7]) == 0
    handle, _ = read_blocks(store_b, [7])
    assert handle.statuses == [ReadStatus.MISSING]
    # A's file copied by hand to B's name for the same hash: B's fingerprint is not in its header
    os.makedirs(os.path.dirname(file_of(store_b, 7)))
    with open(file_of(store_a, 7), "rb") as src, open(file_of(store_b, 7), "wb") as dst:
        dst.write(src.read())
    assert store_b.contains(7)  # by its name; its header decides on reading
    handle, _ = read_blocks(store_b, [7])
    assert handle.statuses == [ReadStatus.CORRUPT]
    assert store_b.stats()["disk_corrupt_blocks"] == 1
    assert not os.path.exists(file_of(store_b, 7)) and os.path.exists(file_of(store_a, 7))


def test_kv_fingerprint_changes_with_every_input(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    base = dict(dtype="bfloat16", kv_cache_dtype="bfloat16", block_size=64, num_layers=2, num_kv_heads=2,
                head_dim=4, tp_size=1, tp_rank=0, block_bytes=4096)
    fp = kv_fingerprint(str(model), **base).hex
    assert kv_fingerprint(str(model), **base).hex == fp
    changes = dict(dtype="float16", kv_cache_dtype="fp8_e4m3", block_size=32, num_layers=3, num_kv_heads=1,
                   head_dim=8, tp_size=2, tp_rank=1, block_bytes=8192, kv_scale_layout="per-token-head",
                   layout="fp8 runs per (layer, K/V)")
    for name, value in changes.items():
        assert kv_fingerprint(str(model), **dict(base, **{name: value})).hex != fp, name
    assert kv_fingerprint(str(model), **base, load_format="dummy").hex != fp
    assert kv_fingerprint(str(model), **base, load_format="dummy", seed=1).hex != \
        kv_fingerprint(str(model), **base, load_format="dummy").hex


def test_model_identity_follows_the_weights_not_the_place(tmp_path):
    a = make_tiny_model(tmp_path / "a")
    same = make_tiny_model(tmp_path / "copy")
    tuned = make_tiny_model(tmp_path / "tuned", scale=1.001)  # a fine-tune: same names, shapes and sizes
    other_config = make_tiny_model(tmp_path / "rope", rope_theta=20000.0)
    assert model_identity(str(a)) == model_identity(str(same))
    assert model_identity(str(tuned)) != model_identity(str(a))
    assert model_identity(str(other_config)) != model_identity(str(a))
    assert os.path.getsize(a / "model.safetensors") == os.path.getsize(tuned / "model.safetensors")


def make_tiny_model(path, scale: float = 1.0, rope_theta: float = 10000.0):
    from safetensors.numpy import save_file
    os.makedirs(path)
    with open(path / "config.json", "w") as f:
        f.write(f'{{"architectures": ["LlamaForCausalLM"], "rope_theta": {rope_theta}}}')
    rng = np.random.default_rng(0)
    save_file({"a.weight": (rng.standard_normal((64, 64)) * scale).astype(np.float32),
               "b.weight": np.ones(8, np.float32)}, str(path / "model.safetensors"))
    return path


@pytest.mark.parametrize("damage", ["truncated", "payload_byte", "header_byte", "empty", "wrong_hash"])
def test_a_damaged_file_is_a_counted_miss_and_is_removed(tmp_path, damage):
    store = open_store(tmp_path)
    write_blocks(store, [5, 6])
    path = file_of(store, 6)
    with open(path, "r+b") as f:
        if damage == "truncated":
            f.truncate(FILE_BYTES - 100)
        elif damage == "payload_byte":
            f.seek(HEADER_BYTES + 500)
            byte = f.read(1)
            f.seek(HEADER_BYTES + 500)
            f.write(bytes([byte[0] ^ 0x01]))
        elif damage == "header_byte":
            f.seek(40)  # inside the block hash field
            f.write(b"\xff")
        elif damage == "empty":
            f.truncate(0)
    if damage == "wrong_hash":  # block 5's whole, valid file under block 6's name
        os.replace(file_of(store, 5), path)
    handle, buffers = read_blocks(store, [6])
    assert handle.statuses == [ReadStatus.CORRUPT] and handle.num_leading_ok == 0
    assert store.stats()["disk_corrupt_blocks"] == 1
    assert not os.path.exists(path)
    assert not store.contains(6) and store.stats()["disk_num_blocks"] == 1  # block 5 (indexed, moved or not)


def test_foreign_files_are_ignored_and_garbage_under_a_block_name_is_a_counted_miss(tmp_path):
    store = open_store(tmp_path)
    write_blocks(store, [1])
    fp_dir = os.path.join(str(tmp_path), FP_A.hex)
    foreign = [tmp_path / "notes.txt", tmp_path / "deadbeef", os.path.join(fp_dir, "README"),
               os.path.join(fp_dir, "ab", "not-a-block.kvb")]
    os.makedirs(os.path.join(fp_dir, "ab"), exist_ok=True)
    os.makedirs(tmp_path / "deadbeef")
    for p in foreign[:1] + foreign[2:]:
        with open(p, "wb") as f:
            f.write(os.urandom(FILE_BYTES))
    garbage = file_of(store, 0xab00000000000002)
    with open(garbage, "wb") as f:
        f.write(os.urandom(FILE_BYTES))  # the right size and name, random content
    store.close()
    store = open_store(tmp_path)
    assert store.stats()["disk_num_blocks"] == 2  # block 1 and the garbage file (found by name, not yet read)
    handle, _ = read_blocks(store, [0xab00000000000002, 1])
    assert handle.statuses == [ReadStatus.CORRUPT, ReadStatus.OK]
    assert store.stats()["disk_corrupt_blocks"] == 1 and not os.path.exists(garbage)
    assert all(os.path.exists(p) for p in foreign)
    assert [i.fingerprint for i in list_fingerprints(str(tmp_path))] == [FP_A.hex]


def test_a_corrupt_file_replaced_meanwhile_by_a_good_one_is_kept(tmp_path):
    path = tmp_path / "x.kvb"
    path.write_bytes(b"bad")
    inode = os.stat(path).st_ino
    (tmp_path / "y").write_bytes(b"good")
    os.replace(tmp_path / "y", path)  # another engine's atomic write
    assert not remove_if_same_file(str(path), inode) and path.read_bytes() == b"good"
    assert remove_if_same_file(str(path), os.stat(path).st_ino) and not path.exists()


# --- atomicity
CRASH_BEFORE_RENAME = """
import os, sys
import numpy as np
from nanovllm_offload import disk_format
from nanovllm_offload.disk_fingerprint import make_fingerprint
fp = make_fingerprint({"model": "a", "dtype": "bfloat16"}, 1024)
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
os.replace = lambda src, dst: os._exit(3)  # the process dies after writing, before the rename
disk_format.write_block_file(path, fp.digest, 9, np.ones(1024, np.uint8), tag="t", fsync=True)
"""


@pytest.mark.subprocess
def test_a_crash_between_write_and_rename_leaves_no_block_and_its_temp_file_is_cleaned(tmp_path):
    store = open_store(tmp_path)
    path = file_of(store, 9)
    proc = subprocess.run([sys.executable, "-c", CRASH_BEFORE_RENAME, path], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    (tmp,) = os.listdir(os.path.dirname(path))
    assert tmp.endswith(".tmp") and os.path.getsize(os.path.join(os.path.dirname(path), tmp)) == FILE_BYTES
    assert not store.contains(9)
    store.close()
    store = open_store(tmp_path)  # a young temp file may be another engine's write in progress: kept
    assert os.listdir(os.path.dirname(path)) == [tmp] and not store.contains(9)
    assert store.stats()["disk_num_blocks"] == 0
    store.close()
    store = open_store(tmp_path, stale_tmp_s=0.0)  # an old one is a crash's leftover: removed
    assert os.listdir(os.path.dirname(path)) == []
    write_blocks(store, [9])  # and the block can be written again
    assert read_blocks(store, [9])[0].num_leading_ok == 1


def test_a_failed_write_is_counted_and_leaves_nothing(tmp_path, monkeypatch):
    store = open_store(tmp_path)
    real_write_all = disk_format._write_all
    calls = []

    def io_error_after_the_header(fd, data):  # not ENOSPC: a full disk is retried (tests/test_hostile_disk.py)
        calls.append(len(data))
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        real_write_all(fd, data)

    monkeypatch.setattr(disk_format, "_write_all", io_error_after_the_header)
    (write,) = write_blocks(store, [4])
    assert not write.is_ok and calls == [HEADER_BYTES, BLOCK_BYTES]
    assert store.stats()["disk_write_errors"] == 1 and store.stats()["blocks_written_to_disk"] == 0
    assert os.listdir(os.path.dirname(file_of(store, 4))) == [] and not store.contains(4)


def test_a_failure_on_an_io_thread_still_hands_the_transfer_back(tmp_path, monkeypatch, caplog):
    """A host block stays held until its transfer comes back from poll(); a transfer that never came back would
    hold it forever and hang close(). An unexpected error (not a disk error) is logged, and the transfer returns."""
    store = open_store(tmp_path)
    write_blocks(store, [1])

    def broken(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(store, "_delete", broken)  # runs after the file is written
    assert store.write_async(2, block_bytes_for(2)) is not None
    assert store.wait_idle(10)
    (write,) = store.poll()
    assert write.is_ok and store.contains(2)
    assert store.write_async(2, block_bytes_for(2)) is None  # stored: not written again, and not "in flight"
    monkeypatch.setattr(store, "_read_file", broken)
    handle, buffers = read_blocks(store, [1, 2])
    assert handle.num_ok == 0 and handle.statuses == [ReadStatus.MISSING, ReadStatus.MISSING]
    assert "injected" in caplog.text and store.wait_idle(1)


def test_files_we_may_not_remove_are_left_quietly(tmp_path, monkeypatch):
    """Another user's files in a shared cache directory: removing one is refused (EACCES/EPERM), not an error."""
    def refused(path):
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(os, "unlink", refused)
    disk_format.unlink_quietly(str(tmp_path / "someone-elses"))
    (tmp_path / "f").write_bytes(b"x")
    assert not remove_if_same_file(str(tmp_path / "f"), os.stat(tmp_path / "f").st_ino)


# --- sharing a directory
def test_two_stores_in_one_process_see_each_others_blocks(tmp_path):
    first, second = open_store(tmp_path), open_store(tmp_path)
    write_blocks(first, [1, 2])
    assert second.lookup_prefix([1, 2, 3]) == 2  # found by name after second's start-up scan
    handle, buffers = read_blocks(second, [1, 2])
    assert handle.num_leading_ok == 2 and np.array_equal(buffers[1], block_bytes_for(2))
    write_blocks(first, [3])
    assert write_blocks(second, [3])[0].is_ok  # first stored it meanwhile: found, not written again
    assert second.stats()["blocks_written_to_disk"] == 0
    # another engine (cap: 1 file) evicts what second has indexed: second's read is a plain miss, not corruption
    first.close()
    set_last_used(second, [3, 1, 2])
    tiny = open_store(tmp_path, num_files=1)
    assert stored_hashes(tmp_path) == [2]
    handle, _ = read_blocks(second, [1, 2])
    assert handle.statuses == [ReadStatus.MISSING, ReadStatus.OK] and not second.contains(1)
    assert second.stats()["disk_corrupt_blocks"] == 0 and tiny.stats()["disk_corrupt_blocks"] == 0


SHARED_BLOCK_BYTES = 256 * 1024  # big enough that a reader would catch a file being written, were it visible
FP_SHARED = make_fingerprint({"model": "shared"}, SHARED_BLOCK_BYTES)
NUM_SHARED_HASHES, NUM_SHARED_FILES = 12, 6  # twice as many blocks as room: constant eviction and rewriting


def shared_block(block_hash: int) -> np.ndarray:
    return np.full(SHARED_BLOCK_BYTES, block_hash + 1, np.uint8)


def share_directory(path: str, seed: int, num_rounds: int, start, results):
    """One engine's traffic on a shared directory: writes and reads of overlapping blocks, checking every byte."""
    store = DiskStore(path, FP_SHARED, NUM_SHARED_FILES * (HEADER_BYTES + SHARED_BLOCK_BYTES), num_io_threads=3,
                      rescan_interval_s=0.0)
    rng = np.random.default_rng(seed)
    sources = [shared_block(h) for h in range(NUM_SHARED_HASHES)]
    start.wait(60)  # both engines run at once
    start_s = time.monotonic()
    num_ok = num_wrong = 0
    for _ in range(num_rounds):
        for h in rng.integers(0, NUM_SHARED_HASHES, 2):
            store.write_async(int(h), sources[h])
        hashes = [int(h) for h in rng.integers(0, NUM_SHARED_HASHES, 4)]
        buffers = [np.zeros(SHARED_BLOCK_BYTES, np.uint8) for _ in hashes]
        handle = store.read_async(hashes, buffers)
        store.wait_idle(30)
        store.poll()
        for h, status, buffer in zip(hashes, handle.statuses, buffers):
            num_ok += status is ReadStatus.OK
            num_wrong += status is ReadStatus.OK and not np.array_equal(buffer, sources[h])
    end_s = time.monotonic()
    store.close()
    results.put((seed, num_ok, num_wrong, store.stats(), start_s, end_s))


def test_two_processes_share_a_directory_without_corruption(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    results, start = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=share_directory, args=(str(tmp_path), seed, 300, start, results)) for seed in (1, 2)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert max(o[4] for o in outcomes) < min(o[5] for o in outcomes)  # their traffic overlapped
    for seed, num_ok, num_wrong, stats, _, _ in outcomes:
        assert num_wrong == 0 and stats["disk_corrupt_blocks"] == 0, (seed, stats)
        assert num_ok > 0 and stats["blocks_evicted_from_disk"] > 0, (seed, stats)
    # every file left is whole and right, and the directory is within the cap give or take the writes in flight
    store = DiskStore(str(tmp_path), FP_SHARED, 100 * (HEADER_BYTES + SHARED_BLOCK_BYTES))
    hashes = stored_hashes(tmp_path, FP_SHARED)
    assert 0 < len(hashes) <= NUM_SHARED_FILES + 2 * 3
    buffers = [np.zeros(SHARED_BLOCK_BYTES, np.uint8) for _ in hashes]
    handle = store.read_async(hashes, buffers)
    store.wait_idle(10)
    assert handle.num_leading_ok == len(hashes)
    assert all(np.array_equal(b, shared_block(h)) for h, b in zip(hashes, buffers))


# --- the load-or-recompute rule
def test_read_speed_is_measured_and_decides_load_or_recompute(tmp_path):
    from nanovllm_offload.policy import PreemptionPolicy
    store = open_store(tmp_path, prior_read_bytes_per_s=1e9)
    policy = PreemptionPolicy("auto", block_bytes=1, prefill_tokens_per_s=1000.0)
    assert policy.should_load_from_disk(1000, 10**9, store.read_bytes_per_s)  # 1 s vs 1 s
    policy.prefill_tokens_per_s = 2000.0
    assert not policy.should_load_from_disk(1000, 10**9, store.read_bytes_per_s)  # 1 s vs 0.5 s
    write_blocks(store, [1, 2])
    read_blocks(store, [1, 2])
    assert store.read_bytes_per_s != 1e9 and store.stats()["disk_read_bytes_per_s"] == store.read_bytes_per_s
    speed = store.read_bytes_per_s
    read_blocks(store, [3])  # a miss reads nothing: no measurement
    assert store.read_bytes_per_s == speed


def test_a_probe_measures_the_read_speed_without_changing_the_lru_order(tmp_path):
    store = open_store(tmp_path, prior_read_bytes_per_s=1.0)  # a prior that would never load anything
    assert store.probe_read_speed() is None  # nothing stored yet
    write_blocks(store, [1, 2, 3], one_at_a_time=True)
    set_last_used(store, [1, 2, 3])
    store.close()
    store = open_store(tmp_path, num_files=3, prior_read_bytes_per_s=1.0)
    probe = store.probe_read_speed(max_blocks=2)
    assert store.wait_idle(10) and store.poll() == [probe]
    assert probe.block_hashes == [3, 2] and probe.num_leading_ok == 2  # the most recently used first
    # the probe's own speed, not a blend with the prior (a blend with a slow prior never loads, so never measures)
    probe_bytes_per_s = 2 * FILE_BYTES / (probe.last_end_s - probe.first_start_s)
    assert store.read_bytes_per_s == pytest.approx(probe_bytes_per_s) and store.num_read_samples == 1
    read_blocks(store, [2])  # later reads move an exponential average
    assert store.num_read_samples == 2 and store.read_bytes_per_s != pytest.approx(probe_bytes_per_s)
    write_blocks(store, [4])  # still evicts block 1, the least recently used: the probe used nothing
    assert stored_hashes(tmp_path) == [2, 3, 4]


def test_the_default_probe_reads_64_mib_of_blocks_at_most_64(tmp_path):
    write_blocks(open_store(tmp_path, num_files=100), range(100), one_at_a_time=True)
    store = open_store(tmp_path, num_files=100)
    probe = store.probe_read_speed()  # 64 MiB of 1 KiB blocks would be 65,536: capped at 64
    assert store.wait_idle(10) and probe.num_leading_ok == 64 and probe.block_hashes == list(range(99, 35, -1))


def test_a_stale_speed_is_probed_again_when_a_hit_is_skipped(tmp_path):
    """A skipped hit reads nothing: without a new probe a speed below the prefill speed would stand for good."""
    write_blocks(open_store(tmp_path), [1, 2, 3])
    store = open_store(tmp_path, num_files=3, reprobe_interval_s=3600.0)
    assert not store.reprobe_if_stale()  # measured (at construction's clock) less than an hour ago
    store.reprobe_interval_s = 0.0
    assert store.reprobe_if_stale()
    assert store.wait_idle(10) and store.num_read_samples == 1
    [probe] = store.poll()
    assert probe.is_probe and probe.num_leading_ok == 3
    assert store.reprobe_if_stale() and store.wait_idle(10) and store.num_read_samples == 2
    store.reprobe_interval_s = 3600.0
    assert not store.reprobe_if_stale()  # just measured


# --- ls and clear
def test_list_and_clear_per_fingerprint(tmp_path):
    store_a, store_b = open_store(tmp_path), open_store(tmp_path, fingerprint=FP_B)
    write_blocks(store_a, [1, 2, 3])
    write_blocks(store_b, [1])
    (tmp_path / "notes.txt").write_text("mine")
    infos = {i.fingerprint: i for i in list_fingerprints(str(tmp_path))}
    assert set(infos) == {FP_A.hex, FP_B.hex}
    assert (infos[FP_A.hex].num_blocks, infos[FP_A.hex].num_bytes) == (3, 3 * FILE_BYTES)
    assert infos[FP_A.hex].meta["model"] == "a" and infos[FP_B.hex].meta["model"] == "b"
    assert infos[FP_A.hex].meta["fingerprint"] == FP_A.hex and infos[FP_A.hex].last_used > 0
    table = format_listing(list_fingerprints(str(tmp_path))).splitlines()
    assert len(table) == 4 and table[-1] == f"2 fingerprint(s), 4 blocks, {4 * FILE_BYTES / (1 << 30):.3f} GiB"
    assert {line.split()[0] for line in table[1:3]} == {FP_A.hex[:12], FP_B.hex[:12]}
    with pytest.raises(ValueError, match="exactly one"):
        clear(str(tmp_path), fingerprint="zz")
    removed = clear(str(tmp_path), fingerprint=FP_B.hex[:8])
    assert [i.fingerprint for i in removed] == [FP_B.hex]
    assert [i.fingerprint for i in list_fingerprints(str(tmp_path))] == [FP_A.hex]
    assert [i.fingerprint for i in clear(str(tmp_path))] == [FP_A.hex]
    assert list_fingerprints(str(tmp_path)) == [] and (tmp_path / "notes.txt").read_text() == "mine"
    # the engine that used the directory meanwhile: misses, and its next write recreates what it needs
    assert read_blocks(store_a, [1])[0].statuses == [ReadStatus.MISSING]
    assert write_blocks(store_a, [4])[0].is_ok and store_a.lookup_prefix([4]) == 1
    with pytest.raises(ValueError, match="not a directory"):
        list_fingerprints(str(tmp_path / "nowhere"))


@pytest.mark.subprocess
def test_disk_tier_modules_import_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import nanovllm_offload.disk_store, nanovllm_offload.disk_admin, nanovllm_offload.disk_transfers\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# --- the index alone
def test_index_orders_found_files_by_their_last_use_and_keeps_recent_entries_over_a_scan():
    from nanovllm_offload.disk_index import DiskIndex, ScannedFile
    index = DiskIndex(capacity_bytes=3 * 10)
    index.add(("f", 1), 10, last_used_ns=100)
    index.add(("f", 2), 10, last_used_ns=300)
    index.add(("g", 3), 10, last_used_ns=200)  # another engine's file, found later, used before block 2
    assert list(index.entries) == [("f", 1), ("g", 3), ("f", 2)]
    index.add(("f", 4), 10)  # written now: the most recent
    assert index.pop_victims() == [("f", 1)] and index.num_bytes == 30
    # a scan that started at 250 saw only blocks 1 and 3 (2 was evicted by another engine, 4 not written yet)
    scanned = [ScannedFile(("f", 1), 10, 100), ScannedFile(("g", 3), 10, 200)]
    index.replace_with_scan(scanned, scan_started_ns=250)
    assert list(index.entries) == [("f", 1), ("g", 3), ("f", 2), ("f", 4)]  # 2 was used at 300, after the start
    assert index.num_bytes == 40 and index.pop_victims() == [("f", 1)]


# --- host blocks <-> disk, by cpu_block_id
def make_transfers(tmp_path, num_cpu_blocks: int = 8):
    from nanovllm_offload.disk_transfers import DiskTransfers
    host_blocks = np.zeros((num_cpu_blocks, BLOCK_BYTES), np.uint8)
    return DiskTransfers(open_store(tmp_path), host_blocks), host_blocks


def test_transfers_write_host_blocks_and_load_a_hit_into_others(tmp_path):
    from nanovllm_offload.disk_transfers import FinishedLoad
    transfers, host_blocks = make_transfers(tmp_path)
    host_blocks[2], host_blocks[3] = block_bytes_for(20), block_bytes_for(30)
    assert transfers.write(2, 20) and transfers.write(3, 30)
    assert not transfers.write(3, 30)  # in flight already
    assert dict(transfers.writing) == {2: 1, 3: 1} and transfers.num_in_flight == 2
    with pytest.raises(RuntimeError, match=r"host blocks \[3\] are still in a disk transfer"):
        transfers.load(1, [20], [3])
    transfers.store.wait_idle(10)
    written, loads = transfers.get_finished()
    assert sorted(written) == [2, 3] and loads == [] and not transfers.writing
    # seq 7's hit: blocks 20, 99 (not stored), 30 into host blocks 5, 6, 4
    transfers.load(7, [20, 99, 30], [5, 6, 4])
    assert transfers.loading == {4, 5, 6}
    transfers.store.wait_idle(10)
    assert transfers.get_finished() == ([], [FinishedLoad(7, [5, 6, 4], 1)])
    assert np.array_equal(host_blocks[5], block_bytes_for(20)) and not transfers.loading
    assert transfers.num_in_flight == 0


def test_transfers_take_a_bfloat16_pool_as_bytes(tmp_path):
    torch = pytest.importorskip("torch")
    from nanovllm_offload.disk_transfers import DiskTransfers
    host_kv = torch.randn(4, 2, 2, 8, 8, dtype=torch.bfloat16)  # (num_cpu_blocks, layers, K/V, tokens, dim)
    block_bytes = host_kv[0].numel() * host_kv.element_size()
    fingerprint = make_fingerprint({"model": "bf16"}, block_bytes)
    store = DiskStore(str(tmp_path), fingerprint, 10 * (HEADER_BYTES + block_bytes))
    transfers = DiskTransfers(store, host_kv.view(torch.uint8).view(4, -1).numpy())
    transfers.write(1, 11)
    store.wait_idle(10)
    transfers.get_finished()
    transfers.load(0, [11], [3])
    store.wait_idle(10)
    assert transfers.get_finished()[1][0].num_loaded == 1 and torch.equal(host_kv[3], host_kv[1])
    with pytest.raises(ValueError, match="uint8 view of the host pool"):
        DiskTransfers(store, np.zeros((4, block_bytes), np.float32))


# --- the disk tier's host blocks (DiskTier, under an OffloadManager)
def tier_with_disk(tmp_path, num_host_blocks: int = 8, block_size: int = 4):
    from nanovllm_offload.offload_manager import OffloadManager
    from nanovllm_offload.policy import PreemptionPolicy
    store = DiskStore(str(tmp_path / "kv"), FP_A, 1 << 30)
    tier = OffloadManager(num_host_blocks, block_size, PreemptionPolicy("swap", BLOCK_BYTES), prefix_cache=True)
    tier.attach_disk(store, np.zeros((num_host_blocks, BLOCK_BYTES), np.uint8), on_cpu=True)
    return tier, store


def store_prompt_blocks(store: DiskStore, seq, block_indices):
    from nanovllm.core.hashing import content_hash
    for i in block_indices:
        assert store.write_async(content_hash(seq, i), block_bytes_for(i)) is not None
    assert store.wait_idle(10)
    store.poll()


def landed(tier, ids: list[int] = ()):
    """The copy engine reports these transfers (and the disk's finished ones are taken in)."""
    from nanovllm_offload.transfer_report import TransferReport
    tier.complete(TransferReport(list(ids)))


def test_a_load_reads_at_once_into_free_host_blocks_never_into_blocks_a_copy_holds(tmp_path):
    """A swap-in holds its host blocks until its copy lands, so the disk's threads, which no copy stream orders,
    never read into a block a copy still reads: a load takes free blocks only, and its reads start at once. Its
    blocks are WRITING until the disk reports them, and no lookup finds them before."""
    from nanovllm.core.block_manager import BlockManager
    from nanovllm.core.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams
    tier, store = tier_with_disk(tmp_path)
    gpu = BlockManager(16, 4)
    swapped = Sequence(list(range(10)), SamplingParams(), 4)  # 2 full blocks and a partial one
    gpu.allocate(swapped, 10)
    swapped.num_computed_tokens = 10
    gpu.cache_full_blocks(swapped)
    assert tier.swap_out(swapped, gpu) == 3
    out = tier.end_step([])
    assert out.swap_out == [(2, 2), (1, 1), (0, 0)] and tier.pool.state[2].name == "WRITING"
    landed(tier, [out.store_id])
    assert tier.swap_in(swapped, gpu, 0, 64) == 1  # the partial block: host block 2 is read by the copy
    out = tier.end_step([])
    assert out.swap_in == [(2, 2)] and tier.pool.num_free_blocks == 5  # 0, 1 and 2 held by the load
    seq = Sequence(list(range(500, 517)), SamplingParams(), 4)  # 4 full blocks before the last token
    store_prompt_blocks(store, seq, range(4))
    assert tier.start_disk_load(seq, 0, [])
    assert tier.disk.transfers.loading == {3, 4, 5, 6} and tier.pool.state[3].name == "WRITING"
    assert tier.lookup(seq, 0) == [] and tier.num_disk_waiting == 1
    assert store.wait_idle(10)
    landed(tier, [out.load_id])
    assert tier.take_loaded_from_disk() == [seq] and tier.lookup(seq, 0) == [3, 4, 5, 6]
    assert tier.pool.num_free_blocks == 8 and tier.num_disk_waiting == 0
    tier.check_invariants([])


def test_a_load_leaves_the_sequences_own_host_hits_in_place(tmp_path):
    """Host hits are free (cached) blocks: a load that counted them as free would evict them for its own blocks,
    and the sequence would come back to a prefix broken at its first block."""
    from nanovllm.core.sequence import Sequence
    from nanovllm.core.hashing import content_hash
    from nanovllm.sampling_params import SamplingParams
    tier, store = tier_with_disk(tmp_path)
    seq = Sequence(list(range(100, 141)), SamplingParams(), 4)  # 10 full blocks before the last token
    store_prompt_blocks(store, seq, range(2, 10))
    for i in range(2):  # blocks 0 and 1 are host prefix-cache entries
        cpu_block_id = tier.pool.store(content_hash(seq, i))
        tier.pool.begin_writes([cpu_block_id])
        tier.pool.finish_writes([cpu_block_id])
        tier.pool.release(cpu_block_id, -1)
    hits = tier.lookup(seq, 0)
    assert len(hits) == 2
    assert tier.start_disk_load(seq, len(hits), hits)
    loading = sorted(tier.disk.transfers.loading)
    assert len(loading) == 6 and not set(loading) & set(hits)  # 8 free less the 2 hits
    assert store.wait_idle(10)
    landed(tier)
    assert tier.take_loaded_from_disk() == [seq]
    assert sorted(tier.lookup(seq, 0)) == sorted(hits + loading)
    assert tier.disk.counters["disk_loaded_tokens"] == 6 * 4 and tier.disk.counters["disk_skipped_tokens"] == 2 * 4


def test_close_waits_for_the_loads_in_flight_and_releases_their_host_blocks(tmp_path):
    from nanovllm.core.sequence import Sequence
    from nanovllm.sampling_params import SamplingParams
    tier, store = tier_with_disk(tmp_path)
    seq = Sequence(list(range(500, 517)), SamplingParams(), 4)
    store_prompt_blocks(store, seq, range(4))
    assert tier.start_disk_load(seq, 0, []) and tier.pool.num_free_blocks == 4
    tier.disk.close()
    assert tier.pool.num_free_blocks == 8 and tier.num_disk_waiting == 0 and tier.disk.transfers.num_in_flight == 0
