"""blocklab timing: the attention stage's share of one Block's wall time, eager and sdpa, against T.

    blocklab timing                         # GPT-2 small's Block, batch 1, T = 256 1024 4096
    blocklab timing --T 512 2048 --repeats 5

Per (T, attention) pair a random Block of the config runs on a random [1, T, D] stream under
inference mode. Two calls are timed, interleaved, each as the median of ``--repeats`` runs after one
warm-up: the whole Block, and its attention stage ``attn(ln_1(x))`` (the q/k/v and output projections
included). The share is attention / Block; the rest (feed-forward, ln_2, the residual adds) is the
difference. Times depend on the machine and its load; the shares and the eager/sdpa ratios measured in
one run are what carry.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from lab.analysis import common
from lab.model import Block


def _seconds(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


@torch.inference_mode()
def time_block(block: Block, T: int, repeats: int) -> dict[str, float]:
    """Median ms of the Block and of its attention stage on a [1, T, D] stream."""
    D = block.ln_1.normalized_shape[0]
    x = torch.randn(1, T, D)  # [1, T, D]
    stages = {
        "block": block,
        "attention": lambda x: block.attn(block.ln_1(x)),
    }
    times: dict[str, list[float]] = {name: [] for name in stages}
    for fn in stages.values():  # warm-up: allocator and kernel selection
        fn(x)
    for _ in range(repeats):
        for name, fn in stages.items():  # interleaved, so a burst of load hits both alike
            times[name].append(_seconds(fn, x))
    return {f"{name}_ms": common.median_ms(t) for name, t in times.items()}


def render(report: dict) -> str:
    columns = ["T", "attention", "Block ms", "attention ms", "rest ms", "attention share"]
    lines = [
        [r["T"], r["attention"], r["block_ms"], r["attention_ms"], r["rest_ms"], f"{100 * r['share']:.1f}%"]
        for r in report["rows"]
    ]
    out = [
        f"timing: one Block of {report['config']}, batch 1, {report['threads']} threads, "
        f"median of {report['repeats']} repeats; load average {report['load_average'][0]} at start, "
        f"{report['load_average'][1]} at end",
        "attention stage = attn(ln_1(x)) with its projections; rest = Block - attention (feed-forward, "
        "ln_2, the adds); share = attention ms / Block ms",
        "",
        common.table(columns, lines),
    ]
    by_key = {(r["T"], r["attention"]): r for r in report["rows"]}
    for T in report["T"]:
        if (T, "eager") in by_key and (T, "sdpa") in by_key:
            ratio = by_key[(T, "eager")]["attention_ms"] / by_key[(T, "sdpa")]["attention_ms"]
            out.append(f"T={T}: eager attention takes {ratio:.2f}x sdpa's time")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    p = common.parser(argv[0], "The attention stage's share of one Block's wall time.")
    common.add_config_args(p, exclude=["attention"])
    p.add_argument(
        "--T", type=int, nargs="+", default=[256, 1024, 4096], help="positions (default: %(default)s)"
    )
    p.add_argument(
        "--attention", dest="modes", nargs="+", choices=["eager", "sdpa"], default=["eager", "sdpa"]
    )
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (default: %(default)s)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default: %(default)s)")
    common.add_output_args(p)
    args = p.parse_args(argv[1:])

    torch.set_num_threads(args.threads)
    cfg = common.config_from_args(args)
    load_before = common.load_average()
    rows = []
    for T in args.T:
        for attention in args.modes:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                block = Block(replace(cfg, attention=attention, dropout=0.0)).eval()
            ms = time_block(block, T, args.repeats)
            rest = ms["block_ms"] - ms["attention_ms"]
            share = ms["attention_ms"] / ms["block_ms"]
            rows.append({"T": T, "attention": attention, **ms, "rest_ms": rest, "share": share})
    report = {
        "config": common.config_name(args),
        "threads": args.threads,
        "repeats": args.repeats,
        "T": args.T,
        "load_average": [load_before, common.load_average()],
        "rows": rows,
    }
    common.emit(args, report, render(report))
    return 0
