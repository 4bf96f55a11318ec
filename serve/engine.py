"""The server's inference: iteration-level scheduling, every block set in one forward pass.

An ``Engine`` holds the requests a worker is running, up to ``max_rows``, and advances them one
``tick`` at a time. Between any two ticks the worker adds what has arrived and the engine retires
what has finished, so a request never waits for another request's generation to end (Orca's
iteration-level scheduling, as vLLM, TGI and SGLang do it). Each tick:

1. retire: jobs whose client is gone stop silently; jobs past their deadline end with a 504 event;
2. prefill, chunked: jobs not yet prefilled advance by whole chunks of ``prefill_chunk`` prompt
   tokens, oldest first, about one chunk per tick while other rows are decoding (as many as the
   context holds when none are). A long prompt thus holds the running rows back for one chunk's
   pass per tick, not for its whole prefill; and chunk boundaries depend on the prompt alone, so a
   prompt's losses are the same whatever else is running;
3. decode: every prefilled row takes one step together, whatever its block set
   (``lab.generate.decode_rows``): block i runs on the rows whose set includes it, exit rows stop at
   their block, adaptive rows decide per token.

With ``batch_invariant`` (the default) the decode step runs under ``lab.model.rows_alone``: every
row's logits are bit for bit those it gets alone, so a seeded request draws the same tokens whether
it ran alone or among any others; prefill is per request and needs nothing more. Off, rows share
matrix-matrix products: faster with many rows, equal up to rounding.

A step that raises is run again row by row, so one bad request fails alone. Nothing here knows
about HTTP or LitServe: ``tick`` returns the events of the jobs that have news (built as
``serve.schema``'s models, then dumped to plain dicts for the trip to the HTTP side), and counts what
happened through a ``Tally``.
"""

from __future__ import annotations

import codecs
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab import generate as lab_generate
from lab import tokens
from lab.blocks import BlockSet
from lab.generate import Decoder, SpeculationStats, Speculator, decode_rows, pick_token
from lab.model import GPT, rows_alone
from serve.schema import (
    DoneEvent,
    ErrorEvent,
    PredictResponse,
    PromptScore,
    Speculation,
    Timings,
    TokenEvent,
)

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One request, resolved for the served model."""

    request_id: str | None
    prompt_tokens: list[int]
    block_set: BlockSet
    max_new_tokens: int
    temperature: float
    top_k: int | None
    seed: int
    score: bool
    stream: bool
    submitted_at: float
    """``time.monotonic()`` when the request was queued."""
    cancelled: Callable[[], bool] = lambda: False
    """True once the client is gone: the job stops without another event."""
    deadline: float = float("inf")
    """``time.monotonic()`` past which the job ends with a 504 error event at its next step."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches this."""
    min_tokens: int = 0
    """The end-of-text token is not drawn before this many new tokens."""
    ignore_eos: bool = False
    """Generate ``max_new_tokens`` whatever is drawn: end-of-text does not stop the job (load tools)."""
    stop: tuple[str, ...] = ()
    """Strings that end the job once the generated text contains one (finish_reason 'stop'); the
    text returned ends before it."""


COUNTERS = (
    "tokens_generated",
    "batches_split",
    "requests_done",
    "requests_failed",
    "requests_cancelled",
    "requests_timed_out",
)
"""What the engine counts; the server sums each over its workers at ``GET /stats``."""

Tally = Callable[[str, int], None]
"""Adds a count to one of ``COUNTERS``."""


def no_tally(name: str, count: int) -> None:
    """The default ``Tally``: nothing is counted (in-process use, tests)."""


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _scores(model: GPT, stream: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """The first n positions of stream [T, D], whose next tokens are ``targets``: per position the
    target's loss, the most likely token and that token's loss (what OpenAI's logprobs report). [n, 3]."""
    n = len(targets)
    logits = model.unembed(stream[None, :n]).float()[0]  # [n, V]
    losses = F.cross_entropy(logits, torch.tensor(targets, device=logits.device), reduction="none")  # [n]
    top_logits, top_tokens = logits.max(-1)  # [n] each
    top_losses = torch.logsumexp(logits, -1) - top_logits  # [n]
    return torch.stack([losses, top_tokens.float(), top_losses], -1)  # [n, 3]


class _Progress:
    """One job's output so far, and the events that report it."""

    def __init__(self, job: Job, started_at: float):
        self.job = job
        self.started_at = started_at
        self.batch_size = 1  # the most rows that shared one of its steps
        self.prefill_s = 0.0
        self.new_tokens: list[int] = []
        self.blocks_per_token: list[int] = []
        self.token_times: list[float] = []
        self.score: dict | None = None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.stopped_at: int | None = None  # where a stop string begins in ``text``, once one appears
        self.speculation: SpeculationStats | None = None

    def token(self, token: int, blocks: int) -> dict | None:
        """Record a new token; its event when the job streams."""
        self.token_times.append(time.monotonic())
        self.new_tokens.append(token)
        self.blocks_per_token.append(blocks)
        piece = self.decoder.decode(tokens.decode_token_bytes(token))
        self.text += piece
        if self.job.stop:
            longest = max(map(len, self.job.stop))
            tail_from = max(0, len(self.text) - len(piece) - longest + 1)  # only new matches
            found = [at for at in (self.text.find(s, tail_from) for s in self.job.stop) if at >= 0]
            self.stopped_at = min(found) if found else None
        if not self.job.stream:
            return None
        index = len(self.new_tokens) - 1
        return TokenEvent(index=index, token=token, text=piece, blocks=blocks).model_dump()

    def scored(self, scores: torch.Tensor) -> None:
        """From ``_scores``' [n, 3], or losses [n] alone (adaptive exit, through lab.generate.score)."""
        if scores.dim() == 1:
            self.score = PromptScore(mean_loss=float(scores.mean()), token_losses=scores.tolist())
            return
        losses = scores[:, 0]
        self.score = PromptScore(
            mean_loss=float(losses.mean()),
            token_losses=losses.tolist(),
            top_tokens=scores[:, 1].long().tolist(),
            top_losses=scores[:, 2].tolist(),
        )

    def done(self, finish_reason: str, blocks_run: list[int] | None) -> dict:
        now, job = time.monotonic(), self.job
        times, per_token = self.token_times, self.blocks_per_token
        mean_blocks = sum(per_token) / len(per_token) if per_token else float(len(blocks_run or ()))
        text = tokens.decode(self.new_tokens) if self.stopped_at is None else self.text[: self.stopped_at]
        response = PredictResponse(
            id=job.request_id,
            text=text,
            tokens=self.new_tokens,
            prompt_tokens=len(job.prompt_tokens),
            finish_reason=finish_reason,
            seed=job.seed,
            block_set=str(job.block_set),
            blocks_run=blocks_run,
            blocks_per_token=per_token,
            mean_blocks_per_token=mean_blocks,
            score=self.score,
            timings=Timings(
                queue_ms=_ms(self.started_at - job.submitted_at),
                prefill_ms=_ms(self.prefill_s),
                first_token_ms=_ms(times[0] - job.submitted_at) if times else None,
                per_token_ms=_ms((times[-1] - times[0]) / (len(times) - 1)) if len(times) > 1 else None,
                total_ms=_ms(now - job.submitted_at),
            ),
            batch_size=self.batch_size,
            speculation=None if self.speculation is None else Speculation.of(self.speculation),
        )
        return DoneEvent(response=response).model_dump()


def error_event(status: int, message: str) -> dict:
    return ErrorEvent(status=status, message=message).model_dump()


class _Row:
    """A job in the engine: its decoder (cache and position), sampler state and progress."""

    def __init__(self, key: Hashable, job: Job, model: GPT, started_at: float):
        self.key = key
        self.job = job
        self.progress = _Progress(job, started_at)
        prompt = job.prompt_tokens
        generating = job.max_new_tokens > 0
        self.scoring = job.score or not generating
        # scoring alone needs the stream up to the second-to-last token; generating, the whole prompt
        self.feed = prompt if generating else prompt[:-1]
        # adaptive exit's losses come from its own pass (lab.generate.score), not from the prefill
        self.loss_targets = prompt[1:] if self.scoring and not job.block_set.is_adaptive else []
        max_len = len(self.feed) + job.max_new_tokens
        if job.block_set.is_speculative:  # its own rounds, not the shared steps (see Engine.tick)
            self.speculator: Speculator | None = Speculator(model, job.block_set, max_len)
            self.decoder = self.speculator.decoder
            self.progress.speculation = self.speculator.stats
        else:
            self.speculator = None
            self.decoder = Decoder(model, job.block_set, max_len=max_len)
        self.generator = torch.Generator(device=model.wte.weight.device).manual_seed(job.seed)
        self.fixed_blocks = None if job.block_set.is_adaptive else self.decoder.blocks
        self.fed = 0  # prompt tokens prefilled so far
        self.scores: list[torch.Tensor] = []  # per prefill chunk, _scores' [n, 3]
        self.last_token: int | None = None  # the token to feed at the next step, once prefilled

    @property
    def prefilled(self) -> bool:
        return self.last_token is not None


class Engine:
    """The requests of one worker, advanced a tick at a time; see the module docstring."""

    def __init__(
        self,
        model: GPT,
        tally: Tally = no_tally,
        *,
        max_rows: int = 8,
        prefill_chunk: int = 64,
        batch_invariant: bool = True,
    ):
        self.model = model
        self.tally = tally
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.batch_invariant = batch_invariant
        self.rows: list[_Row] = []  # in arrival order

    @property
    def capacity(self) -> int:
        """How many more jobs ``add`` takes now."""
        return self.max_rows - len(self.rows)

    @property
    def busy(self) -> bool:
        return bool(self.rows)

    def add(self, key: Hashable, job: Job) -> None:
        """Take ``job`` (its events will carry ``key``); it is prefilled from the next tick."""
        if self.capacity <= 0:
            raise RuntimeError(f"the engine runs {self.max_rows} rows at most")
        self.rows.append(_Row(key, job, self.model, time.monotonic()))

    def tick(self) -> list[tuple[Hashable, dict]]:
        """Retire, prefill a chunk, decode a step; the (key, event) pairs of jobs with news. Each job
        ends with one ``done`` or ``error`` event, or silently once cancelled."""
        return [event for part in self.tick_parts() for event in part]

    def tick_parts(self) -> Iterator[list[tuple[Hashable, dict]]]:
        """``tick`` a part at a time (after retiring, after each prefill chunk, after the decode
        step), so that a caller can send each part's events at once: a prompt's first token leaves
        when its prefill ends, not when the tick does."""
        with torch.inference_mode():
            yield self._counted(self._retire())
            decoding = [row for row in self.rows if row.prefilled]
            budget = self.prefill_chunk if decoding else self.model.config.block_size
            for row in [row for row in self.rows if not row.prefilled]:
                if budget <= 0:
                    break
                while budget > 0 and not row.prefilled and row in self.rows:
                    budget -= min(self.prefill_chunk, len(row.feed) - row.fed)
                    yield self._counted(self._guarded(row, self._prefill_chunk))
            shared = [row for row in decoding if row.speculator is None]
            if shared:
                yield self._counted(self._decode(shared))
            for row in decoding:
                if row.speculator is not None and row in self.rows:
                    yield self._counted(self._guarded(row, self._speculate))

    def _counted(self, events: list[tuple[Hashable, dict]]) -> list[tuple[Hashable, dict]]:
        for _, event in events:
            if event["event"] == "done":
                self.tally("requests_done", 1)
            elif event["event"] == "error":
                self.tally("requests_timed_out" if event["status"] == 504 else "requests_failed", 1)
        return events

    def abort(self, error: Exception) -> list[tuple[Hashable, dict]]:
        """Fail every job held (the worker's loop broke); the engine is empty after."""
        events = [(row.key, error_event(500, f"{type(error).__name__}: {error}")) for row in self.rows]
        self.rows = []
        return events

    def run(self, jobs: list[tuple[Hashable, Job]]) -> Iterator[list[tuple[Hashable, dict]]]:
        """In-process use: every (key, job), admitted as rows free up; per tick, the events."""
        waiting = list(jobs)
        while waiting or self.busy:
            while waiting and self.capacity > 0:
                self.add(*waiting.pop(0))
            events = self.tick()
            if events:
                yield events

    # -- the parts of a tick ----------------------------------------------------------------------

    def _retire(self) -> list[tuple[Hashable, dict]]:
        """Drop the jobs whose client is gone (silently) and those past their deadline (a 504 event)."""
        now = time.monotonic()
        events, running = [], []
        for row in self.rows:
            job = row.job
            try:
                cancelled = job.cancelled()
            except Exception as error:  # the check is the caller's code: its failure ends this job only
                events.append((row.key, error_event(500, f"{type(error).__name__}: {error}")))
                continue
            if cancelled:
                self.tally("requests_cancelled", 1)
            elif now > job.deadline:
                made = len(row.progress.new_tokens)
                message = (
                    f"request timeout: not finished within {job.deadline - job.submitted_at:g} s "
                    f"(the server's --request-timeout), stopped after {made} new tokens"
                )
                events.append((row.key, error_event(504, message)))
            else:
                running.append(row)
        self.rows = running
        return events

    def _guarded(self, row: _Row, work: Callable[[_Row], list[tuple[Hashable, dict]]]):
        """``work(row)``; should it raise, the row alone ends with a 500 event."""
        try:
            return work(row)
        except Exception as error:
            self._finish(row)
            return [(row.key, error_event(500, f"{type(error).__name__}: {error}"))]

    def _finish(self, row: _Row) -> None:
        self.rows.remove(row)

    def _prefill_chunk(self, row: _Row) -> list[tuple[Hashable, dict]]:
        """The row's next chunk of prompt; at the end of the prompt its score and first token."""
        job, progress = row.job, row.progress
        if row.speculator is not None and job.min_tokens > 0:
            self._finish(row)
            message = "min_tokens: not with speculate (drafts are drawn without it)"
            return [(row.key, error_event(422, message))]
        start = time.monotonic()
        if job.block_set.is_adaptive and row.scoring and row.fed == 0:
            scored = lab_generate.score(self.model, job.prompt_tokens, job.block_set)
            progress.scored(torch.tensor(scored.token_losses))
            if job.max_new_tokens == 0:
                progress.blocks_per_token = [len(blocks) for blocks in scored.blocks_per_token]
                progress.prefill_s = time.monotonic() - start
                self._finish(row)
                return [(row.key, progress.done("scored", None))]
        chunk_end = min(row.fed + self.prefill_chunk, len(row.feed))
        stream = row.decoder.extend(row.feed[row.fed : chunk_end])  # [t, D]
        targets = row.loss_targets[row.fed : chunk_end]
        if targets:
            row.scores.append(_scores(self.model, stream, targets))
        row.fed = chunk_end
        progress.prefill_s += time.monotonic() - start
        if row.fed < len(row.feed):
            return []
        if row.scores:
            progress.scored(torch.cat(row.scores))
        if job.max_new_tokens == 0:
            progress.blocks_per_token = [len(row.fixed_blocks)] * len(job.prompt_tokens[1:])
            self._finish(row)
            return [(row.key, progress.done("scored", row.fixed_blocks))]
        logits = self.model.unembed(stream[None, -1:])[0, -1]  # [V]
        blocks = len(row.decoder.prefill_set.blocks_to_run(self.model.config.n_layer))
        return self._emit(row, logits, blocks)

    def _decode(self, rows: list[_Row]) -> list[tuple[Hashable, dict]]:
        """One step for ``rows`` together; should it raise, each row alone (only bad rows fail)."""
        try:
            invariant = rows_alone() if self.batch_invariant else contextlib.nullcontext()
            with invariant:
                decoders, fed = [row.decoder for row in rows], [row.last_token for row in rows]
                logits, blocks_run = decode_rows(self.model, decoders, fed)  # [B, V]
        except Exception as error:
            if len(rows) == 1:
                self._finish(rows[0])
                return [(rows[0].key, error_event(500, f"{type(error).__name__}: {error}"))]
            logger.warning("a step of %d rows failed (%r); each runs again alone", len(rows), error)
            self.tally("batches_split", 1)
            return [event for row in rows for event in self._decode([row])]
        events = []
        for b, row in enumerate(rows):
            row.progress.batch_size = max(row.progress.batch_size, len(rows))
            events += self._emit(row, logits[b], len(blocks_run[b]))
        return events

    def _speculate(self, row: _Row) -> list[tuple[Hashable, dict]]:
        """One round of self-speculative decoding for the row alone: 1 to k + 1 tokens."""
        job = row.job
        wanted = job.max_new_tokens - len(row.progress.new_tokens)
        drawn = row.speculator.round(
            row.last_token, wanted, job.temperature, job.top_k, job.top_p, row.generator
        )
        events = []
        for token, _ in drawn:
            events += self._take(row, token, len(row.fixed_blocks))
            if row not in self.rows:
                break
        return events

    def _emit(self, row: _Row, logits: torch.Tensor, blocks: int) -> list[tuple[Hashable, dict]]:
        """Draw the row's next token from logits [V]; its events, and the row's end when it ends."""
        job, progress = row.job, row.progress
        logits = logits.float()
        if len(progress.new_tokens) < job.min_tokens and not job.ignore_eos:
            logits[tokens.EOT] = float("-inf")
        token = pick_token(logits, job.temperature, job.top_k, row.generator, job.top_p)
        return self._take(row, token, blocks)

    def _take(self, row: _Row, token: int, blocks: int) -> list[tuple[Hashable, dict]]:
        """Record the row's next token; its events, and the row's end when it ends."""
        job, progress = row.job, row.progress
        if token == tokens.EOT and not job.ignore_eos:
            self._finish(row)
            return [(row.key, progress.done("stop", row.fixed_blocks))]
        self.tally("tokens_generated", 1)
        event = progress.token(token, blocks)
        events = [] if event is None else [(row.key, event)]
        if progress.stopped_at is not None:
            finish = "stop"
        elif len(progress.new_tokens) == job.max_new_tokens:
            finish = "length"
        else:
            row.last_token = token
            return events
        self._finish(row)
        return [*events, (row.key, progress.done(finish, row.fixed_blocks))]
