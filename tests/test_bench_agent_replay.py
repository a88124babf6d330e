"""benchmarks/bench_agent_replay.py: the recorded session's shape, and the CPU smoke run of the whole replay (two
server subprocesses, tiny model) with the numbers it must report."""
import json

import pytest

from benchmarks.agent_session import NUM_TOOLS, agent_session


def test_the_session_shares_its_prompt_and_answers_every_tool_use():
    sessions = [agent_session(s, num_turns=8, token_scale=0.1) for s in range(2)]
    assert sessions[0]["system"] == sessions[1]["system"] and sessions[0]["tools"] == sessions[1]["tools"]
    assert len(sessions[0]["tools"]) == NUM_TOOLS and sessions[0]["messages"] != sessions[1]["messages"]
    messages = sessions[0]["messages"]
    assert len(messages) == 1 + 2 * 7 and [m["role"] for m in messages[:3]] == ["user", "assistant", "user"]
    for call, result in zip(messages[1::2], messages[2::2]):
        assert call["content"][1]["id"] == result["content"][0]["tool_use_id"]
    assert agent_session(0, 8, 0.1) == sessions[0]  # the same session every run


@pytest.mark.slow
@pytest.mark.subprocess
def test_cpu_smoke_run_reports_computed_share_and_time_to_first_token(tmp_path):
    from benchmarks.bench_agent_replay import main
    out = tmp_path / "replay.json"
    assert main(["--shape", "tiny", "--device", "cpu", "--token-scale", "0.05", "--num-sessions", "2",
                 "--num-turns", "8", "--max-tokens", "4", "--swap-space", "1", "--max-model-len", "8192",
                 "--out", str(out)]) == 0
    results = {r["mode"]: r for r in json.loads(out.read_text())["results"]}
    assert set(results) == {"no_host_tier", "host_tier"}
    for r in results.values():
        assert r["num_requests"] == 16 and r["max_prompt_tokens"] > 5000 and r["median_ttft_s"] > 0
        assert r["prompt_tokens_after_turn_1"] == results["host_tier"]["prompt_tokens_after_turn_1"]
        assert 0 < r["computed_share_after_turn_1"] < 1
    # the KV holds less than both sessions' histories: the host tier's prefix cache saves what recompute pays again
    assert results["host_tier"]["computed_after_turn_1"] < results["no_host_tier"]["computed_after_turn_1"]
