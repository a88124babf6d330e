"""A checkpoint's `quantization_config` read into one QuantSpec, or refused with one ValueError naming the field,
its value and what is supported. Torch-free: Config runs it before the model is built, so a checkpoint the engine
cannot run fails before any weight is read."""
import re
from dataclasses import dataclass

# vLLM's names for the checkpoint formats; its kernel-specific spellings of the same checkpoints are aliases
METHODS = ("awq", "gptq", "compressed-tensors", "fp8")
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}


@dataclass(frozen=True)
class QuantSpec:
    """How a checkpoint's linear layers are quantized (layout.py holds the layouts)."""
    method: str  # the checkpoint format, one of METHODS or "layout" (layout_spec): the tensors formats.py reads
    kind: str  # the engine layout: "int" or "fp8"
    bits: int = 8
    group_size: int = -1  # int kind: K elements per scale; -1: one group per row (G = K)
    has_zero_point: bool = True  # int kind: the checkpoint stores zero points (asymmetric)
    block_size: tuple[int, int] | None = None  # fp8 kind: (bn, bk) of weight_scale_inv; None: a scale per row
    zero_offset: int = 0  # GPTQ v1 stores each zero point minus 1: added back at load
    skip_modules: tuple[str, ...] = ()  # modules left unquantized: a name fragment, or a regex after "re:"

    def is_skipped(self, prefix: str) -> bool:
        """Whether the linear layer named prefix (a checkpoint name, e.g. model.layers.0.mlp.down_proj) stays
        unquantized (transformers' modules_to_not_convert, compressed-tensors' ignore)."""
        for pattern in self.skip_modules:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], prefix):
                    return True
            elif pattern == prefix or prefix.endswith("." + pattern) or f".{pattern}." in f".{prefix}.":
                return True
        return False

    @property
    def skipped_tensors(self) -> tuple[str, ...]:
        """Checkpoint tensor suffixes no parameter reads: FP8's static activation scales (the engine computes
        in the activations' dtype, weight-only, as vLLM does where FP8 matmuls are missing)."""
        return (".input_scale",) if self.kind == "fp8" else ()

    def group_size_for(self, input_size: int) -> int:
        return input_size if self.group_size == -1 else self.group_size


def parse_quant_spec(quant_config: dict | None, option: str | None) -> QuantSpec | None:
    """The QuantSpec of a checkpoint's quantization_config (None: unquantized). `option` is Config.quantization:
    None or "auto" follows the checkpoint; a method name must agree with it."""
    if option is not None and (not isinstance(option, str) or option != "auto" and _canonical(option) not in METHODS):
        raise ValueError(f"quantization={option!r} must be None, 'auto' or one of {list(METHODS)}")
    if quant_config is None:
        if option not in (None, "auto"):
            raise ValueError(f"quantization={option!r} but the checkpoint has no quantization_config in its "
                             f"config.json (weights are quantized only by their checkpoint; make one with "
                             f"`nanovllm convert --quantize`); drop the option")
        return None
    if not isinstance(quant_config, dict):
        raise ValueError(f"quantization_config={quant_config!r} must be a JSON object")
    method = _canonical(str(quant_config.get("quant_method", "")))
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method={quant_config.get('quant_method')!r} is not supported; "
                         f"supported: {list(METHODS)}")
    if option not in (None, "auto") and _canonical(option) != method:
        raise ValueError(f"quantization={option!r} disagrees with the checkpoint's quantization_config.quant_method="
                         f"{quant_config.get('quant_method')!r}; pass quantization='auto' (or None)")
    return PARSERS[method](quant_config)


def _canonical(name: str) -> str:
    name = name.lower()
    return ALIASES.get(name, name)


def _require(config: dict, field: str, supported, prefix: str = "quantization_config", default=None):
    value = config.get(field, default)
    if value not in supported:
        raise ValueError(f"{prefix}.{field}={value!r} is not supported; supported: {list(supported)}")
    return value


def _group_size(config: dict, field: str, bits: int, prefix: str = "quantization_config") -> int:
    group_size = config.get(field)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or not (
            group_size == -1 or group_size > 0 and (bits != 4 or group_size % 8 == 0)):
        raise ValueError(f"{prefix}.{field}={group_size!r} is not supported; supported: a positive int"
                         f"{' multiple of 8' if bits == 4 else ''}, or -1 (one group per row)")
    return group_size


def _skipped(config: dict, field: str) -> tuple[str, ...]:
    names = config.get(field) or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"quantization_config.{field}={names!r} must be a list of module names")
    return tuple(names)


def _parse_awq(config: dict) -> QuantSpec:
    _require(config, "version", ("gemm", "GEMM"), default="gemm")
    bits = _require(config, "bits", (4,), default=config.get("w_bit"))
    _require(config, "zero_point", (True,), default=True)
    group_size = _group_size(config, "group_size" if "group_size" in config else "q_group_size", bits)
    return QuantSpec("awq", "int", bits, group_size, True, skip_modules=_skipped(config, "modules_to_not_convert"))


def _refuse_set(config: dict, fields: tuple[str, ...], prefix: str = "quantization_config"):
    """ValueError for the first of `fields` that is set (not null, false or empty): each changes what the weights
    mean (a quantized head, per-module overrides, a rotation to apply at run time, sparsity), and ignoring it
    would load a model that computes something else."""
    for field in fields:
        if config.get(field):
            raise ValueError(f"{prefix}.{field}={config[field]!r} is not supported; supported: null (unset)")


def _parse_gptq(config: dict) -> QuantSpec:
    bits = _require(config, "bits", (4, 8))
    _require(config, "desc_act", (False, None), default=False)  # act-order: groups in a permuted K order, refused
    _refuse_set(config, ("lm_head", "dynamic"))  # GPTQModel's quantized head and per-module overrides
    fmt = _require(config, "checkpoint_format", ("gptq", "gptq_v2"), default="gptq")
    group_size = _group_size(config, "group_size", bits)
    zero_offset = 1 if fmt == "gptq" else 0
    return QuantSpec("gptq", "int", bits, group_size, True, zero_offset=zero_offset,
                     skip_modules=_skipped(config, "modules_to_not_convert"))


def _is_block(block) -> bool:
    """[bn, bk]: two positive ints (not bools)."""
    return isinstance(block, list) and len(block) == 2 and all(
        isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)


def _parse_fp8(config: dict) -> QuantSpec:
    _require(config, "fmt", ("e4m3",), default="e4m3")
    _require(config, "activation_scheme", ("dynamic", "static"), default="dynamic")
    block = config.get("weight_block_size")
    if block is not None and not _is_block(block):
        raise ValueError(f"quantization_config.weight_block_size={block!r} is not supported; supported: [bn, bk] "
                         f"of two positive ints (Qwen's [128, 128]), or none (one scale per tensor)")
    return QuantSpec("fp8", "fp8", 8, block_size=tuple(block) if block else None,
                     skip_modules=_skipped(config, "modules_to_not_convert") + _skipped(config, "ignored_layers"))


def _parse_compressed_tensors(config: dict) -> QuantSpec:
    _refuse_set(config, ("transform_config", "sparsity_config"))
    groups = config.get("config_groups") or {}
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"quantization_config.config_groups has {len(groups)} groups; supported: exactly one (a "
                         f"scheme for every Linear)")
    (name, group), = groups.items()
    prefix = f"quantization_config.config_groups.{name}"
    if not isinstance(group, dict):
        raise ValueError(f"{prefix}={group!r} is not supported; supported: a scheme (an object with targets and "
                         f"weights)")
    _refuse_set(group, ("output_activations",), prefix)
    _refuse_set(group.get("weights") or {}, ("dynamic",), f"{prefix}.weights")
    if group.get("targets") != ["Linear"]:
        raise ValueError(f"{prefix}.targets={group.get('targets')!r} is not supported; supported: ['Linear']")
    weights = group.get("weights") or {}
    skip = _skipped(config, "ignore")
    if group.get("format"):  # newer files name the format per group ("mixed-precision" at the top)
        fmt = _require(group, "format", ("pack-quantized", "float-quantized"), prefix)
    else:
        fmt = _require(config, "format", ("pack-quantized", "float-quantized"))
    if fmt == "float-quantized":
        _require(weights, "type", ("float",), f"{prefix}.weights")
        _require(weights, "num_bits", (8,), f"{prefix}.weights")
        strategy = _require(weights, "strategy", ("channel", "tensor", "block"), f"{prefix}.weights")
        block = weights.get("block_structure") if strategy == "block" else None
        if strategy == "block" and not _is_block(block):
            raise ValueError(f"{prefix}.weights.block_structure={block!r} is not supported; supported: [bn, bk] of "
                             f"two positive ints")
        return QuantSpec("compressed-tensors", "fp8", 8, block_size=tuple(block) if block else None,
                         skip_modules=skip)
    _require(weights, "type", ("int",), f"{prefix}.weights")
    bits = _require(weights, "num_bits", (4, 8), f"{prefix}.weights")
    strategy = _require(weights, "strategy", ("group", "channel"), f"{prefix}.weights")
    _require(weights, "actorder", (None, False), f"{prefix}.weights")
    group_size = _group_size(weights, "group_size", bits, f"{prefix}.weights") if strategy == "group" else -1
    symmetric = _require(weights, "symmetric", (True, False), f"{prefix}.weights")
    if group.get("input_activations") is not None:
        raise ValueError(f"{prefix}.input_activations={group['input_activations']!r} is not supported with "
                         f"pack-quantized weights; supported: null (weight-only W4A16/W8A16)")
    return QuantSpec("compressed-tensors", "int", bits, group_size, not symmetric, skip_modules=skip)


def layout_spec(bits: int, group_size: int, has_mins: bool) -> QuantSpec:
    """A QuantSpec whose checkpoint tensors are already the int layout (layout.py): qweight, scales and, with
    has_mins, mins. For loaders that repack a format themselves (GGUF) and then load through the layers' weight
    loaders, which shard them for tensor parallelism."""
    if bits not in (4, 8) or group_size < 1 or bits == 4 and group_size % 8:
        raise ValueError(f"bits={bits}, group_size={group_size}: the int layout holds 4 or 8 bits in groups of a "
                         f"positive size (a multiple of 8 for 4 bits)")
    return QuantSpec("layout", "int", bits, group_size, has_mins)


PARSERS = {"awq": _parse_awq, "gptq": _parse_gptq, "fp8": _parse_fp8, "compressed-tensors": _parse_compressed_tensors}


ROW_PARALLEL = ("o_proj", "down_proj")  # the layers whose inputs tensor parallelism splits


def linear_shapes(hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  tp: int) -> dict[str, tuple[list[int], int]]:
    """The decoder's linear layers on one rank: name -> (output sizes of each merged part, input size)."""
    return {"qkv_proj": ([num_heads * head_dim // tp, num_kv_heads * head_dim // tp, num_kv_heads * head_dim // tp],
                         hidden_size),
            "o_proj": ([hidden_size], num_heads * head_dim // tp),
            "gate_up_proj": ([intermediate_size // tp] * 2, hidden_size),
            "down_proj": ([hidden_size], intermediate_size // tp)}


def check_quant_shapes(spec: QuantSpec, shapes: dict[str, tuple[list[int], int]], tp: int):
    """Every layer splits on group (or block) boundaries: each rank's input size is a whole number of groups (FP8
    blocks), and each merged part's outputs whole packed words (FP8 blocks)."""
    for layer, (output_sizes, input_size) in shapes.items():
        if spec.kind == "fp8":
            (unit_n, unit_k), setting = spec.block_size or (1, 1), f"weight_block_size={list(spec.block_size or [])}"
        else:  # int32 words pack 32 // bits outputs: AWQ's weights, GPTQ's and compressed-tensors' zero points
            unit_n, unit_k, setting = 32 // spec.bits, spec.group_size, f"group_size={spec.group_size}"
            if spec.group_size == -1:  # one group per row: a row-parallel layer's ranks would split it
                unit_k = input_size if tp == 1 or layer not in ROW_PARALLEL else 0
        if unit_k <= 0 or input_size % unit_k:
            raise ValueError(f"quantization_config.{setting} does not divide {layer}'s input size {input_size} (per "
                             f"rank at tensor_parallel_size={tp}); supported: groups that divide each rank's inputs")
        for size in output_sizes:
            if size % unit_n:
                raise ValueError(f"quantization_config.{setting}: {layer}'s output part of {size} (per rank at "
                                 f"tensor_parallel_size={tp}) is not a multiple of {unit_n}; supported: outputs in "
                                 f"whole {'blocks' if spec.kind == 'fp8' else 'packed int32 words'}")
