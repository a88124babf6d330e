"""vLLM's min_tokens: until a request has that many completion tokens, its stop tokens (and EOS, unless
ignore_eos) may not be sampled (plain Python; the sampler masks them)."""
from nanovllm.core.sequence import Sequence


class MinTokens:
    """The sequences still short of their min_tokens (`pending_seq_ids`): owned here, changed only here."""

    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = eos_token_ids
        self.pending_seq_ids: set[int] = set()

    def add(self, seq: Sequence):
        if seq.sampling_params.min_tokens:
            self.pending_seq_ids.add(seq.seq_id)

    def discard(self, seq_id: int):
        self.pending_seq_ids.discard(seq_id)

    def banned_token_ids(self, sample_seqs: list[Sequence]) -> list[tuple[int, list[int]]]:
        """(sample row, token ids) that this step may not sample; a sequence that has reached its min_tokens
        leaves the pending set here."""
        pending = self.pending_seq_ids
        if not pending:
            return []
        banned = []
        for row, seq in enumerate(sample_seqs):
            if seq.seq_id not in pending:
                continue
            params = seq.sampling_params
            if seq.num_completion_tokens >= params.min_tokens:  # placeholders count: they will be tokens
                pending.discard(seq.seq_id)
                continue
            eos = () if params.ignore_eos else self.eos_token_ids
            if ids := sorted({*params.stop_token_ids, *eos}):  # none with ignore_eos and no stop tokens
                banned.append((row, ids))
        return banned
