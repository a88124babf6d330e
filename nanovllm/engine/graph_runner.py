"""The graph runner: the one owner of the CUDA graphs a step may replay and of their buckets. A decode-only step
replays the whole-forward graph of the smallest batch size that holds it (DecodeGraph), a prefill or mixed step of
up to MAX_MIXED_GRAPH_TOKENS tokens the piecewise graphs of the smallest token bucket that holds it
(PiecewiseGraph), and any other step runs the model eagerly. The graphs themselves are engine/cuda_graph.py; the
memory profile sizes the graphs' pool from these buckets (largest_graph_tokens), and the prefill probe times a step
of the largest token bucket."""
import torch

from nanovllm.engine.cuda_graph import DecodeGraph, MixedStepBuffers, PiecewiseGraph
from nanovllm.utils.context import reset_context, set_context
from nanovllm.utils.switches import SWITCHES

# the token buckets of the piecewise graphs (padding: at most 25% from 256 up); a step of more tokens is GPU-bound
# and runs eagerly
MIXED_GRAPH_TOKENS = (16, 32, 64, 128, 192) + tuple(range(256, 2049, 256))
MAX_MIXED_GRAPH_TOKENS = MIXED_GRAPH_TOKENS[-1]


def decode_batch_sizes(config) -> list[int]:
    """1, 2, 4, 8, then every 16 up to 112, then every 32 from 128, below min(max_num_seqs,
    max_cudagraph_capture_size), which is always the last; a decode step of more rows runs eagerly."""
    max_batch_size = min(config.max_num_seqs, config.max_cudagraph_capture_size)
    sizes = [1, 2, 4, 8] + list(range(16, 128, 16)) + list(range(128, max_batch_size, 32))
    return [b for b in sizes if b < max_batch_size] + [max_batch_size]


def mixed_token_buckets(config) -> list[int]:
    """MIXED_GRAPH_TOKENS below max_num_batched_tokens, ending at the smaller of the two limits (no step is larger),
    each bucket once (a bucket listed twice would be captured twice at start-up)."""
    largest = min(config.max_num_batched_tokens, MAX_MIXED_GRAPH_TOKENS)
    return [n for n in MIXED_GRAPH_TOKENS if n < largest] + [largest]


class GraphRunner:
    """The graphs of one rank's model, by bucket, and the forward that picks one (or none) for a step.

    decode_graphs: batch size -> DecodeGraph; mixed_graphs: token bucket -> PiecewiseGraph, in ascending order. Both
    are empty until capture() and after close(). All graphs of a rank share one memory pool: they never run at once.
    """

    def __init__(self, model, config, device: torch.device, dtype: torch.dtype, backend_name: str):
        self.model, self.config, self.device, self.dtype = model, config, device, dtype
        # graphs are captured on CUDA only, and not for the torch backend (the reference) or with enforce_eager
        self.captures_on_gpu = device.type == "cuda" and not config.enforce_eager and backend_name != "torch"
        self.decode_batch_sizes = decode_batch_sizes(config)
        self.mixed_token_buckets = mixed_token_buckets(config)
        self.decode_graphs: dict[int, DecodeGraph] = {}
        self.mixed_graphs: dict[int, PiecewiseGraph] = {}

    def largest_graph_tokens(self) -> int:
        """The most tokens one captured graph runs: the graphs' shared pool holds that step's intermediates, which
        memory_profile.py reserves before the KV cache is sized; 0 where nothing will be captured."""
        if not self.captures_on_gpu:
            return 0
        piecewise = 0 if SWITCHES.piecewise_graphs == "0" else self.mixed_token_buckets[-1]
        return max(self.decode_batch_sizes[-1], piecewise)

    def capture(self) -> int:
        """Capture decode forwards for every decode batch size and piecewise prefill/mixed forwards for every token
        bucket (NANOVLLM_PIECEWISE_GRAPHS=0: none); returns the torch memory the captures reserved. On CPU,
        NANOVLLM_DECODE_GRAPHS=1 and NANOVLLM_PIECEWISE_GRAPHS=1 build the same graphs without capturing them: their
        static buffers, run eagerly (the CPU tests). Call after the KV cache is allocated (the graphs read it)."""
        piecewise = SWITCHES.piecewise_graphs
        if not self.captures_on_gpu:
            if self.device.type == "cpu" and SWITCHES.decode_graphs_on_cpu:
                self._build_decode_graphs(capture=False)
            if piecewise == "1" and self.device.type == "cpu":
                self._build_mixed_graphs(None, capture=False)
            return 0
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = self._build_decode_graphs()
        if piecewise != "0":
            self._build_mixed_graphs(pool)
        return torch.cuda.memory_reserved(self.device) - reserved_before

    def _build_decode_graphs(self, capture: bool = True):
        """Largest first, so the smaller graphs fit in the pool the largest made; returns that pool."""
        block_size = self.config.kvcache_block_size
        width = (self.config.max_model_len + block_size - 1) // block_size
        pool = None
        for size in reversed(self.decode_batch_sizes):
            graph = DecodeGraph(self.model, size, width, self.device, pool, capture)
            pool = graph.pool
            self.decode_graphs[size] = graph
        return pool

    def _build_mixed_graphs(self, pool, capture: bool = True):
        """Piecewise graphs for prefill and mixed steps of up to the largest token bucket (larger steps are
        GPU-bound and run eagerly), sharing one set of static buffers sized for that bucket."""
        sizes = self.mixed_token_buckets
        attn = self.model.model.layers[0].self_attn
        buffers = MixedStepBuffers(sizes[-1], self.config.hf_config.hidden_size, attn.qkv_proj.output_size,
                                   attn.num_heads * attn.head_dim, self.dtype, self.device)
        for size in reversed(sizes):
            graph = PiecewiseGraph(self.model, size, buffers, pool, capture)
            pool = graph.pool if capture else None
            self.mixed_graphs[size] = graph
        self.mixed_graphs = dict(sorted(self.mixed_graphs.items()))

    def decode_graph_for(self, plan) -> DecodeGraph | None:
        if not self.decode_graphs or not plan.is_decode_only:
            return None
        batch = len(plan.query_lens)
        for size in self.decode_batch_sizes:
            if size >= batch:
                return self.decode_graphs[size]
        return None

    def mixed_graph_for(self, plan) -> PiecewiseGraph | None:
        for size, graph in self.mixed_graphs.items():  # ascending
            if size >= plan.num_tokens:
                return graph
        return None

    def forward(self, plan, inputs) -> torch.Tensor:
        """Hidden states of the step's tokens (inputs: prepare_step_inputs of plan): a decode graph's replay, the
        piecewise graphs' (attention runs eagerly between them and reads the context set here), or the model run
        eagerly."""
        graph = self.decode_graph_for(plan)
        if graph is not None:
            return graph.replay(inputs)
        mixed_graph = self.mixed_graph_for(plan)
        set_context(inputs.metadata)
        try:
            if mixed_graph is not None:
                return mixed_graph.replay(inputs)
            return self.model(inputs.input_ids, inputs.positions)
        finally:
            reset_context()

    def close(self):
        """Drop the graphs and the model, so that closing the runner frees their memory."""
        self.decode_graphs.clear()
        self.mixed_graphs.clear()
        self.model = None
