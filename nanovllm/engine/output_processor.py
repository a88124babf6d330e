"""The one way to produce output: a sequence's text (detokenised, cut at a stop string), its RequestOutput
(nanovllm/outputs.py) and its stream deltas (new token ids, text and logprobs since the previous delta).

EngineCore calls `apply_stop_strings` after each read-back (and `token_text` for the logprobs' decoded tokens);
generate() builds RequestOutputs, and generate_stream(), the server's engine loop and the CLI's chat read
`delta()`. The scheduler only sees token ids. No torch."""
from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.core.sequence import Sequence
from nanovllm.outputs import CompletionOutput, RequestOutput
from nanovllm.sampling_params import SamplingParams


@dataclass
class StreamDelta:
    """One sequence's new output since its previous delta: what generate_stream yields (as a dict, `as_chunk`) and
    the server's engine loop publishes. The last delta of a sequence has `finish_reason` set."""
    token_ids: list[int]  # the tokens new since the previous delta
    text: str  # their text, as far as it is safe to send (OutputProcessor.stream_text)
    finish_reason: str | None  # "stop", "length", "abort"; None until the last delta
    num_completion_tokens: int  # tokens generated so far, this delta's included
    logprobs: list | None = None  # the new tokens' {token_id: Logprob}; None unless asked for
    prompt_logprobs: list | None = None  # whole in the first delta (after the prompt is computed), then None

    def as_chunk(self, index: int, output_index: int) -> dict:
        """generate_stream's chunk: "index" is the prompt's, "output_index" the sample's."""
        return {"index": index, "token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason,
                "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs, "output_index": output_index}

    @classmethod
    def aborted(cls) -> "StreamDelta":
        """The last delta of a request aborted before it finished."""
        return cls([], "", "abort", 0)


@dataclass
class DeltaCursor:
    """What has been sent of one sequence's output, so each delta carries only what is new. One per streamed
    sequence, owned by whoever streams it; only OutputProcessor.delta advances it."""
    num_tokens_sent: int = 0
    text_sent: str = ""


class OutputProcessor:
    """Turns sequences' token ids into text and outputs with the engine's tokenizer (None: token ids only, no
    text)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}  # token_text's memo

    def token_text(self, token_id: int) -> str | None:
        """One token's text (Logprob.decoded_token, as vLLM decodes it), decoded once per token id."""
        if self.tokenizer is None:
            return None
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    @staticmethod
    def text_token_ids(seq: Sequence) -> list[int]:
        """The completion tokens whose text is shown: a stop token (stop_token_ids, EOS) stays in token_ids but its
        text is left out, unless include_stop_str_in_output (vLLM's rule)."""
        ids = seq.completion_token_ids
        stopped_by_token = seq.finish_reason == "stop" and seq.output_text is None
        return ids[:-1] if stopped_by_token and not seq.sampling_params.include_stop_str_in_output else ids

    def text(self, seq: Sequence) -> str:
        """seq's text as generate() returns it: "" with detokenize=False, cut at a stop string."""
        params = seq.sampling_params
        if not params.detokenize:
            return ""
        if seq.output_text is not None:
            return seq.output_text
        return self.detokenize(self.text_token_ids(seq), params.skip_special_tokens)

    def completion(self, seq: Sequence, index: int = 0, with_logprobs: bool | None = None) -> CompletionOutput:
        """seq as one sample; with_logprobs (default: whether seq computes them) shows its logprobs and their sum."""
        show = seq.logprobs is not None if with_logprobs is None else with_logprobs
        return CompletionOutput(index, self.text(seq), seq.completion_token_ids,
                                seq.cumulative_logprob if show else None, seq.logprobs if show else None,
                                seq.finish_reason, seq.stop_reason)

    def output(self, seq: Sequence) -> RequestOutput:
        """One sequence as a request of one sample (add_request's requests, the server's)."""
        return self.request_output(str(seq.seq_id), None, [seq], seq.sampling_params)

    def request_output(self, request_id: str, prompt: str | None, seqs: list[Sequence],
                       params: SamplingParams) -> RequestOutput:
        """A request's samples as one RequestOutput. `params` are the request's own (n, best_of, logprobs): with
        best_of > n, the n samples of highest cumulative logprob are returned, best first (vLLM 0.x's rule)."""
        if params.best_of is not None and params.best_of > params.n:
            seqs = sorted(seqs, key=lambda seq: seq.cumulative_logprob, reverse=True)[:params.n]  # stable on ties
        with_logprobs = params.logprobs is not None
        first = seqs[0]
        return RequestOutput(request_id, prompt, first.token_ids[:first.num_prompt_tokens], first.prompt_logprobs,
                             [self.completion(seq, i, with_logprobs) for i, seq in enumerate(seqs)],
                             all(seq.is_finished for seq in seqs), first.metrics)

    def apply_stop_strings(self, seqs: list[Sequence], finish: Callable[[Sequence, str], None]) -> list[Sequence]:
        """Ends each sequence whose text now holds a stop string, its text cut before the first match (after it
        with include_stop_str_in_output). Sequences that just finished by length or a stop token are checked too,
        as vLLM does: their reason becomes "stop". `finish` ends a running one. Returns the running sequences it
        finished."""
        finished = []
        for seq in seqs:
            params = seq.sampling_params
            if not params.stop or self.tokenizer is None or seq.num_completion_tokens <= params.min_tokens:
                continue
            text = self.detokenize(self.text_token_ids(seq), params.skip_special_tokens)
            match = self._first_stop(seq, text)
            if match is None:
                continue
            cut, stop = match
            seq.stop_reason = stop
            seq.output_text = text[:cut + len(stop)] if params.include_stop_str_in_output else text[:cut]
            if seq.is_finished:
                seq.finish_reason = "stop"
                continue
            del seq.token_ids[len(seq.token_ids) - seq.num_unresolved_tokens:]  # drop tokens after the stop
            seq.num_unresolved_tokens = 0
            finish(seq, "stop")
            finished.append(seq)
        return finished

    def _first_stop(self, seq: Sequence, text: str) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in seq's text, or None. With min_tokens, a match must end
        after the text of the first min_tokens tokens (as in vLLM)."""
        params = seq.sampling_params
        start = len(self.detokenize(seq.completion_token_ids[:params.min_tokens], params.skip_special_tokens)) \
            if params.min_tokens else 0
        matches = [(i, stop) for stop in params.stop if (i := text.find(stop, max(start - len(stop) + 1, 0))) >= 0]
        return min(matches, key=lambda match: match[0]) if matches else None

    def stream_text(self, seq: Sequence) -> str:
        """The text that is safe to send: all of it once finished; before that, without a trailing partial
        character and without a tail that could still become a stop string."""
        text = self.text(seq)
        if seq.is_finished:
            return text
        text = text.rstrip("\ufffd")
        holdback = max((len(s) - 1 for s in seq.sampling_params.stop), default=0)
        return text[:max(len(text) - holdback, 0)]

    def delta(self, seq: Sequence, cursor: DeltaCursor) -> StreamDelta | None:
        """What seq gained since `cursor` (which moves past it); None when it gained nothing and has not finished."""
        num_sent = cursor.num_tokens_sent
        new_ids = seq.completion_token_ids[num_sent:]
        if not new_ids and not seq.is_finished:
            return None
        text = self.stream_text(seq)
        delta = StreamDelta(new_ids, text[len(cursor.text_sent):], seq.finish_reason, seq.num_completion_tokens,
                            None if seq.logprobs is None else seq.logprobs[num_sent:num_sent + len(new_ids)],
                            seq.prompt_logprobs if num_sent == 0 else None)
        cursor.num_tokens_sent += len(new_ids)
        cursor.text_sent = text
        return delta
