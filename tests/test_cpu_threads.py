"""The CPU engine's thread count (nanovllm/utils/cpu_threads.py): the cores the process may use (affinity, cgroup
quota), the load, the model's size, and the user's choices, which win."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest import tiny_llm_kwargs
from nanovllm import LLM
from nanovllm.utils import cpu_threads
from nanovllm.utils.cpu_threads import SMALL_HIDDEN_SIZE, cgroup_cpu_limit, choose_num_threads, usable_cores

BIG = SMALL_HIDDEN_SIZE  # a hidden size worth splitting


def choose(cpu_threads=None, hidden_size=BIG, num_ranks=1, cores=2, load=0.0, env=None, now=2, default=2):
    return choose_num_threads(cpu_threads, hidden_size, num_ranks, cores, load, env or {}, now, default)


def test_an_idle_machine_gets_a_thread_per_core():
    assert choose(cores=8, load=0.2, now=8, default=8)[0] == 8


def test_busy_cores_are_left_to_their_processes():
    # a busy loop on one of two cores: one thread, never a second that waits for that core
    assert choose(cores=2, load=1.0)[0] == 1
    assert choose(cores=8, load=5.4, now=8, default=8)[0] == 3
    assert choose(cores=2, load=7.0)[0] == 1  # never fewer than one


def test_a_small_model_runs_one_thread_even_on_an_idle_machine():
    num_threads, why = choose(hidden_size=576, cores=16, load=0.0, now=16, default=16)
    assert num_threads == 1 and "hidden_size=576" in why


def test_tensor_parallel_ranks_share_the_cores():
    assert choose(num_ranks=2, cores=8, load=0.0, now=8, default=8)[0] == 4
    assert choose(num_ranks=4, cores=2, load=0.0)[0] == 1


@pytest.mark.parametrize("env, why", [({"OMP_NUM_THREADS": "3"}, "OMP_NUM_THREADS=3"),
                                      ({"MKL_NUM_THREADS": "3"}, "MKL_NUM_THREADS=3")])
def test_the_usual_environment_variables_win(env, why):
    # torch read the variable when it started: its count stays, whatever the load
    assert choose(env=env, now=3, load=1.5, hidden_size=576) == (3, choose(env=env, now=3)[1])
    assert why in choose(env=env, now=3)[1]


def test_the_option_wins_over_everything():
    assert choose(cpu_threads=2, env={"OMP_NUM_THREADS": "1"}, hidden_size=576, load=9.0) == (2, "cpu_threads=2")


def test_a_count_the_user_set_in_torch_is_kept():
    num_threads, why = choose(cores=8, now=3, default=8, hidden_size=576)
    assert num_threads == 3 and "torch.set_num_threads" in why


def test_cgroup_v2_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "_v2_path", lambda: "/")
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.5
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None


def test_cgroup_v1_quota(tmp_path):
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_limit(str(tmp_path)) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("100000\n")
    assert cgroup_cpu_limit(str(tmp_path)) == 1.0


def test_usable_cores_is_the_affinity_cut_to_the_quota(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_threads, "affinity_cores", lambda: 8)
    monkeypatch.setattr(cpu_threads, "_v2_path", lambda: "/")
    assert usable_cores(str(tmp_path)) == 8  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert usable_cores(str(tmp_path)) == 2  # 2.5 CPUs: a third busy thread would be throttled
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert usable_cores(str(tmp_path)) == 1


@pytest.fixture
def torch_threads():
    """Restores torch's count (the engine sets it for the whole process)."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    cpu_threads._engine_num_threads = None


def test_the_engine_sets_and_logs_its_choice(qwen3_dir, monkeypatch, caplog, torch_threads):
    for name in cpu_threads.THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(cpu_threads, "affinity_cores", lambda: 2)
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    torch.set_num_threads(2)  # torch's default on 2 cores
    with caplog.at_level(logging.INFO, logger="nanovllm.utils.cpu_threads"):
        with LLM(qwen3_dir, **tiny_llm_kwargs()):
            assert torch.get_num_threads() == 1  # the tiny model's hidden size is small
    lines = [r.getMessage() for r in caplog.records if "intra-op thread" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("CPU: 1 intra-op thread(s)"), lines
    with LLM(qwen3_dir, **tiny_llm_kwargs(cpu_threads=2)):
        assert torch.get_num_threads() == 2


def test_cpu_threads_must_be_a_positive_int(qwen3_dir):
    with pytest.raises(ValueError, match=r"cpu_threads=0 must be an int >= 1"):
        LLM(qwen3_dir, **tiny_llm_kwargs(cpu_threads=0))
