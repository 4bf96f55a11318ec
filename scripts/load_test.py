"""Load test: N clients for a bounded time against a real server, every answer checked.

    python scripts/load_test.py                                   # tiny model, 8 clients, 30 s
    python scripts/load_test.py --model gpt2-random --clients 8 --duration 120 --max-new-tokens 16
    python scripts/load_test.py --url http://127.0.0.1:8000 --api-key KEY --json   # a running server
    python scripts/load_test.py --overload-clients 64                # then more clients than admitted

Starts ``blocklab serve`` on a free loopback port (``--model tiny`` is ``serve.process.TINY``, a random
4-block GPT with GPT-2's vocabulary; anything else goes to ``--model``), warms it up unmeasured, then
runs the correctness soak of the tests, ``tests/soak.py``: every model route, streaming and not, scoring
and generating, under the model's default block sets. Reports latency p50/p90/p99 per kind of request,
statuses, lost (unanswered), duplicated and wrong answers, throughput, the server's resident memory
(server process and workers) before and after, and its counters. With ``--overload-clients`` a second
phase sends more clients than ``--max-in-flight`` admits: every request must end with 200 or 429/503/504,
and the server must serve normally after. Exit status 1 on any error.
"""

import json
import os
import sys
import tempfile
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from lab.analysis.common import table
from lab.flags import parse
from serve.process import ServerProcess, save_tiny_model

REFUSALS = frozenset({200, 429, 503, 504})
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class LoadTestOptions:
    """``scripts/load_test.py``'s flags."""

    url: str | None = None
    """A running server (loopback); default: start one."""
    api_key: str | None = None
    """The server's API key (also given to a server started here)."""
    model: str = "tiny"
    """tiny | builtin | gpt2-random | HUB_ID | DIR | CKPT (of the started server)."""
    workers: int = 1
    """Inference workers of the started server."""
    threads: int = 1
    """Torch threads per worker of the started server."""
    max_batch_size: int = 8
    """Of the started server."""
    max_in_flight: int = 16
    """Of the started server."""
    clients: int = 8
    """Concurrent clients, each sending one request after another."""
    duration: float = 30.0
    """Seconds of load."""
    max_new_tokens: int = 16
    """Tokens per generating request."""
    prompt_tokens: int = 32
    """Prompts are cut to this many tokens."""
    client_timeout: float = 60.0
    """Seconds before a request counts as lost."""
    overload_clients: int = 0
    """Then this many clients (0: no overload phase)."""
    overload_duration: float = 10.0
    """Seconds of overload."""
    seed: int = 0
    """Which prompts and which mix."""
    json: bool = False
    """Print the report as JSON."""


def _server(args: LoadTestOptions, stack: ExitStack) -> str:
    """The server's URL: ``--url``, or a server started for the run (closed with ``stack``)."""
    if args.url is not None:
        return stack.enter_context(nullcontext(args.url.rstrip("/")))
    options = ["--workers", str(args.workers), "--threads", str(args.threads)]
    options += ["--max-batch-size", str(args.max_batch_size), "--max-in-flight", str(args.max_in_flight)]
    options += ["--api-key", args.api_key] if args.api_key else []
    model = args.model
    if model == "tiny":
        model = str(save_tiny_model(Path(stack.enter_context(tempfile.TemporaryDirectory())) / "tiny"))
    return stack.enter_context(ServerProcess(["--model", model, *options], startup_timeout=600)).url


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def _text(phase: str, report, kinds: tuple[str, ...]) -> str:
    summary = report.as_dict()
    lines = [
        f"{phase}: {report.clients} clients, {report.wall_s:.1f} s, {report.requests} requests, "
        f"{report.requests_per_s} req/s, {report.tokens_per_s} new tokens/s",
        f"  statuses {report.statuses}; unanswered {report.unanswered}, duplicated {report.duplicated}, "
        f"wrong answers {len(report.problems)}, inconsistent greedy answers {len(report.inconsistent)}",
    ]
    rows = [
        [kind, *(report.latency_ms[kind][q] for q in ("n", "p50", "p90", "p99", "max"))]
        for kind in ("all", *kinds)
    ]
    lines.append(table(["kind", "n", "p50 ms", "p90 ms", "p99 ms", "max ms"], rows))
    lines.append(
        f"  server RSS (server + workers): {_mib(summary['rss_before_bytes'])} before, "
        f"{_mib(summary['rss_after_bytes'])} after, growth {_mib(summary['rss_growth_bytes'])}"
    )
    if summary["server_counters"] is not None:
        lines.append(f"  server counters over the phase: {summary['server_counters']}")
    lines += [f"  problem: {problem}" for problem in report.problems[:5]]
    return "\n".join(lines)


def main() -> int:
    args = parse(LoadTestOptions, sys.argv[1:], prog="load_test.py", description=__doc__.split("\n\n")[0])
    sys.path.insert(0, str(ROOT))  # the soak lives with the tests, which are not installed
    from tests.soak import KINDS, make_plan, run_load

    headers = {"X-API-Key": args.api_key} if args.api_key else None
    load_before = os.getloadavg()
    with ExitStack() as stack:
        url = _server(args, stack)
        info = httpx.get(url + "/info", headers=headers, timeout=30).raise_for_status().json()
        plan = make_plan(
            info, max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens, seed=args.seed
        )
        load = dict(plan=plan, headers=headers, client_timeout_s=args.client_timeout)
        run_load(url, clients=2, duration_s=3.0, plan=plan, headers=headers)  # warm-up, not reported
        phases = {"load": run_load(url, clients=args.clients, duration_s=args.duration, **load)}
        if args.overload_clients:
            phases["overload"] = run_load(
                url,
                clients=args.overload_clients,
                duration_s=args.overload_duration,
                accept=REFUSALS,
                refusal_pause_s=0.05,
                **load,
            )
            time.sleep(1.0)  # the last streams free their slots
            phases["after overload"] = run_load(url, clients=2, duration_s=3.0, plan=plan, headers=headers)
    meta = {
        "model": info["model"],
        "cpus": os.cpu_count(),
        "torch_threads_per_worker": args.threads if args.url is None else None,
        "load_average_before": [round(value, 2) for value in load_before],
        "load_average_after": [round(value, 2) for value in os.getloadavg()],
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "command": " ".join(["python", *sys.argv]),
    }
    errors = sum(report.errors for report in phases.values())
    if args.json:
        print(json.dumps({**meta, "phases": {name: r.as_dict() for name, r in phases.items()}}, indent=2))
    else:
        print(f"{meta['command']}")
        print(
            f"model {info['model']['name']} (depth {info['model']['depth']}, context "
            f"{info['model']['context_length']}), {meta['cpus']} CPUs, load average "
            f"{meta['load_average_before'][0]} before, {meta['load_average_after'][0]} after"
        )
        for name, report in phases.items():
            print(_text(name, report, KINDS))
        print(f"errors: {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
