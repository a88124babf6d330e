"""vLLM's min_tokens: until a request has that many completion tokens, its stop tokens (and EOS, unless
ignore_eos) may not be sampled (plain Python; the sampler masks them)."""
from nanovllm.core.sequence import Sequence


def banned_token_ids(pending: set[int], sample_seqs: list[Sequence], eos_token_ids: set[int]
                     ) -> list[tuple[int, list[int]]]:
    """(sample row, token ids) that this step may not sample. `pending` holds the ids of the sequences still short
    of their min_tokens; a sequence that has reached it leaves the set here."""
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
        eos = () if params.ignore_eos else eos_token_ids
        if ids := sorted({*params.stop_token_ids, *eos}):  # none with ignore_eos and no stop tokens
            banned.append((row, ids))
    return banned
