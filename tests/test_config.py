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
    with pytest.raises(ValueError, match="max_cudagraph_capture_size=0 must be >= 1"):
        Config(qwen3_dir, max_cudagraph_capture_size=0)


def test_async_scheduling_defaults_on_only_without_tensor_parallelism(qwen3_dir):
    assert Config(qwen3_dir).async_scheduling is True
    assert Config(qwen3_dir, tensor_parallel_size=2).async_scheduling is False
    assert Config(qwen3_dir, async_scheduling=False).async_scheduling is False
