"""OpenAI-compatible routes over the same workers: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/responses`` (text), ``/v1/models``, for the stock ``openai`` client and the tools built on it
(aiperf, lm-eval, GuideLLM).

    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="KEY or anything")
    out = client.completions.create(model="builtin", prompt="def main(", max_tokens=20,
                                    extra_body={"blocks": "skip=5", "top_k": 40})
    out.choices[0].text, out.blocklab["mean_blocks_per_token"]

Each body is translated into ``PredictRequest``s (one per prompt: a list of prompts, of token ids
or of lists of ids, becomes as many choices) that go through ``serve.http_front`` like ``/predict``:
same checks, same batches. (LitServe's ``OpenAISpec`` covers chat only and takes over its LitAPI; a
second LitAPI for it would load the model again and never batch with ``/predict``.) The block set
travels in the extra field ``blocks`` (a spec string, ``lab.blocks``); vLLM's extras ``top_k``,
``min_tokens`` and ``ignore_eos`` are taken too, as load tools send them. ``logprobs`` (with
``echo``: lm-eval's loglikelihood requests) come from scoring the prompt and what was generated:
in the first pass when nothing is generated, else in a scoring request after it. Every response
carries a ``blocklab`` object: the block set as run, blocks per token, server timings. ``n``
choices of each prompt are requests of their own (choice j of a seeded body drawn with seed + j).
What is not implemented (``best_of`` > 1, tools, penalties, ``logit_bias``, ``logprobs`` > 1,
...) is refused with 400 whose ``param`` names it, never silently ignored; OpenAI's explicit nulls
mean the default (the bodies' models: ``serve.openai_schema``). Chat turns are rendered as a plain transcript
(``role: content`` lines, then ``assistant:``): the served models are not chat-tuned.
"""

import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from lab import tokens
from serve.http_front import Front, Submission, openai_status
from serve.openai_schema import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    ResponsesRequest,
    StreamOptions,
    chat_prompt,
)
from serve.schema import MAX_NEW_TOKENS, MIN_TOP_P, PredictRequest, ended_at_eos, new_token_count

SAMPLING_EPS = 1e-5
"""A temperature below this is greedy, as vLLM reads it (clients send 1e-7 and the like for greedy)."""


def refuse(param: str, message: str, status: int = 422) -> HTTPException:
    """An error in FastAPI's validation shape, so the OpenAI error names ``param``."""
    return HTTPException(status, [{"type": "value_error", "loc": ["body", param], "msg": message}])


_NAMED_MESSAGE = re.compile(r"(?:Value error, )?(\w+): (.*)", re.DOTALL)


def _in_openai_terms(detail: list[dict], names: dict[str, str]) -> list[dict]:
    """Validation errors of a translated request, naming the fields of the body the client sent.

    A check across fields reports only ``body`` as its place, with the field first in its message
    (``"min_tokens: ..."``): that field becomes the place."""
    translated = []
    for error in detail:
        loc, msg = list(error["loc"]), error["msg"]
        # From model_validate, not from FastAPI, a place lacks the leading "body": it is there all the same.
        if loc[:1] != ["body"]:
            loc = ["body", *loc]
        named = _NAMED_MESSAGE.fullmatch(msg)
        if loc == ["body"] and named:
            loc, msg = ["body", named[1]], named[2]
        for ours in ("max_new_tokens", "prompt_ids"):  # names no message means otherwise
            msg = msg.replace(ours, names.get(ours, ours))
        translated.append({**error, "loc": [names.get(part, part) for part in loc], "msg": msg})
    return translated


def _prompt_ids(prompt: str | list[int]) -> list[int]:
    """The ids the server runs for ``prompt`` (as ``serve.schema.resolve`` tokenises it)."""
    return prompt if isinstance(prompt, list) else tokens.encode(prompt, allow_endoftext=True)


def _prompt_text(prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokens.decode(prompt)


def _token_string(token: int) -> str:
    """A token as OpenAI's logprobs show it: its text, or ``bytes:\\xNN...`` for part of a character."""
    raw = tokens.decode_token_bytes(token)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def _finish_reason(reason: str) -> str:
    return "stop" if reason == "stop" else "length"


def _generated_ids(response: dict) -> list[int]:
    """The tokens it generated as OpenAI counts them and lists their logprobs: end-of-text included
    when it ended it (``serve.schema.new_token_count``), though the text leaves it out."""
    return response["tokens"] + ([tokens.EOT] if ended_at_eos(response) else [])


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


class _Translation:
    """A body as ``PredictRequest``s: how each prompt is asked, and the names to say errors in."""

    def __init__(
        self,
        body: OpenAIRequest,
        prompts: list[str | list[int]],
        max_tokens: int | None,
        names: dict,
        needs: frozenset[str] = frozenset(),
        default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
        context: int | None = None,
    ):
        self.body = body
        self.n = body.n or 1
        self.prompts = [prompt for prompt in prompts for _ in range(self.n)]  # a choice each, OpenAI's order
        self.max_tokens = max_tokens
        """As the body gave it; None: ``default_max_tokens`` (None: to the end of the ``context``),
        never past the context, as vLLM caps it."""
        self.default_max_tokens = default_max_tokens
        self.context = context
        self.names = {
            "prompt_ids": "prompt",
            "max_new_tokens": "max_tokens",
            "top_tokens": "logprobs",
            **names,
        }
        self.needs = needs
        """What the answer needs beyond the requests' own fields (``serve.schema.resolve``)."""

    def choice_seed(self, index: int) -> int | None:
        """The seed of choice ``index``: the body's, moved by the choice's place among its prompt's n
        (the same seed would draw n copies of one text); None stays None, a seed drawn per request."""
        seed = self.body.seed
        return None if seed is None else (seed + index % self.n) % 2**63

    def prompt_tokens(self, counts: list[int]) -> int:
        """The usage's prompt tokens from each choice's count: each prompt once, as OpenAI counts it."""
        return sum(counts[:: self.n])

    def new_tokens(self, prompt: str | list[int]) -> int:
        """The most new tokens ``prompt`` asks for: the body's ``max_tokens``, or its default capped at
        the context left after the prompt (a prompt that fills the context gets the default, and the
        context error)."""
        if self.max_tokens is not None:
            return self.max_tokens
        default = self.default_max_tokens
        room = None if self.context is None else self.context - len(_prompt_ids(prompt))
        if room is None or room < 1:
            return default or DEFAULT_MAX_TOKENS
        return min(room, MAX_NEW_TOKENS, default or room)

    def request(self, prompt: str | list[int], **overrides) -> PredictRequest:
        body = self.body
        stop = [body.stop] if isinstance(body.stop, str) else body.stop
        stop = [text for text in stop or () if text]  # "" stops nothing: clients send it for none
        temperature = DEFAULT_TEMPERATURE if body.temperature is None else body.temperature
        fields = {
            "prompt_ids" if isinstance(prompt, list) else "prompt": prompt,
            "max_new_tokens": self.new_tokens(prompt),
            "temperature": 0.0 if temperature < SAMPLING_EPS else temperature,
            "top_k": body.top_k if body.top_k is not None and body.top_k > 0 else None,
            # below the server's least top_p, the nucleus is the most likely token all the same
            "top_p": None if body.top_p is None else max(body.top_p, MIN_TOP_P),
            "seed": body.seed,
            "stream": bool(body.stream),
            "blocks": body.blocks,
            "min_tokens": body.min_tokens,
            "ignore_eos": body.ignore_eos,
            "stop": stop or None,
            **overrides,
        }
        try:
            return PredictRequest.model_validate(
                {name: value for name, value in fields.items() if value is not None}
            )
        except ValidationError as error:
            detail = error.errors(include_url=False, include_context=False)
            raise HTTPException(422, _in_openai_terms(detail, self.names)) from None

    def admit(self, front: Front, requests: list[PredictRequest]) -> list[Submission]:
        """The requests admitted together (they can share batches), all or none."""
        try:
            return front.admit_all(requests, self.needs)
        except HTTPException as error:  # checked against the model: say it in the client's terms
            if error.status_code == 422 and isinstance(error.detail, list):
                raise HTTPException(422, _in_openai_terms(error.detail, self.names)) from None
            raise


class _Route:
    """One OpenAI route: how its choices look, whole and streamed."""

    def __init__(self, front: Front, model_name: str, kind: Literal["text_completion", "chat.completion"]):
        self.front = front
        self.model_name = model_name
        self.kind = kind

    def _envelope(self, body: OpenAIRequest, object_name: str, request_id: str) -> dict:
        return {
            "id": request_id,
            "object": object_name,
            "created": int(time.time()),
            "model": body.model or self.model_name,
        }

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        streamed: bool,
        logprobs=None,
        first: bool = True,
    ) -> dict:
        """A choice; streamed, a chunk's (``first``: the choice's first chunk, whose chat delta names the
        role, as OpenAI's first delta alone does)."""
        if self.kind == "text_completion":
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if not streamed:
            return {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "finish_reason": finish_reason}

    async def respond(self, translation: _Translation, client: Request, echo: bool = False, logprobs=None):
        """Answer the translated body: its choices whole, or streamed one after another."""
        body = translation.body
        # Scoring alone (lm-eval's loglikelihood): the first pass's score is all the logprobs need.
        score_only = logprobs is not None and translation.max_tokens == 0
        requests = [
            translation.request(prompt, score=score_only or None, seed=translation.choice_seed(index))
            for index, prompt in enumerate(translation.prompts)
        ]
        submissions = translation.admit(self.front, requests)
        try:
            request_id = ("cmpl-" if self.kind == "text_completion" else "chatcmpl-") + uuid.uuid4().hex
            if body.stream:
                first = await submissions[0].next_event(client)
                if first["event"] == "error":
                    return self.front.error_response(first, client.url.path)
                chunk_object = (
                    "text_completion" if self.kind == "text_completion" else "chat.completion.chunk"
                )
                stream = self._sse(
                    first, submissions, translation, self._envelope(body, chunk_object, request_id), echo
                )
                submissions[0].stop_watching()  # the streaming response sees its client leave
                submissions = []  # the stream closes them
                return StreamingResponse(stream, media_type="text/event-stream")
            responses = []
            for submission in submissions:
                event = await submission.final_event(client)
                if event["event"] == "error":
                    return self.front.error_response(event, client.url.path)
                responses.append(event["response"])
        finally:
            for submission in submissions:
                submission.close()
        details = [None] * len(responses)
        if logprobs is not None:
            details = await self._logprobs(translation, responses, echo, logprobs, client)
        whole = self._envelope(body, self.kind, request_id)
        whole["choices"] = []
        for index, (prompt, response) in enumerate(zip(translation.prompts, responses, strict=True)):
            text = _echoed(prompt, response) if echo else response["text"]
            reason = _finish_reason(response["finish_reason"])
            choice = self._choice(index, text, reason, False, details[index])
            choice["stop_reason"] = response["stop_reason"]
            if len(responses) > 1:
                choice["blocklab"] = _blocklab(response)
            whole["choices"].append(choice)
        whole["usage"] = _usage(
            translation.prompt_tokens([response["prompt_tokens"] for response in responses]),
            sum(new_token_count(response) for response in responses),
        )
        whole["blocklab"] = _blocklab(responses[0])
        return JSONResponse(whole)

    async def _scores(
        self, translation: _Translation, responses: list[dict], client: Request
    ) -> list[dict | None]:
        """The score of each prompt followed by what was generated for it (None: under 2 tokens, nothing
        to score), from the responses themselves when they scored alone, else from scoring requests
        admitted together."""
        scores: list[dict | None] = [None] * len(responses)
        pending: dict[int, Submission] = {}
        try:
            requests = {}
            for index, (prompt, response) in enumerate(zip(translation.prompts, responses, strict=True)):
                ids = _prompt_ids(prompt) + _generated_ids(response)
                if response["score"] is not None and len(ids) == response["prompt_tokens"]:
                    scores[index] = response["score"]
                elif len(ids) >= 2:
                    overrides = {"max_new_tokens": 0, "score": True, "stream": False, "stop": None}
                    requests[index] = translation.request(ids, **overrides, min_tokens=None)
            pending = dict(zip(requests, translation.admit(self.front, list(requests.values())), strict=True))
            for index, submission in pending.items():
                event = await submission.final_event(client)
                if event["event"] == "error":
                    raise HTTPException(event["status"], event["message"])
                scores[index] = event["response"]["score"]
        finally:
            for submission in pending.values():
                submission.close()
        return scores

    async def _logprobs(
        self, translation: _Translation, responses: list[dict], echo: bool, top: int, client: Request
    ) -> list[dict]:
        """OpenAI's logprobs of each choice: the prompt's positions when ``echo`` (the first has no
        logprob), then the generated tokens' up to the end of the text (not those of a stop string,
        which the text leaves out) and end-of-text where it ended the generation, with the most likely
        token at each when ``top``."""
        scores = await self._scores(translation, responses, client)  # top tokens: admission checked it
        results = []
        for prompt, response, score in zip(translation.prompts, responses, scores, strict=True):
            prompt_ids = _prompt_ids(prompt)
            ids = prompt_ids + _generated_ids(response)
            losses = [None] + (score["token_losses"] if score else [])
            top_tokens = [None] + (score.get("top_tokens") or [] if score else [])
            top_losses = [None] + (score.get("top_losses") or [] if score else [])
            first = 0 if echo else len(prompt_ids)
            # Offsets are characters from the start of the prompt, echoed or not, as OpenAI's are.
            base = 0 if echo else len(_prompt_text(prompt))
            # the generated tokens that begin within the text, decoded on its own as the text is: not
            # those of a stop string, which the text leaves out
            kept = sum(at < len(response["text"]) for at in tokens.char_offsets(response["tokens"]))
            kept += ended_at_eos(response)
            result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            positions = range(first, len(prompt_ids) + kept)
            offsets = tokens.char_offsets(ids[position] for position in positions)
            for position, offset in zip(positions, offsets, strict=True):
                token, loss = ids[position], losses[position]
                result["tokens"].append(_token_string(token))
                result["token_logprobs"].append(None if loss is None else -loss)
                result["text_offset"].append(base + offset)
                if loss is None:
                    result["top_logprobs"].append(None)
                else:
                    best = {_token_string(top_tokens[position]): -top_losses[position]} if top else {}
                    result["top_logprobs"].append({**best, _token_string(token): -loss})
            results.append(result)
        return results

    async def _sse(
        self,
        first: dict,
        submissions: list[Submission],
        translation: _Translation,
        envelope: dict,
        echo: bool,
    ) -> AsyncIterator[str]:
        """The choices' chunks, one choice after another (their requests run together all the same)."""

        def chunk(payload: dict) -> str:
            return f"data: {json.dumps(payload)}\n\n"

        options = translation.body.stream_options or StreamOptions()
        usage = [0, 0]
        if options.continuous_usage_stats:  # every chunk counts the prompts, known before they run
            usage[0] = translation.prompt_tokens([len(_prompt_ids(prompt)) for prompt in translation.prompts])
        try:
            event = first
            for index, (prompt, submission) in enumerate(zip(translation.prompts, submissions, strict=True)):
                if index:
                    event = await submission.next_event()
                if echo:
                    yield chunk(
                        {**envelope, "choices": [self._choice(index, _prompt_text(prompt), None, True)]}
                    )
                sent, made = "", 0
                while event["event"] == "token":
                    sent += event["text"]
                    made += 1
                    choice = self._choice(index, event["text"], None, True, first=made == 1)
                    out = {**envelope, "choices": [choice]}
                    if options.continuous_usage_stats:
                        out["usage"] = _usage(usage[0], usage[1] + made)
                    yield chunk(out)
                    event = await submission.next_event()
                if event["event"] == "error":
                    error = {
                        "message": event["message"],
                        "type": "server_error",
                        "param": None,
                        "code": openai_status(event["status"]),  # as whole answers
                    }
                    yield chunk({"error": error})
                    return
                response = event["response"]
                if not options.continuous_usage_stats and index % translation.n == 0:  # each prompt once
                    usage[0] += response["prompt_tokens"]
                usage[1] += new_token_count(response)
                rest = response["text"][len(sent) :]  # bytes of a character still open at the end
                reason = _finish_reason(response["finish_reason"])
                final = self._choice(index, rest, reason, True, first=not made)
                final["stop_reason"] = response["stop_reason"]  # on the choice's last chunk, as vLLM's
                last = {**envelope, "choices": [final], "blocklab": _blocklab(response)}
                if options.continuous_usage_stats:
                    last["usage"] = _usage(*usage)
                yield chunk(last)
            if options.include_usage:
                yield chunk({**envelope, "choices": [], "usage": _usage(*usage)})
            yield "data: [DONE]\n\n"
        finally:
            for submission in submissions:
                submission.close()


class _Responses:
    """``POST /v1/responses``: OpenAI's Responses API for text, one prompt (the turns as a transcript,
    as chat's), answered whole as a ``response`` object or streamed as its semantic events (each
    ``event: TYPE`` with a ``sequence_number``, ending with ``response.completed``, or
    ``response.incomplete`` where ``max_output_tokens`` cut it; no ``[DONE]``)."""

    def __init__(self, front: Front, model_name: str):
        self.front = front
        self.model_name = model_name

    async def respond(self, body: ResponsesRequest, translation: _Translation, client: Request) -> Response:
        [submission] = translation.admit(self.front, [translation.request(translation.prompts[0])])
        ids = {
            "id": "resp_" + uuid.uuid4().hex,
            "item": "msg_" + uuid.uuid4().hex,
            "created": int(time.time()),
        }
        try:
            if body.stream:
                first = await submission.next_event(client)
                if first["event"] == "error":
                    return self.front.error_response(first, client.url.path)
                submission.stop_watching()  # the streaming response sees its client leave
                events = self._events(body, ids, first, submission)
                submission = None  # the stream closes it
                return StreamingResponse(events, media_type="text/event-stream")
            event = await submission.final_event(client)
        finally:
            if submission is not None:
                submission.close()
        if event["event"] == "error":
            return self.front.error_response(event, client.url.path)
        return JSONResponse(self._response(body, ids, event["response"]))

    def _message(self, ids: dict, text: str | None, status: str) -> dict:
        content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
        return {
            "type": "message",
            "id": ids["item"],
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def _response(self, body: ResponsesRequest, ids: dict, answer: dict | None) -> dict:
        """The ``response`` object: in progress (``answer`` None), else as the answer ended."""
        whole = {
            "id": ids["id"], "object": "response", "created_at": ids["created"],
            "model": body.model or self.model_name, "status": "in_progress", "output": [], "error": None,
            "incomplete_details": None, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": body.temperature, "top_p": body.top_p,
            "metadata": body.metadata, "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
            "store": False, "text": {"format": {"type": "text"}}, "truncation": "disabled", "user": body.user,
            "usage": None,
        }  # fmt: skip
        if answer is None:
            return whole
        cut = _finish_reason(answer["finish_reason"]) == "length"  # or scored: max_output_tokens 0
        made = new_token_count(answer)
        whole |= {
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": [self._message(ids, answer["text"], "incomplete" if cut else "completed")],
            "usage": {
                "input_tokens": answer["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": made,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": answer["prompt_tokens"] + made,
            },
            "blocklab": _blocklab(answer),
        }
        return whole

    async def _events(self, body: ResponsesRequest, ids: dict, first: dict, submission: Submission):
        """The stream: created, in progress, the message and its text part added, a delta per token
        with text, the text, part and message done, then completed (or incomplete)."""
        sequence = itertools.count()
        place = {"item_id": ids["item"], "output_index": 0, "content_index": 0}

        def sse(kind: str, **payload) -> str:
            event = {"type": kind, "sequence_number": next(sequence), **payload}
            return f"event: {kind}\ndata: {json.dumps(event)}\n\n"

        try:
            started = self._response(body, ids, None)
            yield sse("response.created", response=started)
            yield sse("response.in_progress", response=started)
            yield sse(
                "response.output_item.added", output_index=0, item=self._message(ids, None, "in_progress")
            )
            yield sse(
                "response.content_part.added",
                **place,
                part={"type": "output_text", "text": "", "annotations": []},
            )
            event, sent = first, ""
            while event["event"] == "token":
                if event["text"]:
                    sent += event["text"]
                    yield sse("response.output_text.delta", **place, delta=event["text"], logprobs=[])
                event = await submission.next_event()
            if event["event"] == "error":
                code = str(openai_status(event["status"]))
                yield sse("error", code=code, message=event["message"], param=None)
                return
            answer = event["response"]
            if answer["text"][len(sent) :]:  # bytes of a character still open at the end
                yield sse(
                    "response.output_text.delta", **place, delta=answer["text"][len(sent) :], logprobs=[]
                )
            whole = self._response(body, ids, answer)
            part = whole["output"][0]["content"][0]
            yield sse("response.output_text.done", **place, text=part["text"], logprobs=[])
            yield sse("response.content_part.done", **place, part=part)
            yield sse("response.output_item.done", output_index=0, item=whole["output"][0])
            yield sse(f"response.{whole['status']}", response=whole)
        finally:
            submission.close()


def _echoed(prompt: str | list[int], response: dict) -> str:
    """The prompt, then the text: decoded together from the ids where the prompt is ids and no stop
    string cut the text (a character split between the prompt's last token and the first generated
    one is whole then, and ``text_offset`` indexes into it)."""
    if isinstance(prompt, list) and response["stop_reason"] is None:
        return tokens.decode(prompt + response["tokens"])
    return _prompt_text(prompt) + response["text"]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _prompts(prompt: str | list) -> list[str | list[int]]:
    """The prompts of a completions body: one string, token ids, or a list of either."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def register(app: FastAPI, front: Front, *, model_name: str, responses: dict) -> None:
    completion = _Route(front, model_name, "text_completion")
    chat = _Route(front, model_name, "chat.completion")
    responses_api = _Responses(front, model_name)
    started = int(time.time())

    def context() -> int | None:
        limits = front.limits()
        return None if limits is None else limits.block_size

    def check_slots(prompts: list, n: int | None) -> None:
        """Each choice takes a slot: one client must leave some (``--max-prompts-per-request``)."""
        choices = len(prompts) * (n or 1)
        if choices > front.max_prompts:
            raise refuse(
                "n" if n and n > 1 else "prompt",
                f"at most {front.max_prompts} choices (prompts times n) in one request on this server "
                f"(--max-prompts-per-request), got {choices}",
            )

    async def completions(request: CompletionRequest, client: Request) -> Response:
        if request.logprobs is not None and request.logprobs > MAX_LOGPROBS:
            raise refuse(
                "logprobs", f"at most {MAX_LOGPROBS} (the most likely token), got {request.logprobs}"
            )
        if request.logprobs is not None and request.stream:
            raise refuse("logprobs", "not with stream: ask for the whole response")
        prompts = _prompts(request.prompt)
        check_slots(prompts, request.n)
        needs = frozenset({"top_tokens"} if request.logprobs else ())  # the most likely token per position
        translation = _Translation(request, prompts, request.max_tokens, {}, needs, context=context())
        return await completion.respond(translation, client, bool(request.echo), request.logprobs)

    async def responses_route(request: ResponsesRequest, client: Request) -> Response:
        prompt = chat_prompt(request.messages())
        names = {"max_new_tokens": "max_output_tokens", "prompt": "input"}
        translation = _Translation(
            request, [prompt], request.max_output_tokens, names, default_max_tokens=None, context=context()
        )
        return await responses_api.respond(request, translation, client)

    async def chat_completions(request: ChatCompletionRequest, client: Request) -> Response:
        given = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        max_tokens = getattr(request, given)
        names = {"max_new_tokens": given, "prompt": "messages"}
        check_slots([request.messages], request.n)
        # no default length: OpenAI's chat runs to the end of the text or of the context
        prompt = chat_prompt(request.messages)
        translation = _Translation(
            request, [prompt], max_tokens, names, default_max_tokens=None, context=context()
        )
        return await chat.respond(translation, client)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": started, "owned_by": "blocklab"}

    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    async def one_model(model: str) -> dict:
        if model != model_name:
            raise HTTPException(
                404,
                [
                    {
                        "type": "model_not_found",
                        "loc": ["path", "model"],
                        "msg": f"this server serves {model_name!r} only",
                    }
                ],
            )
        return model_card()

    routes: list[tuple[str, Callable, str, dict]] = [
        ("/v1/completions", completions, "POST", responses),
        ("/v1/chat/completions", chat_completions, "POST", responses),
        ("/v1/responses", responses_route, "POST", responses),
        ("/v1/models", models, "GET", {401: responses[401]}),
        (
            "/v1/models/{model}",
            one_model,
            "GET",
            {401: responses[401], 404: {"description": "No such model"}},
        ),
    ]
    for path, endpoint, method, answers in routes:
        app.add_api_route(path, endpoint, methods=[method], response_model=None, responses=answers)
