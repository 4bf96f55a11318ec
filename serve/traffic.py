"""``blocklab traffic``: your own traffic against a running server, under several block sets.

    blocklab traffic --serve builtin                                   # start, measure, stop a server
    blocklab serve --model builtin &
    blocklab traffic --requests 32 --concurrency 4                     # closed loop, the default sets
    blocklab traffic --serve builtin --target-ci 5% --budget 300       # rounds until the medians are sure
    blocklab traffic --serve gpt2-random --serve-dtype int4            # ... serving int4 weights
    blocklab traffic --rates 1 2 4 8 --slo ttft_ms=200 tpot_ms=50      # open loop: Poisson arrivals
    blocklab traffic --rate 4 --mix                                    # every block set in one stream
    blocklab traffic --prompts my_prompts.jsonl --block-sets all skip=5 exit=9 --duration 60 --json
    blocklab traffic --serve builtin --block-sets-from runs/plan/plan.json   # a plan's frontier, served

The same prompts (a text file with one prompt per line, a JSONL file with a ``prompt`` per line, or
by default pieces of the standard library's source the builtin model never trained on) are sent as
streaming ``/predict`` requests that also score the prompt. Closed loop: ``--concurrency`` clients,
each sending its next request when the last one ends. Open loop, as serving benchmarks measure
(vLLM's ``bench serve``): requests arrive at ``--rate`` per second whatever the server does,
Poisson (``--burstiness`` 1) or gamma-distributed intervals (below 1 burstier, above 1 steadier);
``--rates`` sweeps several.

The block sets take turns in ``--rounds`` rounds: in each round every set gets one turn, in a random
order drawn per round (``--seed``), so warm-up and drift fall on every set alike; a turn is its share
of ``--requests`` sent by the clients (or at the rate) all under that one set, so a set's time per
token is its own and not the cost of steps shared with other sets. ``--sequential``: all of one set,
then the next; ``--mix``: every set in one stream of requests, as real traffic mixes them. With
``--target-ci`` more rounds follow until every median's interval is that narrow or ``--budget`` is
spent.

Per block set (and rate), with the field names serving benchmarks use: time to first token, time per
output token, inter-token latency and end-to-end latency (mean, median, p99), request and output
throughput, goodput under ``--slo`` (requests per second meeting every SLO), mean prompt loss and its
increase over ``all``, blocks run per token; 95% bootstrap intervals of the medians and the mean loss,
and of each one's difference from ``all`` (``serve.traffic_report``). Printed as a table with the
frontier (the sets no other beats significantly on both latency and loss) under it, and written to
``OUT/traffic.csv``, ``OUT/traffic.json``, ``OUT/frontier.png`` and, for a sweep,
``OUT/latency_vs_rate.png``. Only loopback servers, unless ``--allow-remote``: this is a load
generator.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from lab import tokens
from lab.blocks import BlockSet
from lab.corpora import held_out_snippets
from lab.errors import UserError
from lab.flags import parse
from lab.measure import CONFIDENCE, check_loopback, interval
from lab.quantize import WEIGHT_DTYPES
from lab.weights import locate
from serve.client import Reply, arrival_gaps, closed_loop, open_loop, send
from serve.process import ServerProcess
from serve.traffic_report import MEDIANS, SLO_METRICS, Run, compare, render, summarize, write_results


@dataclass
class TrafficOptions:
    """``blocklab traffic``'s flags."""

    url: str = "http://127.0.0.1:8000"
    """The running server (loopback only, unless --allow-remote)."""
    serve: str | None = None
    """Start `blocklab serve --model MODEL` on a free loopback port for this run, and stop it after."""
    serve_dtype: str = "float32"
    """The weights of the server --serve starts: float32, bfloat16, float16; weight-only int8 / int4; or
    w8a8 / w4a8, int8 activations too (lab.quantize)."""
    api_key: str | None = None
    """The server's API key, if it has one."""
    prompts: Path | None = None
    """A text file (one prompt per line) or .jsonl (a prompt per line); default: held-out stdlib source."""
    block_sets: list[str] | None = None
    """Block set specs (default: adapted to the model's depth)."""
    block_sets_from: Path | None = None
    """A `blocklab plan` JSON: serve its frontier (with all), so its estimates meet served requests."""
    mix: bool = False
    """Every block set in one stream of requests (their rows share decode steps)."""
    sequential: bool = False
    """All requests of one block set, then the next (instead of interleaved rounds)."""
    rounds: int = 2
    """Rounds the requests of each block set are spread over (interleaved: one turn per set a round)."""
    concurrency: int = 4
    """Closed loop: clients sending at once."""
    rate: float | None = None
    """Open loop: requests per second (Poisson arrivals)."""
    rates: list[float] | None = None
    """Open loop: sweep these request rates."""
    burstiness: float = 1.0
    """Gamma shape of the arrival gaps (1: Poisson; below: burstier; above: steadier)."""
    slo: list[str] = field(default_factory=list)
    """Per-request bounds for goodput, e.g. ttft_ms=200 tpot_ms=50 (also itl_ms, e2el_ms)."""
    requests: int = 16
    """Requests per block set and rate (unless --duration), spread over the rounds."""
    duration: float | None = None
    """Seconds per block set and rate instead of a request count, spread over the rounds."""
    max_new_tokens: int = 16
    """Tokens generated per request."""
    target_ci: str | None = None
    """More rounds until every median's 95% interval is at most this wide: milliseconds, or a percentage
    of the median (5%)."""
    budget: float = 300.0
    """Seconds per rate that --target-ci may spend, its first rounds included."""
    out: Path = Path("traffic_out")
    """Directory for the CSV, JSON and PNGs."""
    seed: int = 0
    """Which default prompts are drawn, the order of each round, the arrival times, the resamples."""
    json: bool = False
    """Print the results as JSON (for machines) instead of a table."""
    allow_remote: bool = False
    """Allow a non-loopback server."""
    slo_ms: dict[str, float] = field(init=False)
    target: Target | None = field(init=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.requests < 1:
            raise UserError("--concurrency and --requests must be >= 1")
        if self.rounds < 1:
            raise UserError("--rounds must be >= 1")
        if self.rate is not None:
            self.rates = [self.rate, *(self.rates or [])]
        if self.rates and not all(rate > 0 for rate in self.rates):
            raise UserError("--rate/--rates must be positive")
        if not self.burstiness > 0:
            raise UserError("--burstiness must be positive")
        if self.serve_dtype not in WEIGHT_DTYPES:
            raise UserError(f"--serve-dtype: one of {', '.join(WEIGHT_DTYPES)}, got {self.serve_dtype!r}")
        if self.mix and self.sequential:
            raise UserError("give --mix or --sequential, not both")
        if self.block_sets and self.block_sets_from is not None:
            raise UserError("give --block-sets or --block-sets-from, not both")
        if self.sequential:
            self.rounds = 1  # all of one set, then the next
        self.slo_ms = parse_slo(self.slo)
        self.target = None if self.target_ci is None else Target.parse(self.target_ci)

    @property
    def per_turn(self) -> int:
        """Requests of each block set per round (--requests spread over --rounds, rounded up)."""
        return math.ceil(self.requests / self.rounds)

    @property
    def order(self) -> str:
        return "mixed" if self.mix else "sequential" if self.sequential else "interleaved"


@dataclass(frozen=True)
class Target:
    """How narrow ``--target-ci`` wants every median's interval: ``value`` ms, or percent of the median."""

    value: float
    relative: bool

    @classmethod
    def parse(cls, text: str) -> Target:
        number = text.removesuffix("%")
        try:
            value = float(number)
        except ValueError:
            raise UserError(f"--target-ci: milliseconds (20) or a percentage (5%), got {text!r}") from None
        if not value > 0:
            raise UserError(f"--target-ci must be positive, got {text!r}")
        return cls(value, text.endswith("%"))

    def met(self, run: Run, seed: int = 0) -> bool:
        """Whether every median of ``run`` (TTFT, TPOT, end to end) has an interval this narrow."""
        for metric in MEDIANS:
            values = np.asarray(run.seconds(metric)) * 1e3
            low_high = interval(values, np.median, seed=seed)
            if low_high is None:
                return False
            allowed = self.value / 100 * float(np.median(values)) if self.relative else self.value
            if low_high[1] - low_high[0] > allowed:
                return False
        return True


def parse_slo(items: list[str]) -> dict[str, float]:
    """``["ttft_ms=200", "tpot_ms=50"]`` -> {"ttft_ms": 200.0, "tpot_ms": 50.0}; UserError naming the
    part at fault."""
    slo = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in SLO_METRICS:
            known = ", ".join(SLO_METRICS)
            raise UserError(f"--slo: expected NAME=MS with NAME one of {known}, got {item!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise UserError(f"--slo: {name} needs a number of milliseconds, got {value!r}") from None
        if not slo[name] > 0:
            raise UserError(f"--slo: {name} must be positive, got {value}")
    return slo


# ---------------------------------------------------------------------------------------------------
# What is sent


def default_block_sets(n_layer: int, exit_probe: bool = False) -> list[str]:
    """``all``, one middle block skipped, three skipped, exits at 1/2 and 3/4 depth, adaptive exit.

    For 12 blocks: all, skip=5, skip=3,4,5, exit=6, exit=9, and adaptive exit: with the model's exit
    probe ``adaptive=0.8;min=2;check=probe``, else ``adaptive=0.98`` (state saturation, whose useful
    thresholds lie near 1). docs/inference.md measures both on the builtin model.
    """
    middle = max(0, n_layer // 2 - 1)
    three = sorted({max(0, middle - 2), max(0, middle - 1), middle})
    specs = [
        "all",
        f"skip={middle}",
        "skip=" + ",".join(map(str, three)),
        f"exit={max(1, n_layer // 2)}",
        f"exit={max(1, 3 * n_layer // 4)}",
        f"adaptive=0.8;min={min(2, n_layer)};check=probe" if exit_probe else "adaptive=0.98",
    ]
    return list(dict.fromkeys(specs))  # small models repeat some; keep the first of each


def block_sets_of_plan(path: Path) -> list[str]:
    """``all`` and the frontier of a ``blocklab plan`` JSON."""
    frontier = json.loads(path.read_text())["frontier"]
    return list(dict.fromkeys(["all", *(point["block_set"] for point in frontier)]))


def read_prompts(path: Path | None, count: int, seed: int = 0) -> list[str]:
    """Prompts from a text file (one per line) or a JSONL file (``{"prompt": ...}`` or a string per
    line); by default ``count`` pieces of held-out standard-library source, drawn with ``seed``
    (``lab.corpora.held_out_snippets``: the text ``bus``, ``ablate`` and ``plan`` read by default)."""
    if path is None:
        return held_out_snippets(count, seed)
    lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    if Path(path).suffix == ".jsonl":
        records = [json.loads(line) for line in lines]
        lines = [record if isinstance(record, str) else record["prompt"] for record in records]
    if not lines:
        raise UserError(f"{path}: no prompts in it")
    return lines


def fit_prompt(prompt: str, max_tokens: int) -> str:
    """``prompt`` cut to its first ``max_tokens`` tokens, so prompt plus new tokens fit the context."""
    ids = tokens.encode(prompt, allow_endoftext=True)
    return prompt if len(ids) <= max_tokens else tokens.decode(ids[:max_tokens])


def request_body(prompt: str, block_set: str, max_new_tokens: int) -> dict:
    """A streaming ``/predict`` request that also scores its prompt."""
    return {
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "blocks": block_set,
        "score": True,
        "stream": True,
    }


# ---------------------------------------------------------------------------------------------------
# Rounds and turns


def turns_of_round(block_sets: list[str], number: int, order: str, seed: int) -> list[tuple[str, ...]]:
    """The turns of round ``number``, each the block sets it sends under: every set once, in an order
    drawn for this round from ``seed`` (``interleaved``), in the order given (``sequential``), or all
    sets in one turn (``mixed``)."""
    if order == "mixed":
        return [tuple(block_sets)]
    shuffled = list(block_sets)
    if order == "interleaved":
        random.Random(seed * 1_000_003 + number).shuffle(shuffled)
    return [(block_set,) for block_set in shuffled]


async def rounds_until(
    run_round: Callable[[int], Awaitable[None]],
    first: int,
    narrow: Callable[[], bool] | None,
    budget_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[int, bool | None]:
    """Run rounds 0 .. ``first`` - 1, then more while ``narrow`` (None: no target) says the intervals
    are not narrow yet and one more round, as long as the mean round so far, fits in ``budget_s``
    (counted from the first round); the number of rounds run, and whether the target was met (None
    without one)."""
    start = clock()
    for number in range(first):
        await run_round(number)
    done = first
    if narrow is None:
        return done, None
    while not narrow():
        spent = clock() - start
        if spent + spent / done > budget_s:
            return done, False
        await run_round(done)
        done += 1
    return done, True


async def run_turn(
    http: httpx.AsyncClient,
    bodies: list[dict],
    rate: float | None,
    options: TrafficOptions,
    *,
    seed: int,
    progress: tqdm,
) -> tuple[list[Reply], float]:
    """Send ``bodies`` (cycling, while the turn's share of ``--duration`` lasts) from the closed loop's
    clients or at ``rate``; the replies and the wall time."""
    start = time.perf_counter()
    seconds = None if options.duration is None else options.duration / options.rounds
    count = len(bodies) if seconds is None else None
    stop = lambda: seconds is not None and time.perf_counter() - start >= seconds  # noqa: E731

    async def job(number: int) -> Reply:
        reply = await send(http, {**bodies[number % len(bodies)], "seed": number + 1})
        progress.update(1)
        return reply

    if rate is None:
        replies = await closed_loop(job, options.concurrency, count=count, stop=stop)
    else:
        arrivals = count if count is not None else int(rate * seconds) + 1
        replies = await open_loop(job, arrival_gaps(arrivals, rate, options.burstiness, seed), stop=stop)
    return replies, time.perf_counter() - start


class Experiment:
    """Every block set at every rate, in rounds of turns (see the module docstring)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        block_sets: list[str],
        prompts: list[str],
        options: TrafficOptions,
        progress: tqdm,
    ):
        self.http, self.block_sets, self.prompts = http, block_sets, prompts
        self.options, self.progress = options, progress
        self.rates = options.rates or [None]
        self.runs = {(rate, s): Run(s, rate) for rate in self.rates for s in block_sets}
        self.rounds: dict[str, int] = {}
        """Rounds run, per rate."""
        self.target_met: dict[str, bool] = {}
        """Per rate, with --target-ci: whether every interval got that narrow within --budget."""

    async def run(self) -> list[Run]:
        options = self.options
        for rate in self.rates:
            narrow = None if options.target is None else partial(self.narrow, rate)
            one_round = partial(self.round, rate)
            self.rounds[str(rate)], met = await rounds_until(
                one_round, options.rounds, narrow, options.budget
            )
            if met is not None:
                self.target_met[str(rate)] = met
                at = f" at {rate:g} requests/s" if rate else ""
                outcome = "met" if met else f"not met within --budget {options.budget:g} s"
                print(
                    f"--target-ci {options.target_ci}{at}: {outcome} after {self.rounds[str(rate)]} rounds",
                    file=sys.stderr,
                )
        return list(self.runs.values())

    async def round(self, rate: float | None, number: int) -> None:
        """Round ``number``: each of its turns sends this round's prompts under the turn's block sets."""
        options, start = self.options, number * self.options.per_turn
        prompts = [self.prompts[(start + i) % len(self.prompts)] for i in range(options.per_turn)]
        for turn, sets in enumerate(turns_of_round(self.block_sets, number, options.order, options.seed)):
            label = "+".join(sets) if len(sets) < 3 else f"{len(sets)} sets mixed"
            self.progress.set_description(f"round {number + 1}: {label}" + (f" @ {rate:g}/s" if rate else ""))
            # every set of a mixed turn gets the same prompts, interleaved, so their losses compare
            bodies = [request_body(p, s, options.max_new_tokens) for p in prompts for s in sets]
            seed = options.seed + 7919 * number + turn
            replies, wall_s = await run_turn(
                self.http, bodies, rate, options, seed=seed, progress=self.progress
            )
            for block_set in sets:
                self.runs[(rate, block_set)].replies += [r for r in replies if r.body["blocks"] == block_set]
                self.runs[(rate, block_set)].wall_s += wall_s

    def narrow(self, rate: float | None) -> bool:
        """Whether every set's medians at ``rate`` meet ``--target-ci``."""
        return all(
            self.options.target.met(run, self.options.seed) for (r, _), run in self.runs.items() if r == rate
        )


# ---------------------------------------------------------------------------------------------------
# The command


async def _model_info(http: httpx.AsyncClient, url: str) -> dict:
    try:
        return (await http.get("/info")).raise_for_status().json()["model"]
    except httpx.TransportError as error:
        raise UserError(f"no server at {url} ({error}); start one or pass --serve MODEL") from None


def _check_block_sets(block_sets: list[str], info: dict, max_new_tokens: int) -> None:
    """Say once, before sending, what the server would refuse in every request."""
    for spec in block_sets:
        try:
            BlockSet.parse(spec, info["depth"])
        except ValueError as error:
            raise UserError(f"--block-sets: {error}") from None
    if info["context_length"] - max_new_tokens < 2:
        raise UserError(
            f"--max-new-tokens {max_new_tokens} leaves no room in a context of {info['context_length']}"
        )


async def run(options: TrafficOptions, url: str) -> tuple[list, dict]:
    """Measure the server at ``url``; the summaries (``serve.traffic_report.Summary``) and the run's facts."""
    headers = {"X-API-Key": options.api_key} if options.api_key else {}
    connections = None if options.rates else options.concurrency  # open loop: as many as arrive
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    timeout = httpx.Timeout(600.0, connect=10.0)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout, limits=limits) as http:
        info = await _model_info(http, url)
        block_sets = options.block_sets or default_block_sets(info["depth"], info.get("exit_probe", False))
        _check_block_sets(block_sets, info, options.max_new_tokens)
        many = options.duration is not None or options.target is not None  # more rounds, fresh prompts
        room = info["context_length"] - options.max_new_tokens
        drawn = read_prompts(
            options.prompts, max(options.requests, 256) if many else options.requests, options.seed
        )
        prompts = [fit_prompt(prompt, room) for prompt in drawn]
        # one request first, unmeasured: the first pass of a fresh worker pays one-time costs
        await send(http, {"prompt": prompts[0], "max_new_tokens": options.max_new_tokens, "stream": True})
        total = (
            None
            if many
            else options.per_turn * options.rounds * len(block_sets) * len(options.rates or [None])
        )
        with tqdm(total=total, unit="req", disable=options.json, file=sys.stderr) as progress:
            experiment = Experiment(http, block_sets, prompts, options, progress)
            runs = await experiment.run()
    concurrency = None if options.rates else options.concurrency
    summaries = [summarize(r, concurrency=concurrency, slo=options.slo_ms, seed=options.seed) for r in runs]
    meta = {
        "url": url,
        "model": info["name"],
        "depth": info["depth"],
        "mode": "open loop" if options.rates else "closed loop",
        "concurrency": concurrency,
        "burstiness": options.burstiness if options.rates else None,
        "mixed": options.mix,
        "order": options.order,
        "rounds": experiment.rounds,
        "confidence": CONFIDENCE,
        "target_ci": options.target_ci,
        "target_met": experiment.target_met or None,
        "slo": options.slo_ms,
        "max_new_tokens": options.max_new_tokens,
        "prompts": len(prompts),
    }
    return compare(runs, summaries, options.seed), meta


def main(argv: list[str]) -> int:
    options = parse(TrafficOptions, argv[1:], prog="blocklab traffic", description=__doc__.split("\n\n")[0])
    check_loopback(options.url, allow_remote=options.allow_remote, allowed_by="--allow-remote")
    if options.block_sets_from is not None:
        options.block_sets = block_sets_of_plan(options.block_sets_from)
    if options.serve is None:
        summaries, meta = asyncio.run(run(options, options.url))
    else:
        locate(options.serve)  # a missing model fails here in one line, before a server starts
        if options.prompts is not None:
            read_prompts(options.prompts, options.requests)  # and so do prompts that cannot be read
        command = ["--model", options.serve, "--dtype", options.serve_dtype]
        print(f"starting blocklab serve {' '.join(command)} ...", file=sys.stderr)
        with ServerProcess(command) as server:
            summaries, meta = asyncio.run(run(options, server.url))
    paths = write_results(summaries, options.out, meta)
    if options.json:
        files = {name: str(path) for name, path in paths.items()}
        print(json.dumps({**meta, "block_sets": [asdict(s) for s in summaries], "files": files}))
    else:
        print(render(summaries))
        print(f"\nwritten: {', '.join(str(path) for path in paths.values())}")
    return 1 if any(summary.errors for summary in summaries) else 0
