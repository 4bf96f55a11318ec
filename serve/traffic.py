"""``blocklab traffic``: your own traffic against a running server, under several block sets.

    blocklab serve --model builtin &
    blocklab traffic --requests 32 --concurrency 4                     # closed loop, the default sets
    blocklab traffic --serve builtin                                   # start, measure, stop a server
    blocklab traffic --serve gpt2-random --serve-dtype int4            # ... serving int4 weights
    blocklab traffic --rates 1 2 4 8 --slo ttft_ms=200 tpot_ms=50      # open loop: Poisson arrivals
    blocklab traffic --rate 4 --mix                                    # every block set in one stream
    blocklab traffic --prompts my_prompts.jsonl --block-sets all skip=5 exit=9 --duration 60 --json
    blocklab traffic --serve builtin --block-sets-from runs/plan/plan.json   # a plan's frontier, served

The same prompts (a text file with one prompt per line, a JSONL file with a ``prompt`` per line, or
by default paragraphs of the Python docs bundled with Python, ``pydoc_data.topics``) are sent as
streaming ``/predict`` requests that also score the prompt. Closed loop: ``--concurrency`` clients,
each sending its next request when the last one ends. Open loop, as serving benchmarks measure
(vLLM's ``bench serve``): requests arrive at ``--rate`` per second whatever the server does,
Poisson (``--burstiness`` 1) or gamma-distributed intervals (below 1 burstier, above 1 steadier);
``--rates`` sweeps several. Each block set runs in turn, or with ``--mix`` all of them interleaved
in one stream of requests, as real traffic mixes them. Per block set (and rate), with the field
names serving benchmarks use: time to first token, time per output token, inter-token latency and
end-to-end latency (mean, median, p99), request and output throughput, goodput under ``--slo``
(requests per second meeting every SLO), mean prompt loss and its increase over ``all``, blocks run
per token. Written to ``OUT/traffic.csv``, ``OUT/traffic.json``, ``OUT/frontier.png`` (median
latency against loss, with the block sets no other beats on both) and, for a sweep,
``OUT/latency_vs_rate.png``. Only loopback servers, unless ``--allow-remote``: this is a load
generator.
"""

import argparse
import asyncio
import csv
import ipaddress
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
from tqdm import tqdm

from lab import tokens
from lab.blocks import BlockSet
from lab.errors import UserError
from lab.quantize import WEIGHT_DTYPES
from lab.weights import locate
from serve.testing import ServerProcess


@dataclass
class Sample:
    """One request as the client saw it (seconds)."""

    latency_s: float
    ttft_s: float | None = None
    tpot_s: float | None = None
    new_tokens: int = 0
    loss: float | None = None
    mean_blocks: float | None = None
    error: str | None = None
    itl_s: list[float] = field(default_factory=list)
    """The gaps between consecutive tokens."""
    block_set: str | None = None


SLO_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
"""What ``--slo`` may bound, per request (itl: its longest gap between tokens)."""


@dataclass
class Summary:
    """One block set's run (at one request rate), with the names serving benchmarks use."""

    block_set: str
    request_rate: float | None
    """Requests per second sent (open loop); None for a closed loop of ``concurrency`` clients."""
    concurrency: int | None
    completed: int
    errors: int
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2el_ms: float | None
    median_e2el_ms: float | None
    p90_e2el_ms: float | None
    p99_e2el_ms: float | None
    request_throughput: float
    output_throughput: float
    request_goodput: float | None
    """Requests per second that met every ``--slo`` (None without SLOs)."""
    mean_loss: float | None
    loss_increase: float | None
    """Mean loss minus that of ``all`` (None when ``all`` was not run)."""
    mean_blocks_per_token: float | None
    first_error: str | None


def default_block_sets(n_layer: int, exit_probe: bool = False) -> list[str]:
    """``all``, one middle block skipped, three skipped, exits at 1/2 and 3/4 depth, adaptive exit.

    For 12 blocks: all, skip=5, skip=3,4,5, exit=6, exit=9, and adaptive exit: with the model's exit
    probe ``adaptive=0.8;min=2;check=probe`` (on the builtin model half the blocks, for under half the
    loss a fixed exit at that depth costs), else ``adaptive=0.98`` (state saturation; on the
    builtin model its useful thresholds lie in 0.98-0.995). docs/inference.md has the numbers.
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


def read_prompts(path: Path | None, count: int, seed: int = 0) -> list[str]:
    """Prompts from a text file (one per line) or a JSONL file (``{"prompt": ...}`` or a string per
    line); by default ``count`` paragraphs of the Python docs, drawn with ``seed``."""
    if path is None:
        from pydoc_data.topics import topics

        paragraphs = [
            " ".join(paragraph.split())
            for text in topics.values()
            for paragraph in text.split("\n\n")
            if 80 <= len(paragraph.strip()) <= 2000
        ]
        return random.Random(seed).sample(sorted(paragraphs), min(count, len(paragraphs)))
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


def check_loopback(url: str, allow_remote: bool) -> None:
    host = urlparse(url).hostname or ""
    if allow_remote or host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UserError(f"{host} is not a loopback address; pass --allow-remote if you mean it")


async def _one(client: httpx.AsyncClient, body: dict) -> Sample:
    start = time.perf_counter()
    token_times, done = [], None
    block_set = body.get("blocks")
    try:
        async with client.stream("POST", "/predict", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                error = f"{response.status_code}: {text[:300]}"
                return Sample(time.perf_counter() - start, error=error, block_set=block_set)
            async for line in response.aiter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if event["event"] == "token":
                    token_times.append(time.perf_counter())
                elif event["event"] == "done":
                    done = event["response"]
                else:
                    error = f"{event['status']}: {event['message']}"
                    return Sample(time.perf_counter() - start, error=error, block_set=block_set)
    except httpx.HTTPError as error:
        message = f"{type(error).__name__}: {error}"
        return Sample(time.perf_counter() - start, error=message, block_set=block_set)
    latency = time.perf_counter() - start
    if done is None:
        return Sample(latency, error="stream ended without a summary", block_set=block_set)
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
    return Sample(
        latency_s=latency,
        ttft_s=token_times[0] - start if token_times else None,
        tpot_s=tpot,
        new_tokens=len(done["tokens"]),
        loss=done["score"]["mean_loss"] if done["score"] else None,
        mean_blocks=done["mean_blocks_per_token"],
        itl_s=[later - earlier for earlier, later in zip(token_times, token_times[1:], strict=False)],
        block_set=block_set,
    )


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between ``count`` arrivals at ``rate`` per second: gamma-distributed with shape
    ``burstiness`` (1: Poisson arrivals, exponential gaps), as vLLM's ``bench serve`` draws them."""
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=count).tolist()


async def run_requests(
    client: httpx.AsyncClient,
    bodies: list[dict],
    *,
    concurrency: int | None = None,
    rate: float | None = None,
    burstiness: float = 1.0,
    duration_s: float | None = None,
    seed: int = 0,
    progress: tqdm,
) -> tuple[list[Sample], float]:
    """Send ``bodies`` (cycling, while ``duration_s`` lasts) and collect what each client saw; the
    samples and the wall time. Closed loop with ``concurrency`` clients, or open loop at ``rate``."""
    samples: list[Sample] = []
    start = time.perf_counter()
    deadline = None if duration_s is None else start + duration_s
    limit = len(bodies) if duration_s is None else None

    def next_body(number: int) -> dict | None:
        over = deadline is not None and time.perf_counter() >= deadline
        if over or (limit is not None and number >= limit):
            return None
        return {**bodies[number % len(bodies)], "seed": number + 1}

    async def send(body: dict) -> None:
        samples.append(await _one(client, body))
        progress.update(1)

    if rate is None:
        sent = 0

        async def client_loop() -> None:
            nonlocal sent
            while (body := next_body(sent)) is not None:
                sent += 1
                await send(body)

        await asyncio.gather(*(client_loop() for _ in range(concurrency or 1)))
    else:
        count = limit if limit is not None else int(rate * duration_s) + 1
        arrival, tasks = start, []
        for number, gap in enumerate(arrival_gaps(count, rate, burstiness, seed)):
            arrival += gap
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            body = next_body(number)
            if body is None:
                break
            tasks.append(asyncio.create_task(send(body)))
        await asyncio.gather(*tasks)
    return samples, time.perf_counter() - start


async def run_block_set(
    client: httpx.AsyncClient,
    block_set: str,
    prompts: list[str],
    *,
    max_new_tokens: int,
    concurrency: int,
    requests: int | None,
    duration_s: float | None,
    progress: tqdm,
) -> tuple[list[Sample], float]:
    """Closed loop: send prompts (cycling) under ``block_set`` until the count or the time is up."""
    count = requests if requests is not None else len(prompts)
    bodies = [request_body(prompts[i % len(prompts)], block_set, max_new_tokens) for i in range(count)]
    return await run_requests(
        client, bodies, concurrency=concurrency, duration_s=duration_s, progress=progress
    )


def request_body(prompt: str, block_set: str, max_new_tokens: int) -> dict:
    """A streaming ``/predict`` request that also scores its prompt."""
    return {
        "prompt": prompt,
        "max_new_tokens": max_new_tokens,
        "blocks": block_set,
        "score": True,
        "stream": True,
    }


def _stats_ms(values: list[float], *quantiles: int) -> list[float | None]:
    """Mean then the given percentiles of ``values`` (seconds), in milliseconds."""
    if not values:
        return [None] * (1 + len(quantiles))
    means = [float(np.mean(values))] + [float(np.percentile(values, q)) for q in quantiles]
    return [round(value * 1000.0, 2) for value in means]


def meets(sample: Sample, slo: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (``SLO_METRICS`` -> milliseconds)."""
    measured = {
        "ttft_ms": sample.ttft_s,
        "tpot_ms": sample.tpot_s,
        "itl_ms": max(sample.itl_s) if sample.itl_s else None,
        "e2el_ms": sample.latency_s,
    }
    return all(measured[name] is None or measured[name] * 1000.0 <= bound for name, bound in slo.items())


def summarize(
    block_set: str,
    samples: list[Sample],
    wall_s: float,
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    slo: dict[str, float] | None = None,
) -> Summary:
    ok = [sample for sample in samples if sample.error is None]
    losses = [sample.loss for sample in ok if sample.loss is not None]
    blocks = [sample.mean_blocks for sample in ok if sample.mean_blocks is not None]
    errors = [sample.error for sample in samples if sample.error is not None]
    latencies = {
        "ttft": ([sample.ttft_s for sample in ok if sample.ttft_s is not None], (50, 99)),
        "tpot": ([sample.tpot_s for sample in ok if sample.tpot_s is not None], (50, 99)),
        "itl": ([gap for sample in ok for gap in sample.itl_s], (50, 99)),
        "e2el": ([sample.latency_s for sample in ok], (50, 90, 99)),
    }
    named = {}  # mean_ttft_ms, median_ttft_ms, p99_ttft_ms, ...
    for metric, (values, quantiles) in latencies.items():
        names = ["mean"] + ["median" if q == 50 else f"p{q}" for q in quantiles]
        stats = _stats_ms(values, *quantiles)
        named |= {f"{name}_{metric}_ms": value for name, value in zip(names, stats, strict=True)}
    per_s = (lambda count: round(count / wall_s, 3)) if wall_s > 0 else (lambda count: 0.0)
    return Summary(
        block_set=block_set,
        request_rate=rate,
        concurrency=concurrency,
        completed=len(ok),
        errors=len(errors),
        **named,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(sum(sample.new_tokens for sample in ok)),
        request_goodput=per_s(sum(meets(sample, slo) for sample in ok)) if slo else None,
        mean_loss=round(float(np.mean(losses)), 4) if losses else None,
        loss_increase=None,
        mean_blocks_per_token=round(float(np.mean(blocks)), 3) if blocks else None,
        first_error=errors[0] if errors else None,
    )


def with_loss_increase(summaries: list[Summary]) -> list[Summary]:
    """Fill each summary's loss increase over that of ``all`` at the same request rate."""
    base = {s.request_rate: s.mean_loss for s in summaries if s.block_set == "all"}
    for summary in summaries:
        if base.get(summary.request_rate) is not None and summary.mean_loss is not None:
            summary.loss_increase = round(summary.mean_loss - base[summary.request_rate], 4)
    return summaries


def frontier(summaries: list[Summary]) -> list[Summary]:
    """The block sets no other beats on both median latency and loss, fastest first."""
    points = sorted(
        (s for s in summaries if s.median_e2el_ms is not None and s.mean_loss is not None),
        key=lambda s: (s.median_e2el_ms, s.mean_loss),
    )
    best, kept = float("inf"), []
    for summary in points:
        if summary.mean_loss < best:
            kept.append(summary)
            best = summary.mean_loss
    return kept


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_frontier(summaries: list[Summary], path: Path, title: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [s for s in summaries if s.median_e2el_ms is not None and s.mean_loss is not None]
    ax.scatter([s.median_e2el_ms for s in points], [s.mean_loss for s in points], color="tab:blue", zorder=3)
    for summary in points:
        ax.annotate(
            summary.block_set,
            (summary.median_e2el_ms, summary.mean_loss),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=8,
        )
    best = frontier(summaries)
    ax.step(
        [s.median_e2el_ms for s in best],
        [s.mean_loss for s in best],
        where="post",
        color="tab:orange",
        label="frontier (nothing faster is better)",
    )
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("median end-to-end latency per request (ms)")
    ax.set_ylabel("mean prompt loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency_vs_rate(summaries: list[Summary], path: Path, title: str) -> None:
    """Median end-to-end latency and median TTFT against the request rate, a line per block set."""
    plt = _pyplot()
    fig, (e2el, ttft) = plt.subplots(1, 2, figsize=(10, 4.2))
    for block_set in dict.fromkeys(s.block_set for s in summaries):
        runs = sorted((s for s in summaries if s.block_set == block_set), key=lambda s: s.request_rate)
        rates = [s.request_rate for s in runs]
        e2el.plot(rates, [s.median_e2el_ms for s in runs], marker="o", label=block_set)
        ttft.plot(rates, [s.median_ttft_ms for s in runs], marker="o", label=block_set)
    for ax, what in ((e2el, "median end-to-end latency (ms)"), (ttft, "median time to first token (ms)")):
        ax.set_xlabel("request rate (requests/s, open loop)")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    e2el.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(summaries: list[Summary], out: Path, meta: dict) -> dict[str, Path]:
    """traffic.csv and traffic.json (every run), frontier.png (the first rate's runs) and, when
    several rates ran, latency_vs_rate.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "traffic.csv", "json": out / "traffic.json", "png": out / "frontier.png"}
    rows = [asdict(summary) for summary in summaries]
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    paths["json"].write_text(json.dumps({**meta, "block_sets": rows}, indent=2) + "\n")
    first_rate = summaries[0].request_rate
    load = f"{first_rate:g} req/s" if first_rate is not None else f"{meta.get('concurrency')} clients"
    plot_frontier(
        [s for s in summaries if s.request_rate == first_rate],
        paths["png"],
        f"{meta.get('model')}: latency vs loss ({load})",
    )
    if len({s.request_rate for s in summaries}) > 1:
        paths["rates_png"] = out / "latency_vs_rate.png"
        plot_latency_vs_rate(summaries, paths["rates_png"], f"{meta.get('model')}: latency vs request rate")
    return paths


def _table(summaries: list[Summary]) -> str:
    columns = [
        ("block set", "block_set", "{}"),
        ("rate", "request_rate", "{:g}"),
        ("done", "completed", "{}"),
        ("err", "errors", "{}"),
        ("e2el p50", "median_e2el_ms", "{:.1f}"),
        ("e2el p99", "p99_e2el_ms", "{:.1f}"),
        ("ttft p50", "median_ttft_ms", "{:.1f}"),
        ("tpot p50", "median_tpot_ms", "{:.2f}"),
        ("itl p99", "p99_itl_ms", "{:.1f}"),
        ("req/s", "request_throughput", "{:.2f}"),
        ("tok/s", "output_throughput", "{:.1f}"),
        ("goodput", "request_goodput", "{:.2f}"),
        ("loss", "mean_loss", "{:.4f}"),
        ("+loss", "loss_increase", "{:+.4f}"),
        ("blocks", "mean_blocks_per_token", "{:.2f}"),
    ]
    cells = [[title for title, _, _ in columns]]
    for summary in summaries:
        row = []
        for _, name, fmt in columns:
            value = getattr(summary, name)
            row.append("-" if value is None else fmt.format(value))
        cells.append(row)
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)) for row in cells
    )


def parse_slo(items: list[str]) -> dict[str, float]:
    """``["ttft_ms=200", "tpot_ms=50"]`` -> {"ttft_ms": 200.0, "tpot_ms": 50.0}; ValueError naming
    the part at fault."""
    slo = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or name not in SLO_METRICS:
            known = ", ".join(SLO_METRICS)
            raise ValueError(f"--slo: expected NAME=MS with NAME one of {known}, got {item!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo: {name} needs a number of milliseconds, got {value!r}") from None
        if not slo[name] > 0:
            raise ValueError(f"--slo: {name} must be positive, got {value}")
    return slo


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blocklab traffic", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--url", default="http://127.0.0.1:8000", help="the running server (loopback only by default)")
    add(
        "--serve",
        metavar="MODEL",
        default=None,
        help="start `blocklab serve --model MODEL` on a free loopback port for this run, stop it after",
    )
    add(
        "--serve-dtype",
        choices=WEIGHT_DTYPES,
        default="float32",
        help="the weights of the server --serve starts (int8 / int4: weight-only, see lab.quantize)",
    )
    add("--api-key", default=None, help="the server's API key, if it has one")
    add(
        "--prompts",
        type=Path,
        default=None,
        help="text file (one prompt per line) or .jsonl (default: pydoc)",
    )
    add(
        "--block-sets",
        nargs="+",
        default=None,
        help="block set specs (default: adapted to the model's depth)",
    )
    add(
        "--block-sets-from",
        type=Path,
        default=None,
        help="a `blocklab plan` JSON: replay its frontier (with all), so its estimates meet served requests",
    )
    add("--mix", action="store_true", help="interleave the block sets in one stream of requests")
    add("--concurrency", type=int, default=4, help="closed loop: clients sending at once")
    add("--rate", type=float, default=None, help="open loop: requests per second (Poisson arrivals)")
    add("--rates", type=float, nargs="+", default=None, help="open loop: sweep these request rates")
    add(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1: Poisson; below: burstier; above: steadier)",
    )
    add("--slo", nargs="+", default=[], metavar="NAME=MS", help="e.g. ttft_ms=200 tpot_ms=50 (goodput)")
    add("--requests", type=int, default=16, help="requests per block set and rate (unless --duration)")
    add("--duration", type=float, default=None, help="seconds per run instead of a request count")
    add("--max-new-tokens", type=int, default=16, help="tokens generated per request")
    add("--out", type=Path, default=Path("traffic_out"), help="directory for the CSV, JSON and PNGs")
    add("--seed", type=int, default=0, help="which default prompts are drawn, and the arrival times")
    add("--json", action="store_true", help="print the results as JSON (for machines) instead of a table")
    add("--allow-remote", action="store_true", help="allow a non-loopback server")
    return parser


async def _run(args: argparse.Namespace, slo: dict[str, float]) -> tuple[list[Summary], dict]:
    headers = {"X-API-Key": args.api_key} if args.api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    connections = None if args.rates else args.concurrency  # open loop: as many as arrive
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        try:
            info = (await client.get("/info")).raise_for_status().json()["model"]
        except httpx.TransportError as error:
            raise UserError(f"no server at {args.url} ({error}); start one or pass --serve MODEL") from None
        block_sets = args.block_sets or default_block_sets(info["depth"], info.get("exit_probe", False))
        for spec in block_sets:  # the server would refuse each request; say so once, before sending
            try:
                BlockSet.parse(spec, info["depth"])
            except ValueError as error:
                raise UserError(f"--block-sets: {error}") from None
        room = info["context_length"] - args.max_new_tokens
        if room < 2:
            raise UserError(f"--max-new-tokens {args.max_new_tokens} leaves no room in a context of {room}")
        count = args.requests if args.duration is None else max(args.requests, 64)
        prompts = [fit_prompt(p, room) for p in read_prompts(args.prompts, count, args.seed)]
        # one request first, unmeasured: the first pass of a fresh worker pays one-time costs
        await _one(client, {"prompt": prompts[0], "max_new_tokens": args.max_new_tokens, "stream": True})
        requests = args.requests if args.duration is None else count
        runs = [block_sets] if args.mix else [[block_set] for block_set in block_sets]
        rates = args.rates or [None]
        total = None if args.duration is not None else requests * len(block_sets) * len(rates)
        summaries = []
        with tqdm(total=total, unit="req", disable=args.json, file=sys.stderr) as progress:
            for rate in rates:
                for sets in runs:
                    progress.set_description(f"{'+'.join(sets)}" + (f" @ {rate:g}/s" if rate else ""))
                    n = requests * len(sets)
                    # mixed: each block set gets the same prompts, interleaved, so their losses compare
                    bodies = [
                        request_body(
                            prompts[(i // len(sets)) % len(prompts)], sets[i % len(sets)], args.max_new_tokens
                        )
                        for i in range(n)
                    ]
                    samples, wall_s = await run_requests(
                        client,
                        bodies,
                        concurrency=None if rate else args.concurrency,
                        rate=rate,
                        burstiness=args.burstiness,
                        duration_s=args.duration,
                        seed=args.seed,
                        progress=progress,
                    )
                    for block_set in sets:
                        mine = [sample for sample in samples if sample.block_set == block_set]
                        concurrency = None if rate else args.concurrency
                        summaries.append(
                            summarize(block_set, mine, wall_s, rate=rate, concurrency=concurrency, slo=slo)
                        )
    meta = {
        "url": args.url,
        "model": info["name"],
        "depth": info["depth"],
        "mode": "open loop" if args.rates else "closed loop",
        "concurrency": None if args.rates else args.concurrency,
        "burstiness": args.burstiness if args.rates else None,
        "mixed": args.mix,
        "slo": slo,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
    }
    return with_loss_increase(summaries), meta


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv[1:])
    check_loopback(args.url, args.allow_remote)
    if args.concurrency < 1 or args.requests < 1:
        raise SystemExit("blocklab traffic: --concurrency and --requests must be >= 1")
    if args.rate is not None:
        args.rates = [args.rate, *(args.rates or [])]
    if args.rates and not all(rate > 0 for rate in args.rates):
        raise SystemExit("blocklab traffic: --rate/--rates must be positive")
    if not args.burstiness > 0:
        raise SystemExit("blocklab traffic: --burstiness must be positive")
    try:
        slo = parse_slo(args.slo)
    except ValueError as error:
        raise SystemExit(f"blocklab traffic: {error}") from None
    if args.block_sets_from is not None:
        if args.block_sets:
            raise SystemExit("blocklab traffic: give --block-sets or --block-sets-from, not both")
        frontier = json.loads(args.block_sets_from.read_text())["frontier"]
        args.block_sets = list(dict.fromkeys(["all", *(point["block_set"] for point in frontier)]))
    if args.serve is None:
        summaries, meta = asyncio.run(_run(args, slo))
    else:
        locate(args.serve)  # a missing model fails here in one line, before a server starts
        print(f"starting blocklab serve --model {args.serve} --dtype {args.serve_dtype} ...", file=sys.stderr)
        with ServerProcess(["--model", args.serve, "--dtype", args.serve_dtype]) as server:
            args.url = server.url
            summaries, meta = asyncio.run(_run(args, slo))
    paths = write_results(summaries, args.out, meta)
    if args.json:
        print(
            json.dumps(
                {
                    **meta,
                    "block_sets": [asdict(s) for s in summaries],
                    "files": {k: str(p) for k, p in paths.items()},
                }
            )
        )
    else:
        print(_table(summaries))
        print(f"\nwritten: {', '.join(str(path) for path in paths.values())}")
    return 1 if any(summary.errors for summary in summaries) else 0
