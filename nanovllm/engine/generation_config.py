"""The sampling defaults a model ships in its generation_config.json, applied as vLLM's generation_config="auto"
does: an option a request leaves unset takes the file's value (Qwen3's: temperature 0.6, top_p 0.95, top_k 20;
some models ship a repetition_penalty)."""
import json
import logging
import os

from nanovllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # the file's fields applied


def default_sampling_options(model: str, generation_config: str) -> dict:
    """SamplingParams options from `generation_config` ("auto": the model directory's file; "vllm": none; else a
    directory holding one). Values the engine would refuse are a ValueError naming the file."""
    if generation_config == "vllm":
        return {}
    path = os.path.join(model if generation_config == "auto" else generation_config, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        values = json.load(f)
    options = {key: values[key] for key in SAMPLING_KEYS if values.get(key) is not None}
    try:
        SamplingParams(**options)
    except ValueError as e:
        raise ValueError(f"{path}: {e}; pass generation_config='vllm' to ignore the file") from None
    if options:
        logger.info("sampling defaults from %s: %s (generation_config='vllm' ignores them)", path, options)
    return options
