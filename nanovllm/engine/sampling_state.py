"""What sampling keeps from one step to the next on rank 0: per-request generators, the batch's sampling tensors
and the last step's sampled ids. The sampler itself (nanovllm/layers/sampler.py) keeps nothing between calls."""
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.engine.penalties import penalized_rows
from nanovllm.engine.step_inputs import to_device
from nanovllm.layers.sampler import SamplingTensors


class SamplingState:
    """Sampling state across steps; only the runner's launch changes it, and release/clear drop it.

    - generators: a torch.Generator per seeded request (SamplingParams.seed), made at its first sample and dropped
      when the request is released, so that a seeded request's draws do not depend on the rest of the batch.
    - the batch's SamplingTensors, reused while the batch holds the same sequences in the same order: building them
      is host work and small copies every step, and their penalty_batch (the penalized rows' values and prompts on
      the device, which the sampler fills at the batch's first step) lives only as long as they do.
    - last_sampled: the last launched step's sampled ids on the device. NOTE: under asynchronous scheduling the next
      step is planned before the host reads these back, so its input ids and its penalty counts take the tokens
      still marked PLACEHOLDER_TOKEN from here (prepare_step_inputs, the sampler's penalties)."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size, self.device = vocab_size, device
        self.generators: dict[int, torch.Generator] = {}  # seq_id -> per-request generator (SamplingParams.seed)
        self._batch_seq_ids: list[int] | None = None  # the sequences, in order, that _batch_tensors were built for
        self._batch_tensors: SamplingTensors | None = None
        self.last_sampled: torch.Tensor | None = None  # [num_sampled] device tensor of the last launched step

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """Per-row sampling parameters; reused while the batch holds the same sequences in the same order."""
        seq_ids = [s.seq_id for s in seqs]  # a list comprehension: twice as fast as tuple(generator)
        if seq_ids != self._batch_seq_ids:
            self._batch_seq_ids, self._batch_tensors = seq_ids, self._build_sampling_tensors(seqs)
        return self._batch_tensors

    def _build_sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        params = [s.sampling_params for s in seqs]
        temperatures = [p.temperature for p in params]
        all_greedy = all(p.is_greedy for p in params)
        top_ks = top_ps = min_ps = generators = None
        device, vocab = self.device, self.vocab_size
        if not all_greedy:
            if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
                top_ks = to_device([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.int64,
                                   device)
                top_ps = to_device([p.top_p for p in params], torch.float32, device)
            if any(p.min_p > 0 for p in params):
                min_ps = to_device([p.min_p for p in params], torch.float32, device)
            if any(p.seed is not None for p in params):
                generators = [self._generator(s) for s in seqs]
        temps = to_device([0.0 if p.is_greedy else t for p, t in zip(params, temperatures)], torch.float32, device)
        return SamplingTensors(temps, top_ks, top_ps, min_ps, generators, all_greedy, penalized_rows(seqs))

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        if seq.seq_id not in self.generators:
            self.generators[seq.seq_id] = torch.Generator(self.device).manual_seed(seed)
        return self.generators[seq.seq_id]

    def release(self, seq_ids: list[int]):
        """Forget finished requests' generators (the batch's tensors change with the batch)."""
        for seq_id in seq_ids:
            self.generators.pop(seq_id, None)

    def clear(self):
        self.generators.clear()
