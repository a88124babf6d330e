"""A model's tokenizer (a directory's; None without tokenizer files; a GGUF file's from its metadata), its chat
prompts and its EOS token ids."""
import json
import os

from nanovllm.utils.gguf_model import is_gguf_file, load_gguf_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(model: str):
    if is_gguf_file(model):
        return load_gguf_tokenizer(model)
    if not any(os.path.exists(os.path.join(model, f)) for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model)


def chat_token_ids(tokenizer, messages: list[dict], model: str, add_generation_prompt: bool = True,
                   chat_template_kwargs: dict | None = None) -> list[int]:
    """One conversation rendered by the tokenizer's chat template, as token ids. ValueError naming the model when it
    has no tokenizer or template, or quoting the template when it refuses the messages (roles out of order, ...)."""
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer files, so no chat template; pass token ids")
    if not tokenizer.chat_template:
        raise ValueError(f"model {model!r} has no chat template; pass the prompt as text or token ids")
    from jinja2 import TemplateError
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **(chat_template_kwargs or {}))
    except TemplateError as e:
        raise ValueError(f"the chat template refused these messages: {e}") from None
    return tokenizer.encode(text, add_special_tokens=False)  # the template already has its special tokens


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
