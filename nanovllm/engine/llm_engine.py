"""The engine loop: add requests, then step (schedule -> run -> postprocess) until they finish."""
import atexit
import logging
import time

import torch
from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.core.memory_plan import GiB, format_breakdown
from nanovllm.engine.device import resolve_device, with_card_batch_limits, with_cpu_host_tier_default
from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.logit_rules import LogitRules, bad_words_token_ids
from nanovllm.engine.output import StreamCursor, TextOutput
from nanovllm.engine.parallel_sampling import PromptRequest, sample_params
from nanovllm.engine.progress import update_bar
from nanovllm.engine.request_intake import RequestIntake
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.engine.structured_outputs import GrammarCompiler, StructuredOutputs
from nanovllm.core.sequence import Sequence
from nanovllm.engine.step_plan import add_logprob_rows, make_plan
from nanovllm.engine.generation_config import default_sampling_options
from nanovllm.engine.tokenizer import eos_token_ids, load_tokenizer
from nanovllm.engine.workers import WorkerPool, free_init_method
from nanovllm.inputs import checked_params
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm_offload.disk_tier import open_disk_store
from nanovllm_offload.host_tier import HostTier

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, model: str, **kwargs):
        self.config = config = Config(model, **with_cpu_host_tier_default(with_card_batch_limits(kwargs)))
        self.runner = self.workers = self.host_tier = None
        # where the GPU memory went, in bytes (nanovllm/core/memory_plan.py); None on CPU or with kv_cache_memory_bytes
        self.memory_breakdown: dict | None = None
        self.tokenizer = load_tokenizer(config.tokenizer or model)
        self.default_sampling_options = default_sampling_options(config.model, config.generation_config)
        self.text_output = TextOutput(self.tokenizer)
        try:
            self.host_tier = self._start_runners()
        except BaseException:
            self.close()
            raise
        self.block_bytes = self.runner.block_bytes
        self.intake = RequestIntake(config, self.tokenizer, self.num_gpu_blocks)
        self.scheduler = Scheduler.from_config(config, self.num_gpu_blocks, self.host_tier,
                                               eos_token_ids(model, config.hf_config, self.tokenizer))
        self.structured = StructuredOutputs(GrammarCompiler(  # structured outputs: constrained requests' matchers
            self.tokenizer, config.hf_config.vocab_size, self.scheduler.eos_token_ids))
        copy_engine = self.runner.copy_engine
        if copy_engine is not None:
            self.scheduler.kv_ready = lambda seq: copy_engine.blocks_ready(seq.block_table)
        self.requests: dict[int, Sequence] = {}
        self._num_empty_steps = 0
        self._in_flight = None  # (rows, SampledTokens, LogprobRows | None) of the launched step not read back yet
        self._logprob_seq_ids: set[int] = set()  # requests that asked for logprobs: steps without any skip them
        self.logit_rules = LogitRules()  # requests with a logit_bias or bad words
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
        logger.info("%s; graph pools measured after capture %.2f GiB", format_breakdown(self.memory_breakdown),
                    self.runner.graph_pool_bytes_measured / GiB)

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
        """Queue one sequence; returns its seq id (step() returns it when it finishes). n > 1 and best_of need
        generate() or generate_stream(), which gather the samples of a prompt."""
        sampling_params = checked_params(sampling_params)
        if sampling_params.num_samples > 1:
            raise ValueError(f"n={sampling_params.n}, best_of={sampling_params.best_of}: add_request queues one "
                             f"sequence; use generate() or generate_stream() for several samples of a prompt")
        token_ids = self._prompt_token_ids(prompt, sampling_params)
        if sampling_params.max_tokens is None:
            sampling_params.max_tokens = self.intake.room_left(len(token_ids))
        bad_words = bad_words_token_ids(self.tokenizer, sampling_params.bad_words or [])
        seq = Sequence(token_ids, sampling_params, self.config.kvcache_block_size)
        self.scheduler.add(seq)
        self.requests[seq.seq_id] = seq
        self.logit_rules.add(seq, bad_words)
        self.structured.add(seq)
        if seq.logprobs is not None or seq.prompt_logprobs is not None:
            self._logprob_seq_ids.add(seq.seq_id)
        return seq.seq_id

    def _prompt_token_ids(self, prompt, sampling_params: SamplingParams) -> list[int]:
        """Validate a request without touching engine state (RequestIntake); raises ValueError naming the problem."""
        token_ids = self.intake.prompt_token_ids(prompt, sampling_params)
        self.structured.check(sampling_params.structured_outputs)  # compiles (cached): ValueError naming the field
        return token_ids

    def abort_request(self, seq_id: int):
        seq = self.requests.pop(seq_id, None)
        self._logprob_seq_ids.discard(seq_id)
        self.logit_rules.discard(seq_id)
        self.structured.discard(seq_id)
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
        plan.logit_bias, bans, plan.conditional_bans = self.logit_rules.step_rules(sample_seqs)
        plan.banned_token_ids += bans
        logprob_rows = add_logprob_rows(plan, out, sample_seqs) if self._logprob_seq_ids else None
        if self.workers is not None:
            self.workers.send("run", plan)
        finished = []  # structured outputs: a constrained step reads back the previous one before it samples
        sampled = self.runner.launch(plan, sample_seqs,
                                     self.structured.grammar_mask(sample_seqs, self._read_back, finished))
        if self.host_tier is not None:  # after the step's copies: the disk's threads wait for the ones they touch
            self.host_tier.submit_disk_transfers(self.runner.copy_engine)
        finished += self._read_back()  # the previous step, while this one runs
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
        for seq in finished:
            self.logit_rules.discard(seq.seq_id)
            self.structured.discard(seq.seq_id)
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
            logprob_rows.attach(*sampled.logprob_lists(), self.text_output.token_text)
        self.structured.consume(rows, token_ids)
        updated, finished = self.scheduler.resolve(rows, token_ids, sampled.ready_time)
        finished += self.structured.finish_grammars(updated, self.scheduler.finish, self.text_output.text)
        return finished + self.text_output.apply_stop_strings(updated + finished, self.scheduler.finish)

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

    def _queue(self, prompts, sampling_params, streaming: bool = False) -> list[PromptRequest]:
        """Validate every request first, then queue them all: a bad one leaves the engine untouched. Each prompt
        is tokenized once, then queued as one sequence per sample (parallel_sampling.py)."""
        pairs = self.intake.checked_batch(prompts, sampling_params, self.default_sampling_options, streaming)
        token_ids = [self._prompt_token_ids(prompt, sp) for prompt, sp in pairs]
        requests = []
        for (prompt, sp), ids in zip(pairs, token_ids):
            seq_ids = [self.add_request(ids, child) for child in sample_params(sp)]
            requests.append(PromptRequest(str(seq_ids[0]), self.intake.prompt_text(prompt), sp, seq_ids))
        return requests

    def generate(self, prompts: list[str] | list[list[int]] | str, sampling_params=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; returns one RequestOutput per prompt, in input order (nanovllm/outputs.py:
        `.outputs[i].text`, `.token_ids`, ...; `out["text"]` and the other keys of the old dicts still work)."""
        requests = self._queue(prompts, sampling_params)
        request_of = {seq_id: request for request in requests for seq_id in request.seq_ids}
        seq_ids = list(request_of)
        pending = set(seq_ids)
        self._generating.update(seq_ids)
        bar = tqdm(total=len(requests), desc="Generating", dynamic_ncols=True, disable=not use_tqdm)
        last = (time.perf_counter(), self.stats())
        try:
            while pending:
                finished = self._keep_others(self.step(), pending)
                pending.difference_update(s.seq_id for s in finished)
                # the bar counts prompts: one is done when its last sample is
                bar.update(len({request_of[s.seq_id].request_id for s in finished
                                if not pending.intersection(request_of[s.seq_id].seq_ids)}))
                if use_tqdm and not self.config.disable_log_stats:
                    last = update_bar(bar, last, self.stats, len(self.scheduler.swapped))
        finally:
            bar.close()
            self._generating.difference_update(seq_ids)
            if pending:  # interrupted (e.g. Ctrl-C): free what the unfinished requests hold, forget the finished
                for seq_id in seq_ids:
                    self.abort_request(seq_id)
        return [self.text_output.request_output(r.request_id, r.prompt, [self.requests.pop(i) for i in r.seq_ids],
                                                r.params) for r in requests]

    def generate_stream(self, prompts: list[str] | list[list[int]] | str, sampling_params=None):
        """Like generate, but yields {"index", "output_index", "token_ids", "text", "finish_reason", "logprobs",
        "prompt_logprobs"} with the new tokens, text and logprobs of a sample as soon as a step produces them
        ("index": the prompt's, "output_index": the sample's, 0..n-1); finish_reason is None until its last chunk,
        prompt_logprobs None after its first. best_of > n is refused: which samples are returned is known only at
        the end (vLLM refuses it with streaming too).
        Closing the generator early aborts the unfinished requests and frees their blocks; a request aborted by
        abort_request meanwhile ends with finish_reason "abort"."""
        requests = self._queue(prompts, sampling_params, streaming=True)
        places = {seq_id: (i, j) for i, r in enumerate(requests) for j, seq_id in enumerate(r.seq_ids)}
        seq_ids = list(places)
        pending = dict.fromkeys(seq_ids)
        self._generating.update(seq_ids)
        cursor = StreamCursor(self.text_output, seq_ids)
        try:
            while pending:
                self._keep_others(self.step(), pending)
                for seq_id, (i, j) in places.items():
                    if seq_id not in pending:
                        continue
                    seq = self.requests.get(seq_id)
                    if seq is None:  # aborted by abort_request
                        del pending[seq_id]
                        yield {"index": i, "output_index": j, "token_ids": [], "text": "", "finish_reason": "abort",
                               "logprobs": None, "prompt_logprobs": None}
                        continue
                    chunk = cursor.chunk(seq, i)
                    if chunk is None:
                        continue
                    if seq.is_finished:
                        del pending[seq_id]
                        self.requests.pop(seq_id)
                    yield {**chunk, "output_index": j}
        finally:
            self._generating.difference_update(seq_ids)
            for seq_id in pending:
                self.abort_request(seq_id)

    def output(self, seq: Sequence) -> RequestOutput:
        """A finished sequence of add_request as a RequestOutput of one sample."""
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
            self.host_tier.close_disk()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
