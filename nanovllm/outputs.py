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


@dataclass(eq=False)
class RequestOutput(dict):
    """One prompt's result: its samples in `outputs` (n of them; with best_of, the n of highest cumulative logprob,
    best first, as vLLM returns them).
    It is also the dict generate() returned before (the first sample's text, token_ids, finish_reason and logprobs,
    the request's prompt_logprobs, and metrics as a dict), so `out["text"]`, `json.dumps(out)` and
    `dict(out)` keep working; that dict is filled once, when the output is built."""
    request_id: str
    prompt: str | None  # the prompt's text; None when it was given as token ids
    prompt_token_ids: list[int]  # after truncate_prompt_tokens
    prompt_logprobs: list | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None  # the first sample's timings

    def __post_init__(self):
        first = self.outputs[0]
        self.update(text=first.text, token_ids=first.token_ids, finish_reason=first.finish_reason,
                    logprobs=first.logprobs, prompt_logprobs=self.prompt_logprobs,
                    metrics=None if self.metrics is None else self.metrics.as_dict())
