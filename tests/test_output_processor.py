"""The output processor on its own (no model, no torch): stream deltas carry exactly what is new, hold back a tail
that could still become a stop string or a partial character, and join to the finished text; stop strings end a
running sequence and cut its tokens. A character tokenizer makes each token's text obvious: token id i is chr(i)."""
from nanovllm.core.sequence import Sequence, SequenceStatus
from nanovllm.engine.output_processor import DeltaCursor, OutputProcessor, StreamDelta
from nanovllm.sampling_params import SamplingParams

PROMPT = [ord(c) for c in "Q:"]


class CharTokenizer:
    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(chr(t) for t in token_ids if t >= 0)  # a placeholder (-1) has no text


def make_seq(**options) -> Sequence:
    return Sequence(PROMPT, SamplingParams(temperature=0, max_tokens=32, **options), block_size=4)


def grow(seq: Sequence, text: str):
    seq.token_ids.extend(ord(c) for c in text)


def finish(seq: Sequence, reason: str):
    seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason


def test_each_delta_carries_only_what_is_new_and_the_last_one_the_finish_reason():
    processor, seq, cursor = OutputProcessor(CharTokenizer()), make_seq(), DeltaCursor()
    assert processor.delta(seq, cursor) is None  # nothing generated yet
    grow(seq, "ab")
    assert processor.delta(seq, cursor) == StreamDelta([ord("a"), ord("b")], "ab", None, 2)
    assert processor.delta(seq, cursor) is None  # nothing new since
    grow(seq, "c")
    finish(seq, "length")
    assert processor.delta(seq, cursor) == StreamDelta([ord("c")], "c", "length", 3)
    assert (cursor.num_tokens_sent, cursor.text_sent) == (3, "abc")


def test_a_tail_that_could_become_a_stop_string_waits_and_the_deltas_join_to_the_text():
    """stop="xyz": while running, the last two characters may be its start, so they are held back; a trailing
    U+FFFD (half a character) waits too. Once finished, everything is sent."""
    processor, seq, cursor = OutputProcessor(CharTokenizer()), make_seq(stop=["xyz"]), DeltaCursor()
    grow(seq, "hello")
    first = processor.delta(seq, cursor)
    assert first.text == "hel" and first.token_ids == [ord(c) for c in "hello"]
    grow(seq, "\ufffd")
    second = processor.delta(seq, cursor)
    assert second.text == "" and second.token_ids == [0xFFFD]  # "lo" + the partial character: held back
    grow(seq, "!")
    finish(seq, "length")
    last = processor.delta(seq, cursor)
    assert first.text + second.text + last.text == processor.text(seq) == "hello\ufffd!"


def test_logprobs_come_per_delta_and_prompt_logprobs_in_the_first_only():
    processor, seq, cursor = OutputProcessor(CharTokenizer()), make_seq(logprobs=0, prompt_logprobs=0), DeltaCursor()
    seq.prompt_logprobs = [None, {1: "p"}]
    seq.logprobs = []
    grow(seq, "ab")
    seq.logprobs += [{1: "a"}, {2: "b"}]
    first = processor.delta(seq, cursor)
    assert first.logprobs == [{1: "a"}, {2: "b"}] and first.prompt_logprobs == [None, {1: "p"}]
    grow(seq, "c")
    seq.logprobs.append({3: "c"})
    second = processor.delta(seq, cursor)
    assert second.logprobs == [{3: "c"}] and second.prompt_logprobs is None


def test_a_stop_string_ends_a_running_sequence_and_drops_its_tokens_not_read_back():
    """Asynchronous scheduling: the last token is a placeholder for the step in flight; the stop string in the
    text read back ends the sequence, cut before the match, and the placeholder goes."""
    processor, seq = OutputProcessor(CharTokenizer()), make_seq(stop=["#"])
    seq.status = SequenceStatus.RUNNING
    grow(seq, "ok#more")
    seq.token_ids.append(-1)  # the step in flight's placeholder
    seq.num_unresolved_tokens = 1
    ended = []
    assert processor.apply_stop_strings([seq], lambda s, reason: ended.append((s.seq_id, reason))) == [seq]
    assert ended == [(seq.seq_id, "stop")]
    assert seq.output_text == "ok" and seq.stop_reason == "#" and seq.num_unresolved_tokens == 0
    assert seq.completion_token_ids == [ord(c) for c in "ok#more"]


def test_as_chunk_is_generate_streams_dict_and_an_abort_chunk_is_empty():
    delta = StreamDelta([5], "x", None, 1)
    assert delta.as_chunk(2, 1) == {"index": 2, "output_index": 1, "token_ids": [5], "text": "x",
                                    "finish_reason": None, "logprobs": None, "prompt_logprobs": None}
    assert StreamDelta.aborted().as_chunk(0, 0) == {"index": 0, "output_index": 0, "token_ids": [], "text": "",
                                                    "finish_reason": "abort", "logprobs": None,
                                                    "prompt_logprobs": None}
    assert StreamDelta.aborted().token_ids is not StreamDelta.aborted().token_ids  # no list shared between calls


def test_without_a_tokenizer_deltas_carry_token_ids_and_no_text():
    processor, seq, cursor = OutputProcessor(None), make_seq(detokenize=False), DeltaCursor()
    grow(seq, "ab")
    assert processor.delta(seq, cursor) == StreamDelta([ord("a"), ord("b")], "", None, 2)
