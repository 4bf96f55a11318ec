"""Load test: N clients for a bounded time against a real server, every answer checked.

    python scripts/load_test.py                                   # tiny model, 8 clients, 30 s
    python scripts/load_test.py --model gpt2-random --clients 8 --duration 120 --max-new-tokens 16
    python scripts/load_test.py --url http://127.0.0.1:8000 --api-key KEY --json   # a running server
    python scripts/load_test.py --overload-clients 64                # then more clients than admitted

Starts ``blocklab serve`` on a free loopback port (``--model tiny`` is ``serve.testing.TinyModel``,
a random 4-block GPT with GPT-2's vocabulary; anything else goes to ``--model``), warms it up
unmeasured, then runs ``serve.loadgen``: every model route, streaming and not, scoring and
generating, under the model's default block sets. Reports latency p50/p90/p99 per kind of request,
statuses, lost (unanswered), duplicated and wrong answers, throughput, the server's resident memory
(server process and workers) before and after, and its counters. With ``--overload-clients`` a second
phase sends more clients than ``--max-in-flight`` admits: every request must end with 200 or
429/503/504, and the server must serve normally after. Exit status 1 on any error.
"""

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext

import httpx
import torch

from serve.loadgen import KINDS, LoadReport, make_plan, run_load
from serve.testing import ServerProcess, TinyModel

REFUSALS = frozenset({200, 429, 503, 504})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--url", default=None, help="a running server (loopback); default: start one")
    add("--api-key", default=None, help="the server's API key (also given to a server started here)")
    add("--model", default="tiny", help="tiny | builtin | gpt2-random | HUB_ID | DIR | CKPT (started server)")
    add("--workers", type=int, default=1, help="inference workers of the started server")
    add("--threads", type=int, default=1, help="torch threads per worker of the started server")
    add("--max-batch-size", type=int, default=8, help="of the started server")
    add("--max-in-flight", type=int, default=16, help="of the started server")
    add("--clients", type=int, default=8, help="concurrent clients, each sending one request after another")
    add("--duration", type=float, default=30.0, help="seconds of load")
    add("--max-new-tokens", type=int, default=16, help="tokens per generating request")
    add("--prompt-tokens", type=int, default=32, help="prompts are cut to this many tokens")
    add("--client-timeout", type=float, default=60.0, help="seconds before a request counts as lost")
    add("--overload-clients", type=int, default=0, help="then this many clients (0: no overload phase)")
    add("--overload-duration", type=float, default=10.0, help="seconds of overload")
    add("--seed", type=int, default=0, help="which prompts and which mix")
    add("--json", action="store_true", help="print the report as JSON")
    return parser


def _server(args: argparse.Namespace):
    """A context manager giving the server's URL: ``--url``, or a server started for the run."""
    if args.url is not None:
        return nullcontext(args.url.rstrip("/"))
    options = ["--workers", str(args.workers), "--threads", str(args.threads)]
    options += ["--max-batch-size", str(args.max_batch_size), "--max-in-flight", str(args.max_in_flight)]
    options += ["--api-key", args.api_key] if args.api_key else []
    if args.model == "tiny":  # --model is then only the name /info reports
        return ServerProcess(["--model", "tiny", *options], model_factory=TinyModel(), startup_timeout=300)
    return ServerProcess(["--model", args.model, *options], startup_timeout=600)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.1f} MiB"


def _text(phase: str, report: LoadReport) -> str:
    summary = report.as_dict()
    lines = [
        f"{phase}: {report.clients} clients, {report.wall_s:.1f} s, {report.requests} requests, "
        f"{report.requests_per_s} req/s, {report.tokens_per_s} new tokens/s",
        f"  statuses {report.statuses}; unanswered {report.unanswered}, duplicated {report.duplicated}, "
        f"wrong answers {len(report.problems)}, inconsistent greedy answers {len(report.inconsistent)}",
        f"  {'kind':<20}{'n':>6}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'max ms':>10}",
    ]
    for kind in ("all", *KINDS):
        row = report.latency_ms[kind]
        cells = [f"{'-' if row[q] is None else row[q]:>10}" for q in ("p50", "p90", "p99", "max")]
        lines.append(f"  {kind:<20}{row['n']:>6}{''.join(cells)}")
    lines.append(
        f"  server RSS (server + workers): {_mib(summary['rss_before_bytes'])} before, "
        f"{_mib(summary['rss_after_bytes'])} after, growth {_mib(summary['rss_growth_bytes'])}"
    )
    if summary["server_counters"] is not None:
        lines.append(f"  server counters over the phase: {summary['server_counters']}")
    lines += [f"  problem: {problem}" for problem in report.problems[:5]]
    return "\n".join(lines)


def main() -> int:
    args = _parser().parse_args()
    headers = {"X-API-Key": args.api_key} if args.api_key else None
    load_before = os.getloadavg()
    with _server(args) as server:
        url = server if isinstance(server, str) else server.url
        info = httpx.get(url + "/info", headers=headers, timeout=30).raise_for_status().json()
        plan = make_plan(
            info, max_new_tokens=args.max_new_tokens, prompt_tokens=args.prompt_tokens, seed=args.seed
        )
        run_load(url, clients=2, duration_s=3.0, plan=plan, headers=headers)  # warm-up, not reported
        phases = {
            "load": run_load(
                url,
                clients=args.clients,
                duration_s=args.duration,
                plan=plan,
                headers=headers,
                client_timeout_s=args.client_timeout,
            )
        }
        if args.overload_clients:
            phases["overload"] = run_load(
                url,
                clients=args.overload_clients,
                duration_s=args.overload_duration,
                plan=plan,
                headers=headers,
                accept=REFUSALS,
                client_timeout_s=args.client_timeout,
                refusal_pause_s=0.05,
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
            print(_text(name, report))
        print(f"errors: {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
