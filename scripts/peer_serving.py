"""Serving against llama-server: the same GPT-2 small weights at 4 bits, the same cores, the same
closed-loop streaming clients on the OpenAI completions route of each (``scripts/bench_llama_cpp.py
--serving``).

Each round runs ``clients`` closed-loop clients, each sending ``requests`` streamed completions of
``max_tokens`` tokens (``ignore_eos``, greedy) after a prompt of ``prompt_tokens`` random token ids
(a fresh prompt per request, so llama-server's per-slot prompt cache has nothing to reuse), then
``lone`` requests one at a time, of fresh prompts too. The two servers run side by side and idle
while the other is measured; rounds alternate between them, so drift and load fall on both alike.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import time
from itertools import accumulate
from json import loads
from pathlib import Path

import httpx

from lab.measure import interval
from serve.process import free_port, wait_until_healthy

SLOTS = 4
"""llama-server's parallel slots (``-np``): as many as the clients, as its docs suggest for N users."""


class LlamaServer:
    """``llama-server`` on a free loopback port, with ``SLOTS`` slots and ``threads`` threads."""

    def __init__(self, binary: Path, gguf: Path, threads: int, context: int = 1024):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(SLOTS)]
        self.command += ["-c", str(context * SLOTS), "--port", str(self.port), "--log-disable"]

    def __enter__(self) -> LlamaServer:
        self.process = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        reason = wait_until_healthy(self.process, self.url, timeout=120)
        if reason is None:
            return self
        self.process.kill()
        raise RuntimeError(f"llama-server: {reason}: {self.command}")

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        self.process.wait(30)


async def completion(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: seconds to the first token, between tokens, and end to end."""
    body = {"model": "gpt2", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}  # fmt: skip
    start = time.perf_counter()
    arrivals = []
    async with http.stream("POST", url + "/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if loads(line[6:]).get("choices"):  # a token's chunk (the usage chunk has none)
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft_s": arrivals[0] - start, "gaps_s": gaps, "e2e_s": end - start}


async def closed_loop(url: str, clients: int, requests: int, prompt_tokens: int, max_tokens: int, seed: int):
    """``clients`` clients, each sending ``requests`` completions back to back: requests per second,
    and every request's timings."""
    rng = random.Random(seed)
    # fresh prompts for the warm-up and the lone requests too: one already sent would find its keys
    # and values in a llama-server slot's prompt cache and skip its prefill
    count = clients * requests + 4
    fresh_prompts = [[rng.randrange(50257) for _ in range(prompt_tokens)] for _ in range(count)]
    warm_up, lone_prompts, prompts = fresh_prompts[0], fresh_prompts[1:4], fresh_prompts[4:]
    # a connection per request: llama-server may close a kept-alive one as the next request goes out
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=fresh) as http:
        await completion(http, url, warm_up, 2)  # warm: first-call allocations

        async def client(number: int) -> list[dict]:
            own = prompts[number::clients]
            return [await completion(http, url, prompt, max_tokens) for prompt in own]

        start = time.perf_counter()
        done = await asyncio.gather(*(client(n) for n in range(clients)))
        wall = time.perf_counter() - start
        replies = [reply for replies in done for reply in replies]
        lone = [await completion(http, url, prompt, max_tokens) for prompt in lone_prompts]
    return {"requests_per_s": len(replies) / wall, "replies": replies, "lone": lone}


TOKENS_SEEN = (1, 2, 4, 8, 16, 32)
"""The tokens whose arrival ``summary`` reports (the k-th token's time from the request's start)."""


def summary(rounds: list[dict]) -> dict:
    """Medians over every round's requests, with intervals of requests/s over the rounds. Beside TPOT
    and ITL, the median time to the k-th token of a request for each k of ``TOKENS_SEEN`` it has: where
    a server charges a prefill's wait (to the prompts' first tokens, or to the tokens after them)
    moves TPOT against ITL, while the time to each token says what a client sees."""
    replies = [r for one in rounds for r in one["replies"]]
    rates = [one["requests_per_s"] for one in rounds]
    tpot = [statistics.mean(r["gaps_s"]) for r in replies if r["gaps_s"]]
    arrivals = [list(accumulate(r["gaps_s"], initial=r["ttft_s"])) for r in replies]  # the k-th token's time
    return {
        "requests_per_s": statistics.median(rates),
        "requests_per_s_ci": list(interval(rates)),
        "ttft_p50_ms": 1e3 * statistics.median(r["ttft_s"] for r in replies),
        "tpot_p50_ms": 1e3 * statistics.median(tpot),
        "itl_p50_ms": 1e3 * statistics.median(g for r in replies for g in r["gaps_s"]),
        "lone_e2e_p50_ms": 1e3 * statistics.median(r["e2e_s"] for one in rounds for r in one["lone"]),
        "time_to_token_p50_ms": {
            k: 1e3 * statistics.median(times[k - 1] for times in arrivals)
            for k in TOKENS_SEEN
            if all(len(times) >= k for times in arrivals)
        },
    }


def compare(servers: dict[str, str], rounds: int, clients: int, requests: int, prompt_tokens: int,
            max_tokens: int) -> dict:  # fmt: skip
    """Every server's ``closed_loop`` once per round, in turn; each one's ``summary``."""
    measured: dict[str, list[dict]] = {name: [] for name in servers}
    for number in range(rounds):
        for name, url in servers.items():
            load = closed_loop(url, clients, requests, prompt_tokens, max_tokens, seed=number)
            measured[name].append(asyncio.run(load))
    return {name: summary(values) for name, values in measured.items()}


if __name__ == "__main__":
    raise SystemExit(
        "scripts/peer_serving.py is the serving comparison's library, not a command: run it through "
        "`python scripts/bench_llama_cpp.py --serving` (see its --help)"
    )
