"""Structured outputs (SamplingParams.structured_outputs), the host half: each constrained request's grammar matcher
(llguidance), the step's token bitmask built from them, and the matchers advanced by the tokens read back. The
sampler's file applies the bitmask on the device (nanovllm/layers/sampler.py: apply_token_bitmask). No torch.

The life of a constrained step, under asynchronous scheduling too: the engine launches the forward, then reads back
the previous step's tokens (which the matchers consume) while the forward runs, builds this step's bitmask from the
matchers, and only then lets the runner sample (ModelRunner.launch's `grammar_mask`). The next token's mask needs
the token before it, so a constrained step cannot sample before its predecessor is read back; what overlaps the
forward is the read-back and the mask, as in vLLM.
"""
import json
import threading
from collections import OrderedDict

import numpy as np

from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import StructuredOutputsParams

# finish_reason of a request whose grammar rejected its sampled token, so that no token can follow (the mask of a
# matcher in that state allows EOS only, which would never end a request with ignore_eos)
GRAMMAR_ERROR = "grammar_error"
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped): a server sees few distinct schemas


def grammar_text(structured: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (vLLM's guidance backend's mapping): JSON with flexible whitespace
    unless disable_any_whitespace, json_object as the schema {"type": "object"}, grammar as EBNF (GBNF) or Lark."""
    import llguidance
    kind = structured.kind
    if kind in ("json", "json_object"):
        schema = structured.json if kind == "json" else {"type": "object"}
        if structured.disable_additional_properties:
            schema = without_additional_properties(schema)
        defaults = {"whitespace_flexible": not structured.disable_any_whitespace}
        if structured.whitespace_pattern is not None:
            defaults["whitespace_pattern"] = structured.whitespace_pattern
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=defaults)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(structured.choice))
    return llguidance.grammar_from(kind, getattr(structured, kind))  # "regex" or "grammar"


def without_additional_properties(schema):
    """A copy of the schema where each object schema that does not say otherwise has additionalProperties False."""
    if isinstance(schema, list):
        return [without_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: without_additional_properties(value) for key, value in schema.items()}
    if schema.get("type") == "object" or "properties" in schema:
        schema.setdefault("additionalProperties", False)
    return schema


class GrammarCompiler:
    """Grammars compiled for one tokenizer and logits width, cached by the constraint's key: each holds an unused
    matcher (the template) that a request's matcher is deep-copied from, so a schema is compiled once.
    NOTE: a template is never advanced; only its copies consume tokens."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers it, tokens past the tokenizer's masked
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on the first constraint (about 0.3 s for a 50k vocabulary)
        self._templates: OrderedDict = OrderedDict()  # key -> LLMatcher, least recently used first
        self._lock = threading.Lock()  # guards _templates

    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            from llguidance.hf import from_tokenizer
            if self.hf_tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and this model has no tokenizer "
                                 "files; drop structured_outputs or load a model with a tokenizer")
            if not getattr(self.hf_tokenizer, "is_fast", False):
                name = type(self.hf_tokenizer).__name__
                raise ValueError(f"structured_outputs needs a fast (Rust) tokenizer; {name} is not one")
            # the model's EOS ids that the tokenizer knows (a tokenizer borrowed from another model, as the dummy
            # presets' benchmarks do, knows none of them: then its own EOS)
            eos_token_ids = [t for t in self.eos_token_ids if t < len(self.hf_tokenizer)]
            self._ll_tokenizer = from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size,
                                                eos_token=eos_token_ids or None)
        return self._ll_tokenizer

    def matcher(self, structured: StructuredOutputsParams):
        """A fresh matcher for the constraint; ValueError naming the field when it does not compile."""
        return self.template(structured).deep_copy()

    def template(self, structured: StructuredOutputsParams):
        """The constraint's compiled, never advanced matcher (compiled on first use). Thread-safe: the server
        compiles in its requests' worker threads while the engine loop takes matchers (the compile itself runs
        outside the lock)."""
        key = structured.key
        with self._lock:
            template = self._templates.get(key)
        if template is None:
            template = self._compile(structured)
        with self._lock:
            self._templates[key] = template
            self._templates.move_to_end(key)
            if len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return template

    def _compile(self, structured: StructuredOutputsParams):
        import llguidance
        field = f"structured_outputs.{structured.kind}"
        try:
            grammar = grammar_text(structured)
        except ValueError as e:  # a JSON schema or EBNF that llguidance cannot even read
            raise ValueError(f"{field} is invalid: {e}") from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer())
        if error:
            raise ValueError(f"{field} is invalid: {error}")
        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar)
        if matcher.is_error():
            raise ValueError(f"{field} is invalid: {matcher.get_error()}")
        return matcher


class StructuredOutputs:
    """The running constrained requests' matchers, by seq id, so a step without any spends one dict check on them.
    NOTE: a matcher has consumed exactly its sequence's resolved completion tokens; an entry lives from add_request
    until the request finishes or is aborted (`discard`)."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.matchers: dict[int, object] = {}  # seq id -> llguidance.LLMatcher
        self._executor = None  # llguidance's thread pool for the masks of several rows

    def check(self, structured: StructuredOutputsParams | None):
        """Compile (and cache) a request's constraint before it is queued: ValueError naming the field."""
        if structured is not None:
            self.compiler.template(structured)

    def add(self, seq: Sequence):
        structured = seq.sampling_params.structured_outputs
        if structured is not None:
            self.matchers[seq.seq_id] = self.compiler.matcher(structured)

    def discard(self, seq_id: int):
        self.matchers.pop(seq_id, None)

    def grammar_mask(self, sample_seqs: list[Sequence], read_back, finished: list[Sequence]):
        """For a step with constrained rows, what the runner calls once the forward is launched (ModelRunner.launch's
        grammar_mask): read back the step before with `read_back` (the engine's; the sequences it finishes go to
        `finished`), which advances the matchers, then build this step's bitmask, both while the forward runs.
        None for a step without any."""
        if not (self.matchers and any(seq.seq_id in self.matchers for seq in sample_seqs)):
            return None

        def read_back_then_mask():
            finished.extend(read_back())
            return self.step_mask(sample_seqs)
        return read_back_then_mask

    def step_mask(self, sample_seqs: list[Sequence]) -> tuple[list[int], np.ndarray] | None:
        """(sample rows, their bitmask [rows, ceil(vocab / 32)] int32, bit t of a row: token t allowed) for the
        constrained rows of this step; None when it has none. Call once the step before is read back. A row whose
        sequence finished meanwhile is left out (its token will be dropped)."""
        pairs = [(row, self.matchers[seq.seq_id]) for row, seq in enumerate(sample_seqs)
                 if seq.seq_id in self.matchers and not seq.is_finished]
        if not pairs:
            return None
        import llguidance.numpy as llg_numpy
        bitmask = llg_numpy.allocate_token_bitmask(len(pairs), self.compiler.vocab_size)
        if len(pairs) == 1:
            llg_numpy.fill_next_token_bitmask(pairs[0][1], bitmask, 0)
        else:
            if self._executor is None:
                import llguidance
                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, (_, m) in enumerate(pairs)], bitmask)
        return [row for row, _ in pairs], bitmask

    def consume(self, rows: list[tuple[Sequence, int] | None], token_ids: list[int]):
        """Advance the matchers by a read-back step's tokens (Scheduler.advance's rows; before resolve, which may
        finish their sequences: a finished sequence's matcher goes away with it)."""
        if not self.matchers:
            return
        for row, token_id in zip(rows, token_ids):
            if row is not None and not row[0].is_finished:
                matcher = self.matchers.get(row[0].seq_id)
                if matcher is not None:
                    matcher.consume_token(token_id)  # False leaves it in its error state: finish_grammars ends it

    def finish_grammars(self, updated: list[Sequence], finish, text) -> list[Sequence]:
        """End the sequences whose grammar is complete ("stop") or rejected their token (GRAMMAR_ERROR) with
        `finish(seq, reason)`; returns them. Their text is fixed first with `text(seq)` (TextOutput.text): the last
        token is the output's own, not a stop token whose text a "stop" leaves out."""
        if not self.matchers:
            return []
        done = []
        for seq in updated:
            matcher = self.matchers.get(seq.seq_id)
            if matcher is None:
                continue
            if matcher.is_error():
                done.append((seq, GRAMMAR_ERROR))
            elif matcher.is_stopped():
                done.append((seq, "stop"))
        for seq, reason in done:
            seq.output_text = text(seq)
            finish(seq, reason)
        return [seq for seq, _ in done]
