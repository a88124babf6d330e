"""A request's timings, as vLLM's RequestMetrics (plain Python; no torch).

Times are time.perf_counter() seconds: only their differences mean anything (TTFT, gaps), and the clock never
jumps. A token's time is when the host reads it back, once per step for all its sequences.
"""
import math
import time
from array import array


class RequestMetrics:
    """NOTE: arrival <= first_scheduled <= first_token <= finished once each is set; a preempted sequence keeps its
    first_scheduled and first_token times (the user already has that token), and the wait it causes shows as a gap."""
    __slots__ = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "finished_time",
                 "token_gaps")

    def __init__(self, arrival_time: float | None = None):
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None
        self.token_gaps = array("d")  # seconds between consecutive tokens (inter-token latencies)

    def mark_scheduled(self, now: float):
        if self.first_scheduled_time is None:
            self.first_scheduled_time = now

    def mark_token(self, now: float):
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.token_gaps.append(now - self.last_token_time)
        self.last_token_time = now

    def mark_finished(self, now: float):
        if self.finished_time is None:
            self.finished_time = now

    def as_dict(self) -> dict:
        """generate()'s "metrics": the times, ttft (first token - arrival), max_token_gap (0 below two tokens) and
        inter_token_latencies (every gap, for percentiles)."""
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        return {"arrival_time": self.arrival_time, "first_scheduled_time": self.first_scheduled_time,
                "first_token_time": self.first_token_time, "finished_time": self.finished_time, "ttft": ttft,
                "max_token_gap": max(self.token_gaps, default=0.0),
                "inter_token_latencies": self.token_gaps.tolist()}


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latency_summary(metrics: list[dict]) -> dict:
    """TTFT and inter-token latency p50/p99 (seconds) over generate()'s "metrics" dicts."""
    ttfts = [m["ttft"] for m in metrics if m["ttft"] is not None]
    gaps = [g for m in metrics for g in m["inter_token_latencies"]]
    return {"ttft_p50": percentile(ttfts, 50), "ttft_p99": percentile(ttfts, 99),
            "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99)}
