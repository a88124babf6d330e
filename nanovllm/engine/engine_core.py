"""The engine core: one step is schedule -> execute -> update from output, on the sequences the frontend
(llm_engine.py) queued.

It owns the scheduler, the KV caches' sizes and tiers, and the step in flight: with asynchronous scheduling step
N+1 is scheduled and launched before step N's tokens are read back, so at most one launched step waits here
(`_in_flight`) while the host works on the next. It knows nothing of prompts' text: the output processor ends
sequences at stop strings when their tokens are read back.
"""
import time
from dataclasses import dataclass

import torch

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.engine.executor import Executor
from nanovllm.engine.logit_rules import LogitRules
from nanovllm.engine.output_processor import OutputProcessor
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.step_inputs import SampledTokens
from nanovllm.engine.step_plan import LogprobRows, StepPlan, add_logprob_rows, make_plan
from nanovllm.engine.structured_outputs import GrammarCompiler, StructuredOutputs
from nanovllm_offload.disk_tier import open_disk_store
from nanovllm_offload.offload_manager import OffloadManager


@dataclass
class InFlightStep:
    """A launched step whose tokens are not read back yet."""
    rows: list  # Scheduler.advance's rows: which sequence takes which sampled token (Scheduler.resolve)
    sampled: SampledTokens  # rank 0's sampled tokens, still on the device (a constrained step's: maybe not sampled)
    logprob_rows: LogprobRows | None  # who owns the step's logprob rows; None when no sequence asked for logprobs


class EngineCore:
    """The scheduler, the tiers and the step in flight, driven by `step()`.
    NOTE: at most one step is in flight, and only with asynchronous scheduling: `_in_flight` is None whenever
    step() returns under synchronous scheduling. A sequence's per-request state here (logit rules, logprob ids)
    lives from `add` until it finishes (`_forget`) or is aborted (`abort`)."""

    def __init__(self, config: Config, executor: Executor, output_processor: OutputProcessor,
                 eos_token_ids: list[int]):
        self.config = config
        self.executor = executor
        self.output_processor = output_processor
        self.num_gpu_blocks = 0
        self.block_bytes = executor.runner.block_bytes  # one GPU block's KV bytes on one rank
        self.host_tier = self._allocate_caches()
        self.scheduler = Scheduler.from_config(config, self.num_gpu_blocks, self.host_tier, eos_token_ids)
        self.logit_rules = LogitRules()  # requests with a logit_bias or bad words
        self.structured = StructuredOutputs(GrammarCompiler(  # structured outputs: constrained requests' matchers
            output_processor.tokenizer, config.hf_config.vocab_size, self.scheduler.eos_token_ids))
        self._logprob_seq_ids: set[int] = set()  # requests that asked for logprobs: steps without any skip them
        self._in_flight: InFlightStep | None = None
        self._num_empty_steps = 0
        # a step raised: it may have registered prefix-cache hashes for blocks whose KV it never wrote, so the
        # caches are dropped as soon as no sequence holds blocks
        self._prefix_cache_suspect = False
        # prefill speed for the policy: prompt tokens and rows of the steps launched since the last read-back, which
        # waits for them on the GPU; the time between two read-backs is theirs (with asynchronous scheduling the
        # host's own time for a step overlaps the GPU's, so a step's wall time would be its predecessor's)
        self._unsynced_prefill_tokens = self._unsynced_rows = 0
        self._last_sync = time.perf_counter()

    def _allocate_caches(self) -> OffloadManager | None:
        """Every rank sizes and allocates the same caches: the GPU KV cache, the CUDA graphs, then the host pool and
        the disk tier behind it. Returns the host tier (None without a host pool)."""
        config, executor = self.config, self.executor
        self.num_gpu_blocks = executor.call("num_kv_blocks_for_budget")
        executor.call("allocate_kv_cache", self.num_gpu_blocks)
        runner = executor.runner
        host_tier = OffloadManager.from_config(config, runner.block_bytes, pinned=runner.device.type == "cuda")
        executor.call("capture_cuda_graphs")
        if host_tier is not None:
            executor.call("allocate_host_cache", host_tier.num_blocks)
            if config.kv_disk_path is not None:  # TP 1 only (Config): the host pool is this process's
                kv_bytes = runner.host_cache.kv.view(torch.uint8).view(host_tier.num_blocks, -1).numpy()
                host_tier.attach_disk(open_disk_store(config, runner), kv_bytes, runner.device.type == "cpu")
            host_tier.seed_prefill_speed(executor.call("measure_prefill_speed"))  # None on the CPU: the prior stays
        return host_tier

    # --- requests
    def add(self, seq: Sequence, bad_words_token_ids: list[list[int]]):
        self.scheduler.add(seq)
        self.logit_rules.add(seq, bad_words_token_ids)
        self.structured.add(seq)
        if seq.logprobs is not None or seq.prompt_logprobs is not None:
            self._logprob_seq_ids.add(seq.seq_id)

    def abort(self, seq_id: int, seq: Sequence | None):
        """Forget a request; seq (None when the frontend no longer holds it) is finished with "abort" when it runs,
        and its sampling state is released also when it finished in a step whose caller was interrupted."""
        self._logprob_seq_ids.discard(seq_id)
        self.logit_rules.discard(seq_id)
        self.structured.discard(seq_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        if seq is not None:
            self.executor.release([seq_id])

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    def stats(self) -> dict:
        """The scheduler's counters, the copies' bytes and times, the cache sizes and the host tier's counters."""
        stats = self.scheduler.stats.as_dict()
        num_ranks = self.config.tensor_parallel_size
        stats["bytes_swapped_out"] = stats["blocks_swapped_out"] * self.block_bytes * num_ranks
        stats["bytes_swapped_in"] = stats["blocks_swapped_in"] * self.block_bytes * num_ranks
        runner = self.executor.runner
        engine = runner.copy_engine if runner is not None else None  # None once closed
        if engine is not None:
            engine.poll()
        stats["swap_seconds"] = engine.copy_seconds if engine else 0.0
        stats["swap_exposed_seconds"] = engine.exposed_seconds if engine else 0.0
        stats["num_gpu_blocks"] = self.num_gpu_blocks
        stats.update(self.host_tier.stats() if self.host_tier is not None else OffloadManager.no_tier_stats())
        return stats

    # --- the step
    def step(self) -> list[Sequence]:
        """Schedule and launch one step, read back the previous one (asynchronous scheduling) or this one, and
        return the sequences that finished."""
        if self._prefix_cache_suspect and self.reset_prefix_cache():
            self._prefix_cache_suspect = False
        try:
            return self._step()
        except BaseException as error:  # an error, or Ctrl-C between scheduling a step and launching it
            self._prefix_cache_suspect = True
            self.executor.abandon_call(error)  # raises a worker's failure when that is the cause
            raise

    def _step(self) -> list[Sequence]:
        self._restart_prefill_clock_when_idle()
        # schedule
        out = self.scheduler.schedule()
        self._check_progress(out)
        plan, sample_seqs = self._plan(out)
        logprob_rows = add_logprob_rows(plan, out, sample_seqs) if self._logprob_seq_ids else None
        if self._in_flight is not None:  # a constrained step's sampler, deferred while its masks filled, goes first
            self._in_flight.sampled.complete()
        # execute: launch this step, then read the previous one back while this one runs
        finished = []  # structured outputs: a constrained step reads back the previous one before it samples
        sampled = self.executor.launch(plan, sample_seqs,
                                       self.structured.grammar_mask(sample_seqs, self._update_from_output, finished))
        finished += self._update_from_output()
        self._count_unsynced(out)
        rows = self.scheduler.advance(out)
        self._in_flight = InFlightStep(rows, sampled, logprob_rows) if rows or logprob_rows else None
        if not self.config.async_scheduling:
            finished += self._update_from_output()  # this step's own tokens
        self.executor.wait()
        self._after_step()
        self._forget(finished)
        return finished

    def _plan(self, out: SchedulerOutput) -> tuple[StepPlan, list[Sequence]]:
        """The step's plan for the ranks, with the sample rows' bans and biases."""
        plan, sample_seqs = make_plan(out, self.config.kvcache_block_size)
        plan.banned_token_ids = self.scheduler.banned_token_ids(sample_seqs)
        plan.logit_bias, bans, plan.conditional_bans = self.logit_rules.step_rules(sample_seqs)
        plan.banned_token_ids += bans
        return plan, sample_seqs

    def _update_from_output(self) -> list[Sequence]:
        """Read back the step in flight: its tokens join their sequences, which end at a stop token, their length
        or a stop string (the output processor's). Returns the sequences that finished."""
        if self._in_flight is None:
            return []
        step, self._in_flight = self._in_flight, None
        token_ids = step.sampled.tolist()  # waits for the step on the GPU
        self._after_read_back()
        if step.logprob_rows is not None:
            step.logprob_rows.attach(*step.sampled.logprob_lists(), self.output_processor.token_text)
        self.structured.consume(step.rows, token_ids)
        updated, finished = self.scheduler.resolve(step.rows, token_ids, step.sampled.ready_time)
        finished += self.structured.finish_grammars(updated, self.scheduler.finish, self.output_processor.text)
        return finished + self.output_processor.apply_stop_strings(updated + finished, self.scheduler.finish)

    def _forget(self, finished: list[Sequence]):
        """Drop the per-request state of the sequences that finished."""
        self.executor.release([seq.seq_id for seq in finished])
        self._logprob_seq_ids.difference_update(seq.seq_id for seq in finished)
        for seq in finished:
            self.logit_rules.discard(seq.seq_id)
            self.structured.discard(seq.seq_id)

    def _check_progress(self, out: SchedulerOutput):
        """RuntimeError after two steps in a row that could do nothing: a bug, not a shortage."""
        progress = not out.is_empty or out.num_resumed or self._in_flight is not None or self.scheduler.is_finished()
        # only disk reads or loads (an aborted sequence's blocks come free when they land) in flight: wait, do not spin
        if out.is_empty and (self.scheduler.num_disk_waiting or self.scheduler.num_loads_in_flight):
            time.sleep(0.001)
            progress = True
        self._num_empty_steps = 0 if progress else self._num_empty_steps + 1
        if self._num_empty_steps > 1:
            s = self.scheduler
            raise RuntimeError(f"LLMEngine.step: no progress; waiting={list(s.waiting)} running={s.running} "
                               f"swapped={list(s.swapped)} free_gpu_blocks={s.block_manager.num_free_blocks}")

    # --- the prefill clock (the host tier's policy weighs swapping against computing a prompt again)
    def _restart_prefill_clock_when_idle(self):
        if self._in_flight is None and (not self._unsynced_rows or not self.scheduler.running):
            # nothing on the device to wait for, or only steps of sequences that are gone: the clock starts now
            # (not at a read-back before an idle spell)
            self._unsynced_prefill_tokens = self._unsynced_rows = 0
            self._last_sync = time.perf_counter()

    def _count_unsynced(self, out: SchedulerOutput):
        self._unsynced_prefill_tokens += sum(n for n in out.num_new_tokens if n > 1)
        self._unsynced_rows += len(out.seqs)

    # --- the tier's hooks: every call the step makes into the host and disk tiers
    def _after_read_back(self):
        """The steps launched since the last read-back are done; mostly prompt tokens make a sample of prefill
        speed."""
        now = time.perf_counter()
        if self._unsynced_prefill_tokens > self._unsynced_rows and self.host_tier is not None:
            self.host_tier.observe_prefill(self._unsynced_prefill_tokens, now - self._last_sync)
        self._unsynced_prefill_tokens = self._unsynced_rows = 0
        self._last_sync = now

    def _after_step(self):
        """The copies and disk transfers that landed advance their blocks' states (OffloadManager.complete)."""
        if self.host_tier is not None:
            self.host_tier.complete(self.executor.runner.copy_engine.get_finished())

    def reset_prefix_cache(self) -> bool:
        """Forget the GPU and host prefix caches (Scheduler.reset_prefix_cache), the disk's transfers finished first."""
        if self.host_tier is not None and not (self.scheduler.running or self.scheduler.swapped):
            self.host_tier.settle(self.executor.runner.copy_engine)
        return self.scheduler.reset_prefix_cache()

    def close_disk_tier(self):
        """Finish the disk writes before the host pool goes; when idle, offload what the last step freed first."""
        disk = self.host_tier.disk if self.host_tier is not None else None
        if disk is None or self.executor.runner is None:
            return
        try:
            self._update_from_output()
            if self.scheduler.is_finished():
                self.executor.runner.launch(make_plan(self.scheduler.schedule(), self.config.kvcache_block_size)[0])
            self.host_tier.settle(self.executor.runner.copy_engine)  # the last stores land, and go to disk
        finally:
            self.host_tier.close_disk()
