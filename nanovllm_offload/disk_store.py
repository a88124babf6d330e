"""The disk tier: KV blocks as files under kv_disk_path, kept across restarts (no torch).

The engine's thread only asks and submits; reads and writes run on a few I/O threads, straight into and out of the
caller's buffers (pinned host blocks, in the engine), and come back through `poll()`. The index (disk_index.py)
decides what is there and what to evict; the file format (disk_format.py) makes every file whole or a clean miss.
"""
import itertools
import logging
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from nanovllm_offload import disk_space
from nanovllm_offload.disk_fingerprint import Fingerprint
from nanovllm_offload.disk_format import (HEADER_BYTES, ReadStatus, as_byte_view, read_block_file,
                                          remove_if_same_file, unlink_quietly, write_block_file)
from nanovllm_offload.disk_handles import DiskRead, DiskWrite
from nanovllm_offload.disk_space import NO_SPACE_ERRNOS, fitted_capacity, write_json_atomically
from nanovllm_offload.disk_index import (META_FILE, BlockKey, DiskIndex, block_path, fingerprint_dir, scan)

logger = logging.getLogger(__name__)
GiB = 1 << 30
PROBE_BYTES = 64 << 20  # the start-up read probe: enough to time the I/O threads at the depth hits read at


class DiskStore:
    """One fingerprint's blocks under `path`, within a cap on the whole directory.

    The cap is also kept below what the file system can hold: at start (used + free space) and whenever a write
    finds it full (ENOSPC): the write evicts least recently used files and tries again, and if the disk is still
    full the cap comes down to what it holds, said once in the log (`disk_capacity_bytes` in stats()). Every write
    that failed, retried or not, counts in `disk_write_errors`.

    NOTE: no lock is held during file I/O; `_lock` guards the index, the counters and the writes in flight only.
          Several engines may share the directory: files appear by atomic rename, a file evicted or removed as
          corrupt by another engine is a plain miss, and unlinking a file that another process is reading is safe
          on POSIX (the reader keeps the inode). Each engine keeps the cap on what it sees (its scan at start, its
          own writes, rescans every `rescan_interval_s`); writes in flight may pass it by a few blocks.
    """

    def __init__(self, path: str, fingerprint: Fingerprint, capacity_bytes: int, *, num_io_threads: int = 2,
                 fsync: bool = False, rescan_interval_s: float = 60.0, stale_tmp_s: float = 600.0,
                 prior_read_bytes_per_s: float = 1e9, ema: float = 0.2, reprobe_interval_s: float = 60.0):
        self.path, self.fingerprint = path, fingerprint
        self.block_bytes = fingerprint.block_bytes
        self.file_bytes = HEADER_BYTES + self.block_bytes
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"kv_disk_path={path!r} is not a directory; pass a directory (it is created if missing)")
        if capacity_bytes < self.file_bytes:
            raise ValueError(f"kv_disk_gib={capacity_bytes / GiB:.6g} cannot hold one KV block file of "
                             f"{self.file_bytes:,} bytes; raise kv_disk_gib")
        self.fsync, self.rescan_interval_s, self.stale_tmp_s, self.ema = fsync, rescan_interval_s, stale_tmp_s, ema
        self.room_bytes = self.file_bytes * num_io_threads  # the writes in flight need it free, before their evictions
        self._is_cap_lowered = False  # the first lowering is logged as a warning, later ones at debug level
        # The prior decides only until the first read (the start-up probe's, usually): that read replaces it, the
        # later ones move an EMA. Blending the first into the prior would leave a disk that reads faster than the
        # prior below the prefill speed, so never loaded, so never measured again.
        self.read_bytes_per_s = prior_read_bytes_per_s
        self.num_read_samples = 0
        # a skipped hit reads nothing, so a speed that once fell below the prefill speed would never be measured
        # again: reprobe_if_stale re-times a probe when the last measurement is older than this
        self.reprobe_interval_s = reprobe_interval_s
        self._last_timed_s = time.monotonic()  # the last read measured, or the last probe finished
        self._is_probing = False
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._num_in_flight = 0
        self._writing: set[int] = set()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._tags = itertools.count()
        self._counters = dict(disk_read_bytes=0, disk_write_bytes=0, blocks_written_to_disk=0,
                              blocks_read_from_disk=0, disk_corrupt_blocks=0, disk_write_errors=0,
                              blocks_evicted_from_disk=0)
        os.makedirs(fingerprint_dir(path, fingerprint.hex), exist_ok=True)
        self._write_meta()
        self._index = DiskIndex(capacity_bytes)
        self._is_rescanning = False
        self._last_scan_s = time.monotonic()
        self._index.replace_with_scan(scan(path, stale_tmp_s), time.time_ns())
        self._fit_cap_to_file_system(at_start=True)
        self._delete(self._index.pop_victims())
        self._pool = ThreadPoolExecutor(num_io_threads, thread_name_prefix="kv-disk")

    # --- queries (engine thread; no I/O but one stat on a miss)
    def contains(self, block_hash: int) -> bool:
        key = self._key(block_hash)
        with self._lock:
            if key in self._index:
                return True
        return self._found_on_disk(key)

    def lookup_prefix(self, block_hashes: list[int]) -> int:
        """How many of the leading block_hashes are stored (without reading them or changing their LRU place)."""
        return next((i for i, h in enumerate(block_hashes) if not self.contains(h)), len(block_hashes))

    # --- I/O (submitted here, done on the I/O threads, reported by poll)
    def write_async(self, block_hash: int, data) -> DiskWrite | None:
        """Stores one block from the caller's buffer, which must stay unchanged until poll() returns the write.
        None when the block is stored already or being written (nothing to do)."""
        view = as_byte_view(data)
        if len(view) != self.block_bytes:
            raise ValueError(f"a block of fingerprint {self.fingerprint.hex} is {self.block_bytes:,} bytes, "
                             f"got {len(view):,} for block hash {block_hash:#x}")
        key = self._key(block_hash)
        with self._lock:
            if key in self._index or block_hash in self._writing:
                return None
            self._writing.add(block_hash)
            self._num_in_flight += 1
        handle = DiskWrite(block_hash)
        self._pool.submit(self._write, handle, view).add_done_callback(_log_failure)
        return handle

    def read_async(self, block_hashes: list[int], into: list) -> DiskRead:
        """Reads each block into the caller's buffer of the same index (each block_bytes long); the buffers are
        the store's until poll() returns the read. The blocks become the most recently used."""
        if len(block_hashes) != len(into):
            raise ValueError(f"{len(block_hashes)} block hashes but {len(into)} buffers")
        views = [as_byte_view(b) for b in into]
        for h, view in zip(block_hashes, views):
            if len(view) != self.block_bytes:
                raise ValueError(f"the buffer for block hash {h:#x} is {len(view):,} bytes, not {self.block_bytes:,}")
        return self._submit_read(DiskRead(list(block_hashes), [None] * len(block_hashes), len(block_hashes)), views)

    def probe_read_speed(self, max_blocks: int | None = None) -> DiskRead | None:
        """Times a read of up to max_blocks (default: PROBE_BYTES' worth, 4 to 64 blocks) of this fingerprint's
        stored blocks (most recently used first) into scratch buffers, so that the load rule
        (PreemptionPolicy.should_load_from_disk) has a measured speed before the first hit; without one the prior
        decides, and a prior below the prefill speed would never load, so never measure. None with no blocks."""
        if max_blocks is None:
            max_blocks = min(64, max(4, PROBE_BYTES // self.block_bytes))
        with self._lock:
            ours = (k for k in reversed(self._index.entries) if k[0] == self.fingerprint.hex)
            keys = list(itertools.islice(ours, max_blocks))
            self._is_probing = bool(keys)
        if not keys:
            return None
        handle = DiskRead([h for _, h in keys], [None] * len(keys), len(keys), is_probe=True)
        return self._submit_read(handle, [memoryview(bytearray(self.block_bytes)) for _ in keys])

    def reprobe_if_stale(self) -> bool:
        """Start a probe (its handle comes back from poll() marked is_probe) unless one is in flight, or a read was
        measured or a probe finished less than reprobe_interval_s ago. Called when the rule skips a hit. True: one
        started."""
        with self._lock:
            if self._is_probing or time.monotonic() - self._last_timed_s < self.reprobe_interval_s:
                return False
        return self.probe_read_speed() is not None

    def _submit_read(self, handle: DiskRead, views: list[memoryview]) -> DiskRead:
        with self._lock:
            if not handle.is_probe:
                for h in handle.block_hashes:
                    self._index.touch(self._key(h))
            self._num_in_flight += 1
        if not handle.block_hashes:
            self._finish(handle)
        for i, view in enumerate(views):
            self._pool.submit(self._read, handle, i, view).add_done_callback(_log_failure)
        return handle

    def poll(self) -> list[DiskRead | DiskWrite]:
        """The reads and writes finished since the last poll (never blocks)."""
        finished = []
        while True:
            try:
                finished.append(self._done.get_nowait())
            except queue.Empty:
                return finished

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Blocks until no read or write is in flight (tests, shutdown); poll() still returns them."""
        with self._idle:
            return self._idle.wait_for(lambda: self._num_in_flight == 0, timeout_s)

    def stats(self) -> dict:
        with self._lock:
            return dict(self._counters, disk_used_bytes=self._index.num_bytes, disk_num_blocks=len(self._index),
                        disk_capacity_bytes=self._index.capacity_bytes, disk_read_bytes_per_s=self.read_bytes_per_s)

    def close(self):
        self._pool.shutdown(wait=True)

    # --- the I/O threads
    def _write(self, handle: DiskWrite, view: memoryview):
        """The handle comes back from poll() whatever happens here: its host block is held until then."""
        try:
            self._write_file(handle, view)
        finally:
            with self._lock:
                self._writing.discard(handle.block_hash)  # a later write of this block is not refused as in flight
            self._finish(handle)

    def _write_file(self, handle: DiskWrite, view: memoryview):
        key = self._key(handle.block_hash)
        path = block_path(self.path, key)
        if self._found_on_disk(key):  # another engine stored it since our last look
            handle.is_ok = True
            with self._lock:
                self._writing.discard(handle.block_hash)
            return
        try:
            num_bytes = self._write_making_room(path, handle.block_hash, view)
            handle.is_ok = True
        except OSError:  # still no room, a disk error, or the directory cleared under us: the block is not stored
            num_bytes = 0
        with self._lock:
            self._writing.discard(handle.block_hash)
            if handle.is_ok:
                self._index.add(key, num_bytes)
                self._counters["disk_write_bytes"] += num_bytes
                self._counters["blocks_written_to_disk"] += 1
            victims = self._index.pop_victims()
        self._delete(victims)
        self._maybe_rescan()

    def _write_making_room(self, path: str, block_hash: int, view: memoryview) -> int:
        """write_block_file; on a full file system, evict least recently used files and try again, then lower the
        cap to what the file system holds and try once more. After a full file system the cap is fitted to it (so
        the evictions after each write keep room for the next). Raises the last OSError."""
        is_full = False
        for attempt in range(3):
            try:
                self._make_dirs(os.path.dirname(path))
                num_bytes = write_block_file(path, self.fingerprint.digest, block_hash, view,
                                             tag=f"{threading.get_ident()}-{next(self._tags)}", fsync=self.fsync)
                break
            except OSError as error:
                with self._lock:
                    self._counters["disk_write_errors"] += 1
                if error.errno not in NO_SPACE_ERRNOS or attempt == 2:
                    raise
                is_full = True
                if attempt == 0:
                    self._evict_for_room()
                else:  # another I/O thread's write may have taken the room: fit the cap, and make room again
                    self._fit_cap_to_file_system(at_start=False)
                    with self._lock:
                        victims = self._index.pop_victims()
                    self._delete(victims)
                    self._evict_for_room()
        if is_full:  # the caller evicts down to the cap after this write
            self._fit_cap_to_file_system(at_start=False)
        return num_bytes

    def _evict_for_room(self):
        """Frees the room of one write per I/O thread, least recently used files first (of any fingerprint)."""
        with self._lock:
            victims = self._index.pop_oldest(self.room_bytes)
        self._delete(victims)

    def _fit_cap_to_file_system(self, at_start: bool):
        """Lowers the cap to the tier's files plus the free space, less the room for the writes in flight (never
        below one file). At start a cap over that (the default 64 GiB on a small disk) is a warning, not an error:
        the tier still keeps what fits."""
        try:
            free_bytes = disk_space.free_disk_bytes(self.path)
        except OSError:
            return
        with self._lock:
            old_cap = self._index.capacity_bytes
            fits = fitted_capacity(self._index.num_bytes, free_bytes, self.room_bytes, self.file_bytes)
            if fits >= old_cap:
                return
            self._index.capacity_bytes = fits
            is_first, self._is_cap_lowered = not self._is_cap_lowered, True
        why = ("kv_disk_gib is more than the file system can hold" if at_start
               else "the file system is full (writes failed with no space left, even after evicting)")
        logger.log(logging.WARNING if is_first else logging.DEBUG,
                   "disk tier: %s under kv_disk_path=%r: cap lowered from %.3f GiB to %.3f GiB (the tier's files "
                   "%.3f GiB + free %.3f GiB)", why, self.path, old_cap / GiB, fits / GiB,
                   self._index.num_bytes / GiB, free_bytes / GiB)

    def _read(self, handle: DiskRead, i: int, view: memoryview):
        """Block i of a read. Its last block to finish hands the read back to poll() whatever happened: the host
        blocks it fills are held until then."""
        key = self._key(handle.block_hashes[i])
        start_s = time.perf_counter()
        try:
            status = self._read_file(key, view, touch=not handle.is_probe)
        except Exception:  # a bug, not a disk error (those are MISSING): the block is lost, the read still returns
            logger.exception("disk tier: reading block %d of a load failed", i)
            status = ReadStatus.MISSING
        end_s = time.perf_counter()
        with self._lock:
            handle.statuses[i] = status
            handle.first_start_s = min(handle.first_start_s, start_s)
            handle.last_end_s = max(handle.last_end_s, end_s)
            if status is ReadStatus.OK:
                self._counters["disk_read_bytes"] += self.file_bytes
                self._counters["blocks_read_from_disk"] += 1
            else:
                self._index.remove(key)
                self._counters["disk_corrupt_blocks"] += status is ReadStatus.CORRUPT
            handle.num_pending -= 1
            if handle.num_pending:
                return
            self._observe_read(handle.num_ok * self.file_bytes, handle.last_end_s - handle.first_start_s)
            if handle.is_probe:  # finished, even with nothing read: no new probe before the interval
                self._is_probing, self._last_timed_s = False, time.monotonic()
        self._finish(handle)

    def _read_file(self, key: BlockKey, view: memoryview, touch: bool) -> ReadStatus:
        path = block_path(self.path, key)
        try:
            status, inode = read_block_file(path, self.fingerprint.digest, key[1], view)
        except OSError:
            status, inode = ReadStatus.MISSING, 0
        if status is ReadStatus.OK and touch:
            _touch_file(path)
        elif status is ReadStatus.CORRUPT:
            remove_if_same_file(path, inode)
        return status

    def _observe_read(self, num_bytes: int, seconds: float):
        """Read speed from the first block's start to the last block's end: the device's throughput at the queue
        depth we give it, not the time the read waited behind writes."""
        if num_bytes > 0 and seconds > 0:
            weight = self.ema if self.num_read_samples else 1.0
            self.read_bytes_per_s += weight * (num_bytes / seconds - self.read_bytes_per_s)
            self.num_read_samples += 1
            self._last_timed_s = time.monotonic()

    def _finish(self, handle: DiskRead | DiskWrite):
        self._done.put(handle)
        with self._idle:
            self._num_in_flight -= 1
            self._idle.notify_all()

    # --- the directory
    def _key(self, block_hash: int) -> BlockKey:
        return self.fingerprint.hex, block_hash

    def _found_on_disk(self, key: BlockKey) -> bool:
        """A block another engine stored after our last scan is found by its name (one stat) and indexed."""
        try:
            st = os.stat(block_path(self.path, key))
        except OSError:
            return False
        if st.st_size != self.file_bytes:
            return False
        with self._lock:
            self._index.add(key, st.st_size, st.st_mtime_ns)
        return True

    def _maybe_rescan(self):
        """Every rescan_interval_s, on an I/O thread: take in what other engines wrote and evicted."""
        with self._lock:
            if self._is_rescanning or time.monotonic() - self._last_scan_s < self.rescan_interval_s:
                return
            self._is_rescanning = True
        started_ns = time.time_ns()
        try:
            scanned = scan(self.path, self.stale_tmp_s)
        except BaseException:
            with self._lock:
                self._last_scan_s, self._is_rescanning = time.monotonic(), False  # the next interval tries again
            raise
        with self._lock:
            self._index.replace_with_scan(scanned, started_ns)
            victims = self._index.pop_victims()
            self._last_scan_s, self._is_rescanning = time.monotonic(), False
        self._delete(victims)

    def _delete(self, victims: list[BlockKey]):
        for key in victims:
            unlink_quietly(block_path(self.path, key))
        with self._lock:
            self._counters["blocks_evicted_from_disk"] += len(victims)

    def _make_dirs(self, leaf_dir: str):
        """The block file's directory. When it is missing the fingerprint's may be too (`nanovllm cache clear`
        under a running engine): meta.json is written again, so `cache ls` still names the model."""
        if os.path.isdir(leaf_dir):
            return
        os.makedirs(leaf_dir, exist_ok=True)
        self._write_meta()

    def _write_meta(self):
        """meta.json: what `nanovllm cache ls` shows for this fingerprint (written once; a failed write, on a full
        disk, is logged, not raised: the blocks do not need it)."""
        path = os.path.join(fingerprint_dir(self.path, self.fingerprint.hex), META_FILE)
        if not os.path.exists(path):
            write_json_atomically(path, dict(self.fingerprint.meta, fingerprint=self.fingerprint.hex),
                                  "`nanovllm cache ls` will not name this model")

def _touch_file(path: str):
    """A hit's last use, kept in the file's mtime so that LRU order survives restarts."""
    try:
        os.utime(path)
    except OSError:
        pass


def _log_failure(future):
    """A bug on an I/O thread would otherwise vanish with its future (OSErrors are handled where they happen)."""
    if future.exception() is not None:
        logger.error("disk tier I/O thread failed", exc_info=future.exception())
