"""What goes over the wire: the request and response of ``/predict`` as pydantic models, and the job
a request becomes.

FastAPI validates every body against ``PredictRequest`` before anything else sees it (422 naming the
field, and the OpenAPI schema at ``/openapi.json``): types are strict (``"5"`` is not an integer),
unknown fields are refused, and every number has a bound. Its block-set fields are made from
``lab.blocks.KEYS``, as are the rules on which of them go together. What only the served model can
decide (block indices against its depth, prompt plus new tokens against its context length) is
checked by ``resolve``, which raises ``RequestError`` naming the field (the server answers 422 too)
and otherwise returns the ``Job``: the prompt tokenised, the block set and sampling settings made,
what a worker runs. A request is resolved once, on the HTTP side.
"""

from __future__ import annotations

import math
import secrets
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from lab import tokens
from lab.blocks import KEYS, BlockSet, BlockSetError, Key, check_together
from lab.generate import check_sampling
from lab.sampling import FinishReason, SamplingError, SamplingParams

MAX_PROMPT_CHARS = 200_000
MAX_NEW_TOKENS = 8192
MAX_BLOCK_INDICES = 1024
MAX_PROMPT_IDS = 65_536
"""More token ids than any served context holds; the model's own context length is checked later."""
MAX_STOP = 16
MAX_STOP_CHARS = 1024
TokenId = Annotated[int, Field(ge=0, lt=tokens.VOCAB_SIZE)]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
MIN_TEMPERATURE = 1e-6
"""Below it (and above 0) a float32 logit divided by the temperature overflows: NaN probabilities."""
MIN_TOP_P = 1e-6
"""Below it float32 probabilities cannot tell it from 0 (a top_p of 5e-324 is 0 in float32, which
keeps no token); any top_p below the most likely token's probability keeps that token alone."""
REQUEST_KEYS = [key for key in KEYS.values() if key.request is not None]
"""The block-set keys a request may also give as fields of their own (``Key.request``)."""


class _PredictFields(BaseModel):
    """``PredictRequest`` but its block-set fields."""

    model_config = ConfigDict(extra="forbid", strict=True)

    id: str | None = Field(None, max_length=256, description="Client's id, echoed back in the response.")
    prompt: str | None = Field(None, min_length=1, max_length=MAX_PROMPT_CHARS)
    prompt_ids: list[TokenId] | None = Field(
        None, min_length=1, max_length=MAX_PROMPT_IDS, description="The prompt as GPT-2 token ids."
    )
    max_new_tokens: int = Field(16, ge=0, le=MAX_NEW_TOKENS, description="0: score the prompt only.")
    temperature: float = Field(0.0, ge=0.0, le=100.0, allow_inf_nan=False, description="0: greedy.")
    top_k: int | None = Field(None, ge=1, le=tokens.VOCAB_SIZE)
    top_p: float = Field(
        1.0,
        ge=MIN_TOP_P,
        le=1.0,
        allow_inf_nan=False,
        description="Nucleus sampling: the smallest set of tokens whose probability reaches it.",
    )
    min_tokens: int = Field(
        0, ge=0, le=MAX_NEW_TOKENS, description="Neither end-of-text nor a stop string ends it before these."
    )
    ignore_eos: bool = Field(False, description="Generate max_new_tokens whatever is drawn (load tests).")
    stop: list[StopString] | None = Field(
        None,
        max_length=MAX_STOP,
        description="Generation ends once the text contains one of these; the text returned ends before it.",
    )
    seed: int | None = Field(None, ge=0, le=2**63 - 1, description="Sampling seed; drawn when absent.")
    stream: bool = Field(False, description="NDJSON events: one per token, then the summary.")
    score: bool = Field(False, description="Also return the loss of the prompt under the block set.")
    blocks: str | None = Field(None, max_length=4096, examples=["skip=3,4", "exit=6", "adaptive=0.9;min=4"])

    @field_validator("prompt")
    @classmethod
    def _encodable(cls, prompt: str | None) -> str | None:
        if prompt is None:  # an explicit null: the prompt comes as prompt_ids
            return prompt
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:
            raise ValueError(
                f"not valid Unicode text at character {error.start} (a lone surrogate?)"
            ) from None
        return prompt

    @field_validator("temperature")
    @classmethod
    def _not_vanishing(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(f"0 (greedy) or at least {MIN_TEMPERATURE:g}, got {temperature:g}")
        return temperature

    @model_validator(mode="after")
    def _one_prompt(self) -> _PredictFields:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("prompt: give prompt (text) or prompt_ids (token ids), exactly one")
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens: {self.min_tokens} is more than max_new_tokens {self.max_new_tokens}"
            )
        return self

    @model_validator(mode="after")
    def _one_way_to_name_blocks(self) -> _PredictFields:
        given = block_fields(self)
        if self.blocks is not None and given:
            raise ValueError(
                f"blocks: give a spec string or the fields {[k.request for k in given]}, not both"
            )
        try:
            check_together([key.key for key in given])
        except BlockSetError as error:
            raise ValueError(f"{error.key.request}: {error.reason}") from None
        return self


def block_fields(request: _PredictFields) -> dict[Key, Any]:
    """The block-set fields a request gives (not None), by their ``lab.blocks.Key``."""
    values = {key: getattr(request, key.request) for key in REQUEST_KEYS}
    return {key: value for key, value in values.items() if value is not None}


def _block_field(key: Key) -> tuple[Any, Any]:
    """The request field of a block-set key: its type and bounds by the key's kind."""
    if key.kind == "index":
        return list[int] | None, Field(None, max_length=MAX_BLOCK_INDICES, description=key.help)
    if key.kind == "count":
        return int | None, Field(None, ge=key.low, le=key.high, description=key.help)
    if key.kind == "number":
        return float | None, Field(None, gt=key.low, le=key.high, allow_inf_nan=False, description=key.help)
    return Literal[key.choices] | None, Field(None, description=key.help)


PredictRequest = create_model(
    "PredictRequest",
    __base__=_PredictFields,
    __doc__="""One request to ``POST /predict``. The prompt is text (``prompt``) or token ids
    (``prompt_ids``, taken as they are: what a client tokenised itself, as lm-eval does). The block set
    is either ``blocks`` (a spec string, see ``lab.blocks``) or the structured fields (``skip`` or
    ``keep``, ``overwrite``, ``exit_at``, ``adaptive`` with ``adaptive_min_blocks`` and
    ``adaptive_check``: ``lab.blocks.KEYS``' request fields), never both. Nothing given: all blocks.""",
    **{key.request: _block_field(key) for key in REQUEST_KEYS},
)


@dataclass(frozen=True)
class ModelLimits:
    """What a request is checked against besides its own bounds."""

    n_layer: int
    block_size: int
    exit_probe: bool = False
    """Whether the model has an exit probe (lab.exit_probe), which ``check=probe`` needs."""
    tuned_lens: bool = False
    """Whether the model has a tuned lens (lab.lens), which ``lens=tuned`` needs."""
    ranking: bool = False
    """Whether its lens ranks the final tokens (``TunedLens.ranking``), which ``vocab=N`` needs."""
    model_name: str = "MODEL"
    """The served model as ``--model`` named it (what an error tells the user to fit a lens for)."""
    default_blocks: str | None = None
    """The block set of a request that names none (``blocklab serve --default-blocks``); None: all."""


class RequestError(ValueError):
    """A request that does not fit the served model; ``field`` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def detail(self) -> list[dict]:
        """FastAPI's validation-error shape, so every 422 reads the same."""
        return [{"type": "value_error", "loc": ["body", self.field], "msg": self.message}]


def resolve_block_set(request: PredictRequest, n_layer: int, default: str | None = None) -> BlockSet:
    """The request's block set, validated against ``n_layer`` blocks; RequestError names the field.
    A request that names no blocks gets ``default`` (a spec string; None: all blocks)."""
    given = block_fields(request)
    spec = default if request.blocks is None and not given else request.blocks
    if spec is not None:
        try:
            return BlockSet.parse(spec, n_layer)
        except BlockSetError as error:
            raise RequestError("blocks", str(error)) from None
    try:
        return BlockSet.from_values({key.key: value for key, value in given.items()}, n_layer)
    except BlockSetError as error:
        raise RequestError(error.key.request, error.reason) from None


def check_model_has(block_set: BlockSet, limits: ModelLimits, in_spec: bool) -> None:
    """RequestError unless the served model has what ``block_set`` reads through: the exit probe
    (``check=probe``), the tuned lens (``lens=tuned``), the lens's ranking (``vocab=N``). ``in_spec``:
    the set was written as a spec (the error names ``blocks``), not in a request's own fields."""
    if block_set.adaptive_check == "probe" and not limits.exit_probe:
        field = "blocks" if in_spec else KEYS["check"].request
        raise RequestError(field, "check=probe needs an exit probe (lab.exit_probe); this model has none")
    if block_set.lens == "tuned" and not limits.tuned_lens:
        field = "blocks" if in_spec else KEYS["lens"].request
        raise RequestError(field, missing_lens(limits))
    if block_set.draft_vocabulary is not None and not limits.ranking:
        raise RequestError("blocks", missing_ranking(limits))  # vocab=N is only ever in a spec


def missing_lens(limits: ModelLimits) -> str:
    """Why ``lens=tuned`` is refused by a model without a tuned lens, and what to do."""
    return (
        "lens=tuned needs the model's tuned lens (lab.lens) and the served model has none: fit one "
        f"with `blocklab lens fit --model {limits.model_name}`, then restart the server"
    )


def missing_ranking(limits: ModelLimits) -> str:
    """Why ``vocab=N`` is refused by a model whose lens ranks no tokens, and what to do."""
    return (
        "vocab=N drafts over the final tokens the model's tuned lens ranks, and the served model has "
        f"{'a lens fitted before lenses ranked them' if limits.tuned_lens else 'no tuned lens'}: fit one "
        f"with `blocklab lens fit --model {limits.model_name}`, then restart the server"
    )


@dataclass(frozen=True)
class Job:
    """A request resolved for the served model: what a worker runs (``resolve`` makes it)."""

    prompt_tokens: list[int]
    block_set: BlockSet
    max_new_tokens: int
    sampling: SamplingParams
    """Its seed is set (drawn when the request gave none), so the response can report it."""
    score: bool = False
    stream: bool = False
    request_id: str | None = None
    submitted_at: float = 0.0
    """``time.monotonic()`` when the request was admitted (the same clock in every process on Linux)."""
    deadline: float = math.inf
    """``time.monotonic()`` past which it ends with 504 at its next step (``--request-timeout``)."""


def resolve(
    request: PredictRequest,
    limits: ModelLimits,
    *,
    submitted_at: float | None = None,
    timeout: float = math.inf,
    needs: frozenset[str] = frozenset(),
) -> Job:
    """Tokenise the prompt and check the request against the model: its ``Job``, admitted at
    ``submitted_at`` (default: now) to end within ``timeout`` seconds; RequestError names the field.
    ``needs``: what the caller will ask of the result besides the request's own fields
    (``lab.blocks.Key.cannot_serve``'s options), refused under a block set that cannot give it."""
    block_set = resolve_block_set(request, limits.n_layer, limits.default_blocks)
    check_model_has(block_set, limits, in_spec=request.blocks is not None)
    for option in sorted(needs):
        refused = block_set.cannot_serve(option)
        if refused is not None:
            raise RequestError(option, refused)
    if request.prompt_ids is not None:
        prompt_tokens = list(request.prompt_ids)
    else:
        prompt_tokens = tokens.encode(request.prompt, allow_endoftext=True)
    prompt_field = "prompt" if request.prompt_ids is None else "prompt_ids"  # the field the client gave
    if len(prompt_tokens) > limits.block_size:
        raise RequestError(
            prompt_field,
            f"This model's maximum context length is {limits.block_size} tokens: the prompt's "
            f"{len(prompt_tokens)} tokens exceed the context length",
        )
    if len(prompt_tokens) + request.max_new_tokens > limits.block_size:
        raise RequestError(
            "max_new_tokens",
            f"This model's maximum context length is {limits.block_size} tokens: {len(prompt_tokens)} "
            f"prompt tokens + {request.max_new_tokens} new tokens exceed the context length",
        )
    if (request.score or request.max_new_tokens == 0) and len(prompt_tokens) < 2:
        raise RequestError(prompt_field, "scoring needs at least 2 tokens (the loss of each after the first)")
    try:
        sampling = SamplingParams(
            temperature=request.temperature,
            top_k=request.top_k,
            top_p=request.top_p,
            seed=request.seed if request.seed is not None else secrets.randbits(63),
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            stop=tuple(request.stop or ()),
        )
        check_sampling(sampling, block_set)
    except SamplingError as error:
        raise RequestError(error.field, error.reason) from None
    submitted_at = time.monotonic() if submitted_at is None else submitted_at
    return Job(
        prompt_tokens=prompt_tokens,
        block_set=block_set,
        max_new_tokens=request.max_new_tokens,
        sampling=sampling,
        score=request.score,
        stream=request.stream,
        request_id=request.id,
        submitted_at=submitted_at,
        deadline=submitted_at + timeout,
    )


# --------------------------------------------------------------------------------------------------
# Responses: the engine builds these (``serve.engine``), so the schema is what it sends.


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Timings(_Response):
    """Server-side, in milliseconds, measured in the worker from the moment the request was queued."""

    queue_ms: float = Field(description="Queued until its batch started.")
    prefill_ms: float = Field(description="The forward pass over the prompt (shared by its group).")
    first_token_ms: float | None = Field(description="Queued until the first new token.")
    per_token_ms: float | None = Field(description="Mean time between new tokens after the first.")
    total_ms: float = Field(description="Queued until the response was complete.")


class PromptScore(_Response):
    mean_loss: float = Field(description="Mean next-token loss (nats) over the prompt.")
    token_losses: list[float] = Field(description="Loss of prompt tokens 1..n-1 given the ones before.")
    top_tokens: list[int] | None = Field(
        None, description="The most likely token at each of those positions (greedy's choice)."
    )
    top_losses: list[float] | None = Field(
        None, description="The loss of each top token: the least loss at each position."
    )


class Speculation(_Response):
    """What self-speculative decoding did for a request (``speculate=E`` block sets)."""

    rounds: int = Field(description="Verification passes over the drafted tokens.")
    drafted: int = Field(description="Tokens drafted by the first blocks.")
    accepted: int = Field(description="Drafted tokens the full set agreed with.")
    acceptance_rate: float | None

    @classmethod
    def of(cls, stats) -> Speculation:
        """From ``lab.generate.SpeculationStats``."""
        return cls(
            rounds=stats.rounds,
            drafted=stats.drafted,
            accepted=stats.accepted,
            acceptance_rate=stats.acceptance_rate,
        )


class PredictResponse(_Response):
    id: str | None
    text: str
    tokens: list[int] = Field(description="The new token ids (the end-of-text token is not included).")
    prompt_tokens: int
    finish_reason: FinishReason = Field(
        description="length: max_new_tokens reached; stop: end-of-text sampled or a stop string generated; "
        "scored: nothing generated."
    )
    stop_reason: str | None = Field(
        None,
        description="The stop string that ended it (vLLM's field); None otherwise: with finish_reason stop, "
        "end-of-text was drawn.",
    )
    seed: int
    block_set: str = Field(description="The block set as run, as a spec string.")
    blocks_run: list[int] | None = Field(description="Block indices every token ran (None for adaptive).")
    blocks_per_token: list[int] = Field(description="Blocks each new token ran (adaptive exit varies).")
    mean_blocks_per_token: float
    score: PromptScore | None
    timings: Timings
    batch_size: int = Field(description="The most requests that shared one of its decode steps.")
    speculation: Speculation | None = Field(None, description="Drafts and acceptance, when speculating.")


class TokenEvent(_Response):
    event: Literal["token"] = "token"
    index: int
    token: int
    text: str = Field(description="Text completed by this token; may be empty mid-character.")
    blocks: int = Field(description="Blocks this token ran.")


class DoneEvent(_Response):
    event: Literal["done"] = "done"
    response: PredictResponse


class ErrorEvent(_Response):
    event: Literal["error"] = "error"
    status: int
    message: str


def ended_at_eos(response: dict) -> bool:
    """Whether end-of-text ended the generation of ``response`` (a ``PredictResponse`` as a dict)."""
    return response["finish_reason"] == "stop" and response["stop_reason"] is None


def new_token_count(response: dict) -> int:
    """The tokens ``response`` generated as OpenAI and vLLM count them (usage, the server's counters,
    ``vllm:generation_tokens``): its ``tokens``, and end-of-text where that ended it (a token drawn
    by a decode step like any other, though ``tokens`` and ``text`` leave it out)."""
    return len(response["tokens"]) + ended_at_eos(response)


def error_event(status: int, message: str) -> dict:
    """An ``ErrorEvent`` as the plain dict events travel as."""
    return ErrorEvent(status=status, message=message).model_dump()
