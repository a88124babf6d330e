"""What generate / add_request accept as prompts, checked before the engine is touched (torch-free).

A prompt is a string or a sequence of token ids (a list or tuple of ints, or an integer numpy / torch vector), or
vLLM's dict forms of either: {"prompt": str} (TextPrompt) and {"prompt_token_ids": [...]} (TokensPrompt).
`generate` takes one prompt or a list of them. Anything else (bytes, floats, None, other dicts, generators) is a
ValueError that names the value, not a TypeError from deep inside the engine or, worse, a prompt made of a
bytes object's byte values.
"""
import numbers
import reprlib

from nanovllm.sampling_params import SamplingParams

_short = reprlib.Repr()  # bounded reprs: a 10 MB prompt must not become a 10 MB error message
_short.maxstring = _short.maxother = 60
PROMPT_FORMS = ("a string, a list of token ids (ints), a {'prompt': ...} or {'prompt_token_ids': ...} dict, or a "
                "list of those")
DICT_PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt


def as_prompt_list(prompts) -> list:
    """generate's `prompts` as a list of single prompts (not yet checked one by one: see check_prompt)."""
    prompts = _as_array_list(prompts, "prompts")
    if isinstance(prompts, str) or _is_dict_prompt(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise ValueError(_bytes_message("prompts", prompts))
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts={_short.repr(prompts)} ({type(prompts).__name__}) must be {PROMPT_FORMS}")
    if prompts and isinstance(prompts[0], numbers.Number):  # one prompt of token ids (check_prompt checks each)
        return [prompts]
    return list(prompts)


def _is_dict_prompt(prompt) -> bool:
    return isinstance(prompt, dict) and len(prompt) == 1 and next(iter(prompt)) in DICT_PROMPT_KEYS


def check_prompt(prompt) -> str | list[int]:
    """One prompt: the string itself, or its token ids as Python ints (their range is the engine's to check)."""
    if _is_dict_prompt(prompt):
        (key, prompt), = prompt.items()
        if (key == "prompt") != isinstance(prompt, str):
            raise ValueError(f"prompt {{{key!r}: {_short.repr(prompt)}}}: 'prompt' holds a string, "
                             f"'prompt_token_ids' a list of token ids")
    prompt = _as_array_list(prompt, "prompt")
    if isinstance(prompt, str):
        _check_encodable(prompt)
        return prompt
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError(_bytes_message("prompt", prompt))
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"prompt {_short.repr(prompt)} ({type(prompt).__name__}) must be a string or a list of "
                         f"token ids (ints)")
    not_ints = [t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
    if not_ints:
        raise ValueError(f"token id {_short.repr(not_ints[0])} is not an integer; a prompt is a string or a list of "
                         f"ints")
    return [int(t) for t in prompt]  # numpy / torch integers become Python ints


def _as_array_list(value, name: str):
    """A numpy array or torch tensor as nested lists; a float array's elements then fail the int check."""
    if hasattr(value, "tolist") and hasattr(value, "ndim") and hasattr(value, "dtype"):
        if value.ndim == 0:
            raise ValueError(f"{name}={_short.repr(value)} is a scalar array; pass {PROMPT_FORMS}")
        return value.tolist()
    return value


def _check_encodable(text: str):
    """A lone surrogate ("\\ud800", which JSON and Python strings can hold) is no text a tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"prompt has a lone surrogate {text[error.start]!r} at character {error.start}, which is not "
                         f"valid Unicode text; remove or replace it") from None


def _bytes_message(name: str, value) -> str:
    return (f"{name}={_short.repr(value)} is {type(value).__name__}, not text or token ids; decode it to a str "
            f"first (e.g. {name}.decode())")


def checked_params(sampling_params) -> SamplingParams:
    """A checked copy of a request's SamplingParams (ValueError naming the option when a field was set to
    something invalid after construction); the request keeps the copy, so later changes do not reach it."""
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    return sampling_params.clone()
