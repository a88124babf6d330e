"""Per-request timings (nanovllm/core/request_metrics.py) as the scheduler marks them."""
from metadata_factories import make_scheduler, make_seq
from nanovllm.core.request_metrics import RequestMetrics, latency_summary, percentile


def run_step(s):
    out = s.schedule()
    return out, s.postprocess(out, [1] * sum(out.samples))


def run_to_end(s, seqs):
    while not all(seq.is_finished for seq in seqs):
        run_step(s)


def check_fields(m: dict, num_tokens: int):
    order = [m["arrival_time"], m["first_scheduled_time"], m["first_token_time"], m["finished_time"]]
    assert order == sorted(order), m
    assert 0 <= m["ttft"] <= m["finished_time"] - m["arrival_time"]
    assert len(m["inter_token_latencies"]) == num_tokens - 1
    assert min(m["inter_token_latencies"]) >= 0 and m["max_token_gap"] == max(m["inter_token_latencies"])


def test_fields_in_order_for_every_request():
    s = make_scheduler(num_gpu_blocks=16)
    seqs = [make_seq(6, start=100 * i) for i in range(1, 4)]
    for seq in seqs:
        s.add(seq)
    run_to_end(s, seqs)
    for seq in seqs:
        check_fields(seq.metrics.as_dict(), 8)


def test_preempted_sequence_keeps_its_first_token_time():
    for mode in ("recompute", "swap"):
        s = make_scheduler(num_gpu_blocks=5, num_cpu_blocks=8, mode=mode)
        a, b = make_seq(8), make_seq(8, start=200)
        s.add(a)
        s.add(b)
        run_step(s)
        first_token, first_scheduled = b.metrics.first_token_time, b.metrics.first_scheduled_time
        assert first_token is not None
        run_step(s)
        assert s.stats.preemptions == 1 and b.status.name in ("WAITING", "SWAPPED"), mode
        run_to_end(s, [a, b])
        assert b.metrics.first_token_time == first_token and b.metrics.first_scheduled_time == first_scheduled
        check_fields(b.metrics.as_dict(), 8)


def test_token_gaps_and_summary():
    m = RequestMetrics(arrival_time=10.0)
    m.mark_scheduled(10.5)
    m.mark_scheduled(11.0)  # only the first counts
    for t in (11.0, 11.25, 12.0):
        m.mark_token(t)
    m.mark_finished(12.0)
    d = m.as_dict()
    assert d["ttft"] == 1.0 and d["first_scheduled_time"] == 10.5 and d["max_token_gap"] == 0.75
    assert d["inter_token_latencies"] == [0.25, 0.75]
    assert RequestMetrics(0.0).as_dict()["max_token_gap"] == 0.0
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile(list(range(1, 101)), 99) == 99
    assert latency_summary([d]) == {"ttft_p50": 1.0, "ttft_p99": 1.0, "itl_p50": 0.25, "itl_p99": 0.75}


def test_server_histograms_in_prometheus_format():
    from prometheus_client.parser import text_string_to_metric_families
    from nanovllm.entrypoints.server.metrics import METRICS, LatencyHistograms, format_metrics
    hist = LatencyHistograms()
    hist.observe({"ttft": 0.3, "inter_token_latencies": [0.01, 0.02, 0.5]})
    hist.observe({"ttft": None, "inter_token_latencies": []})  # aborted before its first token
    text = format_metrics({**{name: 0 for name, _, _ in METRICS}, **hist.snapshot()}).decode()
    samples = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["nanovllm_time_to_first_token_seconds_bucket", "0.25"] == 0
    assert samples["nanovllm_time_to_first_token_seconds_bucket", "0.5"] == 1
    assert samples["nanovllm_time_to_first_token_seconds_count", None] == 1
    assert samples["nanovllm_inter_token_latency_seconds_bucket", "0.01"] == 1  # le: on the bound counts
    assert samples["nanovllm_inter_token_latency_seconds_bucket", "0.025"] == 2
    assert samples["nanovllm_inter_token_latency_seconds_bucket", "+Inf"] == 3
    assert abs(samples["nanovllm_inter_token_latency_seconds_sum", None] - 0.53) < 1e-9


def test_every_inter_token_gap_is_a_step_in_both_scheduling_modes(qwen3_dir, monkeypatch):
    """A step that takes STEP_S to compute: each token arrives one step after the one before, the last one too.
    With asynchronous scheduling on the CPU the host reads a step back only after computing the next one, so
    stamping tokens at the read-back recorded the last gap as ~0 (and shifted the others by a step)."""
    import time

    from conftest import tiny_llm_kwargs
    from nanovllm import LLM, SamplingParams
    from nanovllm.engine.model_runner import ModelRunner
    step_s = 0.03
    launch = ModelRunner.launch

    def slow_launch(self, plan, sample_seqs=None, grammar_mask=None):
        if plan.num_tokens:
            time.sleep(step_s)
        return launch(self, plan, sample_seqs, grammar_mask)

    monkeypatch.setattr(ModelRunner, "launch", slow_launch)
    for asynchronous in (False, True):
        with LLM(qwen3_dir, **tiny_llm_kwargs(async_scheduling=asynchronous)) as llm:
            [out] = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
        gaps = out["metrics"]["inter_token_latencies"]
        assert len(gaps) == 4 and min(gaps) >= 0.8 * step_s, (asynchronous, gaps)
