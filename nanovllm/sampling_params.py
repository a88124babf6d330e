"""Per-request sampling options, validated at construction and again when a request is added (vLLM's names
and defaults)."""
import json
import math
import numbers
from dataclasses import dataclass, replace


FLOAT32_MAX = 3.4028234663852886e38  # a temperature above it is infinite on the device: every logit becomes NaN
FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal: a repetition penalty below it is 0 or subnormal
MAX_LOGPROBS = 20  # vLLM's default max_logprobs (LLM(max_logprobs=...)): the most alternatives a request may ask for
MAX_LOGIT_BIAS = 100.0  # OpenAI's and vLLM's bound on a logit_bias value


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # StructuredOutputsParams' constraints


@dataclass(slots=True)
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's names): exactly one of json (a JSON schema, as a dict or its
    JSON text), regex, choice (the output is one of these strings), grammar (EBNF / GBNF or Lark) or json_object
    (any JSON object). Checked here for shape only; the engine compiles it when the request is added and raises
    ValueError naming the field where the schema, regex or grammar does not compile."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None  # False counts as unset
    disable_any_whitespace: bool = False  # JSON: no whitespace between tokens (compact output)
    disable_additional_properties: bool = False  # JSON: an object schema without additionalProperties gets False
    whitespace_pattern: str | None = None  # JSON: a regex for the whitespace allowed between tokens

    def __post_init__(self):
        if hasattr(self.json, "model_json_schema"):  # a pydantic model class, as vLLM accepts
            self.json = self.json.model_json_schema()
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if self.json_object is False:
            self.json_object = None
        kinds = self.kinds_set()
        if len(kinds) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; "
                             f"got {', '.join(kinds) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise ValueError(f"structured_outputs.json={self.json!r} must be a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name}={value!r} must be a non-empty string")
        if self.choice is not None:
            choice = _as_list(self.choice)
            if not choice or isinstance(self.choice, str) or not all(isinstance(c, str) for c in choice):
                raise ValueError(f"structured_outputs.choice={self.choice!r} must be a non-empty list of strings")
            self.choice = choice
        if self.json_object not in (None, True):
            raise ValueError(f"structured_outputs.json_object={self.json_object!r} must be True, False or None")

    def kinds_set(self) -> list[str]:
        return [name for name in STRUCTURED_KINDS if getattr(self, name) is not None]

    @property
    def kind(self) -> str:
        """The constraint's field name: "json", "regex", "choice", "grammar" or "json_object"."""
        return self.kinds_set()[0]

    @property
    def key(self) -> tuple:
        """Hashable and equal for equal constraints: the compiled-grammar cache's key."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.dumps(value, sort_keys=True)
        elif self.kind == "choice":
            value = tuple(value)
        return (self.kind, value, self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)


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
    max_tokens: int | None = 16  # vLLM's default; None: up to max_model_len (and what the KV cache holds)
    min_tokens: int = 0  # until this many tokens are generated, EOS and stop_token_ids are not sampled
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # end with finish_reason "stop"; the token stays in token_ids
    stop: list[str] | str | None = None  # stop strings; the text is cut before the first match
    include_stop_str_in_output: bool = False  # keep the matched stop string (or stop token's text) in the text
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    # per generated token: its log-probability and those of the `logprobs` most likely tokens (0: its own only);
    # of the model's raw distribution (before penalties, temperature, top-k/p, min_p, min_tokens; after the
    # structured_outputs mask), as vLLM returns by default
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for each prompt token but the first; no prefix-cache hits then
    # (new fields go last: the order above is the positional one callers may rely on)
    n: int = 1  # completions returned per prompt
    best_of: int | None = None  # sample this many (>= n; None: n) and return the n of highest cumulative logprob
    # {token id: bias} added to the raw logits before sampling (greedy too), clamped to [-100, 100] as vLLM does
    logit_bias: dict[int, float] | None = None
    # words that may not be generated: the last token of a word's tokenization is banned where the tokens before it
    # were just generated (vLLM's rule; each word is tokenized with and without a leading space)
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True  # leave special tokens (EOS, chat markers) out of the text
    detokenize: bool = True  # False: token ids only, the text stays ""
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: the last max_model_len)
    # constrain the output to a JSON schema, regex, choice or grammar; a finished grammar ends the sequence ("stop")
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        # numpy / torch-free integers become Python ints
        for name in ("n", "best_of", "top_k", "max_tokens", "min_tokens", "seed", "logprobs", "prompt_logprobs",
                     "truncate_prompt_tokens"):
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
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens={self.max_tokens!r} must be an int >= 1, or None (up to max_model_len)")
        max_tokens = math.inf if self.max_tokens is None else self.max_tokens
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens!r} must be an int in [0, max_tokens={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise ValueError(f"{name}={value!r} must be None or an int >= 0 (at most the engine's max_logprobs, "
                                 f"default {MAX_LOGPROBS}; 0 gives the chosen token's log-probability only)")
        self._check_parallel_sampling()
        self._check_token_options()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs={self.structured_outputs!r} must be None or a "
                             f"StructuredOutputsParams")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
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
        if self.stop and not self.detokenize:
            raise ValueError(f"stop={self.stop!r} matches text, and detokenize=False makes none; pass stop_token_ids "
                             f"or detokenize=True")

    def _check_parallel_sampling(self):
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be an int >= 1")
        if self.best_of is not None and (not _is_int(self.best_of) or self.best_of < self.n):
            raise ValueError(f"best_of={self.best_of!r} must be None or an int >= n={self.n}")
        if self.seed is not None and self.seed + self.num_samples - 1 >= 2**64:
            raise ValueError(f"seed={self.seed!r} is too large for {self.num_samples} samples: sample i uses seed + i, "
                             f"which must stay below 2**64")

    def _check_token_options(self):
        """logit_bias, bad_words and truncate_prompt_tokens; token ids against the vocabulary are the engine's to
        check. logit_bias keys may be strings of digits, as JSON sends them."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias={self.logit_bias!r} must be a dict {{token id: bias}}")
            bias = {}
            for token_id, value in self.logit_bias.items():
                if isinstance(token_id, str) and token_id.isdigit():
                    token_id = int(token_id)
                if not _is_int(token_id) or token_id < 0:
                    raise ValueError(f"logit_bias key {token_id!r} must be a token id (an int >= 0)")
                if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
                    raise ValueError(f"logit_bias[{token_id}]={value!r} must be a finite number")
                bias[int(token_id)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(value)))
            self.logit_bias = bias or None
        words = _as_list(self.bad_words)
        if words is None or not all(isinstance(w, str) for w in words):
            raise ValueError(f"bad_words={self.bad_words!r} must be a string or a list of strings")
        self.bad_words = [w for w in words if w.strip()] or None
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k >= 1 or k == -1)):
            raise ValueError(f"truncate_prompt_tokens={k!r} must be None, an int >= 1, or -1 (max_model_len)")

    def clone(self) -> "SamplingParams":
        """A checked, independent copy (vLLM's name): the engine takes one per request, so a field changed after
        construction is checked again (ValueError naming it) and a change after add_request cannot reach the
        request."""
        structured = self.structured_outputs
        return replace(self, structured_outputs=structured and replace(structured))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """Sequences generated for the prompt: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

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
