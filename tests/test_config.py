"""Config defaults that depend on other options, and the errors for bad values (no model runs here)."""
import pytest

from nanovllm.config import Config


def test_block_size_default_is_64_without_flash_attn(qwen3_dir):
    assert Config(qwen3_dir, device="cpu").kvcache_block_size == 64
    assert Config(qwen3_dir, attention_backend="flash").kvcache_block_size == 256  # flash-attn's paged KV
    assert Config(qwen3_dir, kvcache_block_size=16).kvcache_block_size == 16


def test_bad_block_size_names_the_option(qwen3_dir):
    with pytest.raises(ValueError, match="kvcache_block_size=48 must be a power of two"):
        Config(qwen3_dir, kvcache_block_size=48)


def test_bad_capture_size_names_the_option(qwen3_dir):
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=0 must be an int >= 1"):
        Config(qwen3_dir, max_cudagraph_capture_size=0)


def test_async_scheduling_defaults_on_only_without_tensor_parallelism(qwen3_dir):
    assert Config(qwen3_dir).async_scheduling is True
    assert Config(qwen3_dir, tensor_parallel_size=2).async_scheduling is False
    assert Config(qwen3_dir, async_scheduling=False).async_scheduling is False


@pytest.mark.parametrize("capability, checkpoint, want", [
    ((8, 9), "bfloat16", "bfloat16"),  # RTX 40-series: the checkpoint's dtype
    ((7, 5), "bfloat16", "float16"),  # T4 / RTX 20-series: no bfloat16 arithmetic
    ((7, 5), "float16", "float16"),
    ((7, 5), "float32", "float16"),  # a float32 checkpoint runs in a half type on CUDA
    ((9, 0), "float32", "bfloat16"),
])
def test_auto_dtype_on_cuda_follows_the_gpu(monkeypatch, capability, checkpoint, want):
    import torch
    from transformers import Qwen3Config

    from nanovllm.engine.device import resolve_dtype
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    hf = Qwen3Config(dtype=checkpoint)
    assert resolve_dtype("auto", hf, torch.device("cuda", 0)) == getattr(torch, want)
    assert resolve_dtype("auto", hf, torch.device("cpu")) == torch.float32


def test_bfloat16_on_a_gpu_without_it_names_the_option(monkeypatch):
    import torch
    from transformers import Qwen3Config

    from nanovllm.engine.device import resolve_dtype
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match=r"dtype='bfloat16': Tesla T4 \(compute capability 7\.5\).*dtype='float16'"):
        resolve_dtype("bfloat16", Qwen3Config(), torch.device("cuda", 0))
    assert resolve_dtype("float16", Qwen3Config(), torch.device("cuda", 0)) == torch.float16


def test_a_sliding_window_shorter_than_max_model_len_is_refused(tmp_path):
    """Mistral-7B-v0.1 attends over the last 4,096 tokens; the engine attends over all of them, which is the same
    only while contexts fit in the window."""
    from transformers import MistralConfig
    cfg = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=256, sliding_window=64)
    cfg.architectures = ["MistralForCausalLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="sliding window of 64 tokens.*max_model_len <= 64"):
        Config(str(tmp_path))  # max_model_len defaults to max_position_embeddings (256)
    assert Config(str(tmp_path), max_model_len=64).max_model_len == 64
    cfg.sliding_window = None  # Mistral v0.2 and later
    cfg.save_pretrained(tmp_path)
    assert Config(str(tmp_path)).max_model_len == 256


@pytest.mark.parametrize("name, value", [("max_model_len", 64.5), ("kv_cache_memory_bytes", -5),
                                         ("kv_cache_memory_bytes", 0), ("num_kvcache_blocks", 2.5),
                                         ("max_num_seqs", True), ("kvcache_block_size", "16")])
def test_integer_options_must_be_positive_ints(qwen3_dir, name, value):
    with pytest.raises(ValueError, match=f"{name}={value!r} must be an int >= 1"):
        Config(qwen3_dir, **{name: value})


@pytest.mark.parametrize("name, value, message", [
    ("swap_space", "1", "must be a finite number"), ("gpu_memory_utilization", float("nan"), "must be a finite number"),
    ("enable_prefix_caching", "no", "must be True or False"), ("enforce_eager", 1, "must be True or False"),
    ("async_scheduling", "no", "must be True or False"), ("offload_embedding", 1, "must be True or False"),
    ("seed", "x", "must be an int")])
def test_mistyped_options_are_value_errors(qwen3_dir, name, value, message):
    """async_scheduling="no" is a true string: it used to switch asynchronous scheduling on."""
    with pytest.raises(ValueError, match=f"{name}={value!r} {message}"):
        Config(qwen3_dir, **{name: value})


def test_whole_floats_are_ints(qwen3_dir):
    config = Config(qwen3_dir, kv_cache_memory_bytes=2e6, max_model_len=64.0)
    assert config.kv_cache_memory_bytes == 2_000_000 and type(config.max_model_len) is int


def _write_llama(path, **overrides):
    from transformers import LlamaConfig
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
    cfg = LlamaConfig(**{**shape, **overrides})
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.save_pretrained(path)
    return str(path)


def test_an_mlp_activation_other_than_silu_is_refused(tmp_path):
    """The MLP is silu(gate) * up; a gelu checkpoint would run with the wrong activation."""
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        Config(_write_llama(tmp_path, hidden_act="gelu"))


def test_an_intermediate_size_that_does_not_split_over_the_ranks_is_refused(tmp_path):
    """130 MLP neurons over 3 ranks would drop one (silently wrong tokens); 129 over 2 failed in the first forward."""
    with pytest.raises(ValueError, match="intermediate_size=130 is not divisible by tensor_parallel_size=3"):
        Config(_write_llama(tmp_path, intermediate_size=130, num_attention_heads=3, num_key_value_heads=3,
                            hidden_size=48), tensor_parallel_size=3)


def test_an_offloaded_embedding_needs_an_untied_head(qwen3_dir, llama_dir):
    """A tied head reads every row of the table each step: it cannot stay in host memory."""
    with pytest.raises(ValueError, match=r"offload_embedding=True needs an embedding apart from the LM head"):
        Config(qwen3_dir, offload_embedding=True)  # tie_word_embeddings=True
    assert Config(llama_dir, offload_embedding=True).offload_embedding
