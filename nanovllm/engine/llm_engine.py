"""The engine loop: add requests, then step (schedule -> run -> postprocess) until they finish."""
import atexit
import itertools
import logging
import time

import torch
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.core.memory_plan import GiB, format_breakdown
from nanovllm.engine.device import resolve_device, with_card_batch_limits
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.output import StreamCursor, TextOutput
from nanovllm.engine.progress import update_bar
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.core.sequence import Sequence
from nanovllm.engine.step_plan import LogprobRows, add_logprob_rows, make_plan
from nanovllm.engine.generation_config import default_sampling_options
from nanovllm.engine.tokenizer import eos_token_ids, load_tokenizer
from nanovllm.engine.workers import WorkerPool, free_init_method
from nanovllm.inputs import as_prompt_list, check_prompt, checked_params
from nanovllm.logprobs import position_logprobs
from nanovllm.sampling_params import SamplingParams
from nanovllm_offload.disk_tier import open_disk_store
from nanovllm_offload.host_tier import HostTier

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = config = Config(model, **with_card_batch_limits(kwargs))
        self.runner = self.workers = self.host_tier = None
        # where the GPU memory went, in bytes (nanovllm/core/memory_plan.py); None on CPU or with kv_cache_memory_bytes
        self.memory_breakdown: dict | None = None
        self.tokenizer = load_tokenizer(model)
        self.default_sampling_options = default_sampling_options(config.model, config.generation_config)
        self.text_output = TextOutput(self.tokenizer)
        try:
            self.host_tier = self._start_runners()
        except BaseException:
            self.close()
            raise
        self.block_bytes = self.runner.block_bytes
        self.scheduler = Scheduler.from_config(config, self.num_gpu_blocks, self.host_tier,
                                               eos_token_ids(model, config.hf_config, self.tokenizer))
        copy_engine = self.runner.copy_engine
        if copy_engine is not None:
            self.scheduler.kv_ready = lambda seq: copy_engine.blocks_ready(seq.block_table)
        self.requests: dict[int, Sequence] = {}
        self._num_empty_steps = 0
        self._in_flight = None  # (rows, SampledTokens, LogprobRows | None) of the launched step not read back yet
        self._logprob_seq_ids: set[int] = set()  # requests that asked for logprobs: steps without any skip them
        # prefill speed for the policy: prompt tokens and rows of the steps launched since the last read-back, which
        # waits for them on the GPU; the time between two read-backs is theirs (with asynchronous scheduling the
        # host's own time for a step overlaps the GPU's, so a step's wall time would be its predecessor's)
        self._unsynced_prefill_tokens = self._unsynced_rows = 0
        self._last_sync = time.perf_counter()
        # requests queued with add_request that finished during generate(): the next step() returns them
        self._unclaimed: list[Sequence] = []
        self._generating: set[int] = set()  # requests of the generate / generate_stream calls under way
        # a step raised: it may have registered prefix-cache hashes for blocks whose KV it never wrote, so the
        # caches are dropped as soon as no sequence holds blocks
        self._prefix_cache_suspect = False

    def _start_runners(self) -> HostTier | None:
        """Rank 0 here, ranks 1..N-1 in worker processes; every rank sizes and allocates the same caches."""
        config = self.config
        init_method = None
        if config.tensor_parallel_size > 1:
            num_gpus = torch.cuda.device_count() if resolve_device(config.device).type == "cuda" else None
            if num_gpus is not None and config.tensor_parallel_size > num_gpus:
                raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} needs one GPU per rank, "
                                 f"only {num_gpus} visible; lower tensor_parallel_size (or widen CUDA_VISIBLE_DEVICES)")
            init_method = free_init_method()
            self.workers = WorkerPool(config, init_method)
            atexit.register(self.close)
        self.runner = ModelRunner(config, 0, init_method)
        self._call_workers_wait()  # the workers' runners are built
        self.num_gpu_blocks = self._call("num_kv_blocks_for_budget")
        self._call("allocate_kv_cache", self.num_gpu_blocks)
        host_tier = HostTier.from_config(config, self.runner.block_bytes, pinned=self.runner.device.type == "cuda")
        self._call("capture_cuda_graphs")
        if host_tier is not None:
            self._call("allocate_host_cache", host_tier.num_blocks)
            if config.kv_disk_path is not None:  # TP 1 only (Config): the host pool is this process's
                kv_bytes = self.runner.host_cache.kv.view(torch.uint8).view(host_tier.num_blocks, -1).numpy()
                host_tier.attach_disk(open_disk_store(config, self.runner), kv_bytes, self.runner.device.type == "cpu")
            host_tier.seed_prefill_speed(self._call("measure_prefill_speed"))  # None on the CPU: the prior stays
        self._log_memory()
        return host_tier

    def _log_memory(self):
        """One line: where rank 0's GPU memory went (nothing to say without a profiling run)."""
        self.memory_breakdown = self.runner.memory_breakdown
        if self.memory_breakdown is None:
            return
        self.memory_breakdown["graph_pools_measured"] = self.runner.graph_pool_bytes_measured
        logger.info("%s; graph pools measured after capture %.2f GiB; the previous sizing rule gave %.2f GiB of KV",
                    format_breakdown(self.memory_breakdown), self.runner.graph_pool_bytes_measured / GiB,
                    self.memory_breakdown.get("old_rule_kv", 0) / GiB)

    def _call(self, method: str, *args):
        """Run a runner method on every rank; returns rank 0's result."""
        if self.workers is not None:
            self.workers.send(method, *args)
        result = getattr(self.runner, method)(*args)
        self._call_workers_wait()
        return result

    def _call_workers_wait(self):
        if self.workers is not None:
            self.workers.wait()

    # --- requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        sampling_params = checked_params(sampling_params)
        seq = Sequence(self._prompt_token_ids(prompt, sampling_params), sampling_params,
                       self.config.kvcache_block_size)
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = seq
        if seq.logprobs is not None or seq.prompt_logprobs is not None:
            self._logprob_seq_ids.add(seq.seq_id)
        return seq.seq_id

    def _prompt_token_ids(self, prompt, sampling_params: SamplingParams) -> list[int]:
        """Validate a request without touching engine state; raises ValueError naming the problem."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
        token_ids = check_prompt(prompt)
        if isinstance(token_ids, str):
            if self.tokenizer is None:
                raise ValueError(f"model={self.config.model!r} has no tokenizer files; pass prompts as token ids")
            token_ids = self.tokenizer.encode(token_ids)
        if not token_ids:
            raise ValueError("empty prompt: a prompt needs at least one token")
        vocab = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})")
        if sampling_params.stop and self.tokenizer is None:
            raise ValueError(f"stop={sampling_params.stop!r} needs a tokenizer to match text, and model="
                             f"{self.config.model!r} has none; pass stop_token_ids instead")
        max_len = self.config.max_model_len
        if len(token_ids) > max_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_model_len={max_len}; "
                             f"shorten it or raise max_model_len")
        # the last token is sampled and never computed: its KV needs no slot
        num_tokens = max(min(len(token_ids) + sampling_params.max_tokens, max_len) - 1, len(token_ids))
        num_blocks = (num_tokens + self.config.kvcache_block_size - 1) // self.config.kvcache_block_size
        if num_blocks > self.num_gpu_blocks:
            raise ValueError(f"request needs {num_blocks} KV blocks ({num_tokens} tokens) but the cache has "
                             f"{self.num_gpu_blocks}; lower max_tokens or raise num_kvcache_blocks / the KV budget")
        return token_ids

    def abort_request(self, seq_id: int):
        seq = self.requests.pop(seq_id, None)
        self._logprob_seq_ids.discard(seq_id)
        if seq is not None and not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        if seq is not None:  # also a request that finished in a step whose caller was interrupted
            self.runner.release([seq_id])

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._in_flight is None

    # --- the loop
    def reset_prefix_cache(self) -> bool:
        """Forget the GPU and host prefix caches (Scheduler.reset_prefix_cache), the disk's transfers finished first."""
        if self.host_tier is not None and not (self.scheduler.running or self.scheduler.swapped):
            self.host_tier.settle_disk(self.runner.copy_engine)
        return self.scheduler.reset_prefix_cache()

    def step(self) -> list[Sequence]:
        """Schedule and launch one step, read back the previous one (asynchronous scheduling) or this one, and
        return the sequences that finished."""
        if self._prefix_cache_suspect and self.reset_prefix_cache():
            self._prefix_cache_suspect = False
        try:
            return self._step()
        except BaseException as error:  # an error, or Ctrl-C between scheduling a step and launching it
            self._prefix_cache_suspect = True
            if self.workers is not None:
                self.workers.abandon_call(error)  # raises a worker's failure when that is the cause
            raise

    def _step(self) -> list[Sequence]:
        if self._in_flight is None and (not self._unsynced_rows or not self.scheduler.running):
            # nothing on the device to wait for, or only steps of sequences that are gone: the clock starts now
            # (not at a read-back before an idle spell)
            self._unsynced_prefill_tokens = self._unsynced_rows = 0
            self._last_sync = time.perf_counter()
        out = self.scheduler.schedule()
        self._check_progress(out)
        plan, sample_seqs = make_plan(out, self.config.kvcache_block_size)
        plan.banned_token_ids = self.scheduler.banned_token_ids(sample_seqs)
        logprob_rows = add_logprob_rows(plan, out, sample_seqs) if self._logprob_seq_ids else None
        if self.workers is not None:
            self.workers.send("run", plan)
        sampled = self.runner.launch(plan, sample_seqs)
        if self.host_tier is not None:  # after the step's copies: the disk's threads wait for the ones they touch
            self.host_tier.submit_disk_transfers(self.runner.copy_engine)
        finished = self._read_back()  # the previous step, while this one runs
        self._unsynced_prefill_tokens += sum(n for n in out.num_new_tokens if n > 1)
        self._unsynced_rows += len(out.seqs)
        rows = self.scheduler.advance(out)
        self._in_flight = (rows, sampled, logprob_rows) if rows or logprob_rows else None
        if not self.config.async_scheduling:
            finished += self._read_back()
        self._call_workers_wait()
        self._observe_copies()
        self.runner.release([seq.seq_id for seq in finished])
        self._logprob_seq_ids.difference_update(seq.seq_id for seq in finished)
        finished, self._unclaimed = self._unclaimed + finished, []
        return finished

    def _keep_others(self, finished: list[Sequence], own_seq_ids) -> list[Sequence]:
        """A generate call's share of a step's finished sequences; those of no generate call (add_request's) wait
        for the caller's next step()."""
        self._unclaimed += [seq for seq in finished if seq.seq_id not in self._generating]
        return [seq for seq in finished if seq.seq_id in own_seq_ids]

    def _read_back(self) -> list[Sequence]:
        """Fill in the tokens of the step in flight; returns the sequences that finished."""
        if self._in_flight is None:
            return []
        rows, sampled, logprob_rows = self._in_flight
        self._in_flight = None
        token_ids = sampled.tolist()  # waits for the step on the GPU
        self._observe_prefill()
        if logprob_rows is not None:
            self._attach_logprobs(logprob_rows, *sampled.logprob_lists())
        updated, finished = self.scheduler.resolve(rows, token_ids)
        return finished + self.text_output.apply_stop_strings(updated + finished, self.scheduler.finish)

    def _attach_logprobs(self, owners: LogprobRows, token_ids: list[list[int]], values: list[list[float]],
                         ranks: list[int]):
        """Hand a read-back step's logprob rows to their sequences (before resolve, which may finish them: the
        token a sequence ends with keeps its logprobs; a row whose sequence already finished is dropped, as its
        token is)."""
        rows = zip(token_ids, values, ranks)
        for seq, (ids, row_values, rank) in zip(owners.sample_seqs, rows):
            if not seq.is_finished:
                seq.logprobs.append(position_logprobs(ids, row_values, rank, seq.sampling_params.logprobs,
                                                      self.text_output.token_text))
        for seq, num_rows in owners.prompt_chunks:
            num_top = seq.sampling_params.prompt_logprobs
            seq.prompt_logprobs.extend(position_logprobs(ids, row_values, rank, num_top, self.text_output.token_text)
                                       for ids, row_values, rank in itertools.islice(rows, num_rows))

    def _check_progress(self, out: SchedulerOutput):
        progress = not out.is_empty or out.num_resumed or self._in_flight is not None or self.scheduler.is_finished()
        if out.is_empty and self.scheduler.num_disk_waiting:  # only disk loads in flight: wait, do not spin
            time.sleep(0.001)
            progress = True
        self._num_empty_steps = 0 if progress else self._num_empty_steps + 1
        if self._num_empty_steps > 1:
            s = self.scheduler
            raise RuntimeError(f"LLMEngine.step: no progress; waiting={list(s.waiting)} running={s.running} "
                               f"swapped={list(s.swapped)} free_gpu_blocks={s.block_manager.num_free_blocks}")

    def _observe_prefill(self):
        """After a read-back: the steps launched since the last one are done; mostly prompt tokens make a sample of
        prefill speed."""
        now = time.perf_counter()
        if self._unsynced_prefill_tokens > self._unsynced_rows and self.host_tier is not None:
            self.host_tier.observe_prefill(self._unsynced_prefill_tokens, now - self._last_sync)
        self._unsynced_prefill_tokens = self._unsynced_rows = 0
        self._last_sync = now

    def _observe_copies(self):
        engine = self.runner.copy_engine
        if engine is not None and self.host_tier is not None:
            self.host_tier.observe_copies(engine.take_recent_copies(), engine.copy_seconds, engine.exposed_seconds)

    def _queue(self, prompts, sampling_params) -> list[int]:
        """Validate every request first, then queue them all: a bad one leaves the engine untouched."""
        prompts = as_prompt_list(prompts)  # one prompt (a string or token ids) or a list of them
        if sampling_params is None:
            sampling_params = SamplingParams(**self.default_sampling_options)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts; pass one or one each")
        # checked again here, not only when built: a SamplingParams may have been changed since (they are mutable,
        # as in vLLM); each request keeps its own checked copy, so a later change cannot reach it either
        sampling_params = [checked_params(sp) for sp in sampling_params]
        for prompt, sp in zip(prompts, sampling_params):
            self._prompt_token_ids(prompt, sp)
        return [self.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]

    def generate(self, prompts: list[str] | list[list[int]] | str, sampling_params=None, use_tqdm: bool = True):
        """Run prompts to completion; returns {"text", "token_ids", "finish_reason", "logprobs", "prompt_logprobs"}
        per prompt, in input order (the logprobs None unless SamplingParams asked for them)."""
        seq_ids = self._queue(prompts, sampling_params)
        pending = set(seq_ids)
        self._generating.update(seq_ids)
        bar = tqdm(total=len(seq_ids), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        last = (time.perf_counter(), self.stats())
        try:
            while pending:
                finished = self._keep_others(self.step(), pending)
                done = [s.seq_id for s in finished]
                pending.difference_update(done)
                bar.update(len(done))
                if use_tqdm:
                    last = update_bar(bar, last, self.stats, len(self.scheduler.swapped))
        finally:
            bar.close()
            self._generating.difference_update(seq_ids)
            if pending:  # interrupted (e.g. Ctrl-C): free what the unfinished requests hold, forget the finished
                for seq_id in seq_ids:
                    self.abort_request(seq_id)
        return [self.output(self.requests.pop(seq_id)) for seq_id in seq_ids]

    def generate_stream(self, prompts: list[str] | list[list[int]] | str, sampling_params=None):
        """Like generate, but yields {"index", "token_ids", "text", "finish_reason", "logprobs", "prompt_logprobs"}
        with the new tokens, text and logprobs of a request as soon as a step produces them; finish_reason is None
        until its last chunk, prompt_logprobs None after its first.
        Closing the generator early aborts the unfinished requests and frees their blocks; a request aborted by
        abort_request meanwhile ends with finish_reason "abort"."""
        seq_ids = self._queue(prompts, sampling_params)
        pending = dict.fromkeys(seq_ids)
        self._generating.update(seq_ids)
        cursor = StreamCursor(self.text_output, seq_ids)
        try:
            while pending:
                self._keep_others(self.step(), pending)
                for i, seq_id in enumerate(seq_ids):
                    if seq_id not in pending:
                        continue
                    seq = self.requests.get(seq_id)
                    if seq is None:  # aborted by abort_request
                        del pending[seq_id]
                        yield {"index": i, "token_ids": [], "text": "", "finish_reason": "abort", "logprobs": None,
                               "prompt_logprobs": None}
                        continue
                    chunk = cursor.chunk(seq, i)
                    if chunk is None:
                        continue
                    if seq.is_finished:
                        del pending[seq_id]
                        self.requests.pop(seq_id)
                    yield chunk
        finally:
            self._generating.difference_update(seq_ids)
            for seq_id in pending:
                self.abort_request(seq_id)

    def output(self, seq: Sequence) -> dict:
        return self.text_output.output(seq)

    def _stream_text(self, seq: Sequence) -> str:  # the server's stream reads it
        return self.text_output.stream_text(seq)

    # --- counters and lifetime
    def stats(self) -> dict:
        stats = self.scheduler.stats.as_dict()
        stats["bytes_swapped_out"] = stats["blocks_swapped_out"] * self.block_bytes * self.config.tensor_parallel_size
        stats["bytes_swapped_in"] = stats["blocks_swapped_in"] * self.block_bytes * self.config.tensor_parallel_size
        engine = self.runner.copy_engine if self.runner is not None else None
        if engine is not None:
            engine.poll()
        stats["swap_seconds"] = engine.copy_seconds if engine else 0.0
        stats["swap_exposed_seconds"] = engine.exposed_seconds if engine else 0.0
        stats["num_gpu_blocks"] = self.num_gpu_blocks
        stats.update(self.host_tier.stats() if self.host_tier is not None else HostTier.no_tier_stats())
        return stats

    def close(self):
        """Release the KV caches, the host pool and the worker processes; safe to call twice."""
        self._close_disk_tier()
        if self.workers is not None:
            self.workers.close()
            self.workers = None
            atexit.unregister(self.close)
        if self.runner is not None:
            self.runner.close()
            self.runner = None

    def _close_disk_tier(self):
        """Finish the disk writes before the host pool goes; when idle, offload what the last step freed first."""
        disk = self.host_tier.disk if self.host_tier is not None else None
        if disk is None or self.runner is None:
            return
        try:
            self._read_back()
            if self.scheduler.is_finished():
                self.runner.launch(make_plan(self.scheduler.schedule(), self.config.kvcache_block_size)[0])
            self.runner.copy_engine.synchronize()
        finally:
            self.host_tier.disk = None
            disk.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
