"""Prefix-chain hashes of full blocks: the key both prefix caches (GPU and host) look blocks up by."""
import numpy as np
import xxhash

from nanovllm.core.sequence import Sequence


def hash_block(prev_hash: int, token_ids: list[int]) -> int:
    """Prefix-chain hash of one full block: it depends on every token before the block too."""
    return xxhash.xxh3_64_intdigest(np.asarray(token_ids, dtype=np.int64).tobytes(), seed=prev_hash)


def content_hash(seq: Sequence, i: int) -> int:
    """Hash of seq's full block i, memoized in seq.block_hashes (hashes are computed in block order)."""
    while len(seq.block_hashes) <= i:
        j = len(seq.block_hashes)
        prev = seq.block_hashes[j - 1] if j else 0
        seq.block_hashes.append(hash_block(prev, seq.block_token_ids(j)))
    return seq.block_hashes[i]
