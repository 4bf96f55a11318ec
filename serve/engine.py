"""The server's inference: iteration-level scheduling, every block set in one forward pass.

An ``Engine`` holds the requests a worker is running, up to ``max_rows``, and advances them one
``tick`` at a time. Between any two ticks the worker adds what has arrived and the engine retires
what has finished, so a request never waits for another request's generation to end (Orca's
iteration-level scheduling, as vLLM, TGI and SGLang do it). Each tick:

1. retire: jobs whose client is gone stop silently; jobs past their deadline end with a 504 event;
2. prefill, chunked: jobs not yet prefilled advance by whole chunks of ``prefill_chunk`` prompt
   tokens, oldest first. While other rows are decoding, each advances one chunk per tick, and the
   tick's chunks stop once they reach ``prefill_per_step`` tokens (when none are decoding, as many
   as the context holds). A long prompt thus holds the running rows back for one chunk's pass per
   tick, not for its whole prefill, and prompts that arrive together start together instead of one
   tick apart; chunk boundaries depend on the prompt alone, so a prompt's losses are the same
   whatever else is running. What another prefill under the same blocks already computed is
   copied, not computed again (``serve.prompt_cache``): a whole identical prompt (waiting for a
   row ahead that prefills it), or the whole chunks a prompt begins with, of rows running or ended;
   with a ``PrefillLane`` (``prefill_lane``, on a CPU with threads to spare), a prompt that arrives
   while rows decode is prefilled on the lane's thread instead, beside the decode steps, and sends
   its first token at the end of the tick during which its prefill ended (or the next one's start);
3. decode: every prefilled row takes one step together, whatever its block set
   (``lab.decode.decode_rows``): block i runs on the rows whose set includes it, exit rows stop at
   their block, adaptive rows decide per token; a speculating row runs a round of its own.

Each row is a ``lab.generate.Generation``: the sampler and the stopping rules (end-of-text,
``min_tokens``, ``ignore_eos``, stop strings, the length, the deadline) are ``lab.generate``'s own,
so a request decodes here exactly as ``lab.generate.generate`` decodes it alone.

With ``batch_invariant`` (the default) the decode step runs under ``lab.rows.rows_alone``: every
row's logits are bit for bit those it gets alone, so a seeded request draws the same tokens whether
it ran alone or among any others; prefill is per request and needs nothing more. Off, the rows of a
step of more than ``lab.float_kernels.SHORT_RUN`` share matrix-matrix products: faster with many rows,
equal up to rounding.

A step that raises is run again row by row, so one bad request fails alone. Nothing here knows
about HTTP or LitServe: ``tick`` returns the events of the jobs that have news (built as
``serve.schema``'s models, then dumped to plain dicts for the trip to the HTTP side), and counts what
happened through a ``Tally``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch
import torch.nn.functional as F

from lab import generate as lab_generate
from lab import tokens
from lab.block_kernel import prefills_in_one_call
from lab.decode import decode_rows
from lab.generate import Generation, Step
from lab.hooks import hooked
from lab.model import GPT, KVCache
from lab.rows import rows_alone
from lab.sampling import SamplingError
from serve.prompt_cache import Prefill, PromptCache, copies_whole
from serve.schema import (
    DoneEvent,
    Job,
    PredictResponse,
    PromptScore,
    Speculation,
    Timings,
    TokenEvent,
    ended_at_eos,
    error_event,
)

logger = logging.getLogger(__name__)

COUNTERS = (
    "tokens_generated",
    "prefills_copied",
    "prompt_tokens_copied",
    "prompt_cache_bytes",
    "batches_split",
    "requests_done",
    "requests_failed",
    "requests_cancelled",
    "requests_timed_out",
    "prefills_in_lane",
)
"""What the engine counts; the server sums each over its workers at ``GET /stats``."""

LEVELS = ("prompt_cache_bytes",)
"""The ``COUNTERS`` that say what is held now (the bytes of the prompt cache, counted up and down),
not what happened: a worker that replaces another starts them again from 0."""

TOKEN_GAPS = "token_gaps_s"
"""The key of a done event beside its response: the seconds between its tokens, for the server's
metrics (``serve.metrics``; the HTTP side takes it out before a client sees the event)."""

Tally = Callable[[str, int], None]
"""Adds a count to one of ``COUNTERS``."""

Events = list[tuple[Hashable, dict]]
"""(key, event) pairs: each job's news, in order."""


def no_tally(name: str, count: int) -> None:
    """The default ``Tally``: nothing is counted (in-process use, tests)."""


def never_cancelled() -> bool:
    return False


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _scores(read_out: Callable[[torch.Tensor], torch.Tensor], stream: torch.Tensor, targets: list[int]):
    """The first n positions of stream [T, D], whose next tokens are ``targets``, read out by
    ``read_out`` (the decoder's): per position the target's loss, the most likely token and that
    token's loss (what OpenAI's logprobs report). [n, 3]."""
    n = len(targets)
    logits = read_out(stream[None, :n]).float()[0]  # [n, V]
    losses = F.cross_entropy(logits, torch.tensor(targets, device=logits.device), reduction="none")  # [n]
    top_logits, top_tokens = logits.max(-1)  # [n] each
    top_losses = torch.logsumexp(logits, -1) - top_logits  # [n]
    return torch.stack([losses, top_tokens.float(), top_losses], -1)  # [n, 3]


def _failed(key: Hashable, error: Exception) -> tuple[Hashable, dict]:
    return key, error_event(500, f"{type(error).__name__}: {error}")


class _Report:
    """One job's timings, score and blocks per token, and the events that report them."""

    def __init__(self, job: Job, started_at: float):
        self.job = job
        self.started_at = started_at
        self.batch_size = 1  # the most rows that shared one of its steps
        self.prefill_s = 0.0
        self.blocks_per_token: list[int] = []
        self.token_times: list[float] = []
        self.score: PromptScore | None = None

    def token(self, step: Step, index: int) -> dict | None:
        """Note a new token; its event when the job streams."""
        self.token_times.append(time.monotonic())
        self.blocks_per_token.append(len(step.blocks_run))
        if not self.job.stream:
            return None
        return TokenEvent(
            index=index, token=step.token, text=step.text, blocks=len(step.blocks_run)
        ).model_dump()

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

    def done(self, generation: Generation, blocks_run: list[int] | None) -> dict:
        now, job = time.monotonic(), self.job
        times, per_token = self.token_times, self.blocks_per_token
        mean_blocks = sum(per_token) / len(per_token) if per_token else float(len(blocks_run or ()))
        speculation = generation.speculation
        response = PredictResponse(
            id=job.request_id,
            text=generation.text,
            tokens=generation.tokens,
            prompt_tokens=len(job.prompt_tokens),
            finish_reason=generation.finish_reason,
            stop_reason=generation.stop_reason,
            seed=job.sampling.seed,
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
            speculation=None if speculation is None else Speculation.of(speculation),
        )
        event = DoneEvent(response=response).model_dump()
        event[TOKEN_GAPS] = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        return event


class _Row:
    """A job in the engine: its generation (cache, position, sampler, stopping rules) and report."""

    def __init__(self, key: Hashable, job: Job, model: GPT, cancelled: Callable[[], bool], started_at: float):
        self.key = key
        self.job = job
        self.cancelled = cancelled
        self.report = _Report(job, started_at)
        self.generation = Generation(
            model, job.prompt_tokens, job.max_new_tokens, job.sampling, job.block_set,
            eos_token=tokens.EOT, deadline=job.deadline, detokenize=True,
        )  # fmt: skip
        prompt = job.prompt_tokens
        generating = job.max_new_tokens > 0
        self.scoring = job.score or not generating
        # scoring alone needs the stream up to the second-to-last token; generating, the whole prompt
        self.feed = prompt if generating else prompt[:-1]
        # adaptive exit's losses come from its own pass (lab.generate.score), not from the prefill
        self.loss_targets = prompt[1:] if self.scoring and not job.block_set.is_adaptive else []
        decoder = self.generation.decoder
        self.fixed_blocks = None if job.block_set.is_adaptive else decoder.blocks
        self.fed = 0  # prompt tokens prefilled so far
        self.scores: list[torch.Tensor] = []  # per prefill chunk, _scores' [n, 3]
        self.prefilled = False
        self.in_lane = False  # its prefill runs on the prefill lane's thread now: that thread's alone
        self.last_stream: torch.Tensor | None = None  # [D]: the prompt's last position leaving the blocks
        self.setting = self._setting(model)

    def _setting(self, model: GPT) -> Hashable | None:
        """What a prefill computes besides its tokens: the blocks it runs and those that overwrite
        (the prefill's set: an adaptive row's runs all its blocks). None where a row's prefill is
        neither copied nor kept (``serve.prompt_cache``): a cache of lab.fast's (a tensor per layer),
        adaptive exit's scoring pass (its own), hooks on the model (they would see one prefill of two)."""
        decoder = self.generation.decoder
        cache = decoder.cache
        if not isinstance(cache, KVCache) or not isinstance(cache.k, torch.Tensor):  # lab.fast's: lists
            return None
        if self.scoring and self.job.block_set.is_adaptive:
            return None
        if hooked(model.modules()):
            return None
        prefill_set = decoder.prefill_set
        return tuple(prefill_set.blocks_to_run(model.config.n_layer)), frozenset(prefill_set.overwrite)

    def prefill(self) -> Prefill:
        """Its prefill as another row copies it (views of its cache: for as long as the row runs)."""
        cache, end, scored = self.generation.decoder.cache, len(self.feed), self.scored
        return Prefill(
            self.setting, tuple(self.feed), cache.k[:, :, :, :end], cache.v[:, :, :, :end],
            self.last_stream, scored, self.reader, None if scored is None else tuple(self.scores),
        )  # fmt: skip

    @property
    def scored(self) -> tuple[int, ...] | None:
        """The loss targets its prefill scores, or None where it scores none."""
        return tuple(self.loss_targets) or None

    @property
    def reader(self) -> Hashable:
        """What its prompt's losses are read out through: the tuned lens's translator of its
        prefill's last block (lens=tuned), or None."""
        decoder = self.generation.decoder
        return decoder.exit_translator(len(decoder.blocks))

    @property
    def speculating(self) -> bool:
        return self.generation.speculator is not None


LANE_POLL_S = 0.01
"""How long a tick with nothing but the lane's prefill to wait for waits for it at most, so that the
worker still takes new requests meanwhile."""


def _one_thread() -> None:
    """The lane thread's torch threads: 1. torch sets a thread's count anew from the process's last
    ``set_num_threads`` (any thread's) at the thread's first parallel op, so that comes first here;
    else the decode step beside the lane, restoring its own count, would give the lane that count."""
    torch.get_num_threads()  # the thread's first call: its count taken from the process's now
    torch.set_num_threads(1)


class PrefillLane:
    """A thread of its own for the prefills of prompts that arrive while other rows decode, with one
    of torch's threads (the decode steps take one fewer meanwhile): DistServe's and Splitwise's
    disaggregation of prefill from decode, on the cores of one CPU. A prompt's prefill is bound by
    its multiply-adds, so in line it holds every running row back for its whole pass; beside them,
    the running rows lose a thread's share of each step instead. Rows are prefilled one after another
    in the order they came, each as in line: the same chunks, through lab's one call, whose bits no
    thread count changes (``Engine._lane_open`` opens the lane only there), and of prompts with no
    losses to score (``Engine._lane_takes``).
    """

    def __init__(self):
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefill-lane", initializer=_one_thread
        )
        self.pending: list[tuple[_Row, Future]] = []  # submitted, in order

    @property
    def busy(self) -> bool:
        return any(not future.done() for _, future in self.pending)

    def submit(self, row: _Row, prefill: Callable[[_Row], object]) -> None:
        row.in_lane = True
        self.pending.append((row, self.executor.submit(prefill, row)))

    def finished(self) -> list[tuple[_Row, Future]]:
        """The submitted rows whose prefill has ended since the last call, in order."""
        ended = [future.done() for _, future in self.pending]  # once: a prefill may end meanwhile
        done = [pair for pair, is_done in zip(self.pending, ended, strict=True) if is_done]
        self.pending = [pair for pair, is_done in zip(self.pending, ended, strict=True) if not is_done]
        return done

    def wait(self, timeout: float) -> None:
        """Until one of the prefills ends, ``timeout`` seconds at most."""
        wait([future for _, future in self.pending], timeout=timeout, return_when=FIRST_COMPLETED)


class Engine:
    """The requests of one worker, advanced a tick at a time; see the module docstring."""

    def __init__(
        self,
        model: GPT,
        tally: Tally = no_tally,
        *,
        max_rows: int = 8,
        prefill_chunk: int = 64,
        prefill_per_step: int = 256,
        batch_invariant: bool = True,
        prompt_cache_bytes: int = 64 << 20,
        prefill_lane: bool = True,
    ):
        self.model = model
        # on a GPU a prefill is bound by reading the weights, and both passes would share one stream
        self.lane = PrefillLane() if prefill_lane and model.wte.weight.device.type == "cpu" else None
        self.prompt_cache = PromptCache(prompt_cache_bytes, prefill_chunk)  # the prefills of rows that ended
        self.ended_now: list[Prefill] = []  # this tick's ended rows' prefills, whatever the cache keeps
        self.tally = tally
        self.max_rows = max_rows
        self.prefill_chunk = prefill_chunk
        self.prefill_per_step = prefill_per_step
        self.batch_invariant = batch_invariant
        self.rows: list[_Row] = []  # in arrival order
        self.refused: Events = []  # jobs ``add`` could not take, answered at the next tick

    @property
    def capacity(self) -> int:
        """How many more jobs ``add`` takes now."""
        return self.max_rows - len(self.rows)

    @property
    def busy(self) -> bool:
        """Jobs held, refusals to answer, or prefills in the lane (a row that left meanwhile holds
        its cache there until the tick that collects it)."""
        return bool(self.rows or self.refused or (self.lane is not None and self.lane.pending))

    def add(self, key: Hashable, job: Job, cancelled: Callable[[], bool] = never_cancelled) -> None:
        """Take ``job`` (its events will carry ``key``); it is prefilled from the next tick.
        ``cancelled``: True once its client is gone (the job then stops without another event)."""
        if self.capacity <= 0:
            raise RuntimeError(f"the engine runs {self.max_rows} rows at most")
        try:
            self.rows.append(_Row(key, job, self.model, cancelled, time.monotonic()))
        except SamplingError as error:  # settings its block set cannot run (``resolve`` refuses them)
            self.refused.append((key, error_event(422, str(error))))

    def tick(self) -> Events:
        """Retire, prefill a chunk, decode a step; the (key, event) pairs of jobs with news. Each job
        ends with one ``done`` or ``error`` event, or silently once cancelled."""
        return [event for part in self.tick_parts() for event in part]

    def tick_parts(self) -> Iterator[Events]:
        """``tick`` a part at a time (after retiring, after each prefill chunk, after the decode
        step), so that a caller can send each part's events at once: a prompt's first token leaves
        when its prefill ends, not when the tick does (the lane's, at the tick's start and end)."""
        with torch.inference_mode():
            self.ended_now = []
            yield self._counted(self._retire())
            if self.lane is not None:
                yield self._counted(self._collect_lane())
            decoding = [row for row in self.rows if row.prefilled]
            waiting = [row for row in self.rows if not row.prefilled and not row.in_lane]
            lane_open = bool(waiting) and self._lane_open(decoding)
            budget = self.prefill_per_step if decoding else self.model.config.block_size
            for row in waiting:
                if row.fed == 0 and row.setting is not None and row in self.rows:
                    source = self._source(row)
                    whole = source is not None and source[1] == len(row.feed)
                    if not whole and self._twin_ahead(row):
                        continue  # copied from its twin once that is prefilled, in no pass of its own
                    if source is not None:
                        yield self._counted(
                            self._guarded(row, lambda row, source=source: self._copy(row, *source))
                        )
                if lane_open and row in self.rows and self._lane_takes(row):  # a failed copy ended it
                    self.lane.submit(row, self._prefill_in_lane)
                    self.tally("prefills_in_lane", 1)
                    continue
                # in line at the worker's full count, the lane busy or not: a prompt's losses are read
                # out through torch's matrix product, whose bits follow the thread count
                while budget > 0 and not row.prefilled and row in self.rows:
                    budget -= min(self.prefill_chunk, len(row.feed) - row.fed)
                    yield self._counted(self._guarded(row, self._prefill_chunk))
                    if decoding:  # one chunk per prompt per tick: the running rows wait for no more
                        break
            shared = [row for row in decoding if not row.speculating]
            with self._threads_beside_lane():
                if shared:
                    yield self._counted(self._decode(shared))
                for row in decoding:
                    if row.speculating and row in self.rows:
                        yield self._counted(self._guarded(row, self._speculate))
            if self.lane is not None:
                if not decoding and self.lane.busy:
                    self.lane.wait(LANE_POLL_S)  # nothing else to run: wake when its prefill ends
                yield self._counted(self._collect_lane())  # ended during the step: its first token now

    def _counted(self, events: Events) -> Events:
        for _, event in events:
            if event["event"] == "done":
                self.tally("requests_done", 1)
            elif event["event"] == "error":
                self.tally("requests_timed_out" if event["status"] == 504 else "requests_failed", 1)
        return events

    def abort(self, error: Exception) -> Events:
        """Fail every job held (the worker's loop broke); the engine is empty after."""
        events = [_failed(row.key, error) for row in self.rows]
        self.rows = []
        return events

    def run(self, jobs: list[tuple[Hashable, Job]]) -> Iterator[Events]:
        """In-process use: every (key, job), admitted as rows free up; per tick, the events."""
        waiting = list(jobs)
        while waiting or self.busy:
            while waiting and self.capacity > 0:
                self.add(*waiting.pop(0))
            events = self.tick()
            if events:
                yield events

    # -- the parts of a tick ----------------------------------------------------------------------

    def _retire(self) -> Events:
        """Drop the jobs whose client is gone (silently) and those past their deadline (a 504 event)."""
        now = time.monotonic()
        events, running = self.refused, []
        self.refused = []
        for row in self.rows:
            job = row.job
            try:
                cancelled = row.cancelled()
            except Exception as error:  # the check is the caller's code: its failure ends this job only
                events.append(_failed(row.key, error))
                continue
            if cancelled:
                self.tally("requests_cancelled", 1)
            elif row.generation.overdue(now):
                made = len(row.generation.tokens)
                message = (
                    f"request timeout: not finished within {job.deadline - job.submitted_at:g} s "
                    f"(the server's --request-timeout), stopped after {made} new tokens"
                )
                events.append((row.key, error_event(504, message)))
            else:
                running.append(row)
        self.rows = running
        return events

    def _guarded(self, row: _Row, work: Callable[[_Row], Events]) -> Events:
        """``work(row)``; should it raise, the row alone ends with a 500 event."""
        try:
            return work(row)
        except Exception as error:
            if row in self.rows:  # its end may have removed it before the error
                self.rows.remove(row)
            return [_failed(row.key, error)]

    def _source(self, row: _Row) -> tuple[Prefill, int] | None:
        """The prefill ``row`` copies most positions of (``serve.prompt_cache``), of the rows prefilled
        beside it or of those that ended, and how many; None where it copies nothing. A row that would
        copy only part looks no further than prefills that begin with its first chunk."""
        chunk, first = self.prefill_chunk, tuple(row.feed[: self.prefill_chunk])
        beside = [other for other in self.rows if other.prefilled and other.setting == row.setting]
        live = [other.prefill() for other in beside if other.feed[:chunk] == list(first)]
        ended = [p for p in self.ended_now if p.setting == row.setting and p.tokens[:chunk] == first]
        candidates = live + ended + self.prompt_cache.beginning(row.setting, first)
        best, most = None, 0
        for prefill in candidates:
            usable = prefill.usable(row.feed, row.loss_targets, row.reader, chunk)
            if usable > most:
                best, most = prefill, usable
        return None if best is None else (best, most)

    def _twin_ahead(self, row: _Row) -> bool:
        """Whether a row ahead of ``row`` in arrival order prefills what ``row`` would copy whole once
        it is done (its tokens, and its loss targets and read-out when ``row`` scores them). Done, it
        runs on, or it ended in the same tick, before ``row``'s turn (``ended_now``)."""
        return any(
            other.setting == row.setting and not other.prefilled
            and copies_whole(row.feed, row.loss_targets, row.reader, other.feed, other.scored, other.reader)
            for other in self.rows[: self.rows.index(row)]
        )  # fmt: skip

    def _copy(self, row: _Row, prefill: Prefill, count: int) -> Events:
        """``row``'s first ``count`` positions from ``prefill`` (``Prefill.usable``): their keys and
        values and, when it scores, their chunks' losses; when that is all of them, the stream leaving
        the last one too, and ``row`` is prefilled. The same bits its own prefill gives."""
        start = time.monotonic()
        cache = row.generation.decoder.cache
        cache.k[:, :, :, :count] = prefill.keys[:, :, :, :count]  # [L, 1, H, count, Dh]
        cache.v[:, :, :, :count] = prefill.values[:, :, :, :count]
        cache.length = row.fed = count
        whole = count == len(row.feed)
        if row.loss_targets:
            row.scores = list(
                prefill.chunk_scores if whole else prefill.chunk_scores[: count // self.prefill_chunk]
            )
        self.prompt_cache.used(prefill)
        self.tally("prompt_tokens_copied", count)
        row.report.prefill_s += time.monotonic() - start
        if not whole:
            return []
        self.tally("prefills_copied", 1)
        if row.scores:
            row.report.scored(torch.cat(row.scores))
        return self._prefilled(row, prefill.last_stream)

    def _prefill_chunk(self, row: _Row) -> Events:
        """The row's next chunk of prompt; at the end of the prompt its score and first token."""
        job, report = row.job, row.report
        start = time.monotonic()
        if job.block_set.is_adaptive and row.scoring and row.fed == 0:
            scored = lab_generate.score(self.model, job.prompt_tokens, job.block_set)
            report.scored(torch.tensor(scored.token_losses))
            if job.max_new_tokens == 0:
                report.blocks_per_token = scored.blocks_per_token
                report.prefill_s = time.monotonic() - start
                return self._end(row)
        stream = self._extend(row)
        report.prefill_s += time.monotonic() - start
        if row.fed < len(row.feed):
            return []
        return self._prefill_done(row, stream[-1].clone())

    def _extend(self, row: _Row) -> torch.Tensor:
        """The row's next chunk of prompt through its blocks, its losses kept: the stream leaving
        them [t, D]."""
        chunk_end = min(row.fed + self.prefill_chunk, len(row.feed))
        stream = row.generation.extend(row.feed[row.fed : chunk_end])  # [t, D]
        targets = row.loss_targets[row.fed : chunk_end]
        if targets:
            row.scores.append(_scores(row.generation.decoder.read_out, stream, targets))
        row.fed = chunk_end
        return stream

    def _prefill_done(self, row: _Row, last_stream: torch.Tensor, logits: torch.Tensor | None = None):
        """The end of ``row``'s prefill: its prompt's score, then ``_prefilled``'s events."""
        if row.scores:
            row.report.scored(torch.cat(row.scores))
        return self._prefilled(row, last_stream, logits)

    def _prefilled(self, row: _Row, last_stream: torch.Tensor, logits: torch.Tensor | None = None):
        """The end of ``row``'s prefill, ``last_stream`` [D] leaving its last position: its first token
        (from ``logits`` [V], read out here where not given), or its end when it only scores."""
        row.prefilled, row.last_stream = True, last_stream
        job, decoder = row.job, row.generation.decoder
        if job.max_new_tokens == 0:
            row.report.blocks_per_token = [len(row.fixed_blocks)] * len(job.prompt_tokens[1:])
            return self._end(row)
        if logits is None:
            logits = decoder.read_out(last_stream[None, None])[0, -1]  # [V]
        return self._took(row, [row.generation.pick(logits, decoder.blocks)])

    # -- the prefill lane ---------------------------------------------------------------------------

    def _lane_open(self, decoding: list[_Row]) -> bool:
        """Whether this tick's prefills go to the lane: there is one, rows are decoding (a prefill in
        line would hold them back), torch has a thread to spare for it (the lane takes one), and the
        model's prefill chunks and decode steps give the same bits at any thread count, as lab's
        one call computes them (``lab.block_kernel.prefills_in_one_call``; torch's matrix products
        do not: the lane would change a row's last bits). Not with hooks on the model (they would
        see two passes at once) or lab.fast's compiled steps."""
        return (
            self.lane is not None and bool(decoding) and torch.get_num_threads() > 1
            and prefills_in_one_call(self.model, self.prefill_chunk)
            and getattr(self.model, "fast", None) is None and not hooked(self.model.modules())
        )  # fmt: skip

    @staticmethod
    def _lane_takes(row: _Row) -> bool:
        """Whether ``row``'s prefill can run in the lane: prompt left to pass through its blocks, and
        no losses to score (a prompt's losses read out many positions at once through torch's
        matrix product, whose bits follow the thread count: in line, as alone)."""
        return row.fed < len(row.feed) and not row.scoring

    def _prefill_in_lane(self, row: _Row) -> tuple[torch.Tensor, torch.Tensor] | None:
        """On the lane's thread: the rest of ``row``'s prompt, chunk by chunk as in line; the stream
        leaving its last position [D] and the logits it reads out there [V] (one position: a
        matrix-vector product, the same bits at any thread count). None when the row left the
        engine meanwhile (cancelled, past its deadline)."""
        start = time.monotonic()
        with torch.inference_mode():
            while row.fed < len(row.feed):
                if row not in self.rows:
                    return None
                stream = self._extend(row)
            last_stream = stream[-1].clone()
            logits = row.generation.decoder.read_out(last_stream[None, None])[0, -1]  # [V]
        row.report.prefill_s += time.monotonic() - start
        return last_stream, logits

    def _collect_lane(self) -> Events:
        """The events of the rows whose prefill the lane finished: their first tokens (and ends, for
        rows that end there; a 500 for a prefill that raised). Rows gone meanwhile send nothing."""
        events = []
        for row, future in self.lane.finished():
            row.in_lane = False
            if row not in self.rows:
                continue
            error = future.exception()
            if error is not None:
                self.rows.remove(row)
                events.append(_failed(row.key, error))
                continue
            last_stream, logits = future.result()
            done = functools.partial(self._prefill_done, last_stream=last_stream, logits=logits)
            events += self._guarded(row, done)
        return events

    @contextlib.contextmanager
    def _threads_beside_lane(self) -> Iterator[None]:
        """While the lane runs a prefill: torch's threads here one fewer (the lane has the other)."""
        if self.lane is None or not self.lane.busy or torch.get_num_threads() < 2:
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(threads - 1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _decode(self, rows: list[_Row]) -> Events:
        """One step for ``rows`` together; should it raise, each row alone (only bad rows fail)."""
        try:
            invariant = rows_alone() if self.batch_invariant else contextlib.nullcontext()
            with invariant:
                decoders = [row.generation.decoder for row in rows]
                fed = [row.generation.last_token for row in rows]
                logits, blocks_run = decode_rows(self.model, decoders, fed)  # [B, V]
        except Exception as error:
            if len(rows) == 1:
                self.rows.remove(rows[0])
                return [_failed(rows[0].key, error)]
            logger.warning("a step of %d rows failed (%r); each runs again alone", len(rows), error)
            self.tally("batches_split", 1)
            return [event for row in rows for event in self._decode([row])]
        events = []
        for b, row in enumerate(rows):
            row.report.batch_size = max(row.report.batch_size, len(rows))
            events += self._took(row, [row.generation.pick(logits[b], blocks_run[b])])
        return events

    def _speculate(self, row: _Row) -> Events:
        """One round of self-speculative decoding for the row alone: 1 to k + 1 tokens."""
        return self._took(row, row.generation.speculate())

    def _took(self, row: _Row, steps: list[Step | None]) -> Events:
        """The events of the row's new tokens (None: end-of-text), and of its end when it ended."""
        events = []
        for step in steps:
            if step is None:
                continue
            self.tally("tokens_generated", 1)
            event = row.report.token(step, len(row.report.token_times))
            if event is not None:
                events.append((row.key, event))
        if row.generation.finished:
            events += self._end(row)
        return events

    def _end(self, row: _Row) -> Events:
        """The row's done event; the row leaves the engine, its prefill for later rows to copy. Should
        its event fail to build, the row stays, for the caller to fail it (it is never lost)."""
        done = [(row.key, row.report.done(row.generation, row.fixed_blocks))]
        if ended_at_eos(done[0][1]["response"]):  # drawn by a step as any token (vLLM counts it)
            self.tally("tokens_generated", 1)
        self.rows.remove(row)
        if row.prefilled and row.setting is not None:
            try:
                prefill = row.prefill()
                self.ended_now.append(prefill)  # views of its cache: for this tick's waiting twins
                if self.prompt_cache.max_bytes > 0:
                    self.tally("prompt_cache_bytes", self.prompt_cache.keep(prefill.kept()))
            except Exception:  # what later rows would copy: they compute it instead; this row is done
                logger.exception("the prefill of a finished row could not be kept")
        return done
