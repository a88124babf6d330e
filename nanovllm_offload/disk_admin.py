"""What a kv_disk_path directory holds, per fingerprint, and clearing it: the logic of `nanovllm cache ls|clear`
(no torch)."""
import dataclasses
import json
import os
import shutil
import time

from nanovllm_offload.disk_index import META_FILE, fingerprint_dir, is_fingerprint_dir_name, scan


@dataclasses.dataclass(slots=True)
class FingerprintInfo:
    fingerprint: str  # hex; the directory's name
    meta: dict  # meta.json: model name and path, dtype, KV cache dtype, block size, layout...; {} if unreadable
    num_blocks: int
    num_bytes: int
    last_used: float | None  # seconds since the epoch of the most recent write or hit; None without blocks


def list_fingerprints(path: str) -> list[FingerprintInfo]:
    """One entry per fingerprint directory under path, most recently used first."""
    if not os.path.isdir(path):
        raise ValueError(f"kv_disk_path={path!r} is not a directory")
    infos = {name: FingerprintInfo(name, _read_meta(path, name), 0, 0, None)
             for name in sorted(os.listdir(path)) if is_fingerprint_dir_name(name)}
    for f in scan(path, stale_tmp_s=float("inf")):  # ls removes nothing, not even stale temporary files
        name = f.key[0]  # a directory created since listdir is counted too
        info = infos.setdefault(name, FingerprintInfo(name, _read_meta(path, name), 0, 0, None))
        info.num_blocks += 1
        info.num_bytes += f.size_bytes
        info.last_used = max(info.last_used or 0.0, f.last_used_ns / 1e9)
    return sorted(infos.values(), key=lambda i: i.last_used or 0.0, reverse=True)


def clear(path: str, fingerprint: str | None = None) -> list[FingerprintInfo]:
    """Removes one fingerprint's directory (a unique prefix of its hex is enough) or, with None, every fingerprint
    directory; files that are not the disk tier's are left alone. Returns what was removed. An engine using the
    directory meanwhile sees misses, and its writes in flight fail cleanly."""
    infos = list_fingerprints(path)
    if fingerprint is not None:
        infos = [i for i in infos if i.fingerprint.startswith(fingerprint.lower())]
        if len(infos) != 1:
            found = "none" if not infos else ", ".join(i.fingerprint for i in infos)
            raise ValueError(f"fingerprint {fingerprint!r} must name exactly one directory under {path!r} "
                             f"(matches: {found}); `nanovllm cache ls` lists them")
    for info in infos:
        shutil.rmtree(fingerprint_dir(path, info.fingerprint), ignore_errors=True)
    return infos


def format_listing(infos: list[FingerprintInfo]) -> str:
    """`nanovllm cache ls`'s table: one line per fingerprint, then the total."""
    lines = [f"{'FINGERPRINT':<12}  {'MODEL':<28} {'DTYPE':<9} {'KV DTYPE':<9} {'BLOCK':>5} {'TP':>5} "
             f"{'BLOCKS':>8} {'GiB':>8}  LAST USED (UTC)"]
    for info in infos:
        meta = info.meta
        tp = f"{meta.get('tp_rank', '?')}/{meta.get('tp_size', '?')}"
        last_used = time.strftime("%Y-%m-%d %H:%M", time.gmtime(info.last_used)) if info.last_used else "-"
        lines.append(f"{info.fingerprint[:12]:<12}  {str(meta.get('model_name', '?'))[:28]:<28} "
                     f"{str(meta.get('dtype', '?')):<9} {str(meta.get('kv_cache_dtype', '?')):<9} "
                     f"{str(meta.get('block_size', '?')):>5} {tp:>5} {info.num_blocks:>8} "
                     f"{info.num_bytes / (1 << 30):>8.3f}  {last_used}")
    total = sum(i.num_bytes for i in infos) / (1 << 30)
    lines.append(f"{len(infos)} fingerprint(s), {sum(i.num_blocks for i in infos)} blocks, {total:.3f} GiB")
    return "\n".join(lines)


def _read_meta(path: str, fingerprint_hex: str) -> dict:
    try:
        with open(os.path.join(fingerprint_dir(path, fingerprint_hex), META_FILE)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
