"""Swap or recompute, per preempted sequence; load or recompute, per disk hit (plain Python; no torch)."""
from dataclasses import dataclass

from nanovllm.core.sequence import Sequence
from nanovllm_offload.transfer_report import TransferReport


@dataclass(slots=True)
class PreemptionPolicy:
    """Picks the cheaper way to bring a victim back.

    swap: its computed blocks go to the host and come back (2 copies of block_bytes each); the copies run on their
    own streams, so what the GPU loses is only the part of the copy time the forward has to wait for;
    recompute: its computed tokens are prefilled again, all of it on the GPU.
    "auto" compares the two from what the engine measures while it runs (exponential moving averages): copy
    bandwidth, the exposed share of copy time, and prefill speed. The priors only matter until then.
    """
    mode: str  # "auto" | "swap" | "recompute"
    block_bytes: int  # one block: all layers, K and V, on one rank
    copy_bytes_per_s: float = 20e9  # prior: a PCIe 4.0 x16 link, pinned
    exposed_fraction: float = 0.25  # prior: share of copy time the forward waits for
    prefill_tokens_per_s: float = 20e3  # prior
    ema: float = 0.2  # weight of the newest measurement
    full_prefill_sample_tokens: int = 1024  # a prefill sample of this many tokens or more gets the full ema weight
    last_copy_totals: tuple[float, float] = (0.0, 0.0)  # the copy engine's (exposed, copy) seconds at the last report

    def should_swap(self, seq: Sequence) -> bool:
        if self.mode != "auto":
            return self.mode == "swap"
        num_blocks = seq.num_blocks_for(seq.num_computed_tokens)
        copy_s = 2 * num_blocks * self.block_bytes / self.copy_bytes_per_s * self.exposed_fraction
        recompute_s = seq.num_computed_tokens / self.prefill_tokens_per_s
        return copy_s <= recompute_s

    def should_load_from_disk(self, num_tokens: int, num_bytes: int, read_bytes_per_s: float) -> bool:
        """Load a disk hit when reading its bytes at the disk's measured read speed takes no longer than prefilling
        its tokens at the measured prefill speed. A load costs only the waiting sequence its wait, a recompute every
        running sequence a share of a forward, so comparing the two times leans towards recomputing: a fast GPU
        never waits on a slow disk (docs/disk_tier.md)."""
        return num_bytes / read_bytes_per_s <= num_tokens / self.prefill_tokens_per_s

    def observe_copies(self, report: TransferReport):
        """report.copies: (bytes, seconds) timed since the last report; its totals: the copy engine's running sums."""
        if not report.copies:
            return
        for num_bytes, seconds in report.copies:
            self.observe_copy(num_bytes, seconds)
        last_exposed, last_copy = self.last_copy_totals
        self.observe_exposure(report.exposed_seconds - last_exposed, report.copy_seconds - last_copy)
        self.last_copy_totals = (report.exposed_seconds, report.copy_seconds)

    def observe_copy(self, num_bytes: int, seconds: float):
        if num_bytes > 0 and seconds > 0:
            self.copy_bytes_per_s += self.ema * (num_bytes / seconds - self.copy_bytes_per_s)

    def observe_exposure(self, exposed_seconds: float, copy_seconds: float):
        if copy_seconds > 0:
            fraction = min(1.0, exposed_seconds / copy_seconds)
            self.exposed_fraction += self.ema * (fraction - self.exposed_fraction)

    def observe_prefill(self, num_tokens: int, seconds: float):
        """A sample counts in proportion to its tokens (up to full_prefill_sample_tokens): a step of a few prompt
        tokens times mostly a step's fixed cost, not how fast the hundreds of tokens of a victim or a disk hit
        would be recomputed."""
        if num_tokens > 0 and seconds > 0:
            weight = self.ema * min(1.0, num_tokens / self.full_prefill_sample_tokens)
            self.prefill_tokens_per_s += weight * (num_tokens / seconds - self.prefill_tokens_per_s)
