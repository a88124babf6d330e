"""Per-request sampling options, validated at construction and again when a request is added (vLLM's names
and defaults)."""
import math
import numbers
from dataclasses import dataclass, replace


FLOAT32_MAX = 3.4028234663852886e38  # a temperature above it is infinite on the device: every logit becomes NaN
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal: a repetition penalty below it is 0 or subnormal
MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the most alternatives a request may ask for


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    # vLLM's penalties, on the raw logits before temperature and the filters (greedy too): presence and frequency
    # count the completion tokens only (logit -= presence * (count > 0) + frequency * count); repetition counts
    # the prompt's and the completion's (a positive logit is divided by it, another multiplied); 0, 0, 1 disable
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0
    max_tokens: int = 16  # vLLM's default
    min_tokens: int = 0  # until this many tokens are generated, EOS and stop_token_ids are not sampled
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # end with finish_reason "stop"; the token stays in token_ids
    stop: list[str] | str | None = None  # stop strings; the text is cut before the first match
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    # per generated token: its log-probability and those of the `logprobs` most likely tokens (0: its own only);
    # of the model's raw distribution (before penalties, temperature, top-k/p, min_p, min_tokens), as vLLM returns by
    # default
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token but the first; no prefix-cache hits then

    def __post_init__(self):
        # numpy / torch-free integers become Python ints
        for name in ("top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name}={value!r} must be a finite number")
            setattr(self, name, float(value))
        if not 0.0 <= self.temperature <= FLOAT32_MAX:
            raise ValueError(f"temperature={self.temperature} must be in [0, {FLOAT32_MAX:.4g}] (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an int, -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [-2, 2] (0 disables)")
        if not FLOAT32_TINY <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(f"repetition_penalty={self.repetition_penalty} must be > 0, in float32's normal range "
                             f"[{FLOAT32_TINY:.4g}, {FLOAT32_MAX:.4g}] (1 disables)")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [-2**63, 2**64) (a torch generator's)")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an int in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name}={value!r} must be None or an int in [0, {MAX_LOGPROBS}] (vLLM's "
                                 f"max_logprobs; 0 gives the chosen token's log-probability only)")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            value = getattr(self, name)
            if isinstance(value, (str, float)) or value not in (True, False):  # 0 / 1 and numpy bools pass
                raise ValueError(f"{name}={value!r} must be True or False")
            setattr(self, name, bool(value))
        stop = _as_list(self.stop)
        if stop is None or not all(isinstance(s, str) for s in stop):
            raise ValueError(f"stop={self.stop!r} must be a string or a list of strings")
        self.stop = [s for s in stop if s]
        ids = _as_list(self.stop_token_ids)
        if ids is None or isinstance(self.stop_token_ids, str) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids={self.stop_token_ids!r} must be a list of token ids (ints >= 0)")
        self.stop_token_ids = [int(i) for i in ids]

    def clone(self) -> "SamplingParams":
        """A checked, independent copy (vLLM's name): the engine takes one per request, so a field changed after
        construction is checked again (ValueError naming it) and a change after add_request cannot reach the
        request."""
        return replace(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _as_list(value) -> list | None:
    """None -> [], a string -> [it], any other iterable (tuple, set, generator, numpy array) -> a list; None when
    the value is not iterable."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    try:
        return list(value)
    except TypeError:
        return None
