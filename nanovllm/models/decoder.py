"""The Llama-style decoder that serves Qwen3, Qwen2 and the Llama family.

Families differ only in: q/k RMSNorm before rope (Qwen3), bias on q/k/v (Qwen2 always, Llama/Qwen3 when
`attention_bias`), bias on the MLP (Llama `mlp_bias`), and whether the LM head is tied to the embedding.
"""
import torch
from torch import nn

from nanovllm.config import head_dim_of, rope_parameters
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.layernorm import RMSNorm
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.rotary_embedding import RotaryEmbedding, qk_norm_rope
from nanovllm.utils.distributed import tp_size
from nanovllm.utils.quant_spec import QuantSpec


class DecoderAttention(nn.Module):
    def __init__(self, hf, family: str, rotary_emb: RotaryEmbedding, quant_spec: QuantSpec | None, prefix: str):
        super().__init__()
        tp = tp_size()
        self.head_dim = head_dim_of(hf)
        num_kv_heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
        self.num_heads, self.num_kv_heads = hf.num_attention_heads // tp, num_kv_heads // tp
        attention_bias = getattr(hf, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(hf.hidden_size, self.head_dim, hf.num_attention_heads, num_kv_heads,
                                          bias=attention_bias or family == "qwen2", quant_spec=quant_spec,
                                          prefix=f"{prefix}.qkv_proj",
                                          checkpoint_names=[f"{prefix}.{p}_proj" for p in "qkv"])
        self.o_proj = RowParallelLinear(hf.num_attention_heads * self.head_dim, hf.hidden_size, bias=attention_bias,
                                        quant_spec=quant_spec, prefix=f"{prefix}.o_proj")
        self.rotary_emb = rotary_emb  # the model's one table, shared by every layer
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim ** -0.5, self.num_kv_heads)
        self.qk_norm = family == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, hf.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, hf.rms_norm_eps)

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """From the qkv projection's output to attention's [T, num_heads * head_dim] (into `out` when given): the
        part of a layer that reads the paged KV cache, which piecewise CUDA graphs leave outside."""
        return self.attend_roped(*self.rope(qkv, positions), out=out)

    def rope(self, qkv: torch.Tensor, positions: torch.Tensor):
        """qkv [T, (nh + 2 * nkv) * hd] -> q [T, nh, hd], k and v [T, nkv, hd], after the q/k norm and rope; the
        fused path stores k and v in the cache in the same kernel and returns (q, None, None). Nothing returned is
        a view of qkv, so an eager forward frees the projection's output (the largest tensor beside attention's)
        before attention runs."""
        if self.attn.fused_rope_store:
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm else (None, None, 0.0)
            return self.attn.rope_store(qkv, positions, self.rotary_emb.cos_sin_cache, *norm), None, None
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # [T, nh, hd]
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # [T, nkv, hd]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk_norm_rope(positions, q, k, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
                                self.rotary_emb.cos_sin_cache)
        else:
            q, k = self.rotary_emb(positions, q, k)
        return q, k, v.contiguous()  # a copy of v (nkv * hd values a token) frees qkv ((nh + 2 * nkv) * hd)

    def attend_roped(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of rope's (q, k, v): [T, num_heads * head_dim], into `out` when given."""
        out = out.view(-1, self.num_heads, self.head_dim) if out is not None else None
        if self.attn.fused_rope_store:  # k and v are in the cache
            return self.attn.attend_stored(q, out).flatten(1)
        return self.attn(q, k, v, out=out).flatten(1)


class DecoderMLP(nn.Module):
    def __init__(self, hf, quant_spec: QuantSpec | None, prefix: str):
        super().__init__()
        bias = getattr(hf, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            hf.hidden_size, [hf.intermediate_size] * 2, bias=bias, quant_spec=quant_spec,
            prefix=f"{prefix}.gate_up_proj", checkpoint_names=[f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        self.down_proj = RowParallelLinear(hf.intermediate_size, hf.hidden_size, bias=bias, quant_spec=quant_spec,
                                           prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))




class DecoderLayer(nn.Module):
    """One pre-norm layer. The residual stream is one [T, hidden] tensor that each layer adds to in place: o_proj
    and down_proj write `residual + x @ W.T` straight into it (RowParallelLinear with `residual`, cuBLAS's beta = 1),
    so the residual adds cost no kernel of their own and the norms only read the stream."""

    def __init__(self, hf, family: str, rotary_emb: RotaryEmbedding, quant_spec: QuantSpec | None, prefix: str):
        super().__init__()
        self.self_attn = DecoderAttention(hf, family, rotary_emb, quant_spec, f"{prefix}.self_attn")
        self.mlp = DecoderMLP(hf, quant_spec, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)
        self.mlp_chunk_tokens: int | None = None  # DecoderForCausalLM's (Config.mlp_chunk_tokens)

    def forward(self, positions, residual):
        """The eager layer: each intermediate is freed as soon as it is read, so that a large step holds at most
        the residual stream and one stage's tensors (the memory profile sizes the KV around this step)."""
        attn = self.self_attn
        q, k, v = attn.rope(self.pre_attention(residual), positions)  # the qkv projection's output dies here
        attn_out = attn.attend_roped(q, k, v)
        del q, k, v
        residual = attn.o_proj(attn_out, residual)
        del attn_out  # freed before the MLP, whose intermediates are the step's largest
        return self.add_mlp(residual)

    # the two halves around attention (piecewise CUDA graphs capture them, engine/cuda_graph.py)
    def pre_attention(self, residual):
        return self.self_attn.qkv_proj(self.input_layernorm(residual))

    def post_attention(self, attn_out, residual):
        """Adds the attention block's output, then the MLP's, to `residual` in place; returns it."""
        return self.add_mlp(self.self_attn.o_proj(attn_out, residual))

    def add_mlp(self, residual):
        """Adds the MLP's output to `residual` in place, mlp_chunk_tokens rows at a time (Config's option; None:
        at once); returns it. Every op of the MLP works row by row, so a slice's rows are those of the whole step
        (the GEMMs' rounding aside)."""
        num_tokens, chunk = residual.size(0), self.mlp_chunk_tokens
        if chunk is None or num_tokens <= chunk:
            return self._add_mlp_rows(residual)
        for start in range(0, num_tokens, chunk):
            self._add_mlp_rows(residual[start:start + chunk])  # contiguous rows: a view, written in place
        return residual

    def _add_mlp_rows(self, residual):
        mlp = self.mlp
        return mlp.down_proj(mlp.act_fn(mlp.gate_up_proj(self.post_attention_layernorm(residual))), residual)


class DecoderModel(nn.Module):
    def __init__(self, hf, family: str, quant_spec: QuantSpec | None = None, int8_vocab: bool = False,
                 embedding_on_host: bool = False):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(hf.vocab_size, hf.hidden_size, int8_vocab, embedding_on_host)
        # one cos/sin table for all layers: a copy per layer cost 28 x 20 MiB (0.55 GiB) at Qwen3's 40,960
        # positions, memory that the KV of an 8 GiB card went without
        rotary_emb = RotaryEmbedding(head_dim_of(hf), hf.max_position_embeddings, rope_parameters(hf)["rope_theta"])
        self.layers = nn.ModuleList(DecoderLayer(hf, family, rotary_emb, quant_spec, f"model.layers.{i}")
                                    for i in range(hf.num_hidden_layers))
        self.norm = RMSNorm(hf.hidden_size, hf.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        residual = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: the layers add to it in place
        for layer in self.layers:
            residual = layer(positions, residual)
        return self.norm(residual)


class DecoderForCausalLM(nn.Module):
    # Hugging Face weight name -> (our packed parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf, family: str, quant_spec: QuantSpec | None = None, quantize_lm_head: str | None = None,
                 mlp_chunk_tokens: int | None = None, embedding_on_host: bool = False):
        super().__init__()
        int8_vocab = quantize_lm_head == "int8"  # the LM head and the input embedding as int8 (embed_head.py)
        self.model = DecoderModel(hf, family, quant_spec, int8_vocab, embedding_on_host)
        for layer in self.model.layers:
            layer.mlp_chunk_tokens = mlp_chunk_tokens
        self.quant_spec = quant_spec  # None: unquantized; the loader asks it which checkpoint tensors no layer reads
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size, int8_vocab)
        self.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def process_weights_after_loading(self):
        """Once the weights are in: the vocabulary weights to int8 when asked, a host embedding pinned; a tied head
        shares the embedding's."""
        embed = self.model.embed_tokens
        embed.quantize_weight()
        embed.pin_host_table()
        if self.tie_word_embeddings:
            self.lm_head.weight, self.lm_head.scales = embed.weight, embed.scales
        else:
            self.lm_head.quantize_weight()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)
