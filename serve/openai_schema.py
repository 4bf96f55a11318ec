"""The bodies the OpenAI-compatible routes take (``serve.openai_compat``), as pydantic models.

OpenAI's fields with OpenAI's defaults and bounds, vLLM's extras (``top_k``, ``min_tokens``,
``ignore_eos``) as load tools send them, and blocklab's own ``blocks``. What the server does not
implement is accepted only at the values that mean "off" (``_only``), so it is refused with 400
naming the field, never silently ignored; ``None`` (absent or an explicit null) is OpenAI's default.
"""

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from serve.schema import MAX_NEW_TOKENS

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions, capped at the context the prompt leaves (chat has none: it runs
to the end of the text or of the context)."""
DEFAULT_TEMPERATURE = 1.0
MAX_PROMPTS = 64
"""Prompts in one completions request; each becomes a request of its own, with its own slot."""
MAX_LOGPROBS = 1
"""The scoring pass reports the most likely token at each position, not a longer list."""


def _only(*neutral) -> AfterValidator:
    """A field accepted only at the values that mean "off": the server does not implement it."""

    def check(value):
        if value not in neutral:
            allowed = " or ".join(map(repr, neutral))
            raise ValueError(f"not supported by this server (got {value!r}; only {allowed})")
        return value

    return AfterValidator(check)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = Field(None, description="vLLM's: usage in every chunk.")
    include_obfuscation: bool | None = Field(None, description="OpenAI's padding of chunks; none is sent.")


class OpenAIRequest(BaseModel):
    """The options completions and chat share. ``None`` (absent or an explicit null) is OpenAI's default."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, max_length=256, description="Accepted and echoed; one model is served.")
    max_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    user: str | None = Field(None, max_length=256)
    # what OpenAI's SDKs and wrappers send that changes nothing generated: accepted, not kept
    store: bool | None = Field(None, description="Accepted; nothing is stored.")
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="Accepted; nothing is stored."
    )
    n: int | None = Field(
        None, ge=1, le=MAX_PROMPTS, description="Choices per prompt; identical prompts are prefilled once."
    )
    presence_penalty: Annotated[float | None, _only(None, 0.0)] = None
    frequency_penalty: Annotated[float | None, _only(None, 0.0)] = None
    logit_bias: Annotated[dict[str, float] | None, _only(None, {})] = None
    # vLLM's extras, which load tools send to fix output lengths
    ignore_eos: bool | None = None
    min_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    top_k: int | None = Field(None, ge=-1, description="vLLM's: -1 or 0 is off.")
    # blocklab's own, sent by OpenAI clients through extra_body
    blocks: str | None = Field(None, max_length=4096, description="Block set spec, e.g. 'skip=3,4'.")

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, options: StreamOptions | None, info: ValidationInfo):
        # as OpenAI's and vLLM's refuse it (a stream that failed its own check is that field's error)
        if options is not None and "stream" in info.data and not info.data["stream"]:
            raise ValueError("only allowed when stream is true")
        return options


def _check_prompt(prompt: Any) -> str | list[str] | list[int] | list[list[int]]:
    """One string, a list of strings, token ids, or a list of lists of token ids (one error for all)."""

    def ids(value) -> bool:
        return isinstance(value, list) and value != [] and all(type(item) is int for item in value)

    shape = "a string, a list of strings, token ids, or a list of lists of token ids"
    if isinstance(prompt, str) or ids(prompt):
        return prompt
    if not isinstance(prompt, list) or prompt == []:
        raise ValueError(f"must be {shape}")
    if not (all(isinstance(item, str) for item in prompt) or all(map(ids, prompt))):
        raise ValueError(f"must be {shape} (a list of prompts holds one kind, each one non-empty)")
    if len(prompt) > MAX_PROMPTS:
        raise ValueError(f"at most {MAX_PROMPTS} prompts in one request, got {len(prompt)}")
    return prompt


class CompletionRequest(OpenAIRequest):
    prompt: Annotated[Any, AfterValidator(_check_prompt)] = Field(
        description="A prompt, a list of prompts, token ids, or a list of lists of token ids."
    )
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    best_of: Annotated[int | None, _only(None, 1)] = None
    suffix: Annotated[str | None, _only(None, "")] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str = Field(max_length=200_000)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | Annotated[list[TextPart], Field(max_length=1024)] | None = Field(max_length=200_000)
    name: str | None = Field(None, max_length=256)

    @field_validator("content")
    @classmethod
    def _said_by_someone(cls, content, info: ValidationInfo):
        # OpenAI allows a null content only in an assistant's turn (one that called tools)
        if content is None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant turn may have none")
        return content

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    logprobs: Annotated[bool | None, _only(None, False)] = None
    top_logprobs: Annotated[int | None, _only(None, 0)] = None
    tools: Annotated[Any, _only(None, [])] = None
    tool_choice: Annotated[Any, _only(None, "none")] = None
    parallel_tool_calls: Annotated[Any, _only(None, False)] = None
    functions: Annotated[Any, _only(None, [])] = None
    function_call: Annotated[Any, _only(None, "none")] = None
    response_format: Annotated[Any, _only(None, {"type": "text"})] = None


class InputText(BaseModel):
    """A text part of a turn; an earlier response's ``output_text`` part passed back keeps its
    ``annotations`` and ``logprobs``, taken and not read."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["input_text", "output_text"]
    text: str = Field(max_length=200_000)
    annotations: list[Any] | None = Field(None, max_length=1024)
    logprobs: list[Any] | None = Field(None, max_length=MAX_NEW_TOKENS)


class InputMessage(BaseModel):
    """A turn of a Responses ``input`` (an ``EasyInputMessage``: ``type`` "message" or left out), or an
    earlier response's output message passed back (its ``id`` and ``status`` taken, not read)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    id: str | None = Field(None, max_length=256)
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: str | None = Field(None, max_length=64)
    content: str | Annotated[list[InputText], Field(max_length=1024)] = Field(max_length=200_000)

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ResponsesStreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_obfuscation: bool | None = Field(None, description="OpenAI's padding of events; none is sent.")


class ResponsesRequest(OpenAIRequest):
    """OpenAI's Responses API (``POST /v1/responses``) for text: ``input`` a string or turns, the
    ``instructions`` a system turn before them. Stateless: nothing is stored, so there is no
    ``previous_response_id`` to continue from. Sampling as the other routes take it."""

    input: str | Annotated[list[InputMessage], Field(min_length=1, max_length=1024)] = Field(
        max_length=200_000
    )
    instructions: str | None = Field(None, max_length=200_000)
    max_output_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    # the other routes' names for what this one has its own names for, or does not have
    max_tokens: Annotated[int | None, _only(None)] = Field(None, description="max_output_tokens here.")
    n: Annotated[int | None, _only(None, 1)] = None
    stream_options: ResponsesStreamOptions | None = None
    # OpenAI's, at their "off" values, or changing nothing generated: taken
    background: Annotated[bool | None, _only(None, False)] = None
    top_logprobs: Annotated[int | None, _only(None, 0)] = None
    max_tool_calls: int | None = Field(None, ge=0, description="Taken: no tools are served.")
    service_tier: str | None = Field(None, max_length=64)
    safety_identifier: str | None = Field(None, max_length=256)
    prompt_cache_key: str | None = Field(None, max_length=256)
    previous_response_id: Annotated[str | None, _only(None)] = None
    text: Annotated[Any, _only(None, {"format": {"type": "text"}})] = None
    tools: Annotated[Any, _only(None, [])] = None
    tool_choice: Annotated[Any, _only(None, "none", "auto")] = None
    parallel_tool_calls: Annotated[Any, _only(None, False, True)] = None
    reasoning: Annotated[Any, _only(None)] = None
    include: Annotated[Any, _only(None, [])] = None
    truncation: Annotated[str | None, _only(None, "disabled")] = None

    def messages(self) -> list[InputMessage]:
        """The turns the model continues: the instructions as a system turn, then the input's."""
        turns = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        system = [InputMessage(role="system", content=self.instructions)] if self.instructions else []
        return [*system, *turns]


def chat_prompt(messages: list[ChatMessage] | list[InputMessage]) -> str:
    """The transcript a base model continues: one ``role: content`` line per turn, then ``assistant:``."""
    return "".join(f"{message.role}: {message.text}\n" for message in messages) + "assistant:"
