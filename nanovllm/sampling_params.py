"""Per-request sampling options, validated at construction (vLLM's names and defaults)."""
import numbers
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]; 1 disables
    top_k: int = -1  # -1 (or 0) disables
    min_p: float = 0.0  # in [0, 1]; 0 disables
    max_tokens: int = 64
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None  # end with finish_reason "stop"; the token stays in token_ids
    stop: list[str] | str | None = None  # stop strings; the text is cut before the first match
    seed: int | None = None  # per-request generator: the same seed gives the same tokens

    def __post_init__(self):
        for name in ("top_k", "max_tokens", "seed"):  # numpy / torch-free integers become Python ints
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                setattr(self, name, int(value))
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k={self.top_k!r} must be an int, -1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p={self.min_p} must be in [0, 1]")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not -2**63 <= self.seed < 2**64):
            raise ValueError(f"seed={self.seed!r} must be None or an int in [-2**63, 2**64) (a torch generator's)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
