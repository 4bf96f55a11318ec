"""``blocklab traffic``: your own traffic against a running server, under several block sets.

    blocklab serve --model builtin &
    blocklab traffic --requests 32 --concurrency 4                     # the default block sets
    blocklab traffic --serve builtin                                   # start, measure, stop a server
    blocklab traffic --serve gpt2-random --serve-dtype int4            # ... serving int4 weights
    blocklab traffic --prompts my_prompts.jsonl --block-sets all skip=5 exit=9 --duration 60 --json
    blocklab traffic --serve builtin --block-sets-from runs/plan/plan.json   # a plan's frontier, served

For each block set in turn, the same prompts (a text file with one prompt per line, a JSONL file
with a ``prompt`` per line, or by default paragraphs of the Python docs bundled with Python,
``pydoc_data.topics``) are sent as streaming ``/predict`` requests that also score the prompt, by
``--concurrency`` clients, until ``--requests`` requests or ``--duration`` seconds. Per block set:
requests, errors, latency p50/p90/p99, time to first token, time per output token, throughput,
mean prompt loss and its increase over ``all``, mean blocks run per token. Written to
``OUT/traffic.csv``, ``OUT/traffic.json`` and ``OUT/frontier.png`` (p50 latency against loss, with
the block sets no other beats on both). Only loopback servers, unless ``--allow-remote``: this is
a load generator.
"""

import argparse
import asyncio
import csv
import ipaddress
import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
from tqdm import tqdm

from lab import tokens
from lab.quantize import WEIGHT_DTYPES
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


@dataclass
class Summary:
    """One block set's run."""

    block_set: str
    requests: int
    errors: int
    latency_p50_ms: float | None
    latency_p90_ms: float | None
    latency_p99_ms: float | None
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    requests_per_s: float
    tokens_per_s: float
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
        raise ValueError(f"{path}: no prompts in it")
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
        raise SystemExit(
            f"blocklab traffic: {host} is not a loopback address; pass --allow-remote if you mean it"
        )


async def _one(client: httpx.AsyncClient, body: dict) -> Sample:
    start = time.perf_counter()
    token_times, done = [], None
    try:
        async with client.stream("POST", "/predict", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return Sample(time.perf_counter() - start, error=f"{response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line:
                    continue
                event = json.loads(line)
                if event["event"] == "token":
                    token_times.append(time.perf_counter())
                elif event["event"] == "done":
                    done = event["response"]
                else:
                    return Sample(time.perf_counter() - start, error=f"{event['status']}: {event['message']}")
    except httpx.HTTPError as error:
        return Sample(time.perf_counter() - start, error=f"{type(error).__name__}: {error}")
    latency = time.perf_counter() - start
    if done is None:
        return Sample(latency, error="stream ended without a summary")
    tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1) if len(token_times) > 1 else None
    return Sample(
        latency_s=latency,
        ttft_s=token_times[0] - start if token_times else None,
        tpot_s=tpot,
        new_tokens=len(done["tokens"]),
        loss=done["score"]["mean_loss"] if done["score"] else None,
        mean_blocks=done["mean_blocks_per_token"],
    )


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
    """Send prompts (cycling) under ``block_set`` until the count or the time is up; samples, wall time."""
    samples: list[Sample] = []
    sent = 0
    start = time.perf_counter()
    deadline = None if duration_s is None else start + duration_s

    async def client_loop() -> None:
        nonlocal sent
        while (requests is None or sent < requests) and (deadline is None or time.perf_counter() < deadline):
            prompt = prompts[sent % len(prompts)]
            sent += 1
            body = {
                "prompt": prompt,
                "max_new_tokens": max_new_tokens,
                "blocks": block_set,
                "score": True,
                "stream": True,
                "seed": sent,
            }
            samples.append(await _one(client, body))
            progress.update(1)

    await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


def _percentile_ms(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)) * 1000.0, 2) if values else None


def summarize(block_set: str, samples: list[Sample], wall_s: float) -> Summary:
    ok = [sample for sample in samples if sample.error is None]
    latencies = [sample.latency_s for sample in ok]
    losses = [sample.loss for sample in ok if sample.loss is not None]
    blocks = [sample.mean_blocks for sample in ok if sample.mean_blocks is not None]
    errors = [sample.error for sample in samples if sample.error is not None]
    return Summary(
        block_set=block_set,
        requests=len(samples),
        errors=len(errors),
        latency_p50_ms=_percentile_ms(latencies, 50),
        latency_p90_ms=_percentile_ms(latencies, 90),
        latency_p99_ms=_percentile_ms(latencies, 99),
        ttft_p50_ms=_percentile_ms([sample.ttft_s for sample in ok if sample.ttft_s is not None], 50),
        tpot_p50_ms=_percentile_ms([sample.tpot_s for sample in ok if sample.tpot_s is not None], 50),
        requests_per_s=round(len(ok) / wall_s, 3) if wall_s > 0 else 0.0,
        tokens_per_s=round(sum(sample.new_tokens for sample in ok) / wall_s, 2) if wall_s > 0 else 0.0,
        mean_loss=round(float(np.mean(losses)), 4) if losses else None,
        loss_increase=None,
        mean_blocks_per_token=round(float(np.mean(blocks)), 3) if blocks else None,
        first_error=errors[0] if errors else None,
    )


def with_loss_increase(summaries: list[Summary]) -> list[Summary]:
    """Fill each summary's loss increase over the ``all`` block set's."""
    base = next((s.mean_loss for s in summaries if s.block_set == "all"), None)
    for summary in summaries:
        if base is not None and summary.mean_loss is not None:
            summary.loss_increase = round(summary.mean_loss - base, 4)
    return summaries


def frontier(summaries: list[Summary]) -> list[Summary]:
    """The block sets no other beats on both p50 latency and loss, fastest first."""
    points = sorted(
        (s for s in summaries if s.latency_p50_ms is not None and s.mean_loss is not None),
        key=lambda s: (s.latency_p50_ms, s.mean_loss),
    )
    best, kept = float("inf"), []
    for summary in points:
        if summary.mean_loss < best:
            kept.append(summary)
            best = summary.mean_loss
    return kept


def plot_frontier(summaries: list[Summary], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [s for s in summaries if s.latency_p50_ms is not None and s.mean_loss is not None]
    ax.scatter([s.latency_p50_ms for s in points], [s.mean_loss for s in points], color="tab:blue", zorder=3)
    for summary in points:
        ax.annotate(
            summary.block_set,
            (summary.latency_p50_ms, summary.mean_loss),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=8,
        )
    best = frontier(summaries)
    ax.step(
        [s.latency_p50_ms for s in best],
        [s.mean_loss for s in best],
        where="post",
        color="tab:orange",
        label="frontier (nothing faster is better)",
    )
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel("latency p50 per request (ms)")
    ax.set_ylabel("mean prompt loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(summaries: list[Summary], out: Path, meta: dict) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "traffic.csv", "json": out / "traffic.json", "png": out / "frontier.png"}
    rows = [asdict(summary) for summary in summaries]
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    paths["json"].write_text(json.dumps({**meta, "block_sets": rows}, indent=2) + "\n")
    plot_frontier(
        summaries, paths["png"], f"{meta['model']}: latency vs loss ({meta['concurrency']} clients)"
    )
    return paths


def _table(summaries: list[Summary]) -> str:
    columns = [
        ("block set", "block_set", "{}"),
        ("req", "requests", "{}"),
        ("err", "errors", "{}"),
        ("p50 ms", "latency_p50_ms", "{:.1f}"),
        ("p90 ms", "latency_p90_ms", "{:.1f}"),
        ("p99 ms", "latency_p99_ms", "{:.1f}"),
        ("ttft ms", "ttft_p50_ms", "{:.1f}"),
        ("tpot ms", "tpot_p50_ms", "{:.2f}"),
        ("req/s", "requests_per_s", "{:.2f}"),
        ("tok/s", "tokens_per_s", "{:.1f}"),
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
    add("--concurrency", type=int, default=4, help="clients sending at once")
    add("--requests", type=int, default=16, help="requests per block set (unless --duration)")
    add("--duration", type=float, default=None, help="seconds per block set instead of a request count")
    add("--max-new-tokens", type=int, default=16, help="tokens generated per request")
    add("--out", type=Path, default=Path("traffic_out"), help="directory for traffic.csv/json, frontier.png")
    add("--seed", type=int, default=0, help="which default prompts are drawn")
    add("--json", action="store_true", help="print the results as JSON (for machines) instead of a table")
    add("--allow-remote", action="store_true", help="allow a non-loopback server")
    return parser


async def _run(args: argparse.Namespace) -> tuple[list[Summary], dict]:
    headers = {"X-API-Key": args.api_key} if args.api_key else {}
    timeout = httpx.Timeout(600.0, connect=10.0)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        info = (await client.get("/info")).raise_for_status().json()["model"]
        block_sets = args.block_sets or default_block_sets(info["depth"], info.get("exit_probe", False))
        room = info["context_length"] - args.max_new_tokens
        if room < 2:
            raise SystemExit(f"--max-new-tokens {args.max_new_tokens} leaves no room in a context of {room}")
        count = args.requests if args.duration is None else max(args.requests, 64)
        prompts = [fit_prompt(p, room) for p in read_prompts(args.prompts, count, args.seed)]
        # one request first, unmeasured: the first pass of a fresh worker pays one-time costs
        await _one(client, {"prompt": prompts[0], "max_new_tokens": args.max_new_tokens, "stream": True})
        requests = None if args.duration is not None else args.requests
        total = None if requests is None else requests * len(block_sets)
        summaries = []
        with tqdm(total=total, unit="req", disable=args.json, file=sys.stderr) as progress:
            for block_set in block_sets:
                progress.set_description(block_set)
                samples, wall_s = await run_block_set(
                    client,
                    block_set,
                    prompts,
                    max_new_tokens=args.max_new_tokens,
                    concurrency=args.concurrency,
                    requests=requests,
                    duration_s=args.duration,
                    progress=progress,
                )
                summaries.append(summarize(block_set, samples, wall_s))
    meta = {
        "url": args.url,
        "model": info["name"],
        "depth": info["depth"],
        "concurrency": args.concurrency,
        "max_new_tokens": args.max_new_tokens,
        "prompts": len(prompts),
    }
    return with_loss_increase(summaries), meta


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv[1:])
    check_loopback(args.url, args.allow_remote)
    if args.concurrency < 1 or args.requests < 1:
        raise SystemExit("blocklab traffic: --concurrency and --requests must be >= 1")
    if args.block_sets_from is not None:
        if args.block_sets:
            raise SystemExit("blocklab traffic: give --block-sets or --block-sets-from, not both")
        frontier = json.loads(args.block_sets_from.read_text())["frontier"]
        args.block_sets = list(dict.fromkeys(["all", *(point["block_set"] for point in frontier)]))
    if args.serve is None:
        summaries, meta = asyncio.run(_run(args))
    else:
        print(f"starting blocklab serve --model {args.serve} --dtype {args.serve_dtype} ...", file=sys.stderr)
        with ServerProcess(["--model", args.serve, "--dtype", args.serve_dtype]) as server:
            args.url = server.url
            summaries, meta = asyncio.run(_run(args))
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
