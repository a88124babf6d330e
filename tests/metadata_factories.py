"""Small factories for the torch-free metadata tests."""
from nanovllm.core.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler, SchedulerOutput
from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm_offload.offload_manager import OffloadManager
from nanovllm_offload.policy import PreemptionPolicy
from nanovllm_offload.transfer_report import TransferReport

BLOCK_SIZE = 4


def make_seq(num_tokens: int = 6, start: int = 100, max_tokens: int = 8, token_ids=None) -> Sequence:
    token_ids = token_ids if token_ids is not None else list(range(start, start + num_tokens))
    return Sequence(token_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), BLOCK_SIZE)


def make_scheduler(num_gpu_blocks=8, num_cpu_blocks=8, mode="swap", max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=64, prefix_caching=True) -> Scheduler:
    bm = BlockManager(num_gpu_blocks, BLOCK_SIZE, prefix_caching)
    policy = PreemptionPolicy(mode, block_bytes=1024)
    offload = None if num_cpu_blocks is None else OffloadManager(num_cpu_blocks, BLOCK_SIZE, policy, prefix_cache=False)
    return Scheduler(bm, max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_ids={0}, offload=offload)


def all_seqs(s: Scheduler) -> list[Sequence]:
    return list(s.waiting) + list(s.running) + list(s.swapped)


def check(s: Scheduler, extra=()):
    """Every invariant, after every step."""
    seqs = all_seqs(s) + list(extra)
    s.block_manager.check_invariants(seqs)
    if s.offload is not None:
        s.offload.check_invariants(seqs)
    for seq in s.running:
        assert seq.status.name == "RUNNING" and not seq.cpu_block_table
        assert len(seq.block_table) * BLOCK_SIZE >= seq.num_computed_tokens
    for seq in s.swapped:
        assert seq.status.name == "SWAPPED" and not seq.block_table
        assert len(seq.cpu_block_table) == seq.num_blocks_for(seq.num_computed_tokens)
    for seq in s.waiting:
        assert seq.status.name == "WAITING" and not seq.cpu_block_table
    assert len(s.running) + len(s.swapped) <= s.max_num_seqs


class ShadowKV:
    """What each GPU and host block would hold if the runner executed the scheduler's decisions: a token id per slot.
    Each step copies first (swap-outs read before anything writes, swap-ins land before the forward), then writes
    the new tokens of every scheduled sequence, then checks that each one's whole context reads back as its own
    token ids. Ref counts cannot see a block that holds the wrong tokens; this can.
    A slot holds (seq, position) and reads as seq.token_ids[position]: under asynchronous scheduling a decode row's
    input is a placeholder when the step is launched and the runner fills it in on the device, as `resolve` does
    here later."""

    def __init__(self):
        self.gpu: dict[int, list] = {}
        self.host: dict[int, list] = {}

    def run(self, out: SchedulerOutput):
        for gpu_block_id, cpu_block_id in out.swap_out:
            self.host[cpu_block_id] = list(self.gpu.get(gpu_block_id, [None] * BLOCK_SIZE))
        for cpu_block_id, gpu_block_id in out.swap_in:
            self.gpu[gpu_block_id] = list(self.host.get(cpu_block_id, [None] * BLOCK_SIZE))
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                block = self.gpu.setdefault(seq.block_table[pos // BLOCK_SIZE], [None] * BLOCK_SIZE)
                block[pos % BLOCK_SIZE] = (seq, pos)
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            end = seq.num_computed_tokens + num_new
            got = [self._read(self.gpu[seq.block_table[p // BLOCK_SIZE]][p % BLOCK_SIZE]) for p in range(end)]
            if got != seq.token_ids[:end]:
                bad = next(p for p in range(end) if got[p] != seq.token_ids[p])
                raise AssertionError(f"seq {seq.seq_id} reads token {got[bad]} at position {bad}, expected "
                                     f"{seq.token_ids[bad]} (gpu block {seq.block_table[bad // BLOCK_SIZE]}, "
                                     f"table {seq.block_table})")

    @staticmethod
    def _read(slot):
        if slot is None:
            return None
        seq, pos = slot
        return seq.token_ids[pos] if pos < len(seq.token_ids) else None


def check_copies(out):
    """Each host block is the destination of at most one swap-out copy of a step: on CUDA the copy engine issues a
    step's copies in another order than the list's (split_by_last_forward), so two copies to one block could land
    either way round."""
    destinations = [cpu_block_id for _, cpu_block_id in out.swap_out]
    twice = sorted({c for c in destinations if destinations.count(c) > 1})
    assert not twice, f"cpu blocks {twice} are written twice by one step's swap-outs {out.swap_out}"


def land(s: Scheduler, out: SchedulerOutput):
    """The copy engine reports the step's copies landed (on the CPU they have by the end of the step)."""
    if s.offload is not None:
        s.offload.complete(TransferReport(out.transfer_ids))


def run_step_async(s: Scheduler, in_flight: list, sampled_token: int = 7, shadow: ShadowKV | None = None,
                   land_copies: bool = True):
    """One step of the engine's asynchronous loop: schedule step N, "launch" it, resolve step N-1, advance N.
    `in_flight` carries step N-1's rows from call to call. land_copies False: the caller lands the step's copies."""
    out = s.schedule()
    check(s)
    check_copies(out)
    if shadow is not None:
        shadow.run(out)
    if in_flight:
        s.resolve(in_flight[0], [sampled_token] * len(in_flight[0]))
        in_flight.clear()
    rows = s.advance(out)
    if rows:
        in_flight.append(rows)
    if land_copies:
        land(s, out)
    check(s)
    return out


def run_step(s: Scheduler, sampled_token: int = 7, shadow: ShadowKV | None = None, land_copies: bool = True):
    """schedule + postprocess with a fixed sampled token, checking invariants on the way (and the KV contents,
    given a shadow); then the step's copies land, unless land_copies is False (the caller lands them)."""
    out = s.schedule()
    check(s)
    check_copies(out)
    if shadow is not None:
        shadow.run(out)
    num_sampled = sum(1 for seq, n in zip(out.seqs, out.num_new_tokens)
                      if seq.num_computed_tokens + n == seq.num_tokens)
    finished = s.postprocess(out, [sampled_token] * num_sampled)
    if land_copies:
        land(s, out)
    check(s)
    return out, finished
