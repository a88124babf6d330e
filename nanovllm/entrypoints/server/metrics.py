"""/metrics: the engine loop's snapshot in Prometheus' text format (prometheus_client writes it), and the sliding
window behind the two throughput gauges."""
from __future__ import annotations

from bisect import bisect_left
from collections import deque

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

# (name, type, help): the name is the key in EngineLoop's snapshot; every name gets the prefix `nanovllm_`, and
# prometheus_client adds the suffix `_total` to counters
METRICS = [
    ("num_requests_running", "gauge", "Requests in the running batch"),
    ("num_requests_waiting", "gauge", "Requests waiting to be admitted (new, or preempted by recompute)"),
    ("num_requests_swapped", "gauge", "Requests whose KV is swapped out to host memory"),
    ("prefill_throughput_tokens_per_s", "gauge", "Prefill tokens per second over the last 10 s"),
    ("decode_throughput_tokens_per_s", "gauge", "Decode tokens per second over the last 10 s"),
    ("num_gpu_blocks", "gauge", "KV blocks on the GPU (device) tier"),
    ("num_free_gpu_blocks", "gauge", "Free GPU KV blocks (prefix-cached blocks that no request holds count as free)"),
    ("gpu_kv_cache_usage_ratio", "gauge", "Fraction of GPU KV blocks held by requests"),
    ("num_cpu_blocks", "gauge", "KV blocks in the host tier (0: no host tier)"),
    ("num_free_cpu_blocks", "gauge", "Free host KV blocks (cached blocks that no swapped request holds count as free)"),
    ("cpu_kv_cache_usage_ratio", "gauge", "Fraction of host KV blocks held by swapped requests"),
    ("finished_requests", "counter", "Requests that finished (stop or length)"),
    ("aborted_requests", "counter", "Requests aborted because their client disconnected"),
    ("rejected_requests", "counter", "Requests refused with HTTP 400 for their prompt or sampling values"),
    ("prefill_tokens", "counter", "Prompt tokens computed (recomputed ones included)"),
    ("decode_tokens", "counter", "Tokens computed by decode steps"),
    ("prefix_cache_hit_tokens", "counter", "Prompt tokens served from the prefix cache"),
    ("preemptions", "counter", "Preemptions (swap and recompute)"),
    ("preemptions_swap", "counter", "Preemptions by swapping KV out to host memory"),
    ("preemptions_recompute", "counter", "Preemptions by recompute"),
    ("recomputed_tokens", "counter", "Tokens computed again after a recompute preemption"),
    ("blocks_swapped_out", "counter", "KV blocks copied GPU -> host"),
    ("blocks_swapped_in", "counter", "KV blocks copied host -> GPU"),
    ("bytes_swapped_out", "counter", "Bytes copied GPU -> host (all ranks)"),
    ("bytes_swapped_in", "counter", "Bytes copied host -> GPU (all ranks)"),
    ("swap_seconds", "counter", "Seconds spent in swap copies"),
    ("swap_exposed_seconds", "counter", "Swap copy seconds not hidden behind compute"),
    ("host_prefix_query_tokens", "counter", "Prompt tokens looked up in the host prefix cache"),
    ("host_prefix_hit_tokens", "counter", "Prompt tokens served from the host prefix cache"),
    ("blocks_offloaded", "counter", "Cached KV blocks copied to the host prefix cache"),
    ("blocks_onloaded", "counter", "Host prefix-cache blocks copied back to the GPU"),
    ("disk_hit_tokens", "counter", "Prompt tokens found in the disk tier (0: no disk tier)"),
    ("disk_loaded_tokens", "counter", "Prompt tokens loaded from the disk tier instead of prefilled"),
    ("blocks_written_to_disk", "counter", "KV blocks written to the disk tier"),
    ("blocks_evicted_from_disk", "counter", "KV block files evicted from the disk tier (cap or full file system)"),
    ("disk_write_errors", "counter", "Disk tier writes that failed (a full file system's are retried after evicting)"),
]

# (name, help, bucket upper bounds in seconds): vLLM's names and buckets; observed when a request finishes, from
# generate()'s "metrics" (nanovllm/core/request_metrics.py)
HISTOGRAMS = [
    ("time_to_first_token_seconds", "Seconds from a request's arrival to its first token",
     (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
      160.0, 640.0, 2560.0)),
    ("inter_token_latency_seconds", "Seconds between two consecutive tokens of a request",
     (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)),
]

METRICS_CONTENT_TYPE = CONTENT_TYPE_LATEST


class _SnapshotCollector:
    """A prometheus_client collector over one snapshot: the numbers are read on the engine loop's thread, so
    /metrics takes them first and then renders them (a collector cannot await)."""

    def __init__(self, snapshot: dict):
        self.snapshot = snapshot

    def collect(self):
        for name, kind, help in METRICS:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"nanovllm_{name}", help, value=self.snapshot[name])
        for name, help, bounds in HISTOGRAMS:
            counts, total = self.snapshot[name]
            cumulative, running = [], 0
            for bound, count in zip((*map(str, bounds), "+Inf"), counts):
                running += count
                cumulative.append((bound, running))
            yield HistogramMetricFamily(f"nanovllm_{name}", help, buckets=cumulative, sum_value=total)


def format_metrics(snapshot: dict) -> bytes:
    """The Prometheus text exposition of a snapshot (see METRICS)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snapshot))
    return generate_latest(registry)


class LatencyHistograms:
    """Bucket counts and sums of HISTOGRAMS, filled on the engine loop's thread as requests finish."""

    def __init__(self):
        self.counts = {name: [0] * (len(bounds) + 1) for name, _, bounds in HISTOGRAMS}  # the last one: +Inf
        self.sums = {name: 0.0 for name, _, _ in HISTOGRAMS}

    def observe(self, metrics: dict):
        if metrics["ttft"] is not None:
            self._add("time_to_first_token_seconds", metrics["ttft"])
        for gap in metrics["inter_token_latencies"]:
            self._add("inter_token_latency_seconds", gap)

    def _add(self, name: str, seconds: float):
        bounds = next(b for n, _, b in HISTOGRAMS if n == name)
        self.counts[name][bisect_left(bounds, seconds)] += 1  # le: a value on a bound falls in that bucket
        self.sums[name] += seconds

    def snapshot(self) -> dict:
        return {name: (list(self.counts[name]), self.sums[name]) for name in self.counts}


def usage_ratio(num_blocks: int, num_free: int) -> float:
    return (num_blocks - num_free) / num_blocks if num_blocks else 0.0


class Throughput:
    """Prefill and decode tokens per second over the last `window_s` seconds, from the engine's running totals
    sampled after each step. The newest sample from before the window stays as the baseline: every token counted
    after it was computed inside the window (or since the first sample, when that is younger)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self.samples: deque[tuple[float, int, int]] = deque()  # (time, prefill_tokens, decode_tokens)

    def add(self, now: float, prefill_tokens: int, decode_tokens: int):
        self.samples.append((now, prefill_tokens, decode_tokens))
        self._prune(now)

    def rates(self, now: float) -> tuple[float, float]:
        self._prune(now)
        if len(self.samples) < 2:
            return 0.0, 0.0
        (t0, p0, d0), (_, p1, d1) = self.samples[0], self.samples[-1]
        seconds = max(now - max(t0, now - self.window_s), 1e-9)
        return (p1 - p0) / seconds, (d1 - d0) / seconds

    def _prune(self, now: float):
        while len(self.samples) > 1 and self.samples[1][0] <= now - self.window_s:
            self.samples.popleft()
