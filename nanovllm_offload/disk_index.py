"""Where block files live under kv_disk_path, and which to evict first (plain Python; no torch).

Layout: `<kv_disk_path>/<fingerprint hex>/<first 2 hex digits of the hash>/<block hash, 16 hex digits>.kvb`, plus a
`meta.json` per fingerprint directory. The two-digit fan-out keeps each directory at a few hundred files even when
a small model's blocks fill 64 GiB.
"""
import dataclasses
import os
import time
from collections import OrderedDict

from nanovllm_offload.disk_format import TMP_SUFFIX, block_file_name, parse_block_file_name, unlink_quietly

BlockKey = tuple[str, int]  # (fingerprint hex, block hash)
META_FILE = "meta.json"


def fingerprint_dir(root: str, fingerprint_hex: str) -> str:
    return os.path.join(root, fingerprint_hex)


def block_path(root: str, key: BlockKey) -> str:
    fingerprint_hex, block_hash = key
    name = block_file_name(block_hash)
    return os.path.join(root, fingerprint_hex, name[:2], name)


def is_fingerprint_dir_name(name: str) -> bool:
    return len(name) == 32 and all(c in "0123456789abcdef" for c in name)


@dataclasses.dataclass(slots=True)
class ScannedFile:
    key: BlockKey
    size_bytes: int
    last_used_ns: int  # the file's mtime: set when written, and again at every hit (os.utime)


def scan(root: str, stale_tmp_s: float) -> list[ScannedFile]:
    """Every block file under root, all fingerprints, least recently used first. Temporary files older than
    stale_tmp_s (a writer that crashed between write and rename) are removed; younger ones may still be written."""
    found = []
    now_ns = time.time_ns()
    for fp_entry in _scandir(root):
        if not (fp_entry.is_dir() and is_fingerprint_dir_name(fp_entry.name)):
            continue
        for sub_entry in _scandir(fp_entry.path):
            if sub_entry.is_dir() and len(sub_entry.name) == 2:
                found += _scan_leaf(fp_entry.name, sub_entry.path, now_ns, stale_tmp_s)
    found.sort(key=lambda f: f.last_used_ns)
    return found


def _scan_leaf(fingerprint_hex: str, path: str, now_ns: int, stale_tmp_s: float) -> list[ScannedFile]:
    found = []
    for entry in _scandir(path):
        try:
            st = entry.stat()
        except OSError:
            continue  # evicted or renamed by another engine while we looked, or not ours to read
        if entry.name.endswith(TMP_SUFFIX):
            if now_ns - st.st_mtime_ns > stale_tmp_s * 1e9:
                unlink_quietly(entry.path)
            continue
        block_hash = parse_block_file_name(entry.name)
        if block_hash is not None and entry.name[:2] == os.path.basename(path):
            found.append(ScannedFile((fingerprint_hex, block_hash), st.st_size, st.st_mtime_ns))
    return found


class DiskIndex:
    """The block files of the whole directory (every fingerprint: the cap is one budget for the directory), in
    least-recently-used order, with their total size.

    Plain data; the DiskStore changes it under its lock and does the file I/O outside. It is a view of the disk
    that can lag: another engine's writes appear at the next lookup miss or rescan, and files it evicted are found
    missing when read (a plain miss).
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.entries: OrderedDict[BlockKey, tuple[int, int]] = OrderedDict()  # key -> (size, last use ns); LRU first
        self.num_bytes = 0

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: BlockKey, size_bytes: int, last_used_ns: int | None = None):
        """A file that is now on disk, as the most recently used (or at its place in time, for a found file)."""
        self.remove(key)
        self.entries[key] = (size_bytes, time.time_ns() if last_used_ns is None else last_used_ns)
        self.num_bytes += size_bytes
        if last_used_ns is not None:
            self._sink(key)

    def touch(self, key: BlockKey):
        if key in self.entries:
            size_bytes, _ = self.entries[key]
            self.entries[key] = (size_bytes, time.time_ns())
            self.entries.move_to_end(key)

    def remove(self, key: BlockKey) -> bool:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.num_bytes -= entry[0]
        return entry is not None

    def pop_victims(self) -> list[BlockKey]:
        """Drops least recently used entries until the directory fits the cap; the caller deletes their files."""
        victims = []
        while self.num_bytes > self.capacity_bytes and self.entries:
            key, (size_bytes, _) = self.entries.popitem(last=False)
            self.num_bytes -= size_bytes
            victims.append(key)
        return victims

    def pop_oldest(self, num_bytes: int) -> list[BlockKey]:
        """Drops least recently used entries until num_bytes are freed (or none is left): room for a write that met a
        full file system. The caller deletes their files."""
        victims, num_freed = [], 0
        while self.entries and num_freed < num_bytes:
            key, (size_bytes, _) = self.entries.popitem(last=False)
            self.num_bytes -= size_bytes
            victims.append(key)
            num_freed += size_bytes
        return victims

    def replace_with_scan(self, scanned: list[ScannedFile], scan_started_ns: int):
        """Takes a fresh scan as the truth, except for entries added or used since the scan started (the scan may
        have missed them, or seen their older mtime)."""
        recent = [(k, v) for k, v in self.entries.items() if v[1] >= scan_started_ns]
        self.entries = OrderedDict((f.key, (f.size_bytes, f.last_used_ns)) for f in scanned)
        for key, value in recent:
            self.entries.pop(key, None)
            self.entries[key] = value
        self.num_bytes = sum(size for size, _ in self.entries.values())

    def _sink(self, key: BlockKey):
        """Moves a just-added entry back past the entries used after it (found files keep their place in time)."""
        _, last_used_ns = self.entries[key]
        newer = []
        for other in reversed(self.entries):
            if other == key:
                continue
            if self.entries[other][1] <= last_used_ns:
                break
            newer.append(other)
        for other in reversed(newer):
            self.entries.move_to_end(other)


def _scandir(path: str) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:  # gone, not a directory, or not ours to read: nothing of it is indexed
        return []

