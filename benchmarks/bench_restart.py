"""bench_swap.py --scenario laptop-agent-restart: the laptop agent's sessions across a process restart, with and
without the disk tier (docs/disk_tier.md). The workload and the engine options are bench_laptop.py's.

A "before" process runs turns 1-4 with the host tier (write_back) and kv_disk_path set to a fresh directory, closes
its engine (which waits for every disk write) and saves the sessions' token histories (prompts and generated ids) as
JSON. Then a fresh process per mode runs turns 5-8 from those histories: "cold" without a disk tier (a restart that
recomputes the history) and "disk" with the same kv_disk_path (the engine loads each hit or recomputes it, by its own
rule). "cold" never opens the directory, so both start from the state "before" left. Before "disk" the directory's
files are dropped from the page cache (unless --keep-page-cache), so its reads come from the device, as after a
reboot. The directory (kv/ and histories.json) is made under --out-dir and removed at the end unless
--keep-restart-dir.
"""
import json
import os
import shutil
import statistics
import tempfile

HISTORIES_FILE = "histories.json"
SCENARIO = "laptop-agent-restart"


# --- inside the processes
def save_histories(restart_dir: str, histories: list[list[int]], workload: dict):
    with open(os.path.join(restart_dir, HISTORIES_FILE), "w") as f:
        json.dump(dict(workload=workload, histories=histories), f)


def load_histories(restart_dir: str, workload: dict) -> list[list[int]]:
    """The histories "before" saved; ValueError when they were made with another workload (sessions, token scale)."""
    path = os.path.join(restart_dir, HISTORIES_FILE)
    with open(path) as f:
        saved = json.load(f)
    if saved["workload"] != workload:
        raise ValueError(f"{path} holds the histories of {saved['workload']}, not of {workload}; run both sides "
                         f"from one bench_swap.py --scenario {SCENARIO} command")
    return saved["histories"]


class DiskDecisions:
    """Each disk hit's load-or-recompute decision and the two speeds the rule compared (the store's measured read
    speed, the policy's prefill speed: PreemptionPolicy.should_load_from_disk), recorded by wrapping this engine's
    DiskTier.start_load. `rule_says_load` is the rule's verdict on those inputs; `is_loading` what happened (a full
    host pool also recomputes). start_prefill_tokens_per_s: the policy's prefill speed as the engine started (on
    CUDA measured at start-up, on the CPU the prior), before the warm-up's prefills moved it."""

    def __init__(self, llm, start_prefill_tokens_per_s: float | None = None):
        self.points: list[dict] = []
        self.start_prefill_tokens_per_s = start_prefill_tokens_per_s
        self.host_tier = llm.host_tier
        self.disk = llm.host_tier.disk if llm.host_tier is not None else None
        if self.disk is not None:
            self.disk.start_load = self._recorded(self.disk, self.disk.start_load)

    def _recorded(self, disk, start_load):
        def recorded_start_load(seq, num_hit_blocks: int, host_hit_ids: list[int]) -> bool:
            read_bytes_per_s, prefill_tokens_per_s = disk.store.read_bytes_per_s, disk.policy.prefill_tokens_per_s
            num_hit_tokens = disk.counters["disk_hit_tokens"]
            is_loading = start_load(seq, num_hit_blocks, host_hit_ids)
            num_tokens = disk.counters["disk_hit_tokens"] - num_hit_tokens
            if num_tokens:
                num_bytes = num_tokens // disk.block_size * disk.store.block_bytes
                self.points.append(dict(hit_tokens=num_tokens, is_loading=is_loading,
                                        rule_says_load=disk.policy.should_load_from_disk(num_tokens, num_bytes,
                                                                                         read_bytes_per_s),
                                        read_bytes_per_s=read_bytes_per_s, prefill_tokens_per_s=prefill_tokens_per_s))
            return is_loading
        return recorded_start_load

    def summary(self) -> dict:
        """The decisions, the speeds as measured at the end, and what the directory holds (after llm.close(): with
        the writes the engine finished at close)."""
        policy = self.host_tier.policy if self.host_tier is not None else None
        out = dict(decisions=self.points, prefill_tokens_per_s=policy.prefill_tokens_per_s if policy else None,
                   start_prefill_tokens_per_s=self.start_prefill_tokens_per_s)
        if self.disk is not None:
            store = self.disk.store.stats()
            out.update(read_bytes_per_s=self.disk.store.read_bytes_per_s, disk_num_blocks=store["disk_num_blocks"],
                       disk_used_bytes=store["disk_used_bytes"],
                       bytes_per_token=self.disk.store.block_bytes / self.disk.block_size)
        return out


# --- the parent
def run_restart(modes: list[str], args, run_child) -> list[dict]:
    """"before", then a fresh process per mode; run_child(scenario, mode, extra_argv) returns a process's result or
    None when it failed. Returns the results that came back, "before" first."""
    os.makedirs(args.out_dir, exist_ok=True)  # as the other scenarios' --out-dir (their plots) is
    restart_dir = tempfile.mkdtemp(prefix="bench_restart_", dir=args.out_dir)
    kv_path = os.path.join(restart_dir, "kv")
    print(f"{SCENARIO}: KV directory {kv_path} on {filesystem_of(restart_dir)}", flush=True)
    extra = ["--restart-dir", restart_dir]
    try:
        before = run_child(SCENARIO, "before", extra)
        if before is None:
            return []
        results = [before]
        for mode in modes:
            if mode == "disk" and not args.keep_page_cache:
                print(f"{SCENARIO}: dropped {drop_page_cache(kv_path) / 1e9:.2f} GB of files from the page cache",
                      flush=True)
            result = run_child(SCENARIO, mode, extra)
            results += [result] if result is not None else []
        return results
    finally:
        if not args.keep_restart_dir:
            shutil.rmtree(restart_dir, ignore_errors=True)


def drop_page_cache(path: str) -> int:
    """Write the files under path back and ask the kernel to drop them from the page cache (POSIX_FADV_DONTNEED), so
    that reading them measures the device. Returns the bytes asked for."""
    os.sync()
    num_bytes = 0
    for root, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                num_bytes += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return num_bytes


def filesystem_of(path: str) -> str:
    """The filesystem type and mount point under path (/proc/mounts): on tmpfs, "disk" reads are memory reads."""
    path, best = os.path.realpath(path), ("", "an unknown filesystem")
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f]
    except OSError:
        mounts = []
    for mount_point, fs_type in mounts:
        inside = path == mount_point or path.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best[0]):
            best = (mount_point, fs_type)
    return f"{best[1]} ({best[0] or '?'})"


def print_restart_table(scenario_options: dict, results: list[dict]):
    shapes = sorted({r["shape"] for r in results})
    print(f"\n## {SCENARIO}: {dict(scenario_options, shape=', '.join(shapes) or scenario_options['shape'])}")
    for r in results:
        if r["mode"] == "before":
            s = r["stats"]
            print(f"before: turns {_turn_range(r)} in {r['seconds']:.1f} s, {s['prefill_tokens']} prompt tokens "
                  f"computed; at exit the directory holds {r['disk']['disk_num_blocks']} blocks "
                  f"({r['disk']['disk_used_bytes'] / 1e9:.2f} GB); histories of {r['end_history_tokens']} tokens saved")
    after = {r["mode"]: r for r in results if r["mode"] != "before"}
    if after:
        _print_after_rows(after)


def _print_after_rows(after: dict[str, dict]):
    """One row per process after the restart. The speeds: the median over its disk hits of what the rule read, then
    the engine's measurement at the end; a read speed also as tokens/s (one rank's bytes per token); the prefill
    speed also as the engine started (seeded: measured at start-up on CUDA, the prior on the CPU)."""
    head = ("mode", "after s", "per turn s", "prompt tok computed", "GPU hits", "host hits",
            "disk hit/loaded/skipped tok", "disk read GB", "read GB/s (tok/s) at hits; end",
            "prefill tok/s at start; at hits; end", "loads/hits (rule: load)", "TTFT p50 s", "sched->1st tok p50 s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for mode, r in after.items():
        s, disk = r["stats"], r["disk"]
        points = disk["decisions"]
        per_turn = "/".join(f"{t['seconds']:.2f}" for t in r["turns"])
        print(f"| {mode} | {r['seconds']:.2f} | {per_turn} | {s['prefill_tokens']} | {s['prefix_cache_hit_tokens']} | "
              f"{s['host_prefix_hit_tokens']} | {s['disk_hit_tokens']}/{s['disk_loaded_tokens']}/"
              f"{s['disk_skipped_tokens']} | {s['disk_read_bytes'] / 1e9:.2f} | {_read_speeds(disk)} | "
              f"{_number(disk.get('start_prefill_tokens_per_s'), '{:.0f}')}; "
              f"{_median(points, 'prefill_tokens_per_s', '{:.0f}')}; "
              f"{_number(disk['prefill_tokens_per_s'], '{:.0f}')} | "
              f"{sum(p['is_loading'] for p in points)}/{len(points)} ({sum(p['rule_says_load'] for p in points)}) | "
              f"{r['latency']['ttft_p50']:.3f} | "
              f"{_number(statistics.median(r['agent_waits']) if r['agent_waits'] else None, '{:.3f}')} |")
    if "cold" in after and "disk" in after:
        cold, disk = after["cold"], after["disk"]
        print(f"\nturns {_turn_range(disk)}: computed(disk)/computed(cold) = "
              f"{_ratio(disk['stats']['prefill_tokens'], cold['stats']['prefill_tokens'])}, time(disk)/time(cold) = "
              f"{_ratio(disk['seconds'], cold['seconds'])}")
        first_cold, first_disk = cold["turns"][0], disk["turns"][0]
        print(f"turn {first_disk['turn']} (the first after the restart): computed(disk)/computed(cold) = "
              f"{_ratio(first_disk['computed'], first_cold['computed'])} ({first_disk['computed']} of "
              f"{first_cold['computed']} tokens), time(disk)/time(cold) = "
              f"{_ratio(first_disk['seconds'], first_cold['seconds'])}")


def _read_speeds(disk: dict) -> str:
    if "read_bytes_per_s" not in disk:
        return "-"
    to_tokens = 1 / disk["bytes_per_token"]
    at_hits = [p["read_bytes_per_s"] for p in disk["decisions"]]
    at = (f"{statistics.median(at_hits) / 1e9:.2f} ({statistics.median(at_hits) * to_tokens:.0f})" if at_hits
          else "-")
    return f"{at}; {disk['read_bytes_per_s'] / 1e9:.2f} ({disk['read_bytes_per_s'] * to_tokens:.0f})"


def _median(points: list[dict], key: str, fmt: str) -> str:
    return fmt.format(statistics.median(p[key] for p in points)) if points else "-"


def _number(value, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "-"


def _turn_range(r: dict) -> str:
    return f"{r['turns'][0]['turn']}-{r['turns'][-1]['turn']}" if r["turns"] else "none"
