"""Structured outputs (SamplingParams.structured_outputs), the host half: each constrained request's grammar matcher
(llguidance), the step's token bitmask built from them, and the matchers advanced by the tokens read back. The
runner's TokenBitmask (nanovllm/layers/token_bitmask.py) holds the buffer the masks are written into and applies
them on the device. No torch.

The life of a constrained step, under asynchronous scheduling too: the engine launches the forward, then reads back
the previous step's tokens (which the matchers consume) while the forward runs; as soon as the matchers have
consumed them, llguidance fills this step's masks on a thread of their own while the read-back goes on (the
sequences' updates, stop strings), and the runner waits for the masks only when it samples (StepMask). The next
token's mask needs the token before it, so a constrained step cannot sample before its predecessor is read back;
what overlaps the forward is the read-back and the mask, as in vLLM.
"""
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from nanovllm.core.sequence import Sequence
from nanovllm.sampling_params import StructuredOutputsParams
from nanovllm.utils.cpu_threads import usable_cores

# finish_reason of a request whose grammar rejected its sampled token, so that no token can follow (the mask of a
# matcher in that state allows EOS only, which would never end a request with ignore_eos)
GRAMMAR_ERROR = "grammar_error"
MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped): a server sees few distinct schemas
# llguidance's mask threads: its own default (80% of the cores, at most 32), counted on the cores this process may
# use (its affinity mask and cgroup quota) rather than the machine's
NUM_MASK_THREADS = max(1, min(32, usable_cores() * 4 // 5))


def grammar_text(structured: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (vLLM's guidance backend's mapping): JSON with flexible whitespace
    unless disable_any_whitespace, json_object as the schema {"type": "object"}, grammar as EBNF (GBNF) or Lark."""
    import llguidance
    kind = structured.kind
    if kind in ("json", "json_object"):
        schema = structured.json if kind == "json" else {"type": "object"}
        if schema is True:  # JSON Schema's `true`, any value: as {}, which takes the whitespace options
            schema = {}
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
    """Grammars compiled for one tokenizer and logits width, cached by the constraint's key. A request's matcher is a
    deep copy of one of its grammar's templates (never advanced matchers), taken in turn, so a schema is compiled
    at most NUM_MASK_THREADS times, never per request. Why several: llguidance's copies of one matcher share its
    lexer (and the lexer states it has built) behind one lock that each mask computation holds, so the masks of
    copies of one template fill one at a time on the parallel executor; copies of NUM_MASK_THREADS templates fill
    side by side. The first requests of a grammar compile a template each; later ones copy."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int]):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: the bitmask covers it, tokens past the tokenizer's masked
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None  # built on the first constraint (about 0.3 s for a 50k vocabulary)
        self._templates: OrderedDict = OrderedDict()  # key -> GrammarTemplates, least recently used first
        self._lock = threading.Lock()  # guards _templates and each entry's turn

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

    def check(self, structured: StructuredOutputsParams):
        """Compile the constraint's first template unless cached: ValueError naming the field when it does not
        compile. Thread-safe: the server checks in its requests' worker threads while the engine loop takes
        matchers (a compile runs outside the lock)."""
        self._template(structured, first=True)

    def matcher(self, structured: StructuredOutputsParams):
        """A fresh matcher for the constraint (a copy of the template whose turn it is)."""
        return self._template(structured, first=False).deep_copy()

    def _template(self, structured: StructuredOutputsParams, first: bool):
        key = structured.key
        with self._lock:
            templates = self._templates.setdefault(key, GrammarTemplates())
            self._templates.move_to_end(key)
            if len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
            template = templates.first() if first else templates.take_turn()
        if template is None:  # not compiled yet: the constraint's first request, or a turn without its template
            template = self._compile(structured)
            with self._lock:
                templates.add(template)
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


class GrammarTemplates:
    """One constraint's templates (compiled, never advanced matchers), at most NUM_MASK_THREADS, and the count of
    matchers taken, which says whose turn is next."""

    def __init__(self):
        self.matchers: list = []
        self.num_taken = 0

    def first(self):
        return self.matchers[0] if self.matchers else None

    def take_turn(self):
        """The template whose turn it is; None where that turn has no template yet (the caller compiles one)."""
        turn = self.num_taken % NUM_MASK_THREADS
        self.num_taken += 1
        return self.matchers[turn] if turn < len(self.matchers) else None

    def add(self, matcher):
        if len(self.matchers) < NUM_MASK_THREADS:
            self.matchers.append(matcher)


class StructuredOutputs:
    """The running constrained requests' matchers, by seq id, so a step without any spends one dict check on them.
    NOTE: a matcher has consumed exactly its sequence's resolved completion tokens; an entry lives from add_request
    until the request finishes or is aborted (`discard`). While a step's masks fill (on the mask thread), only the
    fill touches the matchers: consume waits for it, and finish_grammars reads the states consume recorded."""

    def __init__(self, compiler: GrammarCompiler):
        self.compiler = compiler
        self.matchers: dict[int, object] = {}  # seq id -> llguidance.LLMatcher
        # seq id -> GRAMMAR_ERROR or "stop": the grammars that the last read-back's tokens ended (consume's record)
        self._ended: dict[int, str] = {}
        self._beginning: StepMask | None = None  # the step whose read-back is under way: consume starts its fill
        self._filling: Future | None = None  # the fill on the mask thread, until the runner has waited for it
        self._executor = None  # llguidance's thread pool for the masks of several rows
        self._mask_thread = None  # one thread that runs the fill, so that the host's other work goes on meanwhile
        # where a constrained step's host time goes (bench_structured reports them): the fills' seconds on the mask
        # thread, and the seconds the runner waited for one before it could sample
        self.num_fills, self.fill_seconds, self.fill_wait_seconds = 0, 0.0, 0.0

    def check(self, structured: StructuredOutputsParams | None):
        """Compile (and cache) a request's constraint before it is queued: ValueError naming the field."""
        if structured is not None:
            self.compiler.check(structured)

    def add(self, seq: Sequence):
        structured = seq.sampling_params.structured_outputs
        if structured is not None:
            self.matchers[seq.seq_id] = self.compiler.matcher(structured)

    def discard(self, seq_id: int):
        self.matchers.pop(seq_id, None)

    def grammar_mask(self, sample_seqs: list[Sequence], read_back, finished: list[Sequence]) -> "StepMask | None":
        """For a step with constrained rows, the StepMask that the runner builds the masks with once the forward is
        launched (ModelRunner.launch's `grammar_mask`): `read_back` is the engine's, and the sequences it finishes go
        to `finished`. None for a step without any."""
        if not (self.matchers and any(seq.seq_id in self.matchers for seq in sample_seqs)):
            return None
        return StepMask(self, sample_seqs, read_back, finished)

    def start_fill(self, sample_seqs: list[Sequence], masks: np.ndarray) -> list[int]:
        """Start filling masks[i] for the i-th constrained row of this step on the mask thread (wait_for_fill
        joins it); returns the sample rows, in mask order. Call once the step before is read back into the matchers.
        A row whose sequence finished, or whose grammar ended, is left out (its token will be dropped)."""
        pairs = [(row, self.matchers[seq.seq_id]) for row, seq in enumerate(sample_seqs)
                 if seq.seq_id in self.matchers and not seq.is_finished and seq.seq_id not in self._ended]
        if len(pairs) > masks.shape[0]:
            raise RuntimeError(f"StructuredOutputs.start_fill: {len(pairs)} constrained rows, masks for "
                               f"{masks.shape[0]}")
        if pairs:
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-grammar-mask")
            self._filling = self._mask_thread.submit(self._fill, [matcher for _, matcher in pairs], masks)
        return [row for row, _ in pairs]

    def _fill(self, matchers: list, masks: np.ndarray):
        """llguidance writes the masks in place (it releases the GIL meanwhile)."""
        import llguidance.numpy as llg_numpy
        start = time.perf_counter()
        if len(matchers) == 1:
            llg_numpy.fill_next_token_bitmask(matchers[0], masks, 0)
        else:
            if self._executor is None:
                import llguidance
                self._executor = llguidance.LLExecutor(NUM_MASK_THREADS)
            llg_numpy.fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], masks)
        self.num_fills += 1
        self.fill_seconds += time.perf_counter() - start

    def wait_for_fill(self):
        """Wait for the masks that are filling, if any (raises the fill's error)."""
        filling, self._filling = self._filling, None
        if filling is not None:
            start = time.perf_counter()
            filling.result()
            self.fill_wait_seconds += time.perf_counter() - start

    def close(self):
        """Stop the mask thread (a later constrained step starts another)."""
        self.wait_for_fill()
        if self._mask_thread is not None:
            self._mask_thread.shutdown()
            self._mask_thread = None

    def consume(self, rows: list[tuple[Sequence, int] | None], token_ids: list[int]):
        """Advance the matchers by a read-back step's tokens (Scheduler.advance's rows; before resolve, which may
        finish their sequences: a finished sequence's matcher goes away with it), record the grammars they end, and
        start the fill of the step being launched (StepMask.begin), if any."""
        self._ended = {}
        if not self.matchers:
            return
        self.wait_for_fill()  # a fill that nobody waited for (a step that raised) must not race the tokens
        for row, token_id in zip(rows, token_ids):
            if row is not None and not row[0].is_finished:
                matcher = self.matchers.get(row[0].seq_id)
                if matcher is not None:
                    matcher.consume_token(token_id)  # False leaves it in its error state: finish_grammars ends it
                    if matcher.is_error():
                        self._ended[row[0].seq_id] = GRAMMAR_ERROR
                    elif matcher.is_stopped():
                        self._ended[row[0].seq_id] = "stop"
        if self._beginning is not None:
            self._beginning.start()

    def finish_grammars(self, updated: list[Sequence], finish, text) -> list[Sequence]:
        """End the sequences whose grammar is complete ("stop") or rejected their token (GRAMMAR_ERROR), as
        consume recorded, with `finish(seq, reason)`; returns them. Their text is fixed first with `text(seq)`
        (TextOutput.text): the last token is the output's own, not a stop token whose text a "stop" leaves out."""
        if not self._ended:
            return []
        done = [(seq, self._ended[seq.seq_id]) for seq in updated if seq.seq_id in self._ended]
        for seq, reason in done:
            seq.output_text = text(seq)
            finish(seq, reason)
        return [seq for seq, _ in done]


class StepMask:
    """One constrained step's masks, built while the host does the rest of its work. `begin(masks)` reads the step
    before back (the engine's `read_back`); as soon as the matchers have consumed its tokens, the mask thread fills
    `masks` while the read-back goes on (the sequences' updates, stop strings). `rows()` waits for the fill and
    returns the sample rows whose masks are masks[:len(rows)], or None when no constrained row is left.
    The runner calls begin once the forward is launched (on a CPU, where launch runs the forward itself, before it,
    so that the fill runs beside the forward) and rows before it samples.
    NOTE: the fill starts only after the read-back's consume (or, with nothing in flight, at the end of begin)."""

    def __init__(self, structured: StructuredOutputs, sample_seqs: list[Sequence], read_back,
                 finished: list[Sequence]):
        self.structured, self.sample_seqs = structured, sample_seqs
        self.read_back, self.finished = read_back, finished
        self.masks: np.ndarray | None = None  # [max rows, words] int32 (the runner's host buffer), from begin
        self._rows: list[int] | None = None  # the sample rows being filled, from start

    @property
    def is_begun(self) -> bool:
        return self.masks is not None

    def begin(self, masks: np.ndarray):
        self.masks = masks
        self.structured._beginning = self
        try:
            self.finished.extend(self.read_back())
        finally:
            self.structured._beginning = None
        if self._rows is None:  # nothing was in flight to read back: the matchers are up to date already
            self.start()

    def start(self):
        self._rows = self.structured.start_fill(self.sample_seqs, self.masks)

    def rows(self) -> list[int] | None:
        self.structured.wait_for_fill()
        return self._rows or None
