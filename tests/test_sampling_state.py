"""What sampling keeps between steps (nanovllm/engine/sampling_state.py): the batch's sampling tensors are reused
while the batch is the same sequences in the same order and rebuilt otherwise, and a seeded request keeps one
generator from its first sample until it is released. The draws themselves: tests/test_sampler.py and the seeded
engine tests."""
import torch

from nanovllm.core.sequence import Sequence
from nanovllm.engine.sampling_state import SamplingState
from nanovllm.sampling_params import SamplingParams

VOCAB = 50


def make_seq(**params) -> Sequence:
    return Sequence([1, 2, 3], SamplingParams(max_tokens=4, **params), 16)


def test_the_tensors_are_reused_only_for_the_same_batch_in_the_same_order():
    state = SamplingState(VOCAB, torch.device("cpu"))
    a, b = make_seq(temperature=0.5, top_k=80), make_seq(temperature=0)  # top_k over the vocabulary: clamped
    first = state.sampling_tensors([a, b])
    assert state.sampling_tensors([a, b]) is first
    assert first.temperatures.tolist() == [0.5, 0.0] and first.top_ks.tolist() == [VOCAB, VOCAB]
    assert not first.all_greedy and first.min_ps is None and first.generators is None
    swapped = state.sampling_tensors([b, a])
    assert swapped is not first and swapped.temperatures.tolist() == [0.0, 0.5]
    assert state.sampling_tensors([b]).all_greedy


def test_a_seeded_request_keeps_its_generator_until_released():
    state = SamplingState(VOCAB, torch.device("cpu"))
    seeded, unseeded = make_seq(temperature=1.0, seed=7), make_seq(temperature=1.0)
    generators = state.sampling_tensors([seeded, unseeded]).generators
    assert generators[1] is None and state.generators == {seeded.seq_id: generators[0]}
    first_draws = torch.rand(3, generator=torch.Generator().manual_seed(7)).tolist()
    assert torch.rand(3, generator=generators[0]).tolist() == first_draws  # the request's first step
    kept = state.sampling_tensors([unseeded, seeded]).generators[1]  # a new batch: the same generator
    assert kept is generators[0] and torch.rand(3, generator=kept).tolist() != first_draws  # it goes on
    state.release([seeded.seq_id, unseeded.seq_id])
    assert state.generators == {}
    fresh = state.sampling_tensors([seeded]).generators[0]  # a new batch after the release: seeded anew
    assert fresh is not generators[0] and torch.rand(3, generator=fresh).tolist() == first_draws
