"""OpenAI-compatible routes over the same workers: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, for the stock ``openai`` client and load tools that speak its protocol.

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything")
    out = client.completions.create(model="builtin", prompt="def main(", max_tokens=20,
                                    extra_body={"blocks": "skip=5", "top_k": 40})
    out.choices[0].text, out.blocklab["mean_blocks_per_token"]

Each body is translated into a ``PredictRequest`` and goes through ``serve.gateway`` like
``/predict``: same checks, same batches. (LitServe's ``OpenAISpec`` covers chat only and takes over
its LitAPI; a second LitAPI for it would load the model again and never batch with ``/predict``.)
The block set travels in the extra field ``blocks`` (a spec string, ``lab.blocks``); ``top_k`` is
the other extra. Every response carries a ``blocklab`` object: the block set as run, blocks per
token, server timings. Options this server does not implement (``n`` > 1, ``stop``, ``logprobs``,
penalties, ``top_p`` < 1, ...) are refused with 422 naming them, never silently ignored.
Chat turns are rendered as a plain transcript (``role: content`` lines, then ``assistant:``): the
served models are not chat-tuned.
"""

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve.gateway import Gateway, Submission
from serve.schema import MAX_NEW_TOKENS, PredictRequest

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for completions; used for chat too."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _OpenAIRequest(BaseModel):
    """The options completions and chat share. Defaults are OpenAI's."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(None, max_length=256, description="Accepted and echoed; one model is served.")
    max_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # Accepted only at the value that means "off": the server does not implement them.
    top_p: float | None = Field(None, allow_inf_nan=False)
    n: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    # blocklab's own, sent by OpenAI clients through extra_body
    blocks: str | None = Field(None, max_length=4096, description="Block set spec, e.g. 'skip=3,4'.")
    top_k: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _only_what_is_implemented(self):
        neutral = {
            "top_p": (None, 1.0),
            "n": (None, 1),
            "stop": (None, [], ""),
            "presence_penalty": (None, 0.0),
            "frequency_penalty": (None, 0.0),
            "logit_bias": (None, {}),
        }
        for name, allowed in neutral.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: not supported by this server (got {getattr(self, name)!r})")
        return self


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str] = Field(description="A prompt, or a list holding exactly one.")
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise ValueError(f"prompt: one prompt per request, got a list of {len(self.prompt)}")
        for name, allowed in {
            "echo": (False,),
            "logprobs": (None,),
            "best_of": (None, 1),
            "suffix": (None,),
        }.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}: not supported by this server (got {getattr(self, name)!r})")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant"]
    content: str = Field(max_length=200_000)
    name: str | None = Field(None, max_length=256)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_NEW_TOKENS)
    logprobs: bool | None = None

    @model_validator(mode="after")
    def _no_logprobs(self):
        if self.logprobs:
            raise ValueError("logprobs: not supported by this server")
        return self


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The transcript a base model continues: one ``role: content`` line per turn, then ``assistant:``."""
    return "".join(f"{message.role}: {message.content}\n" for message in messages) + "assistant:"


def _in_openai_terms(detail: list[dict], names: dict[str, str]) -> list[dict]:
    """Validation errors of the translated request, naming the fields of the body the client sent."""
    return [{**error, "loc": [names.get(part, part) for part in error["loc"]]} for error in detail]


def _predict_request(
    body: _OpenAIRequest, prompt: str, max_tokens: int | None, names: dict[str, str]
) -> PredictRequest:
    fields = {
        "prompt": prompt,
        "max_new_tokens": DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        "temperature": body.temperature,
        "top_k": body.top_k,
        "seed": body.seed,
        "stream": body.stream,
        "blocks": body.blocks,
    }
    try:
        return PredictRequest.model_validate(
            {name: value for name, value in fields.items() if value is not None}
        )
    except ValidationError as error:
        detail = error.errors(include_url=False, include_context=False)
        raise HTTPException(422, _in_openai_terms(detail, names)) from None


def _finish_reason(reason: str) -> str:
    return "stop" if reason == "stop" else "length"


def _usage(response: dict) -> dict:
    completion = len(response["tokens"])
    return {
        "prompt_tokens": response["prompt_tokens"],
        "completion_tokens": completion,
        "total_tokens": response["prompt_tokens"] + completion,
    }


def _blocklab(response: dict) -> dict:
    """The extension object every response carries: how the request ran."""
    names = (
        "block_set",
        "blocks_run",
        "blocks_per_token",
        "mean_blocks_per_token",
        "seed",
        "timings",
        "batch_size",
    )
    return {name: response[name] for name in names}


class _Route:
    """One OpenAI route: how its choices look, whole and streamed."""

    def __init__(
        self, gateway: Gateway, model_name: str, kind: Literal["text_completion", "chat.completion"]
    ):
        self.gateway = gateway
        self.model_name = model_name
        self.kind = kind

    def _envelope(self, body: _OpenAIRequest, object_name: str, request_id: str) -> dict:
        return {
            "id": request_id,
            "object": object_name,
            "created": int(time.time()),
            "model": body.model or self.model_name,
        }

    def _choice(self, text: str, finish_reason: str | None, streamed: bool) -> dict:
        if self.kind == "text_completion":
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        key = "delta" if streamed else "message"
        return {"index": 0, key: {"role": "assistant", "content": text}, "finish_reason": finish_reason}

    async def respond(
        self, body: _OpenAIRequest, request: PredictRequest, client: Request, names: dict[str, str]
    ) -> Response:
        """Answer ``body``, translated into ``request``; ``names`` maps the translation's fields back."""
        try:
            submission = self.gateway.admit(request)
        except HTTPException as error:  # checked against the model: say it in the client's terms
            if error.status_code == 422 and isinstance(error.detail, list):
                raise HTTPException(422, _in_openai_terms(error.detail, names)) from None
            raise
        request_id = ("cmpl-" if self.kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
        try:
            first = await (submission.next_event(client) if body.stream else submission.final_event(client))
        except BaseException:
            submission.close()
            raise
        if first["event"] == "error" or not body.stream:
            submission.close()
            if first["event"] == "error":
                return self.gateway.error_response(first, client.url.path)
            response = first["response"]
            whole = self._envelope(body, self.kind, request_id)
            whole["choices"] = [
                self._choice(response["text"], _finish_reason(response["finish_reason"]), False)
            ]
            whole["usage"] = _usage(response)
            whole["blocklab"] = _blocklab(response)
            return JSONResponse(whole)
        chunk_object = "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"
        envelope = self._envelope(body, chunk_object, request_id)
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(
            self._sse(first, submission, envelope, include_usage), media_type="text/event-stream"
        )

    async def _sse(
        self, first: dict, submission: Submission, envelope: dict, include_usage: bool
    ) -> AsyncIterator[str]:
        def chunk(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        sent = ""
        try:
            event = first
            while True:
                if event["event"] == "token":
                    sent += event["text"]
                    yield chunk({**envelope, "choices": [self._choice(event["text"], None, True)]})
                elif event["event"] == "done":
                    response = event["response"]
                    rest = response["text"][len(sent) :]  # bytes of a character still open at the end
                    last = {
                        **envelope,
                        "choices": [self._choice(rest, _finish_reason(response["finish_reason"]), True)],
                    }
                    last["blocklab"] = _blocklab(response)
                    if include_usage:
                        last["usage"] = _usage(response)
                    yield chunk(last)
                    yield "data: [DONE]\n\n"
                    return
                else:
                    error = {"message": event["message"], "type": "server_error", "code": event["status"]}
                    yield chunk({"error": error})
                    return
                event = await submission.next_event()
        finally:
            submission.close()


def register(app: FastAPI, gateway: Gateway, *, model_name: str, responses: dict) -> None:
    completion = _Route(gateway, model_name, "text_completion")
    chat = _Route(gateway, model_name, "chat.completion")

    async def completions(request: CompletionRequest, client: Request) -> Response:
        prompt = request.prompt if isinstance(request.prompt, str) else request.prompt[0]
        names = {"max_new_tokens": "max_tokens"}
        translated = _predict_request(request, prompt, request.max_tokens, names)
        return await completion.respond(request, translated, client, names)

    async def chat_completions(request: ChatCompletionRequest, client: Request) -> Response:
        max_tokens = (
            request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        )
        prompt = chat_prompt(request.messages)
        given = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        names = {"max_new_tokens": given, "prompt": "messages"}
        translated = _predict_request(request, prompt, max_tokens, names)
        return await chat.respond(request, translated, client, names)

    async def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "blocklab"}],
        }

    routes: list[tuple[str, Callable, str, dict]] = [
        ("/v1/completions", completions, "POST", responses),
        ("/v1/chat/completions", chat_completions, "POST", responses),
        ("/v1/models", models, "GET", {401: responses[401]}),
    ]
    for path, endpoint, method, answers in routes:
        app.add_api_route(path, endpoint, methods=[method], response_model=None, responses=answers)
