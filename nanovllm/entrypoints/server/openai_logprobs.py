"""The engine's logprobs ({token_id: Logprob} per token, chosen token first) in OpenAI's two response formats."""
from nanovllm.logprobs import Logprob

OPENAI_MIN_LOGPROB = -9999.0  # what OpenAI (and vLLM) send for -inf, which JSON cannot carry


def token_text(token_id: int, logprob: Logprob) -> str:
    """A token's text; vLLM's "token_id:N" form when the model has no tokenizer."""
    return logprob.decoded_token if logprob.decoded_token is not None else f"token_id:{token_id}"


def _value(logprob: Logprob) -> float:
    return max(logprob.logprob, OPENAI_MIN_LOGPROB)


def completion_logprobs(entries: list[dict | None], text_offset: int = 0, unscored_text: str = "") -> dict:
    """/v1/completions' legacy format: {tokens, token_logprobs, top_logprobs, text_offset}. top_logprobs holds the
    chosen token and the top `logprobs` tokens, so up to logprobs + 1 of them (OpenAI's rule); text_offset is
    each token's start in the text, counting on from `text_offset` (a stream's earlier chunks). A None entry is an
    echoed prompt's first token, which nothing predicts: its text is `unscored_text`, its logprob and top
    logprobs null (vLLM's)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        if entry is None:
            text, value, top = unscored_text, None, None
        else:
            chosen_id, chosen = next(iter(entry.items()))
            text, value = token_text(chosen_id, chosen), _value(chosen)
            top = {token_text(token_id, lp): _value(lp) for token_id, lp in entry.items()}
        tokens.append(text)
        token_logprobs.append(value)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def prompt_logprobs(entries: list[dict | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token, null for the first (nothing predicts it), else
    {token id: {logprob, rank, decoded_token}}, the prompt's own token first."""
    return [None if entry is None else {str(token_id): {"logprob": _value(lp), "rank": lp.rank,
                                                        "decoded_token": lp.decoded_token}
                                        for token_id, lp in entry.items()} for entry in entries]


def chat_logprobs(entries: list[dict], num_top: int) -> dict:
    """/v1/chat/completions' format: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}, top_logprobs being the num_top most likely tokens in rank order."""
    content = []
    for entry in entries:
        chosen_id, chosen = next(iter(entry.items()))
        # k + 1 entries: the chosen token is not among the top k, which follow it; k entries: it is one of them
        top = list(entry.items())[1:] if len(entry) > num_top else entry.items()
        content.append({**_chat_token(chosen_id, chosen), "top_logprobs": [
            _chat_token(token_id, lp) for token_id, lp in sorted(top, key=lambda item: item[1].rank)]})
    return {"content": content}


def _chat_token(token_id: int, logprob: Logprob) -> dict:
    text = token_text(token_id, logprob)
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode("utf-8", errors="replace"))}
