"""The engine's frontend: requests in (checked and tokenized once, RequestIntake), outputs out (the output
processor), and the loops of generate and generate_stream around EngineCore.step.

  LLMEngine (this file): add_request, abort_request, generate, generate_stream, stats, close
    -> EngineCore (engine_core.py): step = schedule -> execute -> update from output
      -> Executor (executor.py): rank 0's ModelRunner and the tensor-parallel workers behind one call
"""
import logging
import time

from tqdm.auto import tqdm

from nanovllm.config import Config
from nanovllm.core.sequence import Sequence
from nanovllm.engine.device import with_card_batch_limits, with_cpu_host_tier_default
from nanovllm.engine.engine_core import EngineCore
from nanovllm.engine.executor import Executor
from nanovllm.engine.generation_config import default_sampling_options
from nanovllm.engine.output_processor import DeltaCursor, OutputProcessor, StreamDelta
from nanovllm.engine.parallel_sampling import PromptRequest
from nanovllm.engine.progress import update_bar
from nanovllm.engine.request_intake import CheckedRequest, RequestIntake
from nanovllm.engine.tokenizer import eos_token_ids, load_tokenizer
from nanovllm.inputs import checked_params
from nanovllm.outputs import RequestOutput
from nanovllm.sampling_params import SamplingParams
from nanovllm.utils.vllm_options import from_vllm_options

logger = logging.getLogger(__name__)


class LLMEngine:
    """The offline engine's frontend. NOTE: `requests` maps seq id -> sequence from its add until abort_request,
    or until the call that queued it (generate, generate_stream, the server's loop) takes its output; `_unclaimed`
    holds the add_request sequences that finished inside a generate call, until the next step() returns them."""

    def __init__(self, model: str, **kwargs):
        kwargs = from_vllm_options(kwargs)
        self.config = config = Config(model, **with_cpu_host_tier_default(with_card_batch_limits(kwargs)))
        self.executor: Executor | None = None
        self.core: EngineCore | None = None  # both None until started: a failed start calls close()
        self.tokenizer = load_tokenizer(config.tokenizer or model)
        self.default_sampling_options = default_sampling_options(config.model, config.generation_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        try:
            self.executor = Executor(config)
            self.core = EngineCore(config, self.executor, self.output_processor,
                                   eos_token_ids(model, config.hf_config, self.tokenizer))
        except BaseException:
            self.close()
            raise
        # where the GPU memory went, in bytes (nanovllm/core/memory_plan.py); None on CPU or with kv_cache_memory_bytes
        self.memory_breakdown: dict | None = self.executor.log_memory()
        self.scheduler, self.host_tier = self.core.scheduler, self.core.host_tier
        self.num_gpu_blocks, self.block_bytes = self.core.num_gpu_blocks, self.core.block_bytes
        self.intake = RequestIntake(config, self.tokenizer, self.num_gpu_blocks, self.core.structured.check)
        self.requests: dict[int, Sequence] = {}
        # requests queued with add_request that finished during generate(): the next step() returns them
        self._unclaimed: list[Sequence] = []
        self._generating: set[int] = set()  # requests of the generate / generate_stream calls under way

    @property
    def runner(self):
        """Rank 0's ModelRunner (its caches, copy engine and model); None once closed."""
        return self.executor.runner if self.executor is not None else None

    # --- requests
    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams) -> int:
        """Queue one sequence; returns its seq id (step() returns it when it finishes). n > 1 and best_of need
        generate() or generate_stream(), which gather the samples of a prompt."""
        sampling_params = checked_params(sampling_params)
        _check_one_sample(sampling_params)
        return self._add(self.intake.checked(prompt, sampling_params))

    def add_checked_request(self, request: CheckedRequest) -> int:
        """add_request for a request `intake` has checked already (the server checks in its handlers' threads, off
        the thread that steps the engine): queued as it is, without a second check."""
        _check_one_sample(request.sampling_params)
        return self._add(request)

    def _add(self, request: CheckedRequest) -> int:
        seq = Sequence(request.token_ids, request.sampling_params, self.config.kvcache_block_size)
        self.core.add(seq, request.bad_words_token_ids)
        self.requests[seq.seq_id] = seq
        return seq.seq_id

    def abort_request(self, seq_id: int):
        self.core.abort(seq_id, self.requests.pop(seq_id, None))

    def is_finished(self) -> bool:
        return self.core.is_finished()

    def _queue(self, prompts, sampling_params, streaming: bool = False) -> list[PromptRequest]:
        """Check every request first, then queue them all: a bad one leaves the engine untouched. Each prompt is
        checked and tokenized once, then queued as one sequence per sample (parallel_sampling.py)."""
        checked = self.intake.checked_batch(prompts, sampling_params, self.default_sampling_options, streaming)
        requests = []
        for request in checked:
            seq_ids = [self._add(sample) for sample in request.samples()]
            requests.append(PromptRequest(str(seq_ids[0]), request.prompt_text, request.sampling_params, seq_ids))
        return requests

    # --- the loops
    def reset_prefix_cache(self) -> bool:
        """Forget the GPU and host prefix caches (Scheduler.reset_prefix_cache), the disk's transfers finished first."""
        return self.core.reset_prefix_cache()

    def step(self) -> list[Sequence]:
        """One engine step (EngineCore.step); returns the sequences that finished, those of add_request that finished
        during a generate() call included."""
        finished = self.core.step()
        finished, self._unclaimed = self._unclaimed + finished, []
        return finished

    def _keep_others(self, finished: list[Sequence], own_seq_ids) -> list[Sequence]:
        """A generate call's share of a step's finished sequences; those of no generate call (add_request's) wait
        for the caller's next step()."""
        self._unclaimed += [seq for seq in finished if seq.seq_id not in self._generating]
        return [seq for seq in finished if seq.seq_id in own_seq_ids]

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
        return [self.output_processor.request_output(r.request_id, r.prompt, [self.requests.pop(i) for i in r.seq_ids],
                                                     r.params) for r in requests]

    def generate_stream(self, prompts: list[str] | list[list[int]] | str, sampling_params=None):
        """Like generate, but yields {"index", "output_index", "token_ids", "text", "finish_reason", "logprobs",
        "prompt_logprobs"} with the new tokens, text and logprobs of a sample as soon as a step produces them
        ("index": the prompt's, "output_index": the sample's, 0..n-1; StreamDelta.as_chunk); finish_reason is None
        until its last chunk, prompt_logprobs None after its first. best_of > n is refused: which samples are
        returned is known only at the end (vLLM refuses it with streaming too).
        Closing the generator early aborts the unfinished requests and frees their blocks; a request aborted by
        abort_request meanwhile ends with finish_reason "abort"."""
        requests = self._queue(prompts, sampling_params, streaming=True)
        places = {seq_id: (i, j) for i, r in enumerate(requests) for j, seq_id in enumerate(r.seq_ids)}
        seq_ids = list(places)
        pending = {seq_id: DeltaCursor() for seq_id in seq_ids}  # what each unfinished sample has been sent
        self._generating.update(seq_ids)
        try:
            while pending:
                self._keep_others(self.step(), pending)
                for seq_id, (i, j) in places.items():
                    if seq_id not in pending:
                        continue
                    seq = self.requests.get(seq_id)
                    if seq is None:  # aborted by abort_request
                        del pending[seq_id]
                        yield StreamDelta.aborted().as_chunk(i, j)
                        continue
                    delta = self.output_processor.delta(seq, pending[seq_id])
                    if delta is None:
                        continue
                    if seq.is_finished:
                        del pending[seq_id]
                        self.requests.pop(seq_id)
                    yield delta.as_chunk(i, j)
        finally:
            self._generating.difference_update(seq_ids)
            for seq_id in pending:
                self.abort_request(seq_id)

    def output(self, seq: Sequence) -> RequestOutput:
        """A finished sequence of add_request as a RequestOutput of one sample."""
        return self.output_processor.output(seq)

    # --- counters and lifetime
    def stats(self) -> dict:
        return self.core.stats()

    def close(self):
        """Release the KV caches, the host pool and the worker processes; safe to call twice."""
        try:
            if self.core is not None:
                self.core.structured.close()  # structured outputs' mask thread
                self.core.close_disk_tier()
        finally:
            if self.executor is not None:
                self.executor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _check_one_sample(sampling_params: SamplingParams):
    if sampling_params.num_samples > 1:
        raise ValueError(f"n={sampling_params.n}, best_of={sampling_params.best_of}: add_request queues one "
                         f"sequence; use generate() or generate_stream() for several samples of a prompt")
