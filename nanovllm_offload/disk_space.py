"""What the file system under kv_disk_path can hold, and the small JSON files kept beside the blocks (no torch).

The disk tier's cap is a budget, not a promise that the space is there: the store fits it to the file system at
start and whenever a write finds the disk full (DiskStore._fit_cap_to_file_system, docs/disk_tier.md).
"""
import errno
import json
import logging
import os

NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # a full file system, or the user's quota: room can be made
logger = logging.getLogger(__name__)


def free_disk_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the file system that holds path."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fitted_capacity(num_used_bytes: int, free_bytes: int, room_bytes: int, min_bytes: int) -> int:
    """The cap the file system can keep: the tier's files plus the free space, less `room_bytes` (what the writes
    in flight need before the eviction after each), and never below `min_bytes` (one file)."""
    return max(min_bytes, num_used_bytes + free_bytes - room_bytes)


def write_json_atomically(path: str, data, what_is_lost: str) -> bool:
    """Writes data as JSON to a temporary name beside path and renames it over path. On failure (a full disk) the
    temporary file is removed and the failure logged with `what_is_lost`; False."""
    tmp = f"{os.path.join(os.path.dirname(path), '.' + os.path.basename(path))}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
        return True
    except OSError as error:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        logger.warning("disk tier: could not write %s (%s): %s", path, error, what_is_lost)
        return False
