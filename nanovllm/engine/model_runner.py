"""The model runner: the only owner of model weights, the GPU KV cache and (through the copy engine) the host KV
cache. It turns a StepPlan into tensors, issues the swap copies, runs the forward pass and samples. Two parts have
their own homes: what sampling keeps between steps (sampling_state.py) and the CUDA graphs with their buckets
(graph_runner.py). forward, warmup, warmup_plan and warmup_sampler are public for the start-up measurements
(memory_profile.py, prefill_probe.py) and bench.py."""
import gc
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.config import SUPPORTED_ARCHITECTURES, Config
from nanovllm.core.sequence import Sequence
from nanovllm.engine.device import resolve_device, resolve_dtype
from nanovllm.engine.graph_runner import GraphRunner
from nanovllm.engine.kv_cache import num_blocks_for_budget
from nanovllm.engine.memory_profile import (apply_budget, bound_dequant_scratch, profile_memory,
                                           release_stack_reservation)
from nanovllm.engine.penalties import PenaltyRows, step_penalties
from nanovllm.engine.prefill_probe import measure_prefill_tokens_per_s
from nanovllm.engine.sampling_state import SamplingState
from nanovllm.engine.step_inputs import SampledTokens, prepare_step_inputs, to_device
from nanovllm.engine.step_plan import StepPlan
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention, select_backend
from nanovllm.layers.kv_layout import KVLayout, check_fp8_support, hadamard
from nanovllm.layers.logprobs import logprobs_of
from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.layers.token_bitmask import TokenBitmask
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.weights import load_model_weights
from nanovllm.utils.compile import set_compile
from nanovllm.utils.cpu_threads import set_cpu_threads
from nanovllm.utils.distributed import tp_size
from nanovllm_offload.copy_engine import CopyEngine
from nanovllm_offload.host_kv_cache import HostKVCache


class ModelRunner:
    def __init__(self, config: Config, rank: int = 0, init_method: str | None = None):
        self.config = config
        self.rank = rank
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", rank)
            torch.cuda.set_device(self.device)
            release_stack_reservation(self.device)
            apply_budget(config, self.device)
            bound_dequant_scratch(config, self.device)  # the quantized kernels' scratch, from the budget
        if self.device.type == "cpu":  # the ranks share the usable cores instead of oversubscribing them
            set_cpu_threads(config.cpu_threads, config.hf_config.hidden_size, config.tensor_parallel_size)
        if config.tensor_parallel_size > 1:
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", init_method=init_method,
                                    world_size=config.tensor_parallel_size, rank=rank,
                                    timeout=timedelta(minutes=10))
        try:
            self._build(config)
        except BaseException:
            if dist.is_initialized():  # a failed start must not leave this process in a group (a retry would join it)
                dist.destroy_process_group()
            raise

    def _build(self, config: Config):
        """The model, sampler and attention backend of this rank; the KV cache comes later (allocate_kv_cache)."""
        hf = config.hf_config
        self.dtype = resolve_dtype(config.dtype, hf, self.device)
        self.block_size = config.kvcache_block_size
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = config.num_kv_heads // tp_size()
        self.head_dim = config.head_dim
        self.kv_layout = KVLayout(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype,
                                  config.kv_cache_dtype)
        check_fp8_support(config.kv_cache_dtype, self.device)
        self.model = self._build_model()
        self.sampler = Sampler()
        self.token_bitmask: TokenBitmask | None = None  # structured outputs' mask buffers, from the first one
        self.sampling = SamplingState(hf.vocab_size, self.device)  # rank 0's: generators, batch tensors, last ids
        self.backend = select_backend(config.attention_backend, self.device, self.block_size)
        # mixed steps: one-token rows through the decode kernel, the rest through prefill (a 256-decode + 256-token
        # step took 10.1 ms instead of 18.5 on an H200); tests turn it off to cover backends that take them whole
        self.split_mixed_steps = self.backend.splits_mixed_steps
        set_compile(self.device.type == "cuda" and not config.enforce_eager)
        if self.backend.name in ("triton", "flash"):
            from nanovllm.kernels.activation import silu_and_mul  # no per-element division (see its docstring)
            for act in (m for m in self.model.modules() if isinstance(m, SiluAndMul)):
                act.kernel = silu_and_mul
        self.kv_cache = None
        self.host_cache = self.copy_engine = None
        self.memory_breakdown = None  # where the GPU memory went (num_kv_blocks_for_budget)
        self.graph_pool_bytes_measured = 0  # torch memory reserved by capture_cuda_graphs
        self.graph_runner = GraphRunner(self.model, config, self.device, self.dtype, self.backend.name)

    # --- start-up
    def _build_model(self) -> DecoderForCausalLM:
        config = self.config
        family = SUPPORTED_ARCHITECTURES[config.architecture]
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            torch.manual_seed(config.seed)
            with self.device:
                model = DecoderForCausalLM(config.hf_config, family, config.quant_spec, config.quantize_lm_head,
                                           config.mlp_chunk_tokens,
                                           embedding_on_host=config.offload_embedding and self.device.type == "cuda")
        finally:
            torch.set_default_dtype(default_dtype)
        load_model_weights(model, config.model, config.load_format, config.seed)
        return model.eval()

    @property
    def block_bytes(self) -> int:
        """One block of all layers, K and V (and their scales with an FP8 cache), on this rank."""
        return self.kv_layout.block_bytes

    def num_kv_blocks_for_budget(self) -> int:
        """Also keeps where the memory went (memory_breakdown; None without a profiling run)."""
        num_blocks, self.memory_breakdown = num_blocks_for_budget(
            self.config, self.block_bytes, self.device, lambda: profile_memory(self), tp_size())
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int):
        """One block-major tensor (kv_layout.py): a block of all layers is one contiguous chunk, so swapping it is
        one DMA. Each layer sees strided views of its K and V (and, with FP8, of their scales)."""
        self.kv_cache = self.kv_layout.allocate(num_blocks, self.device)
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        fused = self.use_fused_rope_store()
        rotation = hadamard(self.head_dim, torch.float32, self.device) if self.kv_layout.is_fp8 else None
        for i, attn in enumerate(layers):
            attn.kv = self.kv_layout.layer_views(self.kv_cache, i)
            attn.rotation = rotation
            attn.backend = self.backend
            attn.fused_rope_store = fused
            attn.is_first_layer = i == 0

    def use_fused_rope_store(self) -> bool:
        """(q/k norm +) rope + KV store in one Triton kernel per layer instead of four to seven small kernels: on an
        H200 a batch-32 decode step drops from 2.78 to 2.49 ms and an eager mixed step's host time halves
        (docs/benchmarks.md). Needs a Triton-capable backend and head_dim / 2 a power of two."""
        half = self.head_dim // 2
        return self.backend.name in ("triton", "flash") and self.head_dim % 2 == 0 and half & (half - 1) == 0

    def allocate_host_cache(self, num_blocks: int):
        self.host_cache = HostKVCache(num_blocks, tuple(self.kv_cache.shape[1:]), self.kv_cache.dtype,
                                      pin_memory=self.device.type == "cuda")
        self.copy_engine = CopyEngine(self.kv_cache, self.host_cache.kv, self.block_size,
                                      reports_completions=self.rank == 0)

    # --- one step
    def release(self, seq_ids: list[int]):
        self.sampling.release(seq_ids)

    @torch.inference_mode()
    def run(self, plan: StepPlan, sample_seqs: list[Sequence] | None = None) -> list[int]:
        """Issue this step's copies, run the forward, sample (rank 0). Returns one token per sequence that completed
        its prompt (or its recompute) this step, in batch order."""
        return self.launch(plan, sample_seqs).tolist()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, sample_seqs: list[Sequence] | None = None,
               grammar_mask=None) -> "SampledTokens":
        """Like run, without waiting: the sampled tokens come back through the returned handle, so the host can
        schedule the next step while this one runs on the GPU. grammar_mask (rank 0, structured outputs): the
        step's StepMask (nanovllm/engine/structured_outputs.py), whose masks the host fills while the forward runs;
        the sampler then waits for them, so it is left to the handle's `complete` (SampledTokens)."""
        if self.copy_engine is not None:
            self.copy_engine.issue_step_copies(plan.swap_out, plan.swap_in, plan.new_gpu_block_ids, plan.block_tables,
                                               plan.store_id, plan.load_id)
        if not plan.num_tokens:
            return SampledTokens(None)
        if grammar_mask is not None and self.device.type == "cpu":  # the forward runs here: the masks fill beside it
            grammar_mask.begin(self._token_bitmask().host_masks())
        logits, prompt_logprobs = self.forward(plan)
        if self.copy_engine is not None:
            self.copy_engine.forward_issued(plan.written_gpu_block_ids)
        if self.rank != 0:
            return SampledTokens(None)
        if logits is None:
            return SampledTokens(None, prompt_logprobs)
        draw = self._sample_inputs(plan, sample_seqs, logits)
        if grammar_mask is None:
            return SampledTokens(*self._sample(plan, logits, prompt_logprobs, draw))
        # structured outputs: the host fills the masks while the forward runs (begun before it on a CPU), and the
        # sampler, which waits for them, is launched by SampledTokens.complete once the next step is scheduled
        if not grammar_mask.is_begun:
            grammar_mask.begin(self._token_bitmask().host_masks())
        return SampledTokens(sample=lambda: self._sample_constrained(plan, logits, prompt_logprobs, draw,
                                                                     grammar_mask))

    @torch.inference_mode()  # it runs after launch has returned
    def _sample_constrained(self, plan: StepPlan, logits: torch.Tensor,
                            prompt_logprobs: tuple[torch.Tensor, ...] | None, draw: "_SampleInputs", grammar_mask):
        return self._sample(plan, self._apply_grammar(logits, grammar_mask), prompt_logprobs, draw)

    def _sample_inputs(self, plan: StepPlan, sample_seqs: list[Sequence], logits: torch.Tensor) -> "_SampleInputs":
        """What the sampler reads of the sequences, taken at launch: a deferred (constrained) sampler runs after the
        next step is scheduled, when each sequence already holds that step's placeholder token and the penalties
        would count it."""
        rows = to_device(plan.sample_logprob_rows, torch.int64, self.device) if plan.sample_logprob_rows else None
        st = self.sampling.sampling_tensors(sample_seqs)
        return _SampleInputs(rows, st, step_penalties(sample_seqs, st.penalized_rows, st.penalty_batch is None))

    def _sample(self, plan: StepPlan, logits: torch.Tensor, prompt_logprobs: tuple[torch.Tensor, ...] | None,
                draw: "_SampleInputs"):
        """(the sampled tokens, the logprob rows: the sample rows' then the prompt rows') of the step's logits."""
        # the logprob rows' logits (an index copy: the sampler biases and penalizes `logits` in place, and logprobs
        # are of the model's own distribution, vLLM's raw_logprobs, after a grammar's mask as in vLLM), turned into
        # logprobs in chunks once sampled
        raw_rows = logits[draw.rows] if draw.rows is not None else None
        sampling = self.sampling
        sampling.last_sampled = self.sampler(logits, draw.tensors, plan.banned_token_ids, draw.penalties,
                                             sampling.last_sampled, plan.logit_bias, plan.conditional_bans)
        if raw_rows is not None:
            sample_logprobs = logprobs_of(raw_rows, sampling.last_sampled[draw.rows], plan.num_top_logprobs)
            prompt_logprobs = _cat_rows(sample_logprobs, prompt_logprobs)
        return sampling.last_sampled, prompt_logprobs

    def _token_bitmask(self) -> TokenBitmask:
        if self.token_bitmask is None:
            self.token_bitmask = TokenBitmask(self.config.max_num_seqs, self.config.hf_config.vocab_size, self.device)
        return self.token_bitmask

    def _apply_grammar(self, logits: torch.Tensor, step_mask) -> torch.Tensor:
        """The step's masks (a begun StepMask), once filled, applied to their rows' logits in place."""
        rows = step_mask.rows()
        return logits if rows is None else self.token_bitmask.apply(logits, rows)

    # rows per full-vocabulary slice of prompt logits: a long prompt chunk's logits stay within the size of what the
    # profiling run sized (max_num_seqs rows; 256 x a 152k vocabulary is 74 MiB in bf16), and logprobs_of turns
    # them into logprobs a few rows at a time
    PROMPT_LOGPROB_ROWS = 256

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, ...] | None:
        """chosen_and_top of the prompt rows (rank 0; every rank computes their logits, a collective at TP > 1)."""
        indices = to_device(plan.prompt_logprob_indices, torch.int64, self.device)
        token_ids = to_device(plan.prompt_logprob_token_ids, torch.int64, self.device)
        parts = None
        for start in range(0, len(plan.prompt_logprob_indices), self.PROMPT_LOGPROB_ROWS):
            end = start + self.PROMPT_LOGPROB_ROWS
            logits = self.model.compute_logits(hidden[indices[start:end]])
            if logits is not None:
                parts = _cat_rows(parts, logprobs_of(logits, token_ids[start:end], plan.num_top_logprobs))
        return parts

    # --- the forward pass, and the warm-up that runs it before the first request
    def forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """The plan's forward pass (a graph's replay where one holds the step), with no copies issued and nothing
        sampled. Returns the logits of the sampled rows (rank 0; None elsewhere or when nothing is sampled), and
        the prompt rows' logprobs (rank 0; None elsewhere or when the step has none). The warm-up, the prefill
        probe and bench.py's step profile call it with plans of their own."""
        inputs = prepare_step_inputs(plan, self.device, self.sampling.last_sampled, self.split_mixed_steps)
        hidden = self.graph_runner.forward(plan, inputs)
        prompt_logprobs = self._prompt_logprobs(hidden, plan) if plan.prompt_logprob_indices else None
        if not plan.logits_indices:
            return None, prompt_logprobs
        return self.model.compute_logits(hidden[inputs.logits_indices]), prompt_logprobs

    @torch.inference_mode()
    def warmup(self):
        """Compile the attention tile variants (one per query-length class) and settle torch.compile's dynamic
        shapes before the first request, so no JIT compile lands in a timed step. The prefills write into blocks
        that are all still free; nothing reads them before their next owner overwrites them."""
        if self.device.type != "cuda":
            return
        bs, num_blocks = self.block_size, self.kv_cache.size(0)
        limit = min(self.config.max_model_len, self.config.max_num_batched_tokens, num_blocks * bs)
        for query_len in sorted({min(n, limit) for n in (1, 2, 12, 24, 48, 100, 300, 1000)}):
            self.forward(self.warmup_plan([query_len]))
        # several sequences in one step, as a run's first steps have
        per_seq = min(300, limit // 4, num_blocks // 4 * bs)
        if per_seq > 0:
            self.forward(self.warmup_plan([per_seq] * 4))
        self.warmup_sampler()
        torch.cuda.synchronize()

    def warmup_plan(self, query_lens: list[int]) -> StepPlan:
        """A prefill of fresh sequences of these lengths, each in its own consecutive blocks from block 0: call it
        only while every block is free (start-up), as the warm-up and the prefill probe do."""
        bs, plan, next_block = self.block_size, StepPlan(), 0
        for query_len in query_lens:
            table = list(range(next_block, next_block + (query_len + bs - 1) // bs))
            next_block += len(table)
            plan.input_ids += [0] * query_len
            plan.positions += list(range(query_len))
            plan.slot_mapping += [table[p // bs] * bs + p % bs for p in range(query_len)]
            plan.query_lens.append(query_len)
            plan.seq_lens.append(query_len)
            plan.block_tables.append(table)
            plan.logits_indices.append(len(plan.input_ids) - 1)
        return plan

    def warmup_sampler(self):
        """Trace the compiled sampling ops (plain, and with top-k/top-p) for a few batch sizes, on logits of the
        LM head's dtype: warmed up on float32 only, the first bf16 batch of a run recompiled (1.2-2.6 s on an
        H200). Batch 1 comes first because torch.compile specializes on size 1 before it turns dynamic."""
        vocab = self.config.hf_config.vocab_size
        for batch in (1, 3, 16):
            logits = torch.randn(batch, vocab, device=self.device, dtype=self.dtype)
            temps = torch.full((batch,), 0.7, device=self.device)
            top_ks = torch.full((batch,), 50, dtype=torch.int64, device=self.device)
            top_ps = torch.full((batch,), 0.9, device=self.device)
            for ks, ps in ((None, None), (top_ks, top_ps)):
                self.sampler(logits, SamplingTensors(temps, ks, ps, None, None, all_greedy=False))

    # --- CUDA graphs (graph_runner.py)
    @torch.inference_mode()
    def capture_cuda_graphs(self):
        """Warm up, then capture the graphs of every bucket (GraphRunner.capture: decode batch sizes up to the
        smaller of max_num_seqs and max_cudagraph_capture_size, prefill/mixed token buckets up to
        MAX_MIXED_GRAPH_TOKENS) and keep what their pool reserved (graph_pool_bytes_measured)."""
        self.warmup()
        self.graph_pool_bytes_measured = self.graph_runner.capture()

    def measure_prefill_speed(self) -> float | None:
        """Tokens/s of a timed prefill step, after capture (prefill_probe.py); None on the CPU, where it would cost
        seconds of start-up, and the policy keeps its prior."""
        return measure_prefill_tokens_per_s(self) if self.device.type == "cuda" else None

    def close(self):
        if self.copy_engine is not None:
            self.copy_engine.close()
        if self.host_cache is not None:
            self.host_cache.close()
        for attn in (m for m in self.model.modules() if isinstance(m, Attention)):
            attn.kv = attn.rotation = None
        self.graph_runner.close()
        self.model = self.kv_cache = self.host_cache = self.copy_engine = None
        self.sampling.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class _SampleInputs:
    """A step's sampler inputs that come from its sequences (ModelRunner._sample_inputs)."""
    rows: torch.Tensor | None  # the sample rows whose logprobs are asked for
    tensors: SamplingTensors
    penalties: PenaltyRows | None


def _cat_rows(first: tuple[torch.Tensor, ...] | None, second: tuple[torch.Tensor, ...] | None):
    """Two chosen_and_top results, one's rows after the other's (either may be None)."""
    if first is None or second is None:
        return first if second is None else second
    return tuple(torch.cat(pair) for pair in zip(first, second))
