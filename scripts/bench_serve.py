"""Benchmark the server in one run: HTTP overhead, batching throughput, latency with blocks skipped.

    python scripts/bench_serve.py            # about two minutes on 2 CPU cores
    python scripts/bench_serve.py --json     # the numbers as JSON

1. Overhead at batch 1: the same one-token request to a tiny model, in-process (``BlockLabAPI``'s
   decode_request + predict, what a worker runs) and over HTTP to a real server (keep-alive, one
   client); overhead = difference of the p50s. Target: <= 1.5 ms.
2. Throughput: GPT-2-small-shaped random weights (``gpt2-random``), requests with 16 new tokens,
   from 1 client and from 8 clients at once; ratio of requests per second. Target: >= 2x, which only
   batching can give (the 8 share forward passes). Measured twice: every prompt the same, and
   prompts of 8 different lengths (left-padded into one batch, see ``serve.engine``).
3. Latency with blocks skipped: the same requests one at a time under ``all``, half the blocks
   skipped, and an exit at half depth.

Every number is measured in this run against a baseline of this run; the machine's load average is
reported with them, because on a shared CPU it moves them.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch

from serve.api import BlockLabAPI, SharedState
from serve.schema import PredictRequest
from serve.testing import ServerProcess, TinyModel, free_port

PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find"


def p50_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1000.0


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


def overhead(repeats: int) -> dict:
    """In-process, our server and a bare FastAPI endpoint in turn, so all see the same machine load."""
    body = {"prompt": "The quick brown fox", "max_new_tokens": 1, "seed": 0}
    torch.set_num_threads(1)  # as the server's worker below
    api = BlockLabAPI(TinyModel(), SharedState(max_in_flight=1))
    api.load("cpu")

    def in_process() -> None:
        for _ in api.predict([api.decode_request(PredictRequest(**body))]):
            pass

    bare_port = free_port()
    bare = subprocess.Popen([sys.executable, "-c", BARE_FASTAPI, str(bare_port)])
    times: dict[str, list[float]] = {"in_process": [], "http": [], "bare": [], "queued": [], "outside": []}
    try:
        with (
            ServerProcess(["--threads", "1", "--model", "tiny"], model_factory=TinyModel()) as server,
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
    p50 = {name: round(p50_ms(values), 3) for name, values in times.items()}
    return {
        "in_process_p50_ms": p50["in_process"],
        "http_p50_ms": p50["http"],
        "overhead_p50_ms": round(p50["http"] - p50["in_process"], 3),
        "server_queue_p50_ms": p50["queued"],
        "outside_worker_p50_ms": p50["outside"],
        "bare_fastapi_p50_ms": p50["bare"],
        "requests": repeats,
    }


def throughput_and_skips(requests: int, clients: int, new_tokens: int) -> dict:
    body = {"prompt": PROMPT, "max_new_tokens": new_tokens, "seed": 0}
    words = PROMPT.split()
    mixed_prompts = [" ".join(words[: 2 + 2 * i]) for i in range(clients)]  # 2, 4, ... words
    server = ServerProcess(["--model", "gpt2-random", "--max-batch-size", str(clients)])
    with server, httpx.Client(base_url=server.url, timeout=300.0) as client:
        depth = client.get("/info").json()["model"]["depth"]
        client.post("/predict", json=body).raise_for_status()  # warm-up

        def timed(extra: dict) -> float:
            start = time.perf_counter()
            client.post("/predict", json={**body, **extra}).raise_for_status()
            return time.perf_counter() - start

        def rates(prompts: list[str]) -> tuple[float, float]:
            """Requests per second from 1 client, then from ``clients`` at once, cycling ``prompts``."""
            start = time.perf_counter()
            for i in range(requests):
                timed({"prompt": prompts[i % len(prompts)]})
            sequential = requests / (time.perf_counter() - start)
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                pool_requests = range(requests * 2)
                list(pool.map(lambda i: timed({"prompt": prompts[i % len(prompts)]}), pool_requests))
            return sequential, requests * 2 / (time.perf_counter() - start)

        sequential_rps, concurrent_rps = rates([PROMPT])
        mixed_sequential_rps, mixed_concurrent_rps = rates(mixed_prompts)

        half = depth // 2
        block_sets = {
            "all": "all",
            f"skip {half} of {depth}": "skip=" + ",".join(map(str, range(half // 2, half // 2 + half))),
            f"exit={half}": f"exit={half}",
        }
        latency = {
            name: round(p50_ms([timed({"blocks": spec}) for _ in range(max(3, requests // 2))]), 1)
            for name, spec in block_sets.items()
        }
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--overhead-requests", type=int, default=300)
    parser.add_argument("--requests", type=int, default=8, help="sequential requests (concurrent: twice)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    results = {
        "load_average_before": os.getloadavg()[0],
        "overhead": overhead(args.overhead_requests),
        "batching": throughput_and_skips(args.requests, args.clients, args.new_tokens),
        "load_average_after": os.getloadavg()[0],
    }
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    o, b = results["overhead"], results["batching"]
    before, after = results["load_average_before"], results["load_average_after"]
    print(f"load average (1 min): {before:.2f} before, {after:.2f} after")
    print(
        f"overhead at batch 1 (tiny model, p50 of {o['requests']} alternating calls): "
        f"in-process {o['in_process_p50_ms']:.3f} ms, HTTP {o['http_p50_ms']:.3f} ms, "
        f"overhead {o['overhead_p50_ms']:.3f} ms (target <= 1.5)"
    )
    print(
        f"  of which: queued until the worker's batch started {o['server_queue_p50_ms']:.3f} ms; "
        f"HTTP and response path (client time - worker's total) {o['outside_worker_p50_ms']:.3f} ms; "
        f"a bare FastAPI endpoint validating the same body: {o['bare_fastapi_p50_ms']:.3f} ms"
    )
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
