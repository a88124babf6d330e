"""A model directory's tokenizer (None without tokenizer files) and its EOS token ids."""
import json
import os

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str):
    if not any(os.path.exists(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


def eos_token_ids(model: str, hf_config, tokenizer) -> set[int]:
    ids = set()
    sources = [getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)]
    path = os.path.join(model, "generation_config.json")
    if os.path.exists(path):
        with open(path) as f:
            sources.append(json.load(f).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids
