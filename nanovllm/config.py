"""Engine configuration: one dataclass, validated up front, torch-free.

The Hugging Face config is loaded lazily (transformers is imported inside `load_hf_config`), so the scheduler and the
block manager can import this module without pulling in torch or transformers.
"""
import json
import math
import numbers
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from nanovllm.utils.gguf_model import gguf_architecture, gguf_quant_spec, is_gguf_file, load_gguf_config

# architecture name (config.json's `architectures`) -> model family; every family is built by
# nanovllm.models.decoder.DecoderForCausalLM. Here, not in models/, so the config can check it without torch.
SUPPORTED_ARCHITECTURES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2ForCausalLM": "qwen2",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
}

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other names, resolved by Config
PREEMPTION_MODES = ("auto", "swap", "recompute")
ATTENTION_BACKENDS = ("auto", "torch", "triton", "flash")
HOST_CACHE_POLICIES = ("write_back", "write_through", "off")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names: "fp8" is e4m3
# the options that take one of a few values: checked by Config, offered by the CLI's flags
OPTION_CHOICES = {
    "device": ("auto", "cuda", "cpu"),
    "dtype": DTYPES + tuple(DTYPE_ALIASES),
    "load_format": ("auto", "dummy"),
    "preemption_mode": PREEMPTION_MODES,
    "attention_backend": ATTENTION_BACKENDS,
    "host_cache_policy": HOST_CACHE_POLICIES,
    "kv_cache_dtype": KV_CACHE_DTYPES,
}
# vLLM's batch limits for cards under 70 GiB (its offline defaults there; vLLM also counts an 80 GB A100 as small,
# which this rule does not): a half-size step and half the sampler rows halve the activation peak, which on an 8 GB
# card is KV that the batch does not get
SMALL_CARD_BYTES = 70 << 30
# and the MLP of a step over 2,048 tokens in 2,048-row slices (mlp_chunk_tokens): on Qwen3-8B its intermediates are
# 576 MiB of an 8,192-token step, 144 MiB a slice. Larger cards keep the unsliced GEMMs (the KV does not miss it)
SMALL_CARD_BATCH_LIMITS = dict(max_num_seqs=256, max_num_batched_tokens=8192, mlp_chunk_tokens=2048)
# 1 PiB: more than any host holds, so a larger swap_space is a typo; the bound also keeps its byte count finite.
# Config does not compare it with this host's memory: bench_swap.py sizes GPU machines' configs on any host
MAX_SWAP_SPACE_GIB = 1 << 20


def small_card_batch_limits(engine_kwargs: dict, card_bytes: int | None) -> dict:
    """The batch limits that replace Config's defaults on a card of card_bytes (the GPU's memory, or the budget when
    smaller), for those engine_kwargs does not set: vLLM's smaller ones under 70 GiB; none on larger cards or the
    CPU (None)."""
    if card_bytes is None or card_bytes >= SMALL_CARD_BYTES:
        return {}
    return {name: value for name, value in SMALL_CARD_BATCH_LIMITS.items() if name not in engine_kwargs}


def budget_bytes(budget_gib) -> int | None:
    """gpu_memory_budget_gib in bytes; None when it is None or not a valid budget (Config says why)."""
    if isinstance(budget_gib, numbers.Real) and not isinstance(budget_gib, bool) and 0 < budget_gib < math.inf:
        return int(budget_gib * (1 << 30))
    return None


@dataclass(slots=True)
class Config:
    model: str
    # --- where and how the model runs
    device: str = "auto"  # "auto": cuda when available, else cpu
    dtype: str = "auto"  # "auto": the checkpoint's dtype on cuda, float32 on cpu
    load_format: str = "auto"  # "dummy": random weights from config.json alone (benchmarks)
    seed: int = 0
    tensor_parallel_size: int = 1
    enforce_eager: bool = False  # True: no CUDA graphs, no torch.compile
    # decode steps of up to min(max_num_seqs, this) rows replay CUDA graphs; larger ones run eagerly. vLLM stops at
    # 512; 1,024 made bench.py's 8B run at max_num_seqs 1,024 1.024x faster (H200, docs/benchmarks.md)
    max_cudagraph_capture_size: int = 1024
    # schedule step N+1 while step N runs on the GPU; a finished sequence may compute one extra, discarded token.
    # None: on when tensor_parallel_size == 1 (the workers need each sampled token before the next step)
    async_scheduling: bool | None = None
    attention_backend: str = "auto"  # the tested ones: triton on cuda, torch on cpu; "flash" only when asked for
    # torch's intra-op threads on the CPU (per rank). None: the engine's choice from the usable cores, their load
    # and the model's size, unless OMP_NUM_THREADS, MKL_NUM_THREADS or torch.set_num_threads set it
    # (nanovllm/utils/cpu_threads.py)
    cpu_threads: int | None = None
    # --- batch limits
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # a GPU (or budget) under 70 GiB gets vLLM's smaller defaults instead, when these are not passed
    # (small_card_batch_limits, applied by the engine)
    max_num_seqs: int = 512
    max_num_batched_tokens: int = 16384  # token budget per step; longer prompts are prefilled in chunks
    # a step of more tokens runs its MLP in slices of this many rows (the same values, the GEMMs' rounding aside):
    # the MLP's intermediates are a large step's largest activation, which the KV cache is sized around. None:
    # unsliced (a card under 70 GiB gets 2,048, the largest piecewise-graph bucket, so no graph step changes)
    mlp_chunk_tokens: int | None = None
    # --- GPU KV cache
    # tokens per KV block; None: 64, or 256 with attention_backend="flash" (its paged KV needs multiples of 256).
    # 64 keeps a block one DMA of several MB (0.6B: 7 MB) while wasting little in each sequence's last block
    kvcache_block_size: int | None = None
    num_kvcache_blocks: int | None = None  # explicit cap on GPU blocks
    kv_cache_memory_bytes: int | None = None  # explicit KV budget; overrides gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # fraction of GPU memory the engine may fill (weights + activations + KV)
    # GiB: run as if the GPU had this much memory ("the 8 GB card" on a larger one). PyTorch's allocator is capped
    # so that torch's memory plus what CUDA itself holds stays inside it (a plan that does not fit fails with an
    # out-of-memory error, as on that card), and the KV is sized against min(GPU memory, this). None: the whole GPU
    gpu_memory_budget_gib: float | None = None
    enable_prefix_caching: bool = True
    # "auto": the model dtype. "fp8"/"fp8_e4m3"/"fp8_e5m2": 8-bit values with one scale per token and kv head inside
    # the block (nanovllm/layers/kv_layout.py), about half the bytes per block on the GPU, over PCIe and on the host
    kv_cache_dtype: str = "auto"
    # --- host tier (nanovllm_offload)
    swap_space: float = 4.0  # GiB of host memory for swapped-out KV blocks, per tensor-parallel rank
    preemption_mode: str = "auto"  # "auto" picks swap or recompute per victim from measured speeds
    # the host pool as a second-level prefix cache: "write_back" copies a cached block when it becomes evictable,
    # "write_through" as soon as it is cached, "off" keeps the pool for swapped sequences only
    host_cache_policy: str = "write_back"
    # --- disk tier (nanovllm_offload/disk_*.py, docs/disk_tier.md): prefix blocks kept across restarts
    kv_disk_path: str | None = None  # a directory (created when missing); None: no disk tier
    kv_disk_gib: float = 64  # cap on the directory's files (every model's blocks share it)
    # sampling defaults for options a request leaves unset: "auto" from the model's generation_config.json, "vllm"
    # none (SamplingParams' own), or a directory holding a generation_config.json (nanovllm/engine/generation_config.py)
    generation_config: str = "auto"
    # --- weights
    # the checkpoint's quantization (vLLM's option): None or "auto" follows config.json's quantization_config; a
    # method name ("awq", "gptq", "compressed-tensors", "fp8") must agree with it (layers/quantization/spec.py)
    quantization: str | None = None
    # "int8": the LM head's weight (and the input embedding's, one tensor when tied) rounded to int8 at load, with
    # a float32 scale per vocabulary row: half the bytes read by every step's head (1.2 GB of bf16 on Qwen3-8B)
    quantize_lm_head: str | None = None
    # True: the input embedding stays in pinned host memory and the GPU reads a step's rows from there over PCIe
    # (nanovllm/kernels/host_embedding.py): its GPU memory goes to the KV cache (Qwen3-8B's: 1.2 GB of bf16). Needs
    # an embedding apart from the LM head (untied), which reads every row each step; on a CPU device every weight
    # is in host memory already and it changes nothing
    offload_embedding: bool = False
    # --- vLLM's LLM(...) options
    tokenizer: str | None = None  # a tokenizer directory other than the model's (None: the model's own)
    trust_remote_code: bool = False  # True is refused: this engine runs only its own model code
    max_logprobs: int = 20  # the most logprobs / prompt_logprobs a request may ask for (vLLM's default)
    disable_log_stats: bool = False  # True: generate()'s progress bar shows no throughput figures
    # --- filled in by __post_init__
    hf_config: Any = field(default=None, repr=False)
    architecture: str = ""
    quant_spec: Any = field(default=None, init=False, repr=False)  # QuantSpec of the checkpoint, None: unquantized

    def __post_init__(self):
        self._check_model_dir()
        self._check_generation_config()
        self._check_vllm_options()
        if type(self.dtype).__name__ == "dtype" and str(self.dtype).startswith("torch."):  # vLLM takes torch.float16
            self.dtype = str(self.dtype).removeprefix("torch.")  # (torch is not imported here: metadata only)
        for name, choices in OPTION_CHOICES.items():
            _check_choice(name, getattr(self, name), choices)
        if self.kvcache_block_size is None:
            self.kvcache_block_size = 256 if self.attention_backend == "flash" else 64
        for name in ("kvcache_block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "max_cudagraph_capture_size", "max_model_len", "num_kvcache_blocks", "kv_cache_memory_bytes",
                     "cpu_threads"):
            value = getattr(self, name)
            if value is None:
                continue
            whole = isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer())
            if not whole or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be an int >= 1")
            setattr(self, name, int(value))  # numpy integers and whole floats (kv_cache_memory_bytes=4e9) too
        bs = self.kvcache_block_size
        if bs & (bs - 1):
            raise ValueError(f"kvcache_block_size={bs} must be a power of two")
        for name in ("gpu_memory_utilization", "swap_space"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
        for name in ("enable_prefix_caching", "enforce_eager", "async_scheduling", "offload_embedding"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "async_scheduling" and value is None):
                raise ValueError(f"{name}={value!r} must be True or False")
        if not isinstance(self.seed, numbers.Integral) or isinstance(self.seed, bool):
            raise ValueError(f"seed={self.seed!r} must be an int")
        budget = self.gpu_memory_budget_gib
        if budget is not None and (not isinstance(budget, numbers.Real) or isinstance(budget, bool)
                                   or not math.isfinite(budget) or budget <= 0):
            raise ValueError(f"gpu_memory_budget_gib={budget!r} must be a number of GiB > 0 (or None: the whole GPU)")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.async_scheduling is None:
            self.async_scheduling = self.tensor_parallel_size == 1
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("async_scheduling=True needs tensor_parallel_size=1 (the workers need each sampled "
                             "token before the next step); turn one of them off")
        if not 0 <= self.swap_space <= MAX_SWAP_SPACE_GIB:
            raise ValueError(f"swap_space={self.swap_space:g} GiB must be in [0, {MAX_SWAP_SPACE_GIB}] (GiB of host "
                             f"memory per rank; whether it fits this host is checked when the pool is allocated)")
        self._check_disk_tier()
        if self.hf_config is None:
            self.hf_config = load_hf_config(self.model)
        self._check_model_shape()
        self._check_kv_cache_dtype()
        self._check_quantization()
        if self.offload_embedding and getattr(self.hf_config, "tie_word_embeddings", False):
            raise ValueError("offload_embedding=True needs an embedding apart from the LM head: this model ties them "
                             "(tie_word_embeddings), and the head reads every row each step, so the table stays on "
                             "the GPU; pass offload_embedding=False")

    def _check_quantization(self):
        """The checkpoint's quantization_config read and checked against the model's shapes, before any weight
        loads: a format or shape the engine cannot run is one ValueError here."""
        from nanovllm.utils.quant_spec import check_quant_shapes, linear_shapes, parse_quant_spec
        if is_gguf_file(self.model):  # each tensor's block type (the layers check their own shapes)
            self.quant_spec = gguf_quant_spec(self.model, self.quantization)
            return
        hf = self.hf_config
        quant_config = getattr(hf, "quantization_config", None)
        if hasattr(quant_config, "to_dict"):  # transformers' QuantizationConfig; anything else parse_quant_spec checks
            quant_config = quant_config.to_dict()
        self.quant_spec = parse_quant_spec(quant_config, self.quantization)
        if self.mlp_chunk_tokens is not None and (not isinstance(self.mlp_chunk_tokens, numbers.Integral)
                                                  or isinstance(self.mlp_chunk_tokens, bool)
                                                  or self.mlp_chunk_tokens < 1):
            raise ValueError(f"mlp_chunk_tokens={self.mlp_chunk_tokens!r} must be None or an int >= 1")
        if self.quantize_lm_head not in (None, "int8"):
            raise ValueError(f"quantize_lm_head={self.quantize_lm_head!r} must be None or 'int8'")
        if self.quant_spec is not None:
            tp = self.tensor_parallel_size
            check_quant_shapes(self.quant_spec, linear_shapes(hf.hidden_size, hf.intermediate_size,
                                                              hf.num_attention_heads, self.num_kv_heads,
                                                              self.head_dim, tp), tp)

    def _check_disk_tier(self):
        gib = self.kv_disk_gib
        if not isinstance(gib, numbers.Real) or isinstance(gib, bool) or not math.isfinite(gib) or gib <= 0:
            raise ValueError(f"kv_disk_gib={gib!r} must be a finite number of GiB > 0")
        if self.kv_disk_path is None:
            return
        if not isinstance(self.kv_disk_path, (str, os.PathLike)) or not os.fspath(self.kv_disk_path):
            raise ValueError(f"kv_disk_path={self.kv_disk_path!r} must be a directory path (or None: no disk tier)")
        self.kv_disk_path = os.fspath(self.kv_disk_path)
        if os.path.exists(self.kv_disk_path) and not os.path.isdir(self.kv_disk_path):
            raise ValueError(f"kv_disk_path={self.kv_disk_path!r} is not a directory; pass a directory")
        try:  # here, before the weights load: the store would only fail once the KV is allocated
            os.makedirs(self.kv_disk_path, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.kv_disk_path):
                pass
        except OSError as error:
            raise ValueError(f"kv_disk_path={self.kv_disk_path!r} cannot be written ({error.strerror}); pass a "
                             f"writable directory, or kv_disk_path=None for no disk tier") from None
        if self.swap_space <= 0 or not self.host_prefix_cache:
            raise ValueError(f"kv_disk_path={self.kv_disk_path!r} needs the host tier below the GPU: swap_space > 0 "
                             f"(got {self.swap_space}), enable_prefix_caching=True (got {self.enable_prefix_caching})"
                             f" and host_cache_policy != 'off' (got {self.host_cache_policy!r})")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"kv_disk_path needs tensor_parallel_size=1 (got {self.tensor_parallel_size}): each rank "
                             f"would need its own store and agreement on every hit; drop kv_disk_path or use TP 1")

    def _check_vllm_options(self):
        """trust_remote_code, tokenizer, max_logprobs, disable_log_stats and dtype's other names."""
        if self.trust_remote_code is not False:
            raise ValueError(f"trust_remote_code={self.trust_remote_code!r}: this engine runs only its own model code "
                             f"(nanovllm/models/) and never a checkpoint's Python files; leave it False")
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)) or not os.path.isdir(self.tokenizer):
                raise ValueError(f"tokenizer={self.tokenizer!r} is not a directory; pass a local tokenizer directory "
                                 f"(or None: the model's)")
            self.tokenizer = os.fspath(self.tokenizer)
        if not isinstance(self.max_logprobs, numbers.Integral) or isinstance(self.max_logprobs, bool) \
                or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs={self.max_logprobs!r} must be an int >= 0")
        self.max_logprobs = int(self.max_logprobs)
        if not isinstance(self.disable_log_stats, bool):
            raise ValueError(f"disable_log_stats={self.disable_log_stats!r} must be True or False")
        if isinstance(self.dtype, str):
            self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)

    def _check_kv_cache_dtype(self):
        if self.kv_cache_dtype == "auto":
            return
        head_dim = self.head_dim
        if head_dim & (head_dim - 1):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} needs head_dim a power of two (K is stored "
                             f"Hadamard-rotated), the model has {head_dim}; use kv_cache_dtype='auto'")
        if self.attention_backend == "flash":
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not supported by attention_backend='flash'; "
                             f"use attention_backend='auto' (the Triton kernels read FP8 KV)")

    def _check_generation_config(self):
        value = self.generation_config
        if not isinstance(value, str) or value not in ("auto", "vllm") and not os.path.isdir(value):
            raise ValueError(f"generation_config={value!r} must be 'auto', 'vllm' or a directory holding a "
                             f"generation_config.json")

    def _check_model_dir(self):
        if not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model={self.model!r} must be the path of a local Hugging Face checkpoint (a str)")
        self.model = os.fspath(self.model)
        if is_gguf_file(self.model):  # a GGUF file: its config is its metadata (nanovllm/utils/gguf_model.py)
            self.hf_config = load_gguf_config(self.model)
            self.architecture = gguf_architecture(self.model, self.hf_config)
            return
        path = os.path.join(self.model, "config.json")
        if not os.path.isdir(self.model):
            raise ValueError(f"model={self.model!r} is not a directory; pass a local Hugging Face checkpoint "
                             f"(or a .gguf file)")
        if not os.path.isfile(path):
            raise ValueError(f"model={self.model!r} has no config.json")
        with open(path) as f:
            architectures = json.load(f).get("architectures") or []
        supported = [a for a in architectures if a in SUPPORTED_ARCHITECTURES]
        if not supported:
            raise ValueError(f"unsupported architecture {architectures} in {path}; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        self.architecture = supported[0]

    def _check_model_shape(self):
        hf = self.hf_config
        max_pos = hf.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = max_pos
        if not 1 <= self.max_model_len <= max_pos:
            raise ValueError(f"max_model_len={self.max_model_len} must be in [1, {max_pos}] "
                             f"(the model's max_position_embeddings)")
        tp = self.tensor_parallel_size
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        for name, n in (("num_attention_heads", hf.num_attention_heads), ("num_key_value_heads", num_kv_heads),
                        ("intermediate_size", hf.intermediate_size)):
            if n % tp:
                raise ValueError(f"{name}={n} is not divisible by tensor_parallel_size={tp}; pick a divisor of {n}")
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={act!r} is not supported (only silu, the MLP activation of Llama, Qwen2 and "
                             f"Qwen3 checkpoints)")
        window = getattr(hf, "sliding_window", None)  # e.g. Mistral-7B-v0.1: 4096; Qwen2/3 ship one, switched off
        layer_types = getattr(hf, "layer_types", None) or ["sliding_attention"]
        windowed = bool(window) and getattr(hf, "use_sliding_window", True) and "sliding_attention" in layer_types
        if windowed and self.max_model_len > window:
            raise ValueError(f"the model attends over a sliding window of {window} tokens, which this engine does not "
                             f"implement; max_model_len={self.max_model_len} would let contexts pass it and give "
                             f"wrong outputs: set max_model_len <= {window}")
        rope_type = rope_parameters(hf).get("rope_type", "default")
        if rope_type != "default":
            raise ValueError(f"rope_type={rope_type!r} is not supported (only the default rope)")

    @property
    def is_fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def host_prefix_cache(self) -> bool:
        """The host pool also serves as a second-level prefix cache."""
        return self.enable_prefix_caching and self.host_cache_policy != "off"

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.hf_config)

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads


def head_dim_of(hf) -> int:
    """A Hugging Face config's attention head size (explicit, or hidden_size / heads)."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads



def _check_choice(name: str, value, choices):
    if value not in choices:
        raise ValueError(f"{name}={value!r} must be one of {list(choices)}")


def load_hf_config(model: str):
    if is_gguf_file(model):
        return load_gguf_config(model)
    path = os.path.join(model, "config.json")
    if os.path.isfile(path):  # checked before transformers reads it: it fails on this one with an AttributeError
        with open(path) as f:
            quant_config = json.load(f).get("quantization_config")
        if quant_config is not None and not isinstance(quant_config, dict):
            raise ValueError(f"quantization_config={quant_config!r} must be a JSON object")
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(model)


def rope_parameters(hf_config) -> dict:
    """rope_theta and rope_type across transformers 4 (rope_theta / rope_scaling) and 5 (rope_parameters)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    params.setdefault("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return params
