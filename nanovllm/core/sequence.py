"""A request's tokens, its progress and its block tables (plain Python; no torch)."""
from enum import Enum, auto
from itertools import count

from nanovllm.core.request_metrics import RequestMetrics
from nanovllm.sampling_params import SamplingParams

PLACEHOLDER_TOKEN = -1  # a sampled token that the host has not read back yet (asynchronous scheduling)


class SequenceStatus(Enum):
    WAITING = auto()  # in the waiting queue: nothing computed, or preempted by recompute
    RUNNING = auto()  # owns GPU blocks for its computed tokens
    SWAPPED = auto()  # its computed KV lives in host blocks (cpu_block_table); owns no GPU blocks
    FINISHED = auto()


class Sequence:
    """One request.

    The sequence owns its block tables and counters; the pools own the blocks.
    NOTE: `block_table` covers at least the first `num_computed_tokens` tokens while RUNNING; while SWAPPED,
    `cpu_block_table` covers them instead and `block_table` is empty.
    NOTE: `block_hashes[i]` is the prefix-chain hash of full block i's tokens; it depends on content only, so it
          survives preemption.
    """
    _ids = count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int):
        self.seq_id = next(Sequence._ids)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.block_size = block_size
        self.sampling_params = sampling_params
        # the length at which it stops for "length" (the scheduler also caps it at max_model_len)
        self.max_num_tokens = self.num_prompt_tokens + sampling_params.max_tokens
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []  # gpu_block_ids
        self.cpu_block_table: list[int] = []  # cpu_block_ids while SWAPPED
        self.block_hashes: list[int] = []  # content hashes of leading full blocks (memo, see content_hash)
        self.num_cached_blocks = 0  # leading blocks of block_table already registered in the GPU prefix cache
        self.num_recompute_pending = 0  # tokens computed before a recompute preemption, not yet computed again
        # with asynchronous scheduling, the last tokens may be placeholders until the step that samples them is
        # read back; the runner then takes them from that step's sampled tensor, at row `sample_row`
        self.num_unresolved_tokens = 0
        self.sample_row = -1
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (vLLM's)
        self.output_text: str | None = None  # set when a stop string cut the text
        # SamplingParams.logprobs / prompt_logprobs: one dict {token_id: Logprob} per resolved completion token,
        # and per prompt token (None for the first); filled as steps are read back
        self.logprobs: list | None = None if sampling_params.logprobs is None else []
        self.prompt_logprobs: list | None = None if sampling_params.prompt_logprobs is None else [None]
        self.cumulative_logprob = 0.0  # the sum of `logprobs`' chosen entries (best_of ranks samples by it)
        # prompt positions whose logprobs a launched step computes (position p gives token p + 1's); a recompute
        # after preemption starts past them, so no prompt token gets its logprobs twice
        self.num_prompt_logprobs_planned = 0
        self.metrics = RequestMetrics()  # arrival now; the scheduler marks the rest

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        """The generated tokens the host knows (placeholders excluded)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.num_unresolved_tokens]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt tokens still lack their logprobs: their positions must be computed, not taken from a cache."""
        return self.prompt_logprobs is not None and self.num_prompt_logprobs_planned < self.num_prompt_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def block_token_ids(self, i: int) -> list[int]:
        return self.token_ids[i * self.block_size:(i + 1) * self.block_size]

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table}, cpu_blocks={self.cpu_block_table})")
