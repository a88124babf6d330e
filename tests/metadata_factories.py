"""Small factories for the torch-free metadata tests."""
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm_offload.host_block_pool import HostBlockPool
from nanovllm_offload.policy import PreemptionPolicy

BLOCK_SIZE = 4


def make_seq(num_tokens: int = 6, start: int = 100, max_tokens: int = 8, token_ids=None) -> Sequence:
    token_ids = token_ids if token_ids is not None else list(range(start, start + num_tokens))
    return Sequence(token_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), BLOCK_SIZE)


def make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, mode="swap", max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=64, prefix_caching=True) -> Scheduler:
    bm = BlockManager(num_gpu_blocks, BLOCK_SIZE, prefix_caching)
    host = HostBlockPool(num_cpu_blocks) if num_cpu_blocks is not None else None
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_ids={0}, host_pool=host,
                     policy=PreemptionPolicy(mode, block_bytes=1024))


def all_seqs(s: Scheduler) -> list[Sequence]:
    return list(s.waiting) + list(s.running) + list(s.swapped)


def check(s: Scheduler, extra=()):
    """Every invariant, after every step."""
    seqs = all_seqs(s) + list(extra)
    s.block_manager.check_invariants(seqs)
    if s.host_pool is not None:
        s.host_pool.check_invariants(seqs)
    for seq in s.running:
        assert seq.status.name == "RUNNING" and not seq.cpu_block_table
        assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
    for seq in s.swapped:
        assert seq.status.name == "SWAPPED" and not seq.block_table
        assert len(seq.cpu_block_table) == seq.num_blocks_for(seq.num_computed_tokens)
    for seq in s.waiting:
        assert seq.status.name == "WAITING" and not seq.cpu_block_table
    assert len(s.running) + len(s.swapped) <= s.max_num_seqs


def run_step(s: Scheduler, sampled_token: int = 7):
    """schedule + postprocess with a fixed sampled token, checking invariants on the way."""
    out = s.schedule()
    check(s)
    num_sampled = sum(1 for seq, n in zip(out.seqs, out.num_new_tokens)
                      if seq.num_computed_tokens + n == seq.num_tokens)
    finished = s.postprocess(out, [sampled_token] * num_sampled)
    check(s)
    return out, finished
