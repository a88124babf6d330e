"""Moves whole KV blocks between the GPU cache and the host cache on dedicated CUDA streams.

Ordering rules (each enforced by an event wait, never by a device-wide sync):
1. A swap-out reads a block only after the last forward that writes it. With asynchronous scheduling a step's
   copies are issued while the step before (the step in flight) is still queued or running; the blocks that step
   writes (`SchedulerOutput.written_gpu_block_ids`, named once by the scheduler and carried by the plan) are
   copied after its forward, all others as soon as the forwards before it are done, so they overlap it. "The step
   in flight" counts steps, not forwards: a step without a forward (only copies) writes nothing, and the forwards
   before it are all done before the next step's stale copies start (`InFlightStep`).
2. Compute that writes a GPU block waits for any swap-out still reading that block (`wait_before_forward`).
   Each run of a swap-out records its own event, and the scheduler orders a victim's blocks the way they are
   handed out again, so the next owner usually waits for one block's copy, not for the victim's whole KV.
3. Compute waits for any swap-in still filling a block that the step reads or writes. A resumed sequence (or one
   whose prefix comes from the host) joins the batch at the earliest one step after its copies were issued, and
   while other sequences can run, only once `get_finished` has reported its load (OffloadManager.complete), so
   the copy overlaps forwards instead of stalling one.
4. The two directions are ordered against each other: a GPU block released by a swap-out can be the next
   swap-in's destination, and a swap-in may read a host block whose store is still being written (a sequence
   swapped out and straight back in).
Host blocks need no rule here: the manager holds every host block a copy reads or writes until `get_finished`
reports that copy, so no other copy, disk read or disk write can touch it meanwhile.
`get_finished` is the one completion API: it names the transfer ids (one per direction per step) that landed.
On a CPU-only machine the copies are plain synchronous memcpys and all of their time counts as exposed.
"""
import itertools
import time

import torch

from nanovllm_offload.transfer_report import TransferReport


def contiguous_runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """[(src, dst)] -> [(src_start, dst_start, length)], merging pairs where both ids advance by one."""
    runs = []
    for src, dst in pairs:
        if runs and src == runs[-1][0] + runs[-1][2] and dst == runs[-1][1] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def split_by_last_forward(pairs: list[tuple[int, int]], written: set[int] | None):
    """Swap-out pairs -> (stale, hot): hot ones read a block the step in flight writes and must wait for its
    forward; stale ones only for the forwards before. `written` None (nothing to wait for short of all compute
    issued so far): all are hot."""
    if written is None:
        return [], pairs
    return [p for p in pairs if p[0] not in written], [p for p in pairs if p[0] in written]


class InFlightStep:
    """Rule 1's bookkeeping, kept per step (a step without a forward too): the blocks the step in flight writes, and
    an event that every forward issued before it has passed. `step_issued` starts a step (before its copies),
    `forward_issued` records its forward; the events are CUDA events on the copy engine, stand-ins in tests.
    NOTE: the written blocks come from the plan of a step that was launched, so a step scheduled but never launched
          (one that raised) cannot make a copy skip a forward that writes its block."""

    def __init__(self):
        self.last_forward = None  # event after the latest forward
        self.forwards_before = None  # event after every forward issued before the step in flight (None: none)
        self.written: list[int] = []  # gpu blocks the step in flight writes
        self._forwards_before_this_step = None
        self._this_step_written: list[int] = []

    def step_issued(self):
        """A new step's copies are about to go out: the step before it becomes the step in flight."""
        self.forwards_before, self._forwards_before_this_step = self._forwards_before_this_step, self.last_forward
        self.written, self._this_step_written = self._this_step_written, []

    def forward_issued(self, event, written_gpu_block_ids: list[int]):
        self.last_forward = event
        self._this_step_written = written_gpu_block_ids

    def split(self, pairs: list[tuple[int, int]]):
        """Swap-out pairs -> (stale, hot) for the copies of the step just issued (see split_by_last_forward)."""
        written = None if self.forwards_before is None else set(self.written)
        return split_by_last_forward(pairs, written)


def events_to_wait(new_gpu_block_ids: list[int], block_tables: list[list[int]], reading: dict, arriving: dict) -> list:
    """The copy events a forward must wait for: swap-outs still reading a block it is handed to write (rule 2) and
    swap-ins still filling a block of its block tables (rule 3). Each event once, unfinished ones only."""
    events = {}
    for block_id in new_gpu_block_ids:
        if block_id in reading:
            events[id(reading[block_id])] = reading[block_id]
    if arriving:
        used = set(itertools.chain.from_iterable(block_tables))
        for block_id, event in arriving.items():
            if block_id in used:
                events[id(event)] = event
    return [e for e in events.values() if not e.query()]


class CopyEngine:
    """Owns the copy streams and the transfers in flight; drained once per step by `poll`."""

    def __init__(self, gpu_kv: torch.Tensor, host_kv: torch.Tensor, block_size: int, reports_completions: bool = True):
        self.gpu_kv, self.host_kv, self.block_size = gpu_kv, host_kv, block_size
        # rank 0's engine reports to the manager; the other ranks' would only pile up transfers nobody asks about
        self.reports_completions = reports_completions
        self.in_flight: list[tuple[int, "torch.cuda.Event | None"]] = []  # (transfer id, its last copy's event)
        self.block_bytes = gpu_kv[0].numel() * gpu_kv.element_size()
        self.is_cuda = gpu_kv.is_cuda
        if self.is_cuda:
            self.out_stream, self.in_stream = torch.cuda.Stream(), torch.cuda.Stream()
        self.reading_gpu_blocks: dict[int, torch.cuda.Event] = {}  # swap-out sources still being read
        self.arriving_gpu_blocks: dict[int, torch.cuda.Event] = {}  # swap-in destinations still being filled
        self.last_out_event = self.last_in_event = None
        self.in_flight_step = InFlightStep()  # rule 1
        self.pending_copies: list[tuple[object, object, int]] = []  # (start, end, bytes): copies not yet timed
        self.pending_waits: list[tuple[object, object]] = []  # compute-stream stalls not yet timed
        self.bytes_out = self.bytes_in = 0
        self.copy_seconds = self.exposed_seconds = 0.0
        self.recent_copies: list[tuple[int, float]] = []  # (bytes, seconds) timed since the last get_finished

    # --- issuing copies
    def issue_step_copies(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]],
                          new_gpu_block_ids: list[int], block_tables: list[list[int]], store_id: int = -1,
                          load_id: int = -1):
        """A step's copies, before its forward: retire finished ones, issue the swap-outs (transfer `store_id`),
        make the forward wait for what it must (rules 2 and 3), then issue the swap-ins (transfer `load_id`). Rule 2
        applies to the blocks the forward writes: a swap-in's destinations are written by the copy, which is
        ordered after the swap-outs (rule 4)."""
        self.poll()
        self.in_flight_step.step_issued()
        self.swap_out(swap_out)
        if swap_out and self.reports_completions:
            self.in_flight.append((store_id, self.last_out_event))  # the out stream runs the step's runs in order
        swap_in_dst = {gpu_block_id for _, gpu_block_id in swap_in}
        self.wait_before_forward([b for b in new_gpu_block_ids if b not in swap_in_dst], block_tables)
        self.swap_in(swap_in)
        if swap_in and self.reports_completions:
            self.in_flight.append((load_id, self.last_in_event))

    def forward_issued(self, written_gpu_block_ids: list[int]):
        """Call after each forward is enqueued on the compute stream, with the blocks it writes (the plan's
        `written_gpu_block_ids`; rule 1). KV written on the compute stream by anything else would not be waited for
        by the swap-outs of blocks the step in flight does not write."""
        if not self.is_cuda:
            return
        event = torch.cuda.Event()
        event.record()
        self.in_flight_step.forward_issued(event, written_gpu_block_ids)

    def swap_out(self, pairs: list[tuple[int, int]]):
        """pairs: (gpu_block_id, cpu_block_id), in the order the blocks are handed out again."""
        if not pairs:
            return
        self.bytes_out += len(pairs) * self.block_bytes
        # on CPU forward_issued records nothing, so every pair is "hot": one synchronous copy
        stale, hot = self.in_flight_step.split(pairs)
        self._copy(stale, self.gpu_kv, self.host_kv, "out", after=self.in_flight_step.forwards_before)
        self._copy(hot, self.gpu_kv, self.host_kv, "out")

    def swap_in(self, pairs: list[tuple[int, int]]):
        """pairs: (cpu_block_id, gpu_block_id)."""
        if not pairs:
            return
        self.bytes_in += len(pairs) * self.block_bytes
        event = self._copy(pairs, self.host_kv, self.gpu_kv, "in")
        if event is not None:
            for _, gpu_block_id in pairs:
                self.arriving_gpu_blocks[gpu_block_id] = event

    def _copy(self, pairs, src: torch.Tensor, dst: torch.Tensor, direction: str, after=None):
        """Copy on the direction's stream once `after` (an event on the compute stream; default: all compute issued
        so far) is done. Returns the event that ends the copy (None on CPU or when there is nothing to copy)."""
        if not pairs:
            return None
        num_bytes = len(pairs) * self.block_bytes
        if not self.is_cuda:
            start = time.perf_counter()
            self._copy_runs(pairs, src, dst)
            seconds = time.perf_counter() - start
            self.copy_seconds += seconds
            self.exposed_seconds += seconds
            self.recent_copies.append((num_bytes, seconds))
            return None
        stream, other = (self.out_stream, self.last_in_event) if direction == "out" else (self.in_stream,
                                                                                          self.last_out_event)
        if after is None:
            stream.wait_stream(torch.cuda.current_stream())  # rule 1 (and: earlier compute done with these blocks)
        else:
            stream.wait_event(after)
        if other is not None:
            stream.wait_event(other)  # rule 4
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record()
            for run in contiguous_runs(pairs):
                self._copy_run(run, src, dst)
                if direction == "out":  # rule 2 waits for the runs holding the blocks it reuses, not the batch
                    read = torch.cuda.Event()
                    read.record()
                    for gpu_block_id in range(run[0], run[0] + run[2]):
                        self.reading_gpu_blocks[gpu_block_id] = read
            end.record()
        self.pending_copies.append((start, end, num_bytes))
        if direction == "out":
            self.last_out_event = end
        else:
            self.last_in_event = end
        return end

    @staticmethod
    def _copy_runs(pairs, src: torch.Tensor, dst: torch.Tensor):
        for run in contiguous_runs(pairs):
            CopyEngine._copy_run(run, src, dst)

    @staticmethod
    def _copy_run(run: tuple[int, int, int], src: torch.Tensor, dst: torch.Tensor):
        s, d, n = run
        dst[d:d + n].copy_(src[s:s + n], non_blocking=True)

    # --- ordering against compute
    def wait_before_forward(self, new_gpu_block_ids: list[int], block_tables: list[list[int]]):
        """Make the compute stream wait for swap-ins still filling blocks of this step's block tables (rule 3) and
        for swap-outs still reading blocks that this step hands out to the forward (rule 2). Call before issuing
        this step's swap-ins."""
        if not self.is_cuda:
            return
        self.arriving_gpu_blocks = {b: e for b, e in self.arriving_gpu_blocks.items() if not e.query()}
        pending = events_to_wait(new_gpu_block_ids, block_tables, self.reading_gpu_blocks, self.arriving_gpu_blocks)
        if not pending:
            return
        compute = torch.cuda.current_stream()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(compute)
        for event in pending:
            compute.wait_event(event)
        end.record(compute)
        self.pending_waits.append((start, end))

    # --- once per step
    def poll(self):
        """Retire finished transfers: time them and forget the blocks they no longer read."""
        if not self.is_cuda:
            return
        still = []
        for start, end, num_bytes in self.pending_copies:
            if end.query():
                seconds = start.elapsed_time(end) / 1e3
                self.copy_seconds += seconds
                self.recent_copies.append((num_bytes, seconds))
            else:
                still.append((start, end, num_bytes))
        self.pending_copies = still
        waits = []
        for start, end in self.pending_waits:
            if end.query():
                self.exposed_seconds += start.elapsed_time(end) / 1e3
            else:
                waits.append((start, end))
        self.pending_waits = waits
        self.reading_gpu_blocks = {b: e for b, e in self.reading_gpu_blocks.items() if not e.query()}

    def get_finished(self) -> TransferReport:
        """The transfers that landed since the last call, by id, with the copies that `poll` (at each step's issue)
        timed meanwhile. Never blocks the host; on the CPU every copy has landed when it is issued."""
        finished, still = [], []
        for transfer_id, event in self.in_flight:  # each event queried once: one that lands meanwhile is not lost
            if event is None or event.query():
                finished.append(transfer_id)
            else:
                still.append((transfer_id, event))
        self.in_flight = still
        recent, self.recent_copies = self.recent_copies, []
        return TransferReport(finished, recent, self.copy_seconds, self.exposed_seconds)

    def synchronize(self):
        if self.is_cuda:
            self.out_stream.synchronize()
            self.in_stream.synchronize()
            torch.cuda.current_stream().synchronize()
        self.poll()

    def close(self):
        """Finish every copy, then let go of both caches (a closed engine's hooks may still hold this object)."""
        self.synchronize()
        self.gpu_kv = self.host_kv = None
