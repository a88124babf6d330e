"""vLLM's logit_bias and bad_words, the plain-Python half: which sample rows of a step get a bias or a ban (the
sampler applies them on the device, nanovllm/layers/sampler.py). No torch."""
from nanovllm.core.sequence import PLACEHOLDER_TOKEN, Sequence


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of bad_words: each word as it would begin the text, and again after a space when that
    gives a different first token and as many tokens (the same word inside a sentence)."""
    token_ids = []
    for word in words:
        alone = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        inside = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        token_ids.append(alone)
        if inside and inside[0] != alone[0] and len(inside) == len(alone):
            token_ids.append(inside)
    return [ids for ids in token_ids if ids]


class LogitRules:
    """The running requests that have a logit_bias or bad words, by seq id, so that a step of requests without
    any spends one dict check on them.
    NOTE: an entry lives from add_request until the request finishes or is aborted (`discard`)."""

    def __init__(self):
        self.bias: dict[int, tuple[list[int], list[float]]] = {}  # seq id -> (token ids, biases)
        self.bad_words: dict[int, list[list[int]]] = {}  # seq id -> each bad word's token ids

    def add(self, seq: Sequence, bad_words: list[list[int]]):
        if seq.sampling_params.logit_bias:
            bias = seq.sampling_params.logit_bias
            self.bias[seq.seq_id] = (list(bias), list(bias.values()))
        if bad_words:
            self.bad_words[seq.seq_id] = bad_words

    def discard(self, seq_id: int):
        self.bias.pop(seq_id, None)
        self.bad_words.pop(seq_id, None)

    def step_rules(self, sample_seqs: list[Sequence]):
        """(logit_bias, bans, conditional_bans) for this step's sample rows:
        logit_bias: (row, token ids, biases); bans: (row, token ids) to mask;
        conditional_bans: (row, token id, source row, expected token): mask the token when the previous step's
        sampled id at `source row` is `expected` (a bad word whose prefix ends in a token not read back yet, under
        asynchronous scheduling)."""
        logit_bias, bans, conditional_bans = [], [], []
        if not (self.bias or self.bad_words):
            return logit_bias, bans, conditional_bans
        for row, seq in enumerate(sample_seqs):
            bias = self.bias.get(seq.seq_id)
            if bias is not None:
                logit_bias.append((row, *bias))
            words = self.bad_words.get(seq.seq_id)
            if words is not None:
                banned = self._ban_bad_words(row, seq, words, conditional_bans)
                if banned:
                    bans.append((row, banned))
        return logit_bias, bans, conditional_bans

    @staticmethod
    def _ban_bad_words(row: int, seq: Sequence, words: list[list[int]], conditional_bans: list) -> list[int]:
        """The last token of each bad word whose other tokens end seq's completion (vLLM's rule: completion tokens
        only, not the prompt's). Returns the ids banned outright; adds the ones that hang on an unresolved token."""
        output_ids = seq.token_ids[seq.num_prompt_tokens:]  # its last entry may be PLACEHOLDER_TOKEN
        banned = []
        for word in words:
            prefix = word[:-1]
            if len(prefix) > len(output_ids):
                continue
            tail = output_ids[len(output_ids) - len(prefix):]
            if tail and tail[-1] == PLACEHOLDER_TOKEN:
                if tail[:-1] == prefix[:-1]:
                    conditional_bans.append((row, word[-1], seq.sample_row, prefix[-1]))
            elif tail == prefix:
                banned.append(word[-1])
        return banned
