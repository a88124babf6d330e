"""logit_bias and bad_words: which rows get a bias or a ban (plain Python, exact), and the sampler applying them on
the device (greedy rows, so each check is exact). The engine runs of both are in test_vllm_script.py."""
import pytest
import torch

from nanovllm.core.sequence import PLACEHOLDER_TOKEN, Sequence
from nanovllm.engine.logit_rules import LogitRules, bad_words_token_ids
from nanovllm.layers.sampler import Sampler, SamplingTensors
from nanovllm.sampling_params import SamplingParams


def make_seq(output_ids: list[int], **options) -> Sequence:
    seq = Sequence([1, 2, 3], SamplingParams(**options), block_size=4)
    seq.token_ids += output_ids
    return seq


def test_rows_without_rules_cost_nothing():
    rules = LogitRules()
    rules.add(make_seq([]), [])
    assert rules.bias == {} and rules.bad_words == {}
    assert rules.step_rules([make_seq([5])]) == ([], [], [])


def test_a_bad_word_bans_its_last_token_after_its_prefix():
    """Words [7] and [8, 9]: 7 is banned always, 9 only right after an 8 (of the completion, not the prompt)."""
    rules = LogitRules()
    after_8, other, prompt_only = make_seq([5, 8]), make_seq([8, 5]), make_seq([])
    prompt_only.token_ids[-1] = 8  # the prompt ends in 8: vLLM matches completion tokens only
    for seq in (after_8, other, prompt_only):
        rules.add(seq, [[7], [8, 9]])
    _, bans, conditional = rules.step_rules([after_8, other, prompt_only])
    assert bans == [(0, [7, 9]), (1, [7]), (2, [7])] and conditional == []


def test_a_bad_word_whose_prefix_ends_in_a_token_not_read_back_bans_on_the_device():
    """Asynchronous scheduling: the last completion token is a placeholder; the ban of 9 holds only if the
    previous step sampled 8 at the sequence's row."""
    rules = LogitRules()
    seq = make_seq([5, PLACEHOLDER_TOKEN])
    seq.num_unresolved_tokens, seq.sample_row = 1, 3
    rules.add(seq, [[8, 9], [6, 8, 9], [5, 8, 9]])
    _, bans, conditional = rules.step_rules([make_seq([1]), seq])
    # [6, 8, 9] cannot match (5 came before the placeholder), the other two wait on the same token
    assert bans == [] and conditional == [(1, 9, 3, 8), (1, 9, 3, 8)]


def test_logit_bias_rows_and_their_end():
    rules = LogitRules()
    seq = make_seq([], logit_bias={"4": 2.5, 9: -300})
    rules.add(seq, [])
    assert rules.step_rules([make_seq([]), seq])[0] == [(1, [4, 9], [2.5, -100.0])]  # clamped as vLLM does
    rules.discard(seq.seq_id)
    assert rules.step_rules([seq]) == ([], [], [])


class WordTokenizer:
    """Splits on spaces; a word with a leading space is another token (as BPE tokenizers do)."""
    vocab = {"bad": 10, " bad": 11, "word": 12, " word": 13}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        words = text.split(" ")
        return [self.vocab[w if i == 0 else " " + w] for i, w in enumerate(words) if w]


def test_bad_words_are_tokenized_alone_and_inside_a_sentence():
    assert bad_words_token_ids(WordTokenizer(), ["bad word", " bad"]) == [[10, 13], [11, 13], [10], [11]]


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The sampler tests run on the CPU, and on CUDA when there is a GPU (pinned copies, the device's index_put)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with torch.device(request.param):
        yield request.param


def greedy_tensors(rows: int) -> SamplingTensors:
    return SamplingTensors(torch.zeros(rows), None, None, None, None, all_greedy=True)


def test_the_sampler_adds_biases_and_bans_on_the_device(device):
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 2.0, 1.0, 0.0]])
    ids = Sampler()(logits.clone(), greedy_tensors(2), logit_bias=[(0, [0], [5.0]), (1, [3, 3], [2.0, 2.0])])
    # 0 + 5 beats 3; 0 + 2 + 2 (one entry twice adds twice) beats 3
    assert ids.device.type == device and ids.tolist() == [0, 3]
    last_sampled = torch.tensor([8, 4])
    bans = [(0, 3, 1, 4), (1, 0, 0, 7)]  # row 0 loses 3 (row 1 sampled 4); row 1 keeps 0 (row 0 sampled 8, not 7)
    ids = Sampler()(logits.clone(), greedy_tensors(2), last_sampled=last_sampled, conditional_bans=bans)
    assert ids.tolist() == [2, 0]


def test_sampling_params_check_the_new_options():
    sp = SamplingParams(logit_bias={"7": 1}, bad_words="x", truncate_prompt_tokens=-1, max_tokens=None, min_tokens=3)
    assert sp.logit_bias == {7: 1.0} and sp.bad_words == ["x"] and sp.max_tokens is None
    for options, message in [({"logit_bias": {-1: 1.0}}, "logit_bias key -1"),
                             ({"logit_bias": {1: float("nan")}}, r"logit_bias\[1\]=nan"),
                             ({"bad_words": [3]}, "bad_words=\\[3\\]"),
                             ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens=0"),
                             ({"detokenize": False, "stop": ["x"]}, "detokenize=False"),
                             ({"skip_special_tokens": "no"}, "skip_special_tokens='no'")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**options)
