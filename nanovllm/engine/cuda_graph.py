"""CUDA graphs: whole decode forwards per padded batch size, and piecewise prefill/mixed forwards per token bucket.
Which sizes and buckets exist, and which graph a step replays, is the graph runner's (engine/graph_runner.py)."""
import torch

from nanovllm.utils.context import AttentionMetadata, reset_context, set_context


class DecodeGraph:
    """Static input buffers plus a CUDA graph of `model(input_ids, positions)` for `batch_size` decode rows.

    Padding rows write to slot -1 (skipped by the KV store) and attend over a context of length 0 is avoided by
    giving them seq_len 1 on block 0; their outputs are discarded.
    `width` (block-table columns, max_model_len's blocks) is fixed at capture. A replay copies only the step's own
    columns: the kernels read a row's table only below its seq_len, so the columns past them (left from earlier
    steps) are never read, and the host does not build and send max_model_len-wide tables every step.
    """

    def __init__(self, model, batch_size: int, width: int, device: torch.device, pool=None, capture: bool = True):
        self.batch_size, self.width, self.model = batch_size, width, model
        self.input_ids = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((batch_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(batch_size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(batch_size, width, dtype=torch.int32, device=device)
        self.metadata = AttentionMetadata(True, self.slot_mapping, self.seq_lens, self.block_tables, max_seq_len=1)
        self.graph = self.pool = None
        if not capture:  # CPU tests: the same static buffers, the forward run eagerly on them
            return
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
        self.block_tables[:n, :md.block_tables.size(1)] = md.block_tables.clamp(min=0)
        if self.graph is not None:
            self.graph.replay()
            return self.hidden[:n]
        set_context(self.metadata)
        try:
            return self.model(self.input_ids, self.positions)[:n]
        finally:
            reset_context()


class MixedStepBuffers:
    """Static buffers that piecewise graphs of every token bucket share (views of their first rows): what flows
    between a captured piece and the attention that runs eagerly after it. One set, sized for the largest bucket,
    so that the graphs' own intermediates can be freed after capture and the captures share one memory pool."""

    def __init__(self, max_num_tokens: int, hidden_size: int, qkv_size: int, attn_size: int, dtype, device):
        self.input_ids = torch.zeros(max_num_tokens, dtype=torch.int64, device=device)
        self.qkv = torch.zeros(max_num_tokens, qkv_size, dtype=dtype, device=device)  # a piece's qkv projection
        self.attn_out = torch.zeros(max_num_tokens, attn_size, dtype=dtype, device=device)  # eager attention's
        self.residual = torch.zeros(max_num_tokens, hidden_size, dtype=dtype, device=device)  # the stream, in place
        self.hidden = torch.zeros(max_num_tokens, hidden_size, dtype=dtype, device=device)  # the final norm's


class PiecewiseGraph:
    """A prefill or mixed forward of up to `num_tokens` tokens: CUDA graphs of everything between two attention
    calls (norms, projections, MLP; L + 1 pieces for L layers), with each layer's attention run eagerly in between.

    Why: such steps run eagerly otherwise, and on an H200 their host time (every GEMM, every compiled norm is a
    Python call) is 2-3x their GPU time. Attention stays outside because its kernels' grids depend on the step's
    sequences, which a graph would freeze. Padding rows (past the step's tokens) compute garbage that no real row
    reads: every op outside attention works row by row, and attention only reads and writes the real rows.
    Replay order is capture order and no piece's intermediates outlive it, so all pieces of all buckets share one
    memory pool (PyTorch allows this for graphs replayed in the order they were captured).
    """

    def __init__(self, model, num_tokens: int, buffers: MixedStepBuffers, pool=None, capture: bool = True):
        self.num_tokens = n = num_tokens
        self.buffers, self.layers = buffers, model.model.layers
        decoder, layers, b = model.model, self.layers, buffers

        def first():  # embedding + layer 0 up to its qkv projection
            b.residual[:n].copy_(decoder.embed_tokens(b.input_ids[:n]))
            b.qkv[:n].copy_(layers[0].pre_attention(b.residual[:n]))

        def middle(i):  # layer i - 1 after attention + layer i up to its qkv projection
            def piece():
                layers[i - 1].post_attention(b.attn_out[:n], b.residual[:n])  # adds to b.residual in place
                b.qkv[:n].copy_(layers[i].pre_attention(b.residual[:n]))
            return piece

        def last():  # the last layer after attention + the final norm
            layers[-1].post_attention(b.attn_out[:n], b.residual[:n])
            b.hidden[:n].copy_(decoder.norm(b.residual[:n]))

        self.pieces = [first] + [middle(i) for i in range(1, len(layers))] + [last]
        self.run = self.pieces  # what replay calls: the graphs' replays once captured
        if not capture:  # CPU tests: the same pieces and buffers, called eagerly
            return
        for piece in self.pieces:
            piece()  # warm-up: torch.compile traces this shape outside the capture
        self.graphs = []
        for piece in self.pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                piece()
            pool = graph.pool()
            self.graphs.append(graph)
        self.run = [graph.replay for graph in self.graphs]
        self.pool = pool

    def replay(self, inputs) -> torch.Tensor:
        """Hidden states of the step's tokens; the runner has set the attention metadata (context)."""
        n, b = inputs.input_ids.size(0), self.buffers
        b.input_ids[:n] = inputs.input_ids
        self.run[0]()
        for i, layer in enumerate(self.layers):
            layer.self_attn.attend(b.qkv[:n], inputs.positions, out=b.attn_out[:n])
            self.run[i + 1]()
        return b.hidden[:n]
