"""The sampler's draws follow softmax(logits / T), in each of its paths: eager on CPU; Triton and compiled on CUDA."""
import pytest
import torch

from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.utils.compile import set_compile

NUM_DRAWS = 40000


@pytest.fixture(autouse=True, params=["cpu", "cuda", "cuda-torch"])
def device(request, monkeypatch, switches):
    """Runs each test eagerly on CPU, and on CUDA when there is a GPU: with the Triton sampler, and with the
    torch.compile'd one (cuda-torch)."""
    if request.param.startswith("cuda") and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if request.param == "cuda-torch":
        switches(triton_sampler=False)
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


@pytest.mark.slow  # thousands of draws
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


@pytest.mark.slow  # thousands of draws
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


def test_filters_apply_in_vllms_order():
    """temperature, min_p, top_k, then top_p over what top_k kept (renormalized): with p = [0.5, 0.3, 0.2],
    top_k=2 leaves [0.625, 0.375], and top_p=0.6 then keeps the first token only. Computing top_p on the full
    distribution (0.5 < 0.6) would keep two; so would min_p=0.5 applied after top_p."""
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    ones = torch.ones(NUM_DRAWS)
    first_only = torch.tensor([1.0, 0.0, 0.0], device="cpu")  # frequencies() returns CPU tensors
    freq = frequencies(logits, 1.0, top_ks=torch.full((NUM_DRAWS,), 2), top_ps=torch.full((NUM_DRAWS,), 0.6))
    assert torch.equal(freq, first_only), freq
    freq = frequencies(logits, 1.0, top_ks=torch.full((NUM_DRAWS,), 3), top_ps=torch.full((NUM_DRAWS,), 0.6),
                       min_ps=torch.full((NUM_DRAWS,), 0.5))  # min_p keeps [0.5, 0.3] -> [0.625, 0.375]
    assert torch.equal(freq, first_only), freq
    freq = frequencies(logits, 1.0, top_ks=torch.full((NUM_DRAWS,), 3), top_ps=ones * 0.7)  # 0.5 < 0.7 <= 0.8
    assert freq[2] == 0 and abs(freq[0] - 0.625) < 0.01, freq


def test_top_p_keeps_the_first_token_however_small_and_drops_nothing_at_one():
    logits = torch.tensor([3.0, 1.0, 0.0, -1.0])
    freq = frequencies(logits, 1.0, top_ks=torch.full((NUM_DRAWS,), 4), top_ps=torch.full((NUM_DRAWS,), 1e-46))
    assert torch.equal(freq, torch.tensor([1.0, 0.0, 0.0, 0.0], device="cpu")), freq  # 1e-46 is 0 in float32
    # top_p = 1 next to a filtering row: a tail token whose float32 cumsum above it reaches 1 still stays
    tail = torch.tensor([30.0, 0.0])  # p(tail) ~ 1e-13: the cumsum above it is 1.0 in float32
    st = SamplingTensors(torch.ones(2), torch.tensor([2, 1]), torch.tensor([1.0, 1.0]), None, None, False)
    from nanovllm.layers.sampler import top_k_top_p
    kept = top_k_top_p(tail.expand(2, -1) / st.temperatures.unsqueeze(1), st.top_ks, st.top_ps)
    assert kept[0, 1].item() == 0.0 and kept[1, 1].item() == float("-inf"), kept


def test_filtered_rows_are_sampled_in_chunks_with_the_same_draws(monkeypatch):
    """Seeded rows with temperature, min-p, top-k and top-p draw the same tokens whether the batch is filtered
    whole or in chunks of 3 rows (the chunks bound the sampler's memory): every field is cut at the same rows."""
    import nanovllm.layers.sampler as sampler_module
    torch.manual_seed(0)
    batch, vocab = 10, 64
    logits = torch.randn(batch, vocab)  # flat enough that rotated seeds change half the draws
    temps = torch.linspace(0.0, 1.5, batch)  # row 0 greedy
    top_ks = torch.tensor([5, 64, 10, 3, 64, 20, 7, 64, 2, 30])
    top_ps = torch.tensor([1.0, 0.9, 0.8, 1.0, 0.5, 0.95, 1.0, 0.7, 1.0, 0.6])
    min_ps = torch.full((batch,), 0.01)
    calls = []
    filtered = Sampler._filtered_sample
    monkeypatch.setattr(Sampler, "_filtered_sample",
                        lambda self, x, st: calls.append(x.size(0)) or filtered(self, x, st))

    def draw():
        generators = [torch.Generator(logits.device).manual_seed(100 + i) for i in range(batch)]
        return Sampler()(logits.clone(), SamplingTensors(temps, top_ks, top_ps, min_ps, generators, False)).tolist()

    whole = draw()
    monkeypatch.setattr(sampler_module, "FILTER_CHUNK_ELEMENTS", 3 * vocab)
    chunked = draw()
    assert calls == [10, 3, 3, 3, 1]
    assert chunked == whole and whole[0] == logits[0].argmax().item()


def test_top_k_top_p_in_place_keeps_the_out_of_place_results():
    """top_k_top_p masks its sorted copies and scatters into its input (in place, for memory): the same logits as
    the out-of-place formulation it replaced, bit for bit, on rows with ties, top_k at the vocabulary and top_p 1."""
    torch.manual_seed(0)
    logits = torch.randn(6, 300).round(decimals=1)  # ties
    top_ks = torch.tensor([1, 5, 300, 40, 300, 7])
    top_ps = torch.tensor([0.5, 1.0, 0.9, 0.3, 1.0, 0.99])
    sorted_logits, order = logits.sort(-1, descending=True)
    ranks = torch.arange(logits.size(1)).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks.unsqueeze(1), float("-inf"))
    sorted_probs = sorted_logits.softmax(-1)
    remove = (sorted_probs.cumsum(-1) - sorted_probs) >= top_ps.unsqueeze(1)
    remove &= top_ps.unsqueeze(1) < 1.0
    remove[:, 0] = False
    expected = torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(remove, float("-inf")))
    from nanovllm.layers.sampler import top_k_top_p
    x = logits.clone()
    kept = top_k_top_p(x, top_ks, top_ps)
    assert kept.data_ptr() == x.data_ptr() and torch.equal(kept, expected)
    assert 1 < int((kept > float("-inf")).sum()) < logits.numel()  # some filtered, some kept
