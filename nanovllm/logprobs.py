"""Log-probabilities as generate() returns them, in vLLM's shape (plain Python; no torch).

A position's entry is a dict {token_id: Logprob}: the chosen token (the sampled one, or the actual next prompt
token) first, then the top-k tokens of the model's raw distribution in rank order; k or k + 1 entries, as the
chosen token may be among the top k.
"""
from collections.abc import Callable
from typing import NamedTuple

PositionLogprobs = dict[int, "Logprob"]


class Logprob(NamedTuple):
    """A named tuple (vLLM's is a dataclass of the same fields), so an output holding logprobs goes through
    json.dumps, each as [logprob, rank, decoded_token]."""
    logprob: float  # natural log of the token's probability under the raw (untempered, unfiltered) distribution
    rank: int  # 1 for the most likely token: the number of tokens at least as likely (vLLM's count)
    decoded_token: str | None = None  # the token's text; None when the model has no tokenizer


def position_logprobs(token_ids: list[int], values: list[float], chosen_rank: int, num_top: int,
                      decode: Callable[[int], str | None]) -> PositionLogprobs:
    """One position's dict from a row of the device's output: token_ids[0] / values[0] is the chosen token (of
    rank chosen_rank), the next entries the top tokens in rank order; only the first num_top of those are kept."""
    entries = {token_ids[0]: Logprob(values[0], chosen_rank, decode(token_ids[0]))}
    for rank, (token_id, value) in enumerate(zip(token_ids[1:num_top + 1], values[1:num_top + 1]), start=1):
        if token_id not in entries:
            entries[token_id] = Logprob(value, rank, decode(token_id))
    return entries
