"""The model runner: the only owner of model weights, the GPU KV cache and (through the copy engine) the host KV
cache. It turns a SchedulerOutput into tensors, issues the swap copies, runs the forward pass and samples."""
import gc
from datetime import timedelta

import torch
import torch.distributed as dist

from nanovllm.config import SUPPORTED_ARCHITECTURES, Config
from nanovllm.core.sequence import Sequence
from nanovllm.engine.kv_cache import num_blocks_for_budget
from nanovllm.engine.memory_profile import apply_budget, profile_memory, release_stack_reservation
from nanovllm.engine.penalties import penalized_rows, step_penalties
from nanovllm.engine.prefill_probe import measure_prefill_tokens_per_s
from nanovllm.engine.cuda_graph import MIXED_GRAPH_TOKENS
from nanovllm.engine.device import resolve_device, resolve_dtype
from nanovllm.engine.step_inputs import SampledTokens, prepare_step_inputs
from nanovllm.engine.step_plan import StepPlan
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention, select_backend
from nanovllm.layers.kv_layout import KVLayout, check_fp8_support, hadamard
from nanovllm.layers.logprobs import chosen_and_top, raw_logprobs
from nanovllm.layers.sampler import Sampler, SamplingTensors, apply_token_bitmask
from nanovllm.models.decoder import DecoderForCausalLM
from nanovllm.models.weights import load_model_weights
from nanovllm.utils.compile import set_compile
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.cpu_threads import set_cpu_threads
from nanovllm.utils.distributed import tp_size
from nanovllm.utils.switches import SWITCHES
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
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> per-request generator (SamplingParams.seed)
        self._sampling_key, self._sampling = None, None  # the last batch's sampling tensors
        self._last_sampled = None  # [num_sampled] device tensor of the last launched step (rank 0)
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
        self.graphs = {}  # decode batch size -> DecodeGraph
        self.mixed_graphs = {}  # token bucket -> PiecewiseGraph, for prefill and mixed steps

    # --- start-up
    def _build_model(self) -> DecoderForCausalLM:
        config = self.config
        family = SUPPORTED_ARCHITECTURES[config.architecture]
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            torch.manual_seed(config.seed)
            with self.device:
                model = DecoderForCausalLM(config.hf_config, family, config.quant_spec, config.quantize_lm_head)
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
        self.copy_engine = CopyEngine(self.kv_cache, self.host_cache.kv, self.block_size)

    # --- one step
    def _to_device(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        """A list on the device; through pinned memory on CUDA so the copy is asynchronous."""
        t = torch.tensor(values, dtype=dtype)
        return t if self.device.type == "cpu" else t.pin_memory().to(self.device, non_blocking=True)

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """Per-row sampling parameters; reused while the batch holds the same sequences in the same order."""
        key = [s.seq_id for s in seqs]  # a list comprehension: twice as fast as tuple(generator)
        if key != self._sampling_key:
            self._sampling_key, self._sampling = key, self._build_sampling_tensors(seqs)
        return self._sampling

    def _build_sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [s.sampling_params for s in seqs]
        temperatures = [p.temperature for p in params]
        all_greedy = all(p.is_greedy for p in params)
        top_ks = top_ps = min_ps = generators = None
        if not all_greedy:
            vocab = self.config.hf_config.vocab_size
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                top_ks = self._to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.int64)
                top_ps = self._to_device([p.top_p for p in params], torch.float32)
            if any(p.min_p > 0 for p in params):
                min_ps = self._to_device([p.min_p for p in params], torch.float32)
            if any(p.seed is not None for p in params):
                generators = [self._generator(s) for s in seqs]
        temps = self._to_device([0.0 if p.is_greedy else t for p, t in zip(params, temperatures)], torch.float32)
        return SamplingTensors(temps, top_ks, top_ps, min_ps, generators, all_greedy, penalized_rows(seqs))

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator(self.device).manual_seed(seed)
        return self.generators[seq.seq_id]

    def release(self, seq_ids: list[int]):
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)

    @torch.inference_mode()
    def run(self, plan: StepPlan, sample_seqs: list[Sequence] | None = None) -> list[int]:
        """Issue this step's copies, run the forward, sample (rank 0). Returns one token per sequence that completed
        its prompt (or its recompute) this step, in batch order."""
        return self.launch(plan, sample_seqs).tolist()

    @torch.inference_mode()
    def launch(self, plan: StepPlan, sample_seqs: list[Sequence] | None = None,
               grammar_mask=None) -> "SampledTokens":
        """Like run, without waiting: the sampled tokens come back through the returned handle, so the host can
        schedule the next step while this one runs on the GPU. grammar_mask (rank 0, structured outputs): called
        once the forward is launched, returns (sample rows, host bitmask) or None; the host builds it meanwhile."""
        if self.copy_engine is not None:
            self.copy_engine.issue_step_copies(plan.swap_out, plan.swap_in, plan.new_gpu_block_ids, plan.block_tables)
        if not plan.num_tokens:
            return SampledTokens(None)
        logits, prompt_logprobs = self._forward(plan)
        if self.copy_engine is not None:
            self.copy_engine.forward_issued(plan.slot_mapping)
        if self.rank != 0:
            return SampledTokens(None)
        if logits is None:
            return SampledTokens(None, prompt_logprobs)
        if grammar_mask is not None:  # structured outputs: the host builds the mask while the forward runs
            logits = apply_token_bitmask(logits, grammar_mask())
        rows = self._to_device(plan.sample_logprob_rows, torch.int64) if plan.sample_logprob_rows else None
        logprobs = raw_logprobs(logits[rows]) if rows is not None else None  # before bans and penalties (vLLM)
        st = self.sampling_tensors(sample_seqs)
        penalties = step_penalties(sample_seqs, st.penalized_rows, st.penalty_batch is None)  # None: no penalty
        self._last_sampled = self.sampler(logits, st, plan.banned_token_ids, penalties, self._last_sampled,
                                          plan.logit_bias, plan.conditional_bans)
        if logprobs is not None:
            sample_logprobs = chosen_and_top(logprobs, self._last_sampled[rows], plan.num_top_logprobs)
            prompt_logprobs = _cat_rows(sample_logprobs, prompt_logprobs)
        return SampledTokens(self._last_sampled, prompt_logprobs)

    # rows per full-vocabulary slice of prompt logits: a long prompt chunk's float32 log-softmax stays within the
    # size of what the profiling run sized (max_num_seqs rows of logits; 256 x a 152k vocabulary is 156 MB)
    PROMPT_LOGPROB_ROWS = 256

    def _prompt_logprobs(self, hidden: torch.Tensor, plan: StepPlan) -> tuple[torch.Tensor, ...] | None:
        """chosen_and_top of the prompt rows (rank 0; every rank computes their logits, a collective at TP > 1)."""
        indices = self._to_device(plan.prompt_logprob_indices, torch.int64)
        token_ids = self._to_device(plan.prompt_logprob_token_ids, torch.int64)
        parts = None
        for start in range(0, len(plan.prompt_logprob_indices), self.PROMPT_LOGPROB_ROWS):
            end = start + self.PROMPT_LOGPROB_ROWS
            logits = self.model.compute_logits(hidden[indices[start:end]])
            if logits is not None:
                parts = _cat_rows(parts, chosen_and_top(raw_logprobs(logits), token_ids[start:end],
                                                         plan.num_top_logprobs))
        return parts

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor | None, tuple[torch.Tensor, ...] | None]:
        """Logits of the sampled rows (rank 0; None elsewhere or when nothing is sampled), and the prompt rows'
        logprobs (rank 0; None elsewhere or when the step has none)."""
        graph = self._graph_for(plan)
        inputs = prepare_step_inputs(plan, self.device, self._last_sampled, self.split_mixed_steps)
        if graph is not None:
            hidden = graph.replay(inputs)
        else:
            mixed_graph = self._mixed_graph_for(plan)
            set_context(inputs.metadata)
            try:
                if mixed_graph is not None:
                    hidden = mixed_graph.replay(inputs)
                else:
                    hidden = self.model(inputs.input_ids, inputs.positions)
            finally:
                reset_context()
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
            self._forward(self._warmup_plan([query_len]))
        # several sequences in one step, as a run's first steps have
        per_seq = min(300, limit // 4, num_blocks // 4 * bs)
        if per_seq > 0:
            self._forward(self._warmup_plan([per_seq] * 4))
        self._warmup_sampler()
        torch.cuda.synchronize()

    def _warmup_plan(self, query_lens: list[int]) -> StepPlan:
        """A prefill of fresh sequences of these lengths, each in its own consecutive free blocks."""
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

    def _warmup_sampler(self):
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

    # --- CUDA graphs for decode steps
    def _graph_for(self, plan: StepPlan):
        if not self.graphs or not plan.is_decode_only:
            return None
        batch = len(plan.query_lens)
        for size in self.graph_batch_sizes:
            if size >= batch:
                return self.graphs[size]
        return None

    def _mixed_graph_for(self, plan: StepPlan):
        for size, graph in self.mixed_graphs.items():  # ascending
            if size >= plan.num_tokens:
                return graph
        return None

    @torch.inference_mode()
    def capture_cuda_graphs(self):
        """Warm up, then capture decode forwards for batch sizes up to the smaller of max_num_seqs and
        max_cudagraph_capture_size (1, 2, 4, 8, 16, 32, ...) and piecewise prefill/mixed forwards for token buckets
        up to 2,048. On CPU, NANOVLLM_DECODE_GRAPHS=1 and NANOVLLM_PIECEWISE_GRAPHS=1 build the same graphs without
        capturing them: their static buffers, run eagerly (the CPU tests)."""
        self.warmup()
        piecewise = SWITCHES.piecewise_graphs
        if self.device.type != "cuda" or self.config.enforce_eager or self.backend.name == "torch":
            if self.device.type == "cpu" and SWITCHES.decode_graphs_on_cpu:
                self._capture_decode_graphs(capture=False)
            if piecewise == "1" and self.device.type == "cpu":
                self._capture_mixed_graphs(None, capture=False)
            return
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = self._capture_decode_graphs()
        if piecewise != "0":
            self._capture_mixed_graphs(pool)
        self.graph_pool_bytes_measured = torch.cuda.memory_reserved(self.device) - reserved_before

    def measure_prefill_speed(self) -> float | None:
        """Tokens/s of a timed prefill step, after capture (prefill_probe.py); None on the CPU, where it would cost
        seconds of start-up, and the policy keeps its prior."""
        return measure_prefill_tokens_per_s(self) if self.device.type == "cuda" else None

    def _capture_decode_graphs(self, capture: bool = True):
        """Returns the graphs' memory pool."""
        from nanovllm.engine.cuda_graph import DecodeGraph
        max_bs = min(self.config.max_num_seqs, self.config.max_cudagraph_capture_size)
        sizes = [1, 2, 4, 8] + list(range(16, 128, 16)) + list(range(128, max_bs, 32))
        self.graph_batch_sizes = [b for b in sizes if b < max_bs] + [max_bs]
        width = (self.config.max_model_len + self.block_size - 1) // self.block_size
        pool = None
        for size in reversed(self.graph_batch_sizes):
            graph = DecodeGraph(self.model, size, width, self.device, pool, capture)
            pool = graph.pool
            self.graphs[size] = graph
        return pool

    MIXED_GRAPH_TOKENS = MIXED_GRAPH_TOKENS  # owned by cuda_graph.py

    def _capture_mixed_graphs(self, pool, capture: bool = True):
        """Piecewise graphs for prefill and mixed steps of up to 2,048 tokens (larger steps are GPU-bound and run
        eagerly); NANOVLLM_PIECEWISE_GRAPHS=0 turns them off."""
        from nanovllm.engine.cuda_graph import MixedStepBuffers, PiecewiseGraph
        limit = self.config.max_num_batched_tokens
        sizes = [n for n in self.MIXED_GRAPH_TOKENS if n < limit] + [min(limit, self.MIXED_GRAPH_TOKENS[-1])]
        attn = self.model.model.layers[0].self_attn
        buffers = MixedStepBuffers(sizes[-1], self.config.hf_config.hidden_size, attn.qkv_proj.output_size,
                                   attn.num_heads * attn.head_dim, self.dtype, self.device)
        for size in reversed(sizes):
            graph = PiecewiseGraph(self.model, size, buffers, pool, capture)
            pool = graph.pool if capture else None
            self.mixed_graphs[size] = graph
        self.mixed_graphs = dict(sorted(self.mixed_graphs.items()))

    def close(self):
        if self.copy_engine is not None:
            self.copy_engine.close()
        if self.host_cache is not None:
            self.host_cache.close()
        for attn in (m for m in self.model.modules() if isinstance(m, Attention)):
            attn.kv = attn.rotation = None
        self.graphs.clear()
        self.mixed_graphs.clear()
        self.model = self.kv_cache = self.host_cache = self.copy_engine = None
        self.generators.clear()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        if dist.is_initialized():
            dist.destroy_process_group()


def _cat_rows(first: tuple[torch.Tensor, ...] | None, second: tuple[torch.Tensor, ...] | None):
    """Two chosen_and_top results, one's rows after the other's (either may be None)."""
    if first is None or second is None:
        return first if second is None else second
    return tuple(torch.cat(pair) for pair in zip(first, second))
