"""GPU blocks for a swapped sequence coming back, reusing those still cached on the GPU (plain Python; no torch).
The offload manager's swap-in calls it; it changes only the GPU block pool and the sequence's block table."""
from nanovllm.core.block_manager import BlockManager
from nanovllm.core.sequence import Sequence


def allocate_for_swap_in(seq: Sequence, gpu_blocks: BlockManager, num_reserved_blocks: int = 0,
                         num_next_tokens: int = 0) -> list[tuple[int, int]] | None:
    """Give a SWAPPED seq GPU blocks for its computed tokens. Full blocks still cached on the GPU are reused and
    need no copy (a loading block, which a load is still filling, is no hit). Returns the (cpu_block_id,
    gpu_block_id) copies to make, or None when blocks are short. Besides num_reserved_blocks, the blocks for its
    next num_next_tokens must stay free: resumed without room for its next prompt chunk, a sequence preempts
    itself at once and swaps in and out every other step."""
    num_blocks = len(seq.cpu_block_table)
    num_reserved_blocks += max(0, seq.num_blocks_for(seq.num_computed_tokens + num_next_tokens) - num_blocks)
    num_full = seq.num_computed_tokens // gpu_blocks.block_size
    cached = {}
    if gpu_blocks.enable_prefix_caching:
        for i in range(min(num_full, len(seq.block_hashes))):
            block_id = gpu_blocks.hash_to_block_id.get(seq.block_hashes[i])
            if block_id is not None and block_id not in gpu_blocks.loading and block_id not in cached.values():
                cached[i] = block_id
    num_needed = num_blocks - len(cached) + gpu_blocks.num_revived(cached.values()) + num_reserved_blocks
    if num_needed > gpu_blocks.num_free_blocks:
        return None
    for block_id in cached.values():  # before any pop_free, which could hand out (and evict) a later hit
        gpu_blocks.take(block_id)
    copies = []
    for i in range(num_blocks):
        if i in cached:
            seq.block_table.append(cached[i])
        else:
            seq.block_table.append(gpu_blocks.pop_free())
            copies.append((seq.cpu_block_table[i], seq.block_table[-1]))
    return copies
