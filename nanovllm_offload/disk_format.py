"""One KV block as one file: header + payload, written atomically, read back verified (no torch).

A block file is a 4 KiB header and the block's bytes (all layers, K and V, and any per-block scales: opaque here,
a fixed size per fingerprint). The payload starts 4 KiB in so a later reader can use O_DIRECT on it.

Header (little-endian): magic, format version, header size, fingerprint (16 bytes), block hash (u64), payload size
(u64), xxh3-64 of the payload, xxh3-64 of the header fields before it; zeros up to 4 KiB.

NOTE: a file under a block's final name is always complete: it is written under a temporary name in the same
      directory and renamed (os.replace, atomic on POSIX) only when fully written. What can still go wrong (a power
      loss without fsync, a disk error, a file copied in by hand) is caught by the checksums: `read_block_file`
      returns a status, never unchecked bytes.
"""
import enum
import os
import struct

import xxhash

MAGIC = b"NVKVBLK\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 4096
_FIELDS = struct.Struct("<8sHHI16sQQQ")  # magic, version, header bytes, reserved, fingerprint, hash, size, checksum
_HEADER_CHECKSUM = struct.Struct("<Q")
BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no such file (never written, or removed by an eviction or another engine): a plain miss
    CORRUPT = "corrupt"  # truncated, bad checksum, foreign header: a miss that is counted and removed


def block_file_name(block_hash: int) -> str:
    return f"{block_hash:016x}{BLOCK_SUFFIX}"


def parse_block_file_name(name: str) -> int | None:
    """The block hash a file name stands for; None for anything that is not a block file's name."""
    if len(name) != 16 + len(BLOCK_SUFFIX) or not name.endswith(BLOCK_SUFFIX):
        return None
    try:
        return int(name[:16], 16)
    except ValueError:
        return None


def pack_header(fingerprint: bytes, block_hash: int, payload) -> bytes:
    fields = _FIELDS.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, 0, fingerprint, block_hash, len(payload),
                          xxhash.xxh3_64_intdigest(payload))
    header = fields + _HEADER_CHECKSUM.pack(xxhash.xxh3_64_intdigest(fields))
    return header + bytes(HEADER_BYTES - len(header))


def unpack_header(header: bytes) -> tuple[bytes, int, int, int] | None:
    """(fingerprint, block hash, payload size, payload checksum), or None when the header is not one of ours."""
    end = _FIELDS.size + _HEADER_CHECKSUM.size
    if len(header) < end:
        return None
    fields = header[:_FIELDS.size]
    (checksum,) = _HEADER_CHECKSUM.unpack(header[_FIELDS.size:end])
    if xxhash.xxh3_64_intdigest(fields) != checksum:
        return None
    magic, version, header_bytes, _, fingerprint, block_hash, payload_bytes, payload_checksum = _FIELDS.unpack(fields)
    if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        return None
    return fingerprint, block_hash, payload_bytes, payload_checksum


def as_byte_view(buffer) -> memoryview:
    """A flat byte view of bytes, bytearray, memoryview or a C-contiguous numpy array (no copy)."""
    view = memoryview(buffer)
    if not view.c_contiguous:
        raise ValueError("a block buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def temp_path_for(path: str, tag: str) -> str:
    """A temporary name next to `path` (same directory, so the final rename is atomic), unique per writer."""
    head, tail = os.path.split(path)
    return os.path.join(head, f".{tail}.{os.getpid()}.{tag}{TMP_SUFFIX}")


def write_block_file(path: str, fingerprint: bytes, block_hash: int, payload, tag: str, fsync: bool) -> int:
    """Writes one block file atomically; returns the bytes written. Raises OSError (disk full, directory removed
    under it); the temporary file is gone either way."""
    view = as_byte_view(payload)
    header = pack_header(fingerprint, block_hash, view)
    tmp = temp_path_for(path, tag)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            _write_all(fd, header)
            _write_all(fd, view)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        if fsync:  # the rename itself survives a power loss only once the directory is synced
            _fsync_dir(os.path.dirname(path))
    except BaseException:
        unlink_quietly(tmp)
        raise
    return HEADER_BYTES + len(view)


def read_block_file(path: str, fingerprint: bytes, block_hash: int, into) -> tuple[ReadStatus, int]:
    """Reads a block's payload into the caller's buffer (its size is the expected payload size) and checks it.
    Returns (status, file inode). On anything but OK the buffer holds garbage and must not be used."""
    view = as_byte_view(into)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return ReadStatus.MISSING, 0
    try:
        st = os.fstat(fd)
        if st.st_size != HEADER_BYTES + len(view):
            return ReadStatus.CORRUPT, st.st_ino
        fields = unpack_header(os.pread(fd, _FIELDS.size + _HEADER_CHECKSUM.size, 0))
        if fields is None or fields[:3] != (fingerprint, block_hash, len(view)):
            return ReadStatus.CORRUPT, st.st_ino
        if _read_all(fd, view, HEADER_BYTES) != len(view) or xxhash.xxh3_64_intdigest(view) != fields[3]:
            return ReadStatus.CORRUPT, st.st_ino
        return ReadStatus.OK, st.st_ino
    finally:
        os.close(fd)


def remove_if_same_file(path: str, inode: int) -> bool:
    """Removes a corrupt file unless another writer has already replaced it with a new one (a new inode)."""
    try:
        if os.stat(path).st_ino != inode:
            return False
        os.unlink(path)
        return True
    except OSError:  # gone already, or not ours to remove (another user's cache directory)
        return False


def _fsync_dir(path: str):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_all(fd: int, view: memoryview, offset: int) -> int:
    num_read = 0
    while num_read < len(view):
        n = os.preadv(fd, [view[num_read:]], offset + num_read)
        if n == 0:
            break
        num_read += n
    return num_read


def unlink_quietly(path: str):
    """Removes a file if it can: one already gone, or not ours to remove, is left to whoever owns it."""
    try:
        os.unlink(path)
    except OSError:
        pass
