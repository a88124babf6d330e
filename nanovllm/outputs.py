"""What generate() returns, in vLLM's shape (vllm/outputs.py): one RequestOutput per prompt, holding one
CompletionOutput per returned sample (plain Python; no torch).

generate() used to return one dict per prompt; `out["text"]`, `out["token_ids"]`, `out["finish_reason"]`,
`out["logprobs"]`, `out["prompt_logprobs"]` and `out["metrics"]` still read that shape (the first sample's fields,
the metrics as a dict), so code written for either API runs.
"""
from dataclasses import dataclass

from nanovllm.core.request_metrics import RequestMetrics


@dataclass
class CompletionOutput:
    """One sample of a request."""
    index: int  # its place among the request's samples (0..n-1)
    text: str  # "" with detokenize=False
    token_ids: list[int]
    cumulative_logprob: float | None  # the sum of its tokens' logprobs; None unless logprobs were asked for
    logprobs: list | None  # one {token_id: Logprob} per token (nanovllm/logprobs.py); None unless asked for
    finish_reason: str | None = None  # "stop", "length", "abort"; None while it runs
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS or length

    def finished(self) -> bool:
        return self.finish_reason is not None


# generate()'s old dict keys: the first sample's fields, the request's prompt_logprobs and metrics
_SAMPLE_KEYS = ("text", "token_ids", "finish_reason", "logprobs")
LEGACY_KEYS = (*_SAMPLE_KEYS, "prompt_logprobs", "metrics")


@dataclass
class RequestOutput:
    """One prompt's result: its samples in `outputs` (n of them; with best_of, the n of highest cumulative logprob,
    best first, as vLLM returns them)."""
    request_id: str
    prompt: str | None  # the prompt's text; None when it was given as token ids
    prompt_token_ids: list[int]  # after truncate_prompt_tokens
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # the first sample's timings

    # --- the old dict shape
    def __getitem__(self, key: str):
        if key in _SAMPLE_KEYS:
            return getattr(self.outputs[0], key)
        if key == "prompt_logprobs":
            return self.prompt_logprobs
        if key == "metrics":
            return None if self.metrics is None else self.metrics.as_dict()
        raise KeyError(f"{key!r}: a RequestOutput's dict keys are {list(LEGACY_KEYS)}; see its attributes for the rest")

    def __contains__(self, key) -> bool:
        return key in LEGACY_KEYS

    def get(self, key: str, default=None):
        return self[key] if key in LEGACY_KEYS else default

    def keys(self) -> tuple[str, ...]:
        return LEGACY_KEYS
