"""The ranks behind one call: rank 0's ModelRunner in this process and, with tensor parallelism, ranks 1..N-1 in
worker processes (workers.py's WorkerPool). The engine never asks which: `call` runs a runner method on every
rank, `launch` starts a step on every rank, `wait` collects the workers' replies.

NOTE: every rank must see the same calls in the same order (their collectives pair up), so a call is sent to the
workers before rank 0 runs it, and its replies are collected before the next call is sent.
"""
import atexit
import logging

import torch

from nanovllm.config import Config
from nanovllm.core.memory_plan import GiB, format_breakdown
from nanovllm.core.sequence import Sequence
from nanovllm.engine.device import resolve_device
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.step_plan import StepPlan
from nanovllm.engine.workers import WorkerPool, free_init_method

logger = logging.getLogger(__name__)


class Executor:
    """Rank 0's runner (`runner`, which also owns the copy engine and the host cache) and the worker pool
    (`workers`, None at tensor_parallel_size 1). Both are None once closed."""

    def __init__(self, config: Config):
        self.runner: ModelRunner | None = None
        self.workers: WorkerPool | None = None
        try:
            init_method = self._start_workers(config)
            self.runner = ModelRunner(config, 0, init_method)
            self.wait()  # the workers' runners are built
        except BaseException:
            self.close()
            raise

    def _start_workers(self, config: Config) -> str | None:
        """Ranks 1..N-1 in spawned processes; returns the address their process group meets at (None: one rank)."""
        if config.tensor_parallel_size == 1:
            return None
        num_gpus = torch.cuda.device_count() if resolve_device(config.device).type == "cuda" else None
        if num_gpus is not None and config.tensor_parallel_size > num_gpus:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs one GPU per rank, "
                             f"only {num_gpus} visible; lower tensor_parallel_size (or widen CUDA_VISIBLE_DEVICES)")
        init_method = free_init_method()
        self.workers = WorkerPool(config, init_method)
        atexit.register(self.close)  # the workers are daemons; this stops them in order
        return init_method

    def call(self, method: str, *args):
        """Run a runner method on every rank; returns rank 0's result."""
        if self.workers is not None:
            self.workers.send(method, *args)
        result = getattr(self.runner, method)(*args)
        self.wait()
        return result

    def launch(self, plan: StepPlan, sample_seqs: list[Sequence], grammar_mask=None):
        """Start one step on every rank without waiting for it: returns rank 0's SampledTokens (read back later).
        The workers' replies are collected by `wait`, after the host's work for the step."""
        if self.workers is not None:
            self.workers.send("run", plan)
        return self.runner.launch(plan, sample_seqs, grammar_mask)

    def wait(self):
        """Collect the workers' replies to the call out (nothing to do with one rank); raises a worker's failure."""
        if self.workers is not None:
            self.workers.wait()

    def abandon_call(self, error: BaseException):
        """A step raised on rank 0 while the workers were in it: the pool is shut down (WorkerPool.abandon_call),
        which raises a worker's failure when that was the cause."""
        if self.workers is not None:
            self.workers.abandon_call(error)

    def release(self, seq_ids: list[int]):
        """Forget finished sequences' sampling state; only rank 0 samples, so only it holds any."""
        self.runner.release(seq_ids)

    def log_memory(self) -> dict | None:
        """Logs one line: where rank 0's GPU memory went, and returns it in bytes (nanovllm/core/memory_plan.py), the
        graph pools as measured after capture included; None without a profiling run (the CPU, or
        kv_cache_memory_bytes)."""
        breakdown = self.runner.memory_breakdown
        if breakdown is None:
            return None
        breakdown["graph_pools_measured"] = self.runner.graph_pool_bytes_measured
        logger.info("%s; graph pools measured after capture %.2f GiB", format_breakdown(breakdown),
                    breakdown["graph_pools_measured"] / GiB)
        return breakdown

    def close(self):
        """Stop the workers, then release rank 0's caches; safe to call twice."""
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            atexit.unregister(self.close)
        if self.runner is not None:
            self.runner.close()
            self.runner = None
