"""The sampler's draws follow softmax(logits / T), in each of its paths: eager on CPU; Triton and compiled on CUDA."""
import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.utils.compile import set_compile

NUM_DRAWS = 40000


@pytest.fixture(autouse=True, params=["cpu", "cuda", "cuda-torch"])
def device(request, monkeypatch):
    """Runs each test eagerly on CPU, and on CUDA when there is a GPU: with the Triton sampler, and with the
    torch.compile'd one (cuda-torch)."""
    if request.param.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cuda-torch":
        monkeypatch.setenv("NANOVLLM_TRITON_SAMPLER", "0")
    set_compile(request.param.startswith("cuda"))
    with torch.device(request.param.split("-")[0]):
        yield request.param
    set_compile(False)


def frequencies(logits: torch.Tensor, temperature: float, **filters) -> torch.Tensor:
    """Draw NUM_DRAWS tokens from one row of logits; returns how often each token came up."""
    torch.manual_seed(0)
    batch = logits.expand(NUM_DRAWS, -1).contiguous()
    temps = torch.full((NUM_DRAWS,), temperature)
    st = SamplingTensors(temps, filters.get("top_ks"), filters.get("top_ps"), filters.get("min_ps"), None,
                         all_greedy=False)
    ids = Sampler()(batch, st)
    return (torch.bincount(ids, minlength=logits.numel()).float() / NUM_DRAWS).cpu()


def test_plain_temperature_draws_follow_the_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    for temperature in (0.6, 1.0, 2.0):
        expected = (logits / temperature).softmax(-1).cpu()
        assert torch.allclose(frequencies(logits, temperature), expected, atol=0.01), temperature


def test_greedy_rows_keep_their_argmax_next_to_sampled_rows():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 4.9]]).repeat(500, 1)
    temps = torch.tensor([0.0, 1.0]).repeat(500)
    ids = Sampler()(logits, SamplingTensors(temps, None, None, None, None, all_greedy=False))
    assert (ids[0::2] == 1).all()  # greedy
    sampled = ids[1::2]
    assert set(sampled.tolist()) <= {0, 1, 2} and (sampled == 2).any() and (sampled == 0).any()


def test_top_k_and_min_p_paths_cut_the_tail():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -3.0])
    freq = frequencies(logits, 1.0, top_ks=torch.full((NUM_DRAWS,), 2), top_ps=torch.ones(NUM_DRAWS))
    expected = torch.zeros(5, device="cpu")
    expected[:2] = logits[:2].softmax(-1).cpu()
    assert torch.allclose(freq, expected, atol=0.01)
    freq = frequencies(logits, 1.0, min_ps=torch.full((NUM_DRAWS,), 0.5))  # keeps p >= 0.5 * max p
    probs = logits.softmax(-1).cpu()
    kept = probs >= 0.5 * probs.max()
    assert torch.allclose(freq, torch.where(kept, probs / probs[kept].sum(), torch.zeros((), device="cpu")),
                          atol=0.01)


def test_draws_span_the_vocabulary_chunks_of_the_two_stage_argmax():
    # 2,500 entries: three 1,024-entry chunks, the last one padded; the mass sits in all three
    logits = torch.full((2500,), -30.0)
    logits[[5, 1500, 2499]] = torch.tensor([1.0, 0.0, 0.5])
    freq = frequencies(logits, 1.0)
    expected = logits.softmax(-1).cpu()
    assert torch.allclose(freq, expected, atol=0.01)
    greedy = Sampler()(logits.expand(4, -1), SamplingTensors(torch.zeros(4), None, None, None, None, False))
    assert greedy.tolist() == [5] * 4
    logits[2499] = 2.0  # the maximum in the padded last chunk
    greedy = Sampler()(logits.expand(4, -1), SamplingTensors(torch.zeros(4), None, None, None, None, False))
    assert greedy.tolist() == [2499] * 4


def test_a_triton_failure_falls_back_to_the_torch_path_for_good(caplog):
    sampler = Sampler()

    def broken(*args):
        raise RuntimeError("no compiler here")
    sampler.triton_sample = broken
    assert sampler._triton_sample(torch.zeros(2, 5), torch.ones(2)) is None
    assert not sampler.use_triton and "Triton sampler unavailable (RuntimeError: no compiler here)" in caplog.text
