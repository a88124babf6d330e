"""A step's tensors: the StepPlan's integer lists packed into one host buffer and moved in one copy, the attention
metadata built from them (split into a decode and a prefill part for mixed steps), and the handle through which the
sampled tokens come back."""
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.step_plan import StepPlan
from nanovllm.utils.context import AttentionMetadata


class PackedInputs:
    """A step's integer inputs in one byte buffer: int64 parts, then int32 parts, then the int32 block table
    [rows, width] padded with -1; every part starts on a 16-byte boundary. One buffer means one host-to-device copy;
    the alignment keeps each part's device address 16-byte aligned whatever the lengths before it, because Triton
    compiles a kernel variant per pointer alignment (a part at an 8-byte offset one step and a 16-byte one the next
    would compile mid-run). On the device the parts come out of one `split` per dtype (each torch call costs a few
    microseconds of host time on a GPU machine)."""

    ALIGN_BYTES = 16

    def __init__(self, int64_parts: list[list[int]], int32_parts: list[list[int]], block_tables: list[list[int]],
                 pin_memory: bool, width: int | None = None):
        # per dtype: [len 0, padding 0, len 1, padding 1, ...] in elements; `split` by it, every other chunk is a part
        self.int64_sizes = self._sizes_with_padding(int64_parts, 8)
        self.int32_sizes = self._sizes_with_padding(int32_parts, 4)
        self.int64_bytes, self.int32_bytes = 8 * sum(self.int64_sizes), 4 * sum(self.int32_sizes)
        table_lens = [len(t) for t in block_tables]
        width = width or max(table_lens)  # default: the longest table
        self.table_shape = (len(block_tables), width)
        self.host = torch.empty(self.int64_bytes + self.int32_bytes + 4 * len(block_tables) * width,
                                dtype=torch.uint8, pin_memory=pin_memory)
        buffer = self.host.numpy()
        for region, parts, sizes, np_dtype in ((buffer[:self.int64_bytes], int64_parts, self.int64_sizes, np.int64),
                                               (buffer[self.int64_bytes:self.int64_bytes + self.int32_bytes],
                                                int32_parts, self.int32_sizes, np.int32)):
            values, start = region.view(np_dtype), 0
            for part, length, padding in zip(parts, sizes[::2], sizes[1::2]):
                values[start:start + length] = np.fromiter(part, dtype=np_dtype, count=length)  # faster than a list
                start += length + padding
        table = buffer[self.int64_bytes + self.int32_bytes:].view(np.int32).reshape(self.table_shape)
        table.fill(-1)
        table[np.arange(width)[None, :] < np.array(table_lens)[:, None]] = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int32, count=sum(table_lens))

    @classmethod
    def _sizes_with_padding(cls, parts: list[list[int]], itemsize: int) -> list[int]:
        multiple = cls.ALIGN_BYTES // itemsize
        return [n for part in parts for n in (len(part), -len(part) % multiple)]

    def to(self, device: torch.device) -> list[torch.Tensor]:
        """The parts, as views of one device copy of the buffer; the table as [rows, width]."""
        data = self.host if device.type == "cpu" else self.host.to(device, non_blocking=True)
        int32_end = self.int64_bytes + self.int32_bytes
        int64 = data[:self.int64_bytes].view(torch.int64).split(self.int64_sizes)[::2]
        int32 = data[self.int64_bytes:int32_end].view(torch.int32).split(self.int32_sizes)[::2]
        return [*int64, *int32, data[int32_end:].view(torch.int32).view(self.table_shape)]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [num_sampled]: rows of the hidden states whose next token is sampled


class SampledTokens:
    """Token ids sampled by a launched step, and the logprob rows it computed (chosen_and_top's three tensors,
    sample rows then prompt rows), on their way to the host: pinned copies and an event on CUDA.
    A constrained step's sampler waits for its masks, which fill on the host while the forward runs: it is passed
    as `sample` (returning the two) and launched by `complete`, so that the engine schedules the next step while
    the masks fill. It must be complete before the next step's forward is launched (that forward reads its tokens);
    tolist completes it too."""

    def __init__(self, sampled: torch.Tensor | None = None, logprobs: tuple[torch.Tensor, ...] | None = None,
                 sample=None):
        self.event = None
        self.host = self.logprobs = None
        # when the tokens were computed: the time their sequences' metrics get. On the CPU the step ran before
        # launch returned, and the host reads it back only after computing the next one (asynchronous scheduling):
        # that read's time would shift every token by a step and make the last gap ~0
        self.ready_time: float | None = None
        self._sample = sample
        if sample is None:
            self._take(sampled, logprobs)

    def complete(self):
        """Launch the deferred sampler, if there is one and it has not run."""
        if self._sample is not None:
            sample, self._sample = self._sample, None
            self._take(*sample())

    def _take(self, sampled: torch.Tensor | None, logprobs: tuple[torch.Tensor, ...] | None):
        self.host, self.logprobs = sampled, logprobs
        if not any(t is not None and t.is_cuda for t in (sampled, *(logprobs or ()))):
            self.ready_time = time.perf_counter()
            return
        self.host, self.logprobs = self._to_host(sampled), logprobs and tuple(map(self._to_host, logprobs))
        self.event = torch.cuda.Event()
        self.event.record()

    @staticmethod
    def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    def tolist(self) -> list[int]:
        self.complete()
        if self.event is not None:
            self.event.synchronize()
            self.ready_time = self.ready_time or time.perf_counter()
        return [] if self.host is None else self.host.tolist()

    def logprob_lists(self) -> tuple[list[list[int]], list[list[float]], list[int]] | None:
        """(token ids, logprobs, chosen ranks) per row; call after tolist (which waits for the copies)."""
        return self.logprobs and tuple(t.tolist() for t in self.logprobs)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A list on the device; through pinned memory on CUDA so the copy is asynchronous."""
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def prepare_step_inputs(plan: StepPlan, device: torch.device, last_sampled: torch.Tensor | None,
                        split_mixed_steps: bool) -> StepInputs:
    """Tensors for one step, packed into one host buffer (pinned on CUDA) and moved in one host-to-device copy;
    block tables are padded with -1 to the step's longest table (a decode graph copies them into its wider static
    table). What the attention kernels read is int32 already, so no conversion kernels follow the copy.
    `last_sampled`: the previous step's sampled tokens on the device, for rows whose input the host has not read
    back yet."""
    cu_seqlens = [0, *itertools.accumulate(plan.query_lens)]
    num_decode_rows = count_decode_rows(plan) if split_mixed_steps else 0
    prefill_cu_seqlens = [n - num_decode_rows for n in cu_seqlens[num_decode_rows:]] if num_decode_rows else []
    packed = PackedInputs(
        int64_parts=[plan.input_ids, plan.positions, plan.slot_mapping, plan.logits_indices,
                     plan.placeholder_rows, plan.placeholder_sources],
        int32_parts=[plan.seq_lens, cu_seqlens, prefill_cu_seqlens],
        block_tables=plan.block_tables, pin_memory=device.type == "cuda")
    (input_ids, positions, slots, logits_indices, rows, sources, seq_lens, cu_seqlens_q, prefill_cu_seqlens_q,
     tables) = packed.to(device)
    if len(plan.placeholder_rows) == len(plan.input_ids):  # every row's token: sampled by the previous step
        torch.index_select(last_sampled, 0, sources, out=input_ids)  # one kernel, no index_put
    elif plan.placeholder_rows:  # tokens the previous step sampled, never read back to the host
        input_ids[rows] = last_sampled[sources]
    md = AttentionMetadata(
        is_decode_only=plan.is_decode_only, slot_mapping=slots, seq_lens=seq_lens, block_tables=tables,
        cu_seqlens_q=cu_seqlens_q, max_query_len=max(plan.query_lens), max_seq_len=max(plan.seq_lens),
        query_lens_cpu=plan.query_lens, seq_lens_cpu=plan.seq_lens)
    if num_decode_rows:
        split_mixed(md, num_decode_rows, prefill_cu_seqlens_q)
    return StepInputs(input_ids, positions, md, logits_indices)


def count_decode_rows(plan: StepPlan) -> int:
    """How many leading rows of a mixed step compute one token (the scheduler puts them first); 0 when the step is
    decode-only or prefill-only."""
    if plan.is_decode_only:
        return 0
    num_rows = len(plan.query_lens)
    return next((i for i, n in enumerate(plan.query_lens) if n != 1), num_rows) % num_rows


def split_mixed(md: AttentionMetadata, num_decode_rows: int, prefill_cu_seqlens_q: torch.Tensor):
    """The prefill part gets its own copies of seq_lens and block_tables: a slice at row d would start at an address
    Triton specializes on (16-byte alignment), so each new d % 4 would compile kernel variants mid-run."""
    d = num_decode_rows
    md.decode_part = AttentionMetadata(
        is_decode_only=True, slot_mapping=md.slot_mapping[:d], seq_lens=md.seq_lens[:d],
        block_tables=md.block_tables[:d], max_seq_len=max(md.seq_lens_cpu[:d]),
        query_lens_cpu=md.query_lens_cpu[:d], seq_lens_cpu=md.seq_lens_cpu[:d])
    md.prefill_part = AttentionMetadata(
        is_decode_only=False, slot_mapping=md.slot_mapping[d:], seq_lens=md.seq_lens[d:].clone(),
        block_tables=md.block_tables[d:].clone(), cu_seqlens_q=prefill_cu_seqlens_q,
        max_query_len=max(md.query_lens_cpu[d:]), max_seq_len=max(md.seq_lens_cpu[d:]),
        query_lens_cpu=md.query_lens_cpu[d:], seq_lens_cpu=md.seq_lens_cpu[d:])
