"""Where a built model's weights come from: random values (load_format="dummy"), a GGUF file, or a directory of
safetensors."""
from torch import nn

from nanovllm.layers.quantization.gguf import load_gguf_weights
from nanovllm.utils.gguf_model import is_gguf_file
from nanovllm.utils.loader import init_dummy_weights, load_weights


def load_model_weights(model: nn.Module, model_path: str, load_format: str, seed: int):
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    elif is_gguf_file(model_path):
        load_gguf_weights(model, model_path)
    else:
        load_weights(model, model_path)
