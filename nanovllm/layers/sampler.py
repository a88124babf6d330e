"""Batched sampling with per-request penalties, temperature, top-k, top-p, min-p and seeds."""
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.layers.penalties import BatchPenalties, apply_penalties
from nanovllm.utils.compile import compilable
from nanovllm.utils.switches import SWITCHES

logger = logging.getLogger(__name__)


@dataclass
class SamplingTensors:
    temperatures: torch.Tensor  # [B] float32; 0 = greedy
    top_ks: torch.Tensor | None  # [B] int64, vocab size where disabled; None when no row filters
    top_ps: torch.Tensor | None  # [B] float32
    min_ps: torch.Tensor | None  # [B] float32
    generators: list[torch.Generator | None] | None  # per row; None rows use the engine's generator
    all_greedy: bool
    penalized_rows: list[int] | tuple = ()  # rows with a penalty (plain Python; each step builds their counts)
    penalty_batch: BatchPenalties | None = None  # their values and prompts on the device, from the batch's first step

    def rows(self, start: int, end: int) -> "SamplingTensors":
        """Rows start..end-1 of every field."""
        def cut(t):
            return None if t is None else t[start:end]
        return SamplingTensors(self.temperatures[start:end], cut(self.top_ks), cut(self.top_ps), cut(self.min_ps),
                               cut(self.generators), self.all_greedy)


# Filtered rows (top-k, top-p, min-p, seeds) are sampled in chunks of at most this many logits: each [rows, vocab]
# float32 intermediate (the sort's values, softmax, cumsum, noise) is then 16 MiB at most and the sort's int64
# indices 32 MiB, about 100 MiB alive at a chunk's peak. Whole, a 256-row batch over Qwen3's 151,936-token
# vocabulary peaked at 1.4 GiB, all of it taken from the KV cache at start-up (memory_profile.py sizes the KV around
# this step); chunks of twice the size made the sampler the peak of Qwen3-8B's profiling step once its MLP ran in
# slices (models/decoder.py).
FILTER_CHUNK_ELEMENTS = 1 << 22


class Sampler(nn.Module):
    """Samples with the exponential-race trick: argmax(p / E), E ~ Exp(1), which draws from p without a cumsum.
    A seeded row draws its E from its own generator, so its tokens do not depend on the rest of the batch. On CUDA,
    rows with a temperature only (the common case) go to the Triton kernels of nanovllm/kernels/sampling.py, which
    draw by inverse transform instead (NANOVLLM_TRITON_SAMPLER=0: the torch race)."""

    def __init__(self):
        super().__init__()
        self.triton_sample = None  # nanovllm.kernels.sampling.sample_tempered, loaded on the first CUDA batch
        self.use_triton = SWITCHES.triton_sampler

    def forward(self, logits: torch.Tensor, st: SamplingTensors, banned_token_ids=(), penalties=None,
                last_sampled: torch.Tensor | None = None, logit_bias=(), conditional_bans=()) -> torch.Tensor:
        """banned_token_ids: (row, token ids) that row may not sample (min_tokens, bad words); logits is masked in
        place. logit_bias: (row, token ids, biases) added to the logits (then float32, as vLLM adds them);
        conditional_bans: (row, token id, source row, token): banned when last_sampled[source row] is that token.
        penalties: the step's PenaltyRows (nanovllm/engine/penalties.py) or None; its tokens that the host has not
        read back yet are in last_sampled, the previous step's sampled ids. Bans, biases and penalties apply before
        the rest, greedy rows included (vLLM's order); a step without any pays nothing for them."""
        pairs = [(row, i) for row, ids in banned_token_ids for i in ids if i < logits.size(1)]
        if pairs:
            index = _on_device(torch.tensor(pairs, dtype=torch.long, device="cpu"), logits.device)
            logits[index[:, 0], index[:, 1]] = float("-inf")
        if logit_bias:
            logits = add_logit_bias(logits, logit_bias)
        if conditional_bans:
            ban_if_sampled(logits, conditional_bans, last_sampled)
        if penalties is not None:
            if st.penalty_batch is None:  # this step's PenaltyRows holds the prompts (step_penalties)
                st.penalty_batch = BatchPenalties(penalties, logits.device)
            logits = apply_penalties(logits, penalties, last_sampled, FILTER_CHUNK_ELEMENTS, st.penalty_batch)
        if st.all_greedy:
            return logits.argmax(-1)
        if st.top_ks is None and st.min_ps is None and not st.generators:  # the common case
            if logits.is_cuda and self.use_triton:
                ids = self._triton_sample(logits, st.temperatures)
                if ids is not None:
                    return ids
            return gumbel_sample(logits, st.temperatures)
        rows = max(1, FILTER_CHUNK_ELEMENTS // logits.size(1))
        if logits.size(0) <= rows:
            return self._filtered_sample(logits, st)
        return torch.cat([self._filtered_sample(logits[i:i + rows], st.rows(i, i + rows))
                          for i in range(0, logits.size(0), rows)])

    def _filtered_sample(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        """Temperature, min-p, top-k and top-p, then the race with per-row seeds."""
        logits = logits.float()  # [B, V]
        greedy_ids = logits.argmax(-1)
        # vLLM's order: temperature, min_p, top_k, then top_p over what top_k kept (renormalized)
        logits = logits / st.temperatures.clamp(min=1e-5).unsqueeze(1)
        if st.min_ps is not None:
            probs = logits.softmax(-1)
            logits = logits.masked_fill(probs < st.min_ps.unsqueeze(1) * probs.amax(-1, keepdim=True), float("-inf"))
        if st.top_ks is not None:
            logits = top_k_top_p(logits, st.top_ks, st.top_ps)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs).exponential_()
        for row, generator in enumerate(st.generators or ()):
            if generator is not None:
                noise[row].exponential_(generator=generator)
        return race(probs, noise, st.temperatures, greedy_ids)

    def _triton_sample(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor | None:
        """The Triton kernels' draw (inverse transform; uniforms from a seed that torch's default generator picks, so
        torch.manual_seed makes runs repeat), or None when Triton cannot run it: then the torch path is used from
        here on."""
        try:
            if self.triton_sample is None:
                from nanovllm.kernels.sampling import sample_tempered
                self.triton_sample = sample_tempered
            seed = int(torch.randint(1 << 30, (1,), device="cpu"))
            return self.triton_sample(logits, temperatures, seed)
        except Exception as e:  # noqa: BLE001 -- no Triton, or it fails to compile here: the torch path is exact too
            logger.warning("Triton sampler unavailable (%s: %s); sampling with torch", type(e).__name__,
                           str(e).splitlines()[0] if str(e) else "")
            self.use_triton = False
            return None


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor (built on the CPU whatever the default device) on the device; pinned first on CUDA, so
    the copy does not wait for the forward (asynchronous scheduling)."""
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def add_logit_bias(logits: torch.Tensor, logit_bias) -> torch.Tensor:
    """logits [B, V] -> float32 logits with each (row, token ids, biases) entry's biases added."""
    rows = [row for row, ids, _ in logit_bias for _ in ids]
    ids = [i for _, row_ids, _ in logit_bias for i in row_ids]
    values = [v for _, _, row_values in logit_bias for v in row_values]
    logits = logits.float()
    index = _on_device(torch.tensor([rows, ids], dtype=torch.long, device="cpu"), logits.device)
    biases = _on_device(torch.tensor(values, dtype=torch.float32, device="cpu"), logits.device)
    logits.index_put_((index[0], index[1]), biases, accumulate=True)
    return logits


def ban_if_sampled(logits: torch.Tensor, conditional_bans, last_sampled: torch.Tensor | None):
    """Mask (row, token) where the previous step sampled `expected` at `source` (in place): -inf is added there and
    0 elsewhere, so two entries for one logit need no order."""
    if last_sampled is None:
        raise RuntimeError(f"ban_if_sampled: bans {conditional_bans} wait on tokens of a previous step, and no step "
                           f"sampled")
    host = torch.tensor(conditional_bans, dtype=torch.long, device="cpu").T.contiguous()  # [4, K]
    rows, ids, sources, expected = _on_device(host, logits.device)
    hit = last_sampled[sources].long() == expected
    penalty = torch.where(hit, float("-inf"), 0.0).to(logits.dtype)
    logits.index_put_((rows, ids), penalty, accumulate=True)


ARGMAX_CHUNK = 1024  # vocabulary entries per partial argmax


@compilable
def gumbel_sample(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """The same race without softmax or a noise tensor: argmax(p / E) = argmax(logits / T - log E), and
    -log E = -log(-log U) is Gumbel noise drawn inside the fused kernel. Greedy rows (T = 0) take the plain argmax.

    The argmax runs in two stages, over chunks of the vocabulary and then over the chunks' maxima: one row's
    reduction over a 150k vocabulary would otherwise run on one SM (110-140 us at batch 1-32 on an H200)."""
    batch, vocab = logits.shape
    x = F.pad(logits.float(), (0, (-vocab) % ARGMAX_CHUNK), value=float("-inf")).view(batch, -1, ARGMAX_CHUNK)
    t = temperatures.view(batch, 1, 1)
    gumbel = -torch.log(-torch.log(torch.rand_like(x).clamp_(min=1e-10)))
    scores = torch.where(t == 0, x, x / t.clamp(min=1e-5) + gumbel)  # [B, num_chunks, CHUNK]
    chunk_max, chunk_ids = scores.max(-1)  # [B, num_chunks]
    best = chunk_max.argmax(-1, keepdim=True)  # [B, 1]
    return (best * ARGMAX_CHUNK + chunk_ids.gather(1, best)).squeeze(1)


@compilable
def race(probs: torch.Tensor, noise: torch.Tensor, temperatures: torch.Tensor, greedy_ids: torch.Tensor):
    """argmax(p / E): a draw from p; greedy rows keep their argmax."""
    return torch.where(temperatures == 0, greedy_ids, probs.div(noise).argmax(-1))


# not compiled: torch 2.11's inductor fails on this cumsum (dynamic shapes), and the sort dominates anyway
def top_k_top_p(logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keeps each row's top_k largest logits, then of those the fewest whose renormalized probability reaches top_p
    (the largest always stays); the others become -inf. In place: `logits` (the caller's own float32 copy) is
    returned, and the sorted copies are masked in place, so that no chunk holds two of them."""
    sorted_logits, order = logits.sort(-1, descending=True)  # [B, V]
    ranks = torch.arange(logits.size(1), device=logits.device).unsqueeze(0)
    sorted_logits.masked_fill_(ranks >= top_ks.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    # drop a token when the tokens ranked above it already reach top_p; rows at top_p = 1 drop nothing (their
    # float32 cumsum can reach 1 before the tail)
    remove = sorted_probs.cumsum(-1).sub_(sorted_probs) >= top_ps.unsqueeze(1)
    del sorted_probs
    remove &= top_ps.unsqueeze(1) < 1.0
    remove[:, 0] = False
    sorted_logits.masked_fill_(remove, float("-inf"))
    return logits.scatter_(1, order, sorted_logits)  # order is a permutation: every entry is written
