"""A captured decode forward for one padded batch size."""
import torch

from nanovllm.utils.context import AttentionMetadata, reset_context, set_context


class DecodeGraph:
    """Static input buffers plus a CUDA graph of `model(input_ids, positions)` for `batch_size` decode rows.

    Padding rows write to slot -1 (skipped by the KV store) and attend over a context of length 0 is avoided by
    giving them seq_len 1 on block 0; their outputs are discarded.
    NOTE: `width` (block-table columns) is fixed at capture; the runner pads every table to it.
    """

    def __init__(self, model, batch_size: int, width: int, device: torch.device, pool=None):
        self.batch_size, self.width = batch_size, width
        self.input_ids = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((batch_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(batch_size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(batch_size, width, dtype=torch.int32, device=device)
        self.metadata = AttentionMetadata(True, self.slot_mapping, self.seq_lens, self.block_tables, max_seq_len=1)
        set_context(self.metadata)
        try:
            model(self.input_ids, self.positions)  # warm-up: compiles kernels outside the capture
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool):
                self.hidden = model(self.input_ids, self.positions)
        finally:
            reset_context()
        self.pool = self.graph.pool()

    def replay(self, inputs) -> torch.Tensor:
        n = inputs.input_ids.size(0)
        md = inputs.metadata
        self.input_ids[:n] = inputs.input_ids
        self.positions[:n] = inputs.positions
        self.slot_mapping.fill_(-1)
        self.slot_mapping[:n] = md.slot_mapping
        self.seq_lens.fill_(1)
        self.seq_lens[:n] = md.seq_lens
        self.block_tables[:n] = md.block_tables.clamp(min=0)
        self.graph.replay()
        return self.hidden[:n]
