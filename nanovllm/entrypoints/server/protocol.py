"""The request bodies of /v1/completions and /v1/chat/completions (pydantic models), and the error every route
answers with (OpenAI's body).

The models are strict: JSON's true, "8" and 8.0 are not integers and [true, false] is not a list of token ids, as
the Python API refuses them too (a float field still takes an integer). Every string in a body must be encodable as
UTF-8: JSON can carry a lone surrogate ("\\ud800") that no tokenizer can encode.
"""
from __future__ import annotations

import json

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationInfo, model_validator

from nanovllm.entrypoints.server.structured import StructuredOutputsError, requested_structured_outputs
from nanovllm.sampling_params import MAX_LOGPROBS

# A stop string is matched against the tail of the text after every step: many or long ones slow every step of
# every request in the batch, so a request may carry only a few short ones (OpenAI allows 4).
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
# choices in one request (prompts x n): each is an engine request, so one body must not queue without bound
MAX_CHOICES = 256
# logit_bias entries and bad words are applied to every step of the request's rows
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_BAD_WORDS = 64
MAX_TOOLS = 512  # each tool's schema is written into every prompt of the request

StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_STRING_CHARS)]


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status_code: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.body = {"error": {"message": message, "type": type, "param": param, "code": code}}


# OpenAI and vLLM options this server does not implement, each with a test for the values that change nothing: a
# request that sets one to any other value gets a 400 instead of an answer without it. A request model that
# declares one as a field implements it (CompletionRequest: echo, prompt_logprobs).
UNSUPPORTED_OPTIONS = {
    "best_of": lambda v: v == 1,
    "echo": lambda v: not v,
    "suffix": lambda v: v == "",
    "functions": lambda v: v == [],  # the legacy form of `tools`
    # vLLM's extensions
    "add_generation_prompt": lambda v: v is True,
    "continue_final_message": lambda v: v is False,
    "prompt_logprobs": lambda v: False,
    "guided_json": lambda v: False,
    "guided_regex": lambda v: False,
    "guided_choice": lambda v: False,
    "guided_grammar": lambda v: False,
    "allowed_token_ids": lambda v: False,
    "truncate_prompt_tokens": lambda v: False,
}


def find_unencodable(value: Any, where: str = "") -> str | None:
    """The path ("messages.0.content") of the first string in a parsed JSON value, keys included, that UTF-8
    cannot encode (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.isascii() or value.encode("utf-8")
        except UnicodeEncodeError:
            return where or "body"
        return None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        key_text = str(key).encode("utf-8", "backslashreplace").decode()  # the path goes into the error message
        path = f"{where}.{key_text}" if where else key_text
        found = find_unencodable(item, path) or (find_unencodable(key, path) if isinstance(key, str) else None)
        if found is not None:
            return found
    return None


def refuse_unencodable(data: Any) -> Any:
    """A request model's before-validator: ValueError naming the first lone surrogate's path, else the data."""
    where = find_unencodable(data)
    if where is not None:
        raise ValueError(f"{where} has a lone surrogate (a \\ud800-\\udfff escape that is not part of a pair); "
                         f"send text that is valid UTF-8")
    return data


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions. None means the engine's default; top_k, min_p,
    repetition_penalty, ignore_eos, stop_token_ids, min_tokens, include_stop_str_in_output, bad_words and
    skip_special_tokens are vLLM's extensions (send them in the openai client's `extra_body`)."""
    model_config = ConfigDict(strict=True, extra="allow")  # other OpenAI options are accepted and ignored, see `check`

    model: str | None = None  # None: the served model (vLLM's default)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    # OpenAI's logit_bias ({"token id": bias}, the ids as JSON strings) and vLLM's bad_words, skip_special_tokens
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    skip_special_tokens: bool | None = None
    # OpenAI's response_format and vLLM's structured_outputs (structured.py maps them; at most one of the two)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _utf8_only(cls, data: Any, info: ValidationInfo) -> Any:
        if not (info.context or {}).get("may_hold_surrogates", True):  # body.py found no surrogate escape
            return data
        return refuse_unencodable(data)

    def check(self, served_model_name: str, max_logprobs: int = MAX_LOGPROBS):
        """max_logprobs: the engine's (LLM(max_logprobs=...)), the most logprobs a request may ask for."""
        if self.model is not None and self.model != served_model_name:
            raise APIError(404, f"model {self.model!r} is not served here; this server serves {served_model_name!r}",
                           type="not_found_error", param="model", code="model_not_found")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if self.n < 1:
            raise APIError(400, f"n={self.n} must be >= 1", param="n")
        if self.n * self.num_prompts > MAX_CHOICES:
            raise APIError(400, f"n={self.n} samples of {self.num_prompts} prompt(s) make "
                                f"{self.n * self.num_prompts} choices, more than {MAX_CHOICES} in one request; "
                                f"split the request", param="n")
        for name, changes_nothing in UNSUPPORTED_OPTIONS.items():
            value = (self.model_extra or {}).get(name)
            if value is not None and not changes_nothing(value):
                raise APIError(400, f"{name}={value!r} is not supported by this server", param=name)

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: alternatives per generated token (0: the token's own only); None: none."""
        return None

    @property
    def num_prompts(self) -> int:
        return 1

    @staticmethod
    def _check_num_logprobs(name: str, value: int | None, max_logprobs: int):
        if value is not None and not 0 <= value <= max_logprobs:
            raise APIError(400, f"{name}={value} must be in [0, {max_logprobs}] (the most this server returns)",
                           param=name)

    def sampling(self, max_tokens: int | None) -> dict:
        """SamplingParams options; max_tokens None: as many as fit (see prepare.room_left)."""
        options = {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p,
                   "top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
                   "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
                   "stop": self.stop, "stop_token_ids": self.stop_token_ids,
                   "seed": self.seed, "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
                   "include_stop_str_in_output": self.include_stop_str_in_output, "logprobs": self.num_logprobs,
                   "n": self.n, "logit_bias": self.logit_bias, "bad_words": self.bad_words,
                   "skip_special_tokens": self.skip_special_tokens}
        try:
            options["structured_outputs"] = requested_structured_outputs(self.response_format, self.structured_outputs)
        except StructuredOutputsError as e:
            raise APIError(400, str(e), param=e.field) from None
        return {k: v for k, v in options.items() if v is not None or k == "max_tokens"}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions; 0 only with echo (the prompt alone)
    logprobs: int | None = None  # the legacy API's: top tokens per generated token, besides the chosen one
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) in the logprobs
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and this many top ones, per choice

    def check(self, served_model_name: str, max_logprobs: int = MAX_LOGPROBS):
        super().check(served_model_name, max_logprobs)
        self._check_num_logprobs("logprobs", self.logprobs, max_logprobs)
        self._check_num_logprobs("prompt_logprobs", self.prompt_logprobs, max_logprobs)
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens=0 generates nothing; it is allowed with echo=true only (the prompt "
                                "and its logprobs alone)", param="max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs is not available with stream=true (as in vLLM); use echo=true "
                                "with logprobs to stream the prompt's logprobs", param="prompt_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def generates(self) -> bool:
        """False for echo with max_tokens=0: the answer is the prompt alone, with its logprobs (how evaluation
        harnesses score a text). The engine still runs one step; its token is dropped."""
        return not (self.echo and self.max_tokens == 0)

    @property
    def num_prompt_logprobs(self) -> int | None:
        """SamplingParams.prompt_logprobs: prompt_logprobs, else with echo the alternatives logprobs asks for."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    def sampling(self, max_tokens: int | None) -> dict:
        options = super().sampling(max_tokens if self.generates else 1)
        if not self.generates:
            options.pop("min_tokens", None)  # nothing is generated: no minimum to reach
        if self.num_prompt_logprobs is not None:
            options["prompt_logprobs"] = self.num_prompt_logprobs
        return options

    @property
    def num_prompts(self) -> int:
        return len(self.prompts())

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one (a string or token ids) or a list of them, as OpenAI takes them."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return list(prompt)
        if prompt == []:
            raise APIError(400, "prompt is an empty list: send a prompt, or a list of prompts", param="prompt")
        return [prompt]


class ContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A call an assistant message made (sent back in a later turn's history)."""
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    model_config = ConfigDict(strict=True, extra="allow")  # name, tool_call_id, ...: passed to the chat template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    # an earlier answer's reasoning (vLLM's name, and its older one): templates that replay it read reasoning_content
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> "ChatMessage":
        """Only an assistant message may come without content (one that made tool calls): a template would write
        a missing one as the text "None"."""
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content (OpenAI's rule)")
        return self

    def as_template_message(self) -> dict:
        """The message as plain data; its parts are joined where every caller's are (engine/tokenizer.py)."""
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump(exclude_none=True) for part in content]
        message = {**(self.model_extra or {}), "role": self.role, "content": content}
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls([call.model_dump() for call in self.tool_calls])
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return message


def template_tool_calls(tool_calls: list[dict]) -> list[dict]:
    """An assistant message's tool_calls as chat templates read them: OpenAI sends each call's arguments as JSON
    text, templates (Llama's, Qwen's) write them with `| tojson`, so they get the parsed object (as vLLM does)."""
    rendered = []
    for call in tool_calls:
        function = dict(call.get("function") or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments)
            except ValueError:
                pass  # not JSON: the template gets the text as the model wrote it
        rendered.append({**call, "function": function})
    return rendered


class FunctionDefinition(_Strict):
    name: Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")]  # OpenAI's rule for the name
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins when both are set
    logprobs: bool | None = None  # each generated token's logprob ...
    top_logprobs: int | None = None  # ... and those of this many most likely tokens (needs logprobs)
    # tools (see tools.py); tool_choice None: "auto" with tools, "none" without (OpenAI's defaults)
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template (enable_thinking)

    def check(self, served_model_name: str, max_logprobs: int = MAX_LOGPROBS):
        super().check(served_model_name, max_logprobs)
        self._check_num_logprobs("top_logprobs", self.top_logprobs, max_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, f"top_logprobs={self.top_logprobs} needs logprobs=true", param="top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        if not self.messages:
            raise APIError(400, "messages is empty: a chat needs at least one message", param="messages")
        return [m.as_template_message() for m in self.messages]

    def tool_dicts(self) -> list[dict] | None:
        return None if self.tools is None else [tool.model_dump(exclude_none=True) for tool in self.tools]

    def tool_choice_value(self) -> str | dict | None:
        return self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
