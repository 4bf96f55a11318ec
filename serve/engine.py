"""The server's inference: requests that share a block set share forward passes.

A batch of requests is split into groups that can run as one tensor:

- scoring (``max_new_tokens`` 0) under one fixed block set: one right-padded forward pass. This is
  exact under causal attention: position t only reads positions <= t, so the padding after a short
  sequence never reaches its losses, which are taken over its own positions only.
- generation under one fixed block set: one prefill and one KV cache for all rows, then one token
  per row per step. Prompts of different lengths are left-padded to the longest, with each row's
  positions counted from its first real token and a mask that hides the padding
  (``GPT.residual_stream(padding=...)``), so every row computes what it would alone, up to rounding
  (a batch multiplies matrices where one row multiplies a vector). A group's
  longest prompt plus its largest ``max_new_tokens`` must fit the context: jobs are packed into
  groups by prompt length until they would not.
- adaptive exit decides per token and per position, so each such request runs alone, through
  ``lab.generate``.

Prefills run ``GPT.residual_stream`` and unembed only the positions needed (the last one; every one
for rows that score): ``GPT.forward`` would make a [B, T, V] tensor, 1.6 GB for 8 GPT-2 prompts of
1024 tokens. Groups advance in lockstep, one step each per ``Engine.run`` tick, so a long generation
does not hold back another group's first token. Between steps every group drops the jobs whose
client is gone and ends those past their deadline with a 504 error event, so a long generation
cannot hold a worker past ``--request-timeout``. Nothing here knows about HTTP or LitServe: ``run``
yields, per tick, the events (plain dicts, see ``serve.schema``) of the jobs that have news, and
counts what happened through a ``Tally``.
"""

from __future__ import annotations

import codecs
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab import generate as lab_generate
from lab import tokens
from lab.blocks import BlockSet
from lab.model import GPT, KVCache

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


def pick_token(
    logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator
) -> int:
    """Greedy at temperature 0, else a sample from the (top-k) softmax; logits [V].

    The same arithmetic as ``lab.generate``'s sampler, so a seed gives the same tokens either way.
    """
    if temperature == 0.0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator))


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


def _losses(model: GPT, stream: torch.Tensor, idx: torch.Tensor, length: int) -> torch.Tensor:
    """Next-token losses [length-1] of one row: stream [T, D] and tokens idx [T], first ``length`` real."""
    logits = model.unembed(stream[None, : length - 1]).float()[0]  # [length-1, V]
    return F.cross_entropy(logits, idx[1:length], reduction="none")  # [length-1]


class _Progress:
    """One job's output so far, and the events that report it."""

    def __init__(self, job: Job, batch_size: int, started_at: float):
        self.job = job
        self.batch_size = batch_size
        self.started_at = started_at
        self.prefill_s = 0.0
        self.new_tokens: list[int] = []
        self.blocks_per_token: list[int] = []
        self.token_times: list[float] = []
        self.score: dict | None = None
        self.text = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def token(self, token: int, blocks: int) -> dict | None:
        """Record a new token; its event when the job streams."""
        self.token_times.append(time.monotonic())
        self.new_tokens.append(token)
        self.blocks_per_token.append(blocks)
        piece = self.text.decode(tokens.decode_token_bytes(token))
        if not self.job.stream:
            return None
        index = len(self.new_tokens) - 1
        return {"event": "token", "index": index, "token": token, "text": piece, "blocks": blocks}

    def scored(self, losses: torch.Tensor) -> None:
        self.score = {"mean_loss": float(losses.mean()), "token_losses": losses.tolist()}

    def done(self, finish_reason: str, blocks_run: list[int] | None) -> dict:
        now, job = time.monotonic(), self.job
        times, per_token = self.token_times, self.blocks_per_token
        mean_blocks = sum(per_token) / len(per_token) if per_token else float(len(blocks_run or ()))
        response = {
            "id": job.request_id,
            "text": tokens.decode(self.new_tokens),
            "tokens": self.new_tokens,
            "prompt_tokens": len(job.prompt_tokens),
            "finish_reason": finish_reason,
            "seed": job.seed,
            "block_set": str(job.block_set),
            "blocks_run": blocks_run,
            "blocks_per_token": per_token,
            "mean_blocks_per_token": mean_blocks,
            "score": self.score,
            "timings": {
                "queue_ms": _ms(self.started_at - job.submitted_at),
                "prefill_ms": _ms(self.prefill_s),
                "first_token_ms": _ms(times[0] - job.submitted_at) if times else None,
                "per_token_ms": _ms((times[-1] - times[0]) / (len(times) - 1)) if len(times) > 1 else None,
                "total_ms": _ms(now - job.submitted_at),
            },
            "batch_size": self.batch_size,
        }
        return {"event": "done", "response": response}


def error_event(status: int, message: str) -> dict:
    return {"event": "error", "status": status, "message": message}


class _Group(ABC):
    """Jobs that advance together. ``step`` returns (position in the batch, event) pairs."""

    def __init__(self, model: GPT, members: list[tuple[int, Job]], started_at: float, tally: Tally):
        self.model = model
        self.members = members
        self.started_at = started_at
        self.tally = tally
        self.progress = {position: _Progress(job, len(members), started_at) for position, job in members}
        self.began = False  # whether any step has run: a group that has not begun can be split

    def split(self) -> list[_Group]:
        """After a failure in the group's first step, one group per job, to run again alone: one bad
        request must not fail the requests it was batched with. [] when there is nothing to split
        (one job, or tokens already sent)."""
        if self.began or len(self.members) < 2:
            return []
        return [type(self)(self.model, [member], self.started_at, self.tally) for member in self.members]

    @property
    def finished(self) -> bool:
        return not self.members

    @abstractmethod
    def step(self) -> list[tuple[int, dict]]:
        """Advance every job one token (or finish them); their events. ``retire`` runs first, so
        there are members."""

    def fail(self, error: Exception) -> list[tuple[int, dict]]:
        """Every job still running gets the error; the group is over."""
        message = f"{type(error).__name__}: {error}"
        events = [(position, error_event(500, message)) for position, _ in self.members]
        self.members = []
        return events

    def retire(self) -> list[tuple[int, dict]]:
        """Drop the jobs whose client is gone (silently) and those past their deadline (a 504 event)."""
        now = time.monotonic()
        events, running = [], []
        for position, job in self.members:
            if job.cancelled():
                self.tally("requests_cancelled", 1)
            elif now > job.deadline:
                made = len(self.progress[position].new_tokens)
                message = (
                    f"request timeout: not finished within {job.deadline - job.submitted_at:g} s "
                    f"(the server's --request-timeout), stopped after {made} new tokens"
                )
                events.append((position, error_event(504, message)))
            else:
                running.append((position, job))
        self.members = running
        return events


class _Scoring(_Group):
    """Score-only jobs under one fixed block set: one right-padded forward pass."""

    def step(self) -> list[tuple[int, dict]]:
        events = []
        block_set = self.members[0][1].block_set
        lengths = [len(job.prompt_tokens) for _, job in self.members]
        width = max(lengths)
        padded = [
            job.prompt_tokens + [tokens.EOT] * (width - len(job.prompt_tokens)) for _, job in self.members
        ]
        idx = torch.tensor(padded, device=self.model.wte.weight.device)  # [B, T]
        start = time.monotonic()
        stream = self.model.residual_stream(idx[:, :-1], block_set=block_set)  # [B, T-1, D]
        losses = [_losses(self.model, stream[row], idx[row], length) for row, length in enumerate(lengths)]
        prefill_s = time.monotonic() - start
        blocks_run = block_set.blocks_to_run(self.model.config.n_layer)
        for row, (position, _) in enumerate(self.members):
            progress = self.progress[position]
            progress.prefill_s = prefill_s
            progress.scored(losses[row])
            progress.blocks_per_token = [len(blocks_run)] * len(losses[row])
            events.append((position, progress.done("scored", blocks_run)))
        self.members = []
        return events


class _Generation(_Group):
    """Generating jobs under one fixed block set: one left-padded prefill, one cache."""

    def __init__(self, model: GPT, members: list[tuple[int, Job]], started_at: float, tally: Tally):
        super().__init__(model, members, started_at, tally)
        device = model.wte.weight.device
        self.block_set = members[0][1].block_set
        self.blocks_run = self.block_set.blocks_to_run(model.config.n_layer)
        self.generators = {}
        for position, job in members:
            self.generators[position] = torch.Generator(device=device).manual_seed(job.seed)
        self.cache: KVCache | None = None
        self.padding: torch.Tensor | None = None  # [B] leading pad tokens per row; None: none anywhere
        self.cache_rows: list[int] = []  # the job (position) of each row of the cache
        self.last_tokens: dict[int, int] = {}

    def step(self) -> list[tuple[int, dict]]:
        events = []
        if self.cache is None:
            logits = self._prefill()  # [B, V]
        else:
            if len(self.members) < len(self.cache_rows):  # some retired since the last step
                self._keep_rows([self.cache_rows.index(position) for position, _ in self.members])
            last = [[self.last_tokens[position]] for position, _ in self.members]
            idx = torch.tensor(last, device=self.model.wte.weight.device)  # [B, 1]
            logits = self.model(idx, self.cache, self.block_set, self.padding)[:, -1].float()  # [B, V]

        still_running = []
        for row, (position, job) in enumerate(self.members):
            progress = self.progress[position]
            token = pick_token(logits[row], job.temperature, job.top_k, self.generators[position])
            if token == tokens.EOT:
                events.append((position, progress.done("stop", self.blocks_run)))
                continue
            self.tally("tokens_generated", 1)
            event = progress.token(token, len(self.blocks_run))
            if event is not None:
                events.append((position, event))
            if len(progress.new_tokens) == job.max_new_tokens:
                events.append((position, progress.done("length", self.blocks_run)))
                continue
            self.last_tokens[position] = token
            still_running.append((position, job))
        if still_running and len(still_running) < len(self.members):
            running = {position for position, _ in still_running}
            self._keep_rows([row for row, (position, _) in enumerate(self.members) if position in running])
        self.members = still_running
        return events

    def _prefill(self) -> torch.Tensor:
        """One pass over every row's prompt; fills the cache. The logits [B, V] after each prompt."""
        cfg = self.model.config
        prompts = [job.prompt_tokens for _, job in self.members]
        weight = self.model.wte.weight
        width = max(map(len, prompts))
        pads = [width - len(prompt) for prompt in prompts]
        max_len = width + max(job.max_new_tokens for _, job in self.members)
        start = time.monotonic()
        self.cache = KVCache(
            cfg, batch_size=len(prompts), max_len=max_len, device=weight.device, dtype=weight.dtype
        )
        self.cache_rows = [position for position, _ in self.members]
        if any(pads):
            self.padding = torch.tensor(pads, device=weight.device)  # [B]
        padded = [[tokens.EOT] * pad + prompt for pad, prompt in zip(pads, prompts, strict=True)]
        idx = torch.tensor(padded, device=weight.device)  # [B, T]
        stream = self.model.residual_stream(idx, self.cache, self.block_set, self.padding)  # [B, T, D]
        for row, (position, job) in enumerate(self.members):
            if job.score:
                real = slice(pads[row], width)
                losses = _losses(self.model, stream[row, real], idx[row, real], width - pads[row])
                self.progress[position].scored(losses)
        next_logits = self.model.unembed(stream[:, -1:]).float()[:, 0]  # [B, V]
        prefill_s = time.monotonic() - start
        for position, _ in self.members:
            self.progress[position].prefill_s = prefill_s
        return next_logits

    def _keep_rows(self, rows: list[int]) -> None:
        """Drop finished rows from the cache so later steps do not compute them."""
        self.cache_rows = [self.cache_rows[row] for row in rows]
        keep = torch.tensor(rows, device=self.cache.k.device)
        self.cache.k = self.cache.k[:, keep]  # [L, B', H, T_max, Dh]
        self.cache.v = self.cache.v[:, keep]  # [L, B', H, T_max, Dh]
        if self.padding is not None:
            self.padding = self.padding[keep]  # [B']


class _Adaptive(_Group):
    """One job under adaptive exit, through ``lab.generate`` (depth is decided per token)."""

    def __init__(self, model: GPT, members: list[tuple[int, Job]], started_at: float, tally: Tally):
        super().__init__(model, members, started_at, tally)
        ((self.position, self.job),) = members
        self.steps: Iterator[lab_generate.Step] | None = None

    def step(self) -> list[tuple[int, dict]]:
        events = []
        job, progress = self.job, self.progress[self.position]
        if self.steps is None:
            start = time.monotonic()
            if job.score or job.max_new_tokens == 0:
                scored = lab_generate.score(self.model, job.prompt_tokens, job.block_set)
                progress.scored(torch.tensor(scored.token_losses))
                if job.max_new_tokens == 0:
                    progress.blocks_per_token = [len(blocks) for blocks in scored.blocks_per_token]
                    progress.prefill_s = time.monotonic() - start
                    self.members = []
                    return [(self.position, progress.done("scored", None))]
            self.steps = lab_generate.generate(
                self.model,
                job.prompt_tokens,
                job.max_new_tokens,
                temperature=job.temperature,
                top_k=job.top_k,
                seed=job.seed,
                stop_token=tokens.EOT,
                block_set=job.block_set,
            )
            progress.prefill_s = time.monotonic() - start  # the first next() below adds the prefill
        step = next(self.steps)
        if step.token == tokens.EOT:
            self.members = []
            return [(self.position, progress.done("stop", None))]
        self.tally("tokens_generated", 1)
        event = progress.token(step.token, len(step.blocks_run))
        if event is not None:
            events.append((self.position, event))
        if len(progress.new_tokens) == job.max_new_tokens:
            events.append((self.position, progress.done("length", None)))
            self.members = []
        return events


class Engine:
    """Runs batches of jobs on one model; see the module docstring for how they share passes."""

    def __init__(self, model: GPT, tally: Tally = no_tally):
        self.model = model
        self.tally = tally

    def groups(self, jobs: list[tuple[int, Job]], started_at: float) -> list[_Group]:
        """Split (position, job) pairs into groups that can share forward passes."""
        scoring: dict[BlockSet, list[tuple[int, Job]]] = {}
        generating: dict[BlockSet, list[tuple[int, Job]]] = {}
        adaptive = []
        for position, job in jobs:
            if job.block_set.is_adaptive:
                adaptive.append(_Adaptive(self.model, [(position, job)], started_at, self.tally))
            else:
                by_block_set = scoring if job.max_new_tokens == 0 else generating
                by_block_set.setdefault(job.block_set, []).append((position, job))
        groups: list[_Group] = [
            _Scoring(self.model, members, started_at, self.tally) for members in scoring.values()
        ]
        for members in generating.values():
            for packed in self._pack(members):
                groups.append(_Generation(self.model, packed, started_at, self.tally))
        return groups + adaptive

    def _pack(self, members: list[tuple[int, Job]]) -> list[list[tuple[int, Job]]]:
        """Split generating jobs, shortest prompt first, into runs whose longest prompt plus largest
        ``max_new_tokens`` fit the context (each job alone fits: the request was checked)."""
        context = self.model.config.block_size
        packs: list[list[tuple[int, Job]]] = []
        most_new = 0  # the largest max_new_tokens in the last pack
        for position, job in sorted(members, key=lambda member: len(member[1].prompt_tokens)):
            # sorted: this job's prompt is the longest of the pack it joins
            if packs and len(job.prompt_tokens) + max(most_new, job.max_new_tokens) <= context:
                packs[-1].append((position, job))
                most_new = max(most_new, job.max_new_tokens)
            else:
                packs.append([(position, job)])
                most_new = job.max_new_tokens
        return packs

    @torch.inference_mode()
    def run(self, jobs: list[tuple[int, Job]]) -> Iterator[list[tuple[int, dict]]]:
        """Per tick, the (position, event) pairs of every job with news; each job ends with one
        ``done`` or ``error`` event (or silently, once cancelled)."""
        groups = self.groups(jobs, time.monotonic())
        while groups:
            events = []
            alone: list[_Group] = []
            for group in groups:
                try:
                    events += group.retire()
                    if group.finished:
                        continue
                    events += group.step()
                    group.began = True
                except Exception as error:  # one group's failure must not end the others
                    split = group.split()
                    if split:  # its jobs run again, each alone, from the next tick
                        logger.warning("a batch of %d failed (%r); each runs again alone", len(split), error)
                        self.tally("batches_split", 1)
                        alone += split
                        group.members = []
                    else:
                        events += group.fail(error)
            groups = [group for group in groups if not group.finished] + alone
            for _, event in events:
                if event["event"] == "done":
                    self.tally("requests_done", 1)
                elif event["event"] == "error":
                    self.tally("requests_timed_out" if event["status"] == 504 else "requests_failed", 1)
            if events:
                yield events
