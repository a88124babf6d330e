"""bench_swap.py --scenario laptop-agent-restart on the CPU, end to end: a config-only Qwen3 shape with dummy weights
(as the GPU runs use), the agent workload shortened; a "before" process, then a fresh "cold" and "disk" process.
And why its disk hits are legitimate: dummy weights are the same in every process (the disk tier's fingerprint
names load_format="dummy" and the seed instead of weight files: tests/test_disk_store.py)."""
import json
import os
import subprocess
import sys

import pytest
import xxhash

from conftest import close_llm
from nanovllm_offload.offload_manager import CPU_PREFILL_PRIOR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench_swap  # noqa: E402

pytestmark = [pytest.mark.subprocess, pytest.mark.slow]  # the restart is a second process

# config.json only (load_format="dummy"): a vocabulary that holds the workload's ids (0-10,000) and positions for the
# scenario's max_model_len (32,768); 1 KiB of KV per token in float32
TINY_SHAPE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=10240, hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  max_position_embeddings=32768, rope_theta=1e5, rms_norm_eps=1e-6, hidden_act="silu",
                  attention_bias=False, tie_word_embeddings=True, torch_dtype="float32", bos_token_id=1, eos_token_id=2)
# 2 sessions x 8 turns, every length x 0.05: histories of about 550 tokens at the restart; a 20 MiB KV, a 50 MiB host
# pool, 16-token blocks; --gpu-memory-gib 0: no budget (a CPU has no GPU memory to cap)
QUICK = ["--scale", "0.5", "--token-scale", "0.05", "--kv-gib", "0.02", "--swap-space", "0.05", "--gpu-memory-gib", "0",
         "--kvcache-block-size", "16", "--enforce-eager", "--no-tqdm"]


def tiny_shape_dir(tmp_path) -> str:
    path = tmp_path / "tiny-qwen3"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(TINY_SHAPE))
    return str(path)


def test_the_disk_tier_across_a_restart_computes_less_than_a_cold_restart(tmp_path, monkeypatch):
    tables = []
    out_dir = tmp_path / "out"  # not there yet: the benchmark makes it
    argv = ["--scenario", "laptop-agent-restart", "--shape", tiny_shape_dir(tmp_path), "--out-dir", str(out_dir),
            "--keep-restart-dir", *QUICK]
    monkeypatch.setattr(sys, "argv", ["bench_swap.py", *argv])
    monkeypatch.setattr(bench_swap, "print_restart_table", lambda options, results: tables.append(results))
    assert bench_swap.main() == 0
    runs = {r["mode"]: r for r in tables[-1]}
    before, cold, disk = runs["before"], runs["cold"], runs["disk"]
    assert [t["turn"] for t in before["turns"]] == [1, 2, 3, 4]
    assert [t["turn"] for t in cold["turns"]] == [t["turn"] for t in disk["turns"]] == [5, 6, 7, 8]
    assert before["disk"]["disk_num_blocks"] > 0  # written by the time its engine closed
    # the histories file: what "before" generated is what both later processes started from
    [restart_dir] = [p for p in out_dir.iterdir() if p.name.startswith("bench_restart_")]
    saved = json.loads((restart_dir / "histories.json").read_text())["histories"]
    assert sum(map(len, saved)) == before["end_history_tokens"] == cold["start_history_tokens"] \
        == disk["start_history_tokens"]
    # the histories' generated tokens are found on disk: the file was used, and the fingerprint of the dummy model hit
    assert cold["stats"]["disk_hit_tokens"] == 0 and cold["disk"]["decisions"] == []
    s = disk["stats"]
    assert s["disk_hit_tokens"] > 0 and s["disk_hit_tokens"] == s["disk_loaded_tokens"] + s["disk_skipped_tokens"]
    assert sum(p["hit_tokens"] for p in disk["disk"]["decisions"]) == s["disk_hit_tokens"]
    for point in disk["disk"]["decisions"]:
        assert point["read_bytes_per_s"] > 0 and point["prefill_tokens_per_s"] > 0
        assert not point["is_loading"] or point["rule_says_load"]
    # Load or recompute is decided at the first admission after the restart, before this engine has measured a
    # prefill: the CPU prior (about 1k tokens/s) against the probe's read speed, which for 1 KiB per token beats it
    # unless the files read at under 1 MB/s. So here the rule loads, and the disk run computes less.
    assert s["disk_loaded_tokens"] > 0
    assert disk["disk"]["start_prefill_tokens_per_s"] == CPU_PREFILL_PRIOR  # the CPU measures none at start-up
    assert disk["turns"][0]["computed"] < cold["turns"][0]["computed"]
    assert s["prefill_tokens"] < cold["stats"]["prefill_tokens"]


DUMMY_WEIGHTS_HASH = """
import sys
sys.path.insert(0, {tests!r})
from test_bench_restart import dummy_weights_hash
print(dummy_weights_hash({model!r}, 0))
"""


def dummy_weights_hash(model: str, seed: int) -> str:
    from nanovllm import LLM
    llm = LLM(model, load_format="dummy", seed=seed, device="cpu", max_model_len=256, num_kvcache_blocks=16,
              enforce_eager=True)
    try:
        h = xxhash.xxh3_128()
        for name, param in llm.runner.model.state_dict().items():
            h.update(name.encode())
            h.update(param.detach().cpu().contiguous().view(-1).numpy().tobytes())
        return h.hexdigest()
    finally:
        close_llm(llm)


def test_dummy_weights_are_the_same_in_every_process(tmp_path):
    model = tiny_shape_dir(tmp_path)
    code = DUMMY_WEIGHTS_HASH.format(tests=os.path.dirname(os.path.abspath(__file__)), model=model)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    here = dummy_weights_hash(model, 0)
    assert done.stdout.strip().splitlines()[-1] == here
    assert dummy_weights_hash(model, 1) != here  # the seed decides them
