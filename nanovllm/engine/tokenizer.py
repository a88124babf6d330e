"""A model's tokenizer (a directory's; None without tokenizer files; a GGUF file's from its metadata), its chat
prompts and its EOS token ids.

Chat messages are rendered here for every caller (LLM.chat, the server, the CLI): OpenAI's content parts are
joined here, once.
"""
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


def read_chat_template(value: str, option: str = "chat_template") -> str:
    """A chat template given as vLLM takes it (`--chat-template`, LLM.chat's chat_template): the path of a Jinja
    file, or the template itself. ValueError naming `option` when it is neither."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"{option}={value!r} is neither a readable file nor a Jinja template (no '{{{{' or '{{%' in "
                     f"it); pass the path of a .jinja file or the template's text")


def chat_token_ids(tokenizer, messages: list[dict], model: str, add_generation_prompt: bool = True,
                   chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> list[int]:
    """chat_text's conversation as token ids."""
    text = chat_text(tokenizer, messages, model, add_generation_prompt, chat_template_kwargs, chat_template)
    return tokenizer.encode(text, add_special_tokens=False)  # the template already has its special tokens


def chat_text(tokenizer, messages: list[dict], model: str, add_generation_prompt: bool = True,
              chat_template_kwargs: dict | None = None, chat_template: str | None = None) -> str:
    """One conversation rendered by `chat_template` (the template's text; None: the tokenizer's). ValueError naming
    the model when it has no tokenizer or template, or quoting the template when it refuses the messages (roles out
    of order, ...)."""
    if tokenizer is None:
        raise ValueError(f"model {model!r} has no tokenizer files, so no chat template; pass token ids")
    if not (chat_template or tokenizer.chat_template):
        raise ValueError(f"model {model!r} has no chat template; pass one (chat_template=, `--chat-template`), or "
                         f"the prompt as text or token ids")
    messages = template_messages(messages)
    from jinja2 import TemplateError
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **(chat_template_kwargs or {}))
    except TemplateError as e:
        raise ValueError(f"the chat template refused these messages: {e}") from None
    return text


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI chat messages as a chat template takes them: a content of parts (`[{"type": "text", "text": ...}]`)
    becomes its texts joined by newlines (as vLLM joins them), None becomes "". ValueError naming the message for
    one that is not a dict, a part that is not text, or a string that is not valid Unicode (a lone surrogate, which
    no tokenizer can encode)."""
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is {type(message).__name__}, not a dict with 'role' and 'content'")
        content = message.get("content")
        if isinstance(content, list):
            content = "\n".join(_part_text(i, part) for part in content)
        message = {**message, "content": content or ""}
        for key, value in message.items():
            _check_unicode(i, key, value)
        rendered.append(message)
    return rendered


def _part_text(i: int, part) -> str:
    is_text = isinstance(part, dict) and part.get("type") == "text"
    if not is_text or not isinstance(part.get("text") or "", str):
        raise ValueError(f"message {i} has the content part {str(part)[:80]!r}: only text parts "
                         f"({{'type': 'text', 'text': ...}}) are supported")
    return part.get("text") or ""


def _check_unicode(i: int, key, value):
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"message {i}: its {key!r} has a lone surrogate {value[error.start]!r} at character "
                         f"{error.start}, which is not valid Unicode text; remove or replace it") from None


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
