"""Benchmark the server in one run: HTTP overhead, batching throughput, latency with blocks skipped,
and the scheduler (head-of-line blocking, time to first token, block sets sharing steps, batch
invariance).

    python scripts/bench_serve.py                                   # a few minutes on 2 CPU cores
    python scripts/bench_serve.py --json                            # the numbers as JSON
    python scripts/bench_serve.py --only scheduling --models gpt2-random:int4 builtin:float32 --rounds 5
    python scripts/bench_serve.py --only overhead --overhead-requests 150   # section 1 alone, a minute
    python scripts/bench_serve.py --only restart                    # section 5 alone (not in the default run)

1. Overhead at batch 1: the same one-token request to a tiny random model
   (``serve.process.save_tiny_model``), in-process (``serve.schema.resolve`` and the worker's engine,
   what the server runs besides HTTP) and over HTTP to a real server (keep-alive, one
   client); overhead = difference of the p50s. Target: at most 1.5x a bare FastAPI+uvicorn endpoint
   validating the same body, measured in turn with them.
2. Throughput: GPT-2-small-shaped random weights (``gpt2-random``), requests with 16 new tokens,
   from 1 client and from 8 clients at once; ratio of requests per second. Target: >= 2x, which only
   batching can give (the 8 share forward passes). Measured twice: every prompt the same, and
   prompts of 8 different lengths (each row has its own cache, see ``serve.engine``).
3. Latency with blocks skipped: the same requests one at a time under ``all``, half the blocks
   skipped, and an exit at half depth.
4. The scheduler, per model (``--models SPEC:DTYPE``; GPT-2 small shapes in int4 and the builtin
   model by default), each against its own baseline of this run:
   - head-of-line: a 1-token request sent 0.5 s into a 200-token generation, against the same
     request alone plus 6 decode steps (target: within 3x alone + 6 steps);
   - 4 closed-loop streaming clients: median time to first token against a lone request's plus 4
     decode steps; 8 clients' against 4 clients' (target: at most 1.5x); and 4 clients sending one
     prompt, whose prefill the engine makes once and copies;
   - 4 requests of 4 block sets (adaptive among them) at once against one after another (target
     >= 1.6x the throughput), and 8 adaptive clients against one (target >= 2x);
   - 4 clients under ``skip`` of half the blocks against ``all``: time per output token (target
     <= 0.7x);
   - one prompt scored and sampled alone and inside 8 mixed requests: the largest loss difference
     and whether the seeded tokens are the same;
   - 8 clients against 1: requests per second, with and without ``--no-batch-invariant``.

5. Restarts with ``--compile`` (``--only restart``: minutes, so not part of the default run), on
   ``--restart-model``: a server started on an empty compile cache (what a new machine pays), then
   restarted on the cache it left, then restarted with ``--warm-up []``; for each its start-up time
   (until ``/health`` is ready), its first request (greedy, 32 new tokens) and the p50 of the
   ``--requests`` after it. Target: the first request after a restart within 2x a warm one.

6. The prompt cache, in-process (``--only prompt-cache``; part of the default run): the first token of
   a GPT-2-shaped int4 prompt of 256 + 16 tokens whose first 256 a request that ended had (a
   system prompt), on an engine that copies them (``serve.prompt_cache``) and one that computes them.

Every number is measured in this run against a baseline of this run; the machine's load average is
reported with them, because on a shared CPU it moves them. The overhead's ratio comes with the 95%
bootstrap interval over its alternating calls. The throughput and scheduler sections' servers keep
no ended request's prefill (``NO_KEPT_PREFILLS``), and the scheduler's requests at once each have a
prompt of their own of ``PROMPT``'s length (``distinct``), but where a figure says one prompt: the
engine prefills identical prompts running together once. Each scheduler figure is the median of
``--rounds`` rounds on the same server with the interval of that median (with 3 rounds, about their
range): a single round of a few requests moves these ratios by a fifth or more between runs. The
requests go through ``serve.client``, the client ``blocklab traffic`` uses.
"""

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal
from unittest import mock

import httpx
import numpy as np
import torch

from lab import tokens
from lab.blocks import BlockSet
from lab.flags import parse
from lab.measure import ends, interval, latency_ms, resampled, shown
from lab.sampling import SamplingParams
from lab.weights import load_model
from serve.client import Reply, closed_loop, send
from serve.engine import Engine
from serve.process import ServerProcess, free_port, save_tiny_model
from serve.schema import Job, PredictRequest, resolve
from serve.shared import SharedState
from serve.worker import WeightsLoader, Worker

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"
PROMPT_IDS = tokens.encode(PROMPT)
NO_KEPT_PREFILLS = ("--prompt-cache-mb", "0")
"""The throughput and scheduler sections' servers keep no ended request's prefill: their requests
send few prompts again and again, and each would find its own in the cache (section 6 measures
that); identical prompts running together still share theirs (the one-prompt figures)."""


def distinct(body: dict, i: int) -> dict:
    """``body`` with a prompt of its own, as long as ``PROMPT``: its first token replaced by the i-th
    one after it. Requests at once then share no prefill (``serve.engine`` copies the prefill of an
    identical prompt), so each costs what a prompt of its own costs."""
    ids = [(PROMPT_IDS[0] + 1 + i) % tokens.VOCAB_SIZE, *PROMPT_IDS[1:]]
    return {**{key: value for key, value in body.items() if key != "prompt"}, "prompt_ids": ids}


@dataclass
class BenchOptions:
    """``scripts/bench_serve.py``'s flags."""

    overhead_requests: int = 300
    """Requests of the overhead section (each in-process, to the server, to a bare FastAPI)."""
    requests: int = 8
    """Sequential requests of the throughput section (the concurrent ones: twice as many)."""
    clients: int = 8
    """Concurrent clients of the throughput section."""
    new_tokens: int = 16
    """New tokens per request of the throughput section."""
    models: list[str] = field(default_factory=lambda: ["gpt2-random:int4", "builtin:float32"])
    """MODEL:DTYPE servers for the scheduler section."""
    rounds: int = 3
    """Rounds of the scheduler section on each server: every figure is the median over them, with its
    95% bootstrap interval (one round of a few requests swings these ratios by a fifth or more)."""
    restart_model: str = "gpt2-random:w4a8"
    """MODEL:DTYPE of the restart section."""
    only: Literal["scheduling", "overhead", "prompt-cache", "restart"] | None = None
    """Run one section (restart runs only when named)."""
    json: bool = False
    """Print the numbers as JSON."""


def p50_ms(seconds: list[float]) -> float:
    return latency_ms(seconds, (50,), digits=3)["p50"]


# The floor: the same body validated by FastAPI and answered at once, under the same uvicorn.
BARE_FASTAPI = """
import sys
import uvicorn
from fastapi import FastAPI
from serve.schema import PredictRequest
app = FastAPI()
@app.post("/predict")
async def predict(request: PredictRequest) -> dict:
    return {"id": request.id}
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""


def overhead(repeats: int, model_dir: Path) -> dict:
    """In-process, our server and a bare FastAPI endpoint in turn, so all see the same machine load.
    One plain request at a time: the time of a call, not a load."""
    body = {"prompt": "The quick brown fox", "max_new_tokens": 1, "seed": 0}
    torch.set_num_threads(1)  # as the server's worker below
    worker = Worker(WeightsLoader(str(model_dir)), SharedState(slots=1))
    worker.load("cpu")
    limits = worker.shared.limits()

    def in_process() -> None:
        for _ in worker.engine.run([(0, resolve(PredictRequest(**body), limits))]):
            pass

    bare_port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE_FASTAPI, str(bare_port)])
    times: dict[str, list[float]] = {"in_process": [], "http": [], "bare": [], "queued": [], "outside": []}
    try:
        with (
            ServerProcess(["--threads", "1", "--model", str(model_dir)]) as server,
            httpx.Client(base_url=server.url, timeout=30.0) as client,
            httpx.Client(base_url=f"http://127.0.0.1:{bare_port}", timeout=30.0) as bare_client,
        ):
            for i in range(repeats + 20):
                start = time.perf_counter()
                in_process()
                middle = time.perf_counter()
                timings = client.post("/predict", json=body).raise_for_status().json()["timings"]
                end = time.perf_counter()
                bare_client.post("/predict", json=body).raise_for_status()
                if i >= 20:  # warm-up dropped
                    times["in_process"].append(middle - start)
                    times["http"].append(end - middle)
                    times["bare"].append(time.perf_counter() - end)
                    times["queued"].append(timings["queue_ms"] / 1000.0)
                    times["outside"].append(end - middle - timings["total_ms"] / 1000.0)
    finally:
        bare.terminate()
        bare.wait()
    p50 = {name: p50_ms(values) for name, values in times.items()}
    low, high = overhead_interval(times)
    return {
        "in_process_p50_ms": p50["in_process"],
        "http_p50_ms": p50["http"],
        "overhead_p50_ms": round(p50["http"] - p50["in_process"], 3),
        "server_queue_p50_ms": p50["queued"],
        "outside_worker_p50_ms": p50["outside"],
        "bare_fastapi_p50_ms": p50["bare"],
        "overhead_over_bare": round((p50["http"] - p50["in_process"]) / p50["bare"], 2),
        "overhead_over_bare_interval": [round(low, 2), round(high, 2)],
        "requests": repeats,
    }


def overhead_interval(times: dict[str, list[float]]) -> tuple[float, float]:
    """The 95% bootstrap interval of (p50 HTTP - p50 in-process) / p50 bare, resampling the alternating
    calls with each call's three timings together (what drifts between calls falls on all three)."""
    http, in_process, bare = (np.asarray(times[name]) for name in ("http", "in_process", "bare"))

    def ratio(picks: np.ndarray, axis: int) -> np.ndarray:
        calls = picks.astype(int)  # [R, n]: the calls each resample takes
        overhead = np.median(http[calls], axis) - np.median(in_process[calls], axis)
        return overhead / np.median(bare[calls], axis)

    return ends(resampled(np.arange(len(http)), ratio))


async def answered(http: httpx.AsyncClient, body: dict) -> Reply:
    """One request through ``serve.client``; a failed one stops the benchmark."""
    reply = await send(http, body)
    if not reply.ok:
        raise RuntimeError(f"{body}: {reply.error}")
    return reply


async def together(
    http: httpx.AsyncClient, bodies: list[dict], clients: int | None = None
) -> tuple[float, list]:
    """``bodies`` from ``clients`` closed-loop clients (default: all at once); the wall time and the
    replies in the order of ``bodies``."""
    start = time.perf_counter()
    replies = await closed_loop(
        lambda n: answered(http, bodies[n]), clients or len(bodies), count=len(bodies)
    )
    order = {id(body): i for i, body in enumerate(bodies)}
    return time.perf_counter() - start, sorted(replies, key=lambda reply: order[id(reply.body)])


async def throughput_and_skips(requests: int, clients: int, new_tokens: int) -> dict:
    body = {"prompt": PROMPT, "max_new_tokens": new_tokens, "seed": 0}
    words = PROMPT.split()
    mixed_prompts = [" ".join(words[: 2 + 2 * i]) for i in range(clients)]  # 2, 4, ... words
    with ServerProcess(
        ["--model", "gpt2-random", "--max-batch-size", str(clients), *NO_KEPT_PREFILLS]
    ) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=300.0) as http:
            depth = (await http.get("/info")).json()["model"]["depth"]
            await answered(http, body)  # warm-up

            async def rates(prompts: list[str]) -> tuple[float, float]:
                """Requests per second from 1 client, then from ``clients`` at once, cycling ``prompts``."""
                bodies = [{**body, "prompt": prompts[i % len(prompts)]} for i in range(requests * 2)]
                sequential_s, _ = await together(http, bodies[:requests], clients=1)
                concurrent_s, _ = await together(http, bodies, clients=clients)
                return requests / sequential_s, requests * 2 / concurrent_s

            sequential_rps, concurrent_rps = await rates([PROMPT])
            mixed_sequential_rps, mixed_concurrent_rps = await rates(mixed_prompts)
            half = depth // 2
            block_sets = {
                "all": "all",
                f"skip {half} of {depth}": "skip=" + ",".join(map(str, range(half // 2, half // 2 + half))),
                f"exit={half}": f"exit={half}",
            }
            latency = {}
            for name, spec in block_sets.items():
                replies = [
                    await answered(http, {**body, "blocks": spec}) for _ in range(max(3, requests // 2))
                ]
                latency[name] = round(p50_ms([reply.latency_s for reply in replies]), 1)
    return {
        "model": "gpt2-random",
        "new_tokens": new_tokens,
        "clients": clients,
        "sequential_rps": round(sequential_rps, 3),
        "concurrent_rps": round(concurrent_rps, 3),
        "throughput_ratio": round(concurrent_rps / sequential_rps, 2),
        "mixed_lengths_words": [len(p.split()) for p in mixed_prompts],
        "mixed_sequential_rps": round(mixed_sequential_rps, 3),
        "mixed_concurrent_rps": round(mixed_concurrent_rps, 3),
        "mixed_throughput_ratio": round(mixed_concurrent_rps / mixed_sequential_rps, 2),
        "latency_p50_ms_by_block_set": latency,
    }


def streamed(body: dict, **changes) -> dict:
    return {**body, **changes, "stream": True}


async def head_of_line(http: httpx.AsyncClient, base: dict) -> dict:
    """A decode step alone, a 1-token request alone, and the same 0.5 s into a 200-token generation."""
    step_ms = (await answered(http, streamed(base, max_new_tokens=64))).response.timings.per_token_ms
    one_alone_ms = p50_ms(
        [(await answered(http, streamed(base, max_new_tokens=1))).latency_s for _ in range(5)]
    )
    long = asyncio.create_task(answered(http, streamed(base, max_new_tokens=200, prompt="def main(")))
    await asyncio.sleep(0.5)
    during = (await answered(http, streamed(base, max_new_tokens=1))).latency_s
    await long
    return {
        "decode_step_ms": step_ms,
        "one_token_alone_ms": round(one_alone_ms, 1),
        "one_token_during_200_token_generation_ms": round(during * 1000.0, 1),
        "head_of_line_bound_ms": round(3 * one_alone_ms + 6 * step_ms, 1),
    }


async def ttft_under_load(http: httpx.AsyncClient, base: dict, step_ms: float) -> dict:
    """4, then 8 streaming clients, closed loop, 16 new tokens each: time to first token against alone
    (bound: alone + 4 steps), and 8 clients' against 4 clients' (bound: 1.5x)."""
    alone = [(await answered(http, streamed(base, max_new_tokens=16))).ttft_s for _ in range(3)]
    ttft_p50 = {}
    for clients in (4, 8):
        bodies = [distinct(streamed(base, max_new_tokens=16, seed=i), i) for i in range(3 * clients)]
        _, replies = await together(http, bodies, clients=clients)
        ttft_p50[clients] = p50_ms([reply.ttft_s for reply in replies])
    one_prompt = [streamed(base, max_new_tokens=16, seed=i) for i in range(12)]  # prefilled once a round
    _, replies = await together(http, one_prompt, clients=4)
    ttft_alone = p50_ms(alone)
    return {
        "ttft_alone_ms": round(ttft_alone, 1),
        "ttft_4_clients_p50_ms": round(ttft_p50[4], 1),
        "ttft_4_clients_one_prompt_p50_ms": round(p50_ms([reply.ttft_s for reply in replies]), 1),
        "ttft_bound_ms": round(ttft_alone + 4 * step_ms, 1),
        "ttft_8_clients_p50_ms": round(ttft_p50[8], 1),
        "ttft_8_over_4_clients": round(ttft_p50[8] / ttft_p50[4], 2),
    }


async def block_sets_sharing(http: httpx.AsyncClient, base: dict, mixed_sets: list[str]) -> dict:
    """4 block sets at once against one after another; 8 adaptive clients against one; 4 clients
    under skip of half the blocks against all (time per output token)."""
    four = [distinct(streamed(base, max_new_tokens=32, blocks=spec), i) for i, spec in enumerate(mixed_sets)]
    sequential_s, _ = await together(http, four, clients=1)
    together_s, _ = await together(http, four)
    adaptive_bodies = [
        distinct(streamed(base, max_new_tokens=32, blocks=mixed_sets[3], seed=i), i) for i in range(8)
    ]
    one_adaptive_s = (await together(http, adaptive_bodies[:2], clients=1))[0] / 2
    eight_adaptive_s, _ = await together(http, adaptive_bodies)
    tpot = {}
    for spec in mixed_sets[:2]:
        _, replies = await together(
            http, [distinct(streamed(base, max_new_tokens=32, blocks=spec, seed=i), i) for i in range(4)]
        )
        tpot[spec] = latency_ms([reply.response.timings.per_token_ms / 1e3 for reply in replies], (50,))[
            "p50"
        ]
    return {
        "four_block_sets": mixed_sets,
        "four_block_sets_speedup": round(sequential_s / together_s, 2),
        "eight_adaptive_speedup": round(8 * one_adaptive_s / eight_adaptive_s, 2),
        "tpot_ms_4_clients": tpot,
        "tpot_skip_half_over_all": round(tpot[mixed_sets[1]] / tpot["all"], 2),
    }


async def batch_invariance_and_throughput(http: httpx.AsyncClient, base: dict, mixed_sets: list[str]) -> dict:
    """The same prompt and seed alone and among 7 others of other block sets; 8 clients against 1."""
    probe = streamed(base, max_new_tokens=24, temperature=1.0, seed=7, score=True)
    alone = (await answered(http, probe)).response
    other_sets = [*mixed_sets, "all", "skip=1", "all"]
    others = [
        {**probe, "prompt": PROMPT[: 20 + 8 * i], "seed": i, "blocks": spec}
        for i, spec in enumerate(other_sets)
    ]
    _, replies = await together(http, [*others[:3], probe, *others[3:]])
    batched = replies[3].response
    pairs = zip(alone.score.token_losses, batched.score.token_losses, strict=True)
    eight = [distinct(streamed(base, max_new_tokens=16, seed=i), i) for i in range(16)]
    one_s, _ = await together(http, eight[:4], clients=1)
    eight_s, _ = await together(http, eight[:8])
    eight_s2, _ = await together(http, eight[8:])
    return {
        "batched_loss_max_abs_diff": max(abs(a - b) for a, b in pairs),
        "batched_tokens_equal": alone.tokens == batched.tokens,
        "batched_batch_size": batched.batch_size,
        "throughput_8_clients_over_1": round((16 / (eight_s + eight_s2)) / (4 / one_s), 2),
    }


def over_rounds(rounds: list[dict]) -> dict:
    """One server's rounds in one dict: each number the median over the rounds, beside it
    (``<key>_interval``) the 95% bootstrap interval of that median; the rest as the first round has
    it, but ``batched_tokens_equal``, true only if every round's tokens were, and the largest loss
    difference and batch of any round. With 3 rounds an interval is about their range."""
    merged = dict(rounds[0])
    for key, value in rounds[0].items():
        values = [r[key] for r in rounds]
        if key == "batched_tokens_equal":
            merged[key] = all(values)
        elif key in ("batched_loss_max_abs_diff", "batched_batch_size"):
            merged[key] = max(values)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            merged[key] = round(float(np.median(values)), 3)
            low_high = interval(values)
            merged[f"{key}_interval"] = None if low_high is None else [round(end, 3) for end in low_high]
    merged["rounds"] = len(rounds)
    return merged


async def scheduling(model: str, dtype: str, invariant: bool = True, rounds: int = 3) -> dict:
    """Section 4 of the module docstring, on one server of ``model`` in ``dtype``: ``rounds`` rounds,
    merged by ``over_rounds``."""
    args = ["--model", model, "--dtype", dtype, "--max-batch-size", "8", *NO_KEPT_PREFILLS]
    if not invariant:
        args.append("--no-batch-invariant")
    with ServerProcess(args) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=600.0) as http:
            info = (await http.get("/info")).json()["model"]
            base = {"prompt": PROMPT, "seed": 0, "temperature": 0.0}
            await answered(http, streamed(base, max_new_tokens=4))  # warm-up
            half = info["depth"] // 2
            skip_half = "skip=" + ",".join(map(str, range(half // 2, half // 2 + half)))
            adaptive = "adaptive=0.8;min=2;check=probe" if info["exit_probe"] else "adaptive=0.98"
            mixed_sets = ["all", skip_half, f"exit={half}", adaptive]
            measured = []
            for _ in range(rounds):
                result = {"model": model, "dtype": dtype, "batch_invariant": invariant}
                result |= await head_of_line(http, base)
                result |= await ttft_under_load(http, base, result["decode_step_ms"])
                result |= await block_sets_sharing(http, base, mixed_sets)
                result |= await batch_invariance_and_throughput(http, base, mixed_sets)
                measured.append(result)
    return over_rounds(measured)


def prompt_cache(rounds: int = 12, shared: int = 256, own: int = 16) -> dict:
    """Section 6, in-process (the engine alone: what the cache changes): ms from admission to the
    first token of a gpt2-random int4 prompt of ``shared`` + ``own`` tokens whose first ``shared``
    a request that ended had, on an engine with the prompt cache and one without, in turn; a new
    ``own`` tail each round."""
    model = load_model("gpt2-random", "int4")
    rng = torch.Generator().manual_seed(0)
    system = torch.randint(0, tokens.VOCAB_SIZE, (shared,), generator=rng).tolist()

    def job(tail: list[int]) -> Job:
        sampling = SamplingParams(seed=0)
        return Job(system + tail, BlockSet(), 1, sampling, submitted_at=time.monotonic())

    engines = {"copied": Engine(model), "computed": Engine(model, prompt_cache_bytes=0)}
    for engine in engines.values():
        list(engine.run([(0, job([1] * own))]))  # warm; leaves the shared tokens' prefill kept
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        tail = torch.randint(0, tokens.VOCAB_SIZE, (own,), generator=rng).tolist()
        for name, engine in engines.items():
            start = time.perf_counter()
            list(engine.run([(0, job(tail))]))
            times[name].append((time.perf_counter() - start) * 1e3)
    result = {"shared_tokens": shared, "own_tokens": own}
    for name, values in times.items():
        result[f"{name}_ms"] = round(float(np.median(values)), 2)
        result[f"{name}_ms_interval"] = [round(end, 2) for end in interval(values)]
    result["copied_over_computed"] = round(result["copied_ms"] / result["computed_ms"], 3)
    return result


RESTART_TOKENS = 32


async def first_and_warm(url: str, requests: int) -> tuple[float, float]:
    """A server's first request and the p50 of ``requests`` after it, end to end, ms."""
    body = streamed({"prompt": PROMPT, "seed": 0, "ignore_eos": True}, max_new_tokens=RESTART_TOKENS)
    async with httpx.AsyncClient(base_url=url, timeout=1800.0) as http:
        first = (await answered(http, body)).latency_s
        warm = [(await answered(http, body)).latency_s for _ in range(requests)]
    return first * 1000.0, p50_ms(warm)


def restarts(spec: str, requests: int) -> dict:
    """Section 5 of the module docstring, on an empty inductor cache of its own."""
    model, _, dtype = spec.partition(":")
    args = ["--model", model, "--dtype", dtype or "float32", "--compile"]
    starts = {"new machine": [], "restart": [], "restart without warm-up": ["--warm-up", "[]"]}
    runs = {}
    with tempfile.TemporaryDirectory() as cache, mock.patch.dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache):
        for name, extra in starts.items():  # the servers inherit the cache directory
            start = time.perf_counter()
            with ServerProcess(args + extra, startup_timeout=1800.0) as server:
                started = time.perf_counter() - start
                first, warm = asyncio.run(first_and_warm(server.url, requests))
            runs[name] = {
                "start_s": round(started, 1),
                "first_request_ms": round(first, 1),
                "warm_p50_ms": round(warm, 1),
                "first_over_warm": round(first / warm, 2),
            }
    return {"model": spec, "new_tokens": RESTART_TOKENS, "runs": runs}


def with_interval(r: dict, key: str, digits: int = 0) -> str:
    """``r[key]`` and, where the rounds gave one, its interval: ``106 [101, 112]``."""
    return shown(r[key], r.get(f"{key}_interval"), digits)


def _print_scheduling(r: dict) -> None:
    mode = "batch-invariant" if r["batch_invariant"] else "shared products"
    print(
        f"scheduler, {r['model']} {r['dtype']} ({mode}); {r['rounds']} rounds, medians [95% interval]; "
        f"decode step {with_interval(r, 'decode_step_ms', 1)} ms"
    )
    print(
        f"  1-token request during a 200-token generation: "
        f"{with_interval(r, 'one_token_during_200_token_generation_ms')} ms "
        f"(alone {r['one_token_alone_ms']:.0f} ms; target <= {r['head_of_line_bound_ms']:.0f})"
    )
    print(
        f"  4 streaming clients: TTFT p50 {with_interval(r, 'ttft_4_clients_p50_ms')} ms "
        f"(alone {with_interval(r, 'ttft_alone_ms')}; target <= {r['ttft_bound_ms']:.0f}); 8 clients "
        f"{with_interval(r, 'ttft_8_clients_p50_ms')} ms, {with_interval(r, 'ttft_8_over_4_clients', 2)}x "
        f"4 clients' (target <= 1.5); 4 clients of one prompt (its prefill copied) "
        f"{with_interval(r, 'ttft_4_clients_one_prompt_p50_ms')} ms"
    )
    print(
        f"  4 block sets at once {with_interval(r, 'four_block_sets_speedup', 2)}x one after another "
        f"(target >= 1.6); 8 adaptive clients {with_interval(r, 'eight_adaptive_speedup', 2)}x one "
        f"(target >= 2)"
    )
    print(
        f"  4 clients, TPOT skip half / all: {with_interval(r, 'tpot_skip_half_over_all', 2)} "
        f"{r['tpot_ms_4_clients']} (target <= 0.7)"
    )
    same = "equal" if r["batched_tokens_equal"] else "DIFFERENT"
    print(
        f"  alone vs among 8 mixed: max loss difference {r['batched_loss_max_abs_diff']:.2e}, "
        f"seeded tokens {same} (batch of {r['batched_batch_size']})"
    )
    print(f"  8 clients over 1: {with_interval(r, 'throughput_8_clients_over_1', 2)}x requests/s")


def main(argv: list[str] | None = None) -> int:
    args = parse(
        BenchOptions,
        sys.argv[1:] if argv is None else argv,
        prog="bench_serve.py",
        description=__doc__.split("\n\n")[0],
    )
    results = {"load_average_before": os.getloadavg()[0]}
    if args.only in (None, "overhead"):
        with tempfile.TemporaryDirectory() as scratch:
            results["overhead"] = overhead(args.overhead_requests, save_tiny_model(Path(scratch) / "tiny"))
    if args.only in (None, "prompt-cache"):
        results["prompt_cache"] = prompt_cache()
    if args.only is None:
        results["batching"] = asyncio.run(throughput_and_skips(args.requests, args.clients, args.new_tokens))
    if args.only == "restart":
        results["restart"] = restarts(args.restart_model, args.requests)
    results["scheduling"] = []
    for spec in args.models if args.only in (None, "scheduling") else []:
        model, _, dtype = spec.partition(":")
        for invariant in (True, False):
            result = asyncio.run(scheduling(model, dtype or "float32", invariant, args.rounds))
            results["scheduling"].append(result)
    results["load_average_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    before, after = results["load_average_before"], results["load_average_after"]
    print(f"load average (1 min): {before:.2f} before, {after:.2f} after")
    for result in results["scheduling"]:
        _print_scheduling(result)
    if "restart" in results:
        r = results["restart"]
        for name, run in r["runs"].items():
            print(
                f"{r['model']} --compile, {name}: ready in {run['start_s']:.1f} s, first request "
                f"{run['first_request_ms']:.0f} ms, then p50 {run['warm_p50_ms']:.0f} ms "
                f"({run['first_over_warm']:.2f}x; target <= 2 after a restart)"
            )
    if "prompt_cache" in results:
        c = results["prompt_cache"]
        print(
            f"prompt cache (gpt2-random int4, in-process): a prompt of {c['shared_tokens']} + "
            f"{c['own_tokens']} tokens whose first {c['shared_tokens']} an ended request had: first "
            f"token {with_interval(c, 'copied_ms', 1)} ms copied, {with_interval(c, 'computed_ms', 1)} "
            f"ms computed, {c['copied_over_computed']:.3f}x"
        )
    if "overhead" not in results:
        return 0
    o = results["overhead"]
    print(
        f"overhead at batch 1 (tiny model, p50 of {o['requests']} alternating calls): "
        f"in-process {o['in_process_p50_ms']:.3f} ms, HTTP {o['http_p50_ms']:.3f} ms, "
        f"overhead {o['overhead_p50_ms']:.3f} ms, "
        f"{with_interval(o, 'overhead_over_bare', 2)}x bare FastAPI (target <= 1.5x)"
    )
    print(
        f"  of which: queued until the worker's batch started {o['server_queue_p50_ms']:.3f} ms; "
        f"HTTP and response path (client time - worker's total) {o['outside_worker_p50_ms']:.3f} ms; "
        f"a bare FastAPI endpoint validating the same body: {o['bare_fastapi_p50_ms']:.3f} ms"
    )
    if "batching" not in results:
        return 0
    b = results["batching"]
    print(
        f"throughput ({b['model']}, {b['new_tokens']} new tokens): 1 client {b['sequential_rps']:.3f} req/s, "
        f"{b['clients']} clients {b['concurrent_rps']:.3f} req/s, "
        f"ratio {b['throughput_ratio']:.2f}x (target >= 2)"
    )
    print(
        f"  prompts of {len(b['mixed_lengths_words'])} lengths: "
        f"1 client {b['mixed_sequential_rps']:.3f} req/s, {b['clients']} clients "
        f"{b['mixed_concurrent_rps']:.3f} req/s, ratio {b['mixed_throughput_ratio']:.2f}x"
    )
    for name, ms in b["latency_p50_ms_by_block_set"].items():
        print(f"  latency p50, one request at a time, {name}: {ms:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
