"""blocklab timing: the attention stage's share of one Block's wall time, eager and sdpa, against T.

    blocklab timing                         # GPT-2 small's Block, batch 1, T = 256 1024 4096
    blocklab timing --T 512 2048 --repeats 5

Per T, a random Block of the config (the same weights for eager and sdpa) runs on a random [1, T, D]
stream under inference mode. Per attention mode two calls are timed, each as the median of
``--repeats`` runs after one warm-up, all interleaved: the whole Block, and its attention stage
``attn(ln_1(x))`` (the q/k/v and output projections included). The share is attention / Block; the
rest (feed-forward, ln_2, the residual adds) is the difference. Beside it, the stage's share of the
Block's matmul FLOPs. Times depend on the machine and its load; the shares and the eager/sdpa ratios
measured in one run are what carry. On a CPU shared with other jobs, ``--threads 1`` is steadier: two
threads that must meet at every op wait for each other whenever one is descheduled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

import torch
from jsonargparse.typing import PositiveInt

from lab import flags
from lab.analysis import common
from lab.analysis.designs import Design
from lab.config import GPTConfig
from lab.model import Block


def _seconds(fn, x: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x)
    return time.perf_counter() - start


@torch.inference_mode()
def time_blocks(blocks: dict[str, Block], T: int, repeats: int) -> dict[str, dict[str, float]]:
    """Per attention mode, the median ms of the Block and of its attention stage on one [1, T, D] stream.

    All calls are interleaved within each repeat (mode by mode, stage by stage), so a burst of load
    from elsewhere hits every measurement alike instead of one mode's whole series.
    """
    D = next(iter(blocks.values())).ln_1.normalized_shape[0]
    x = torch.randn(1, T, D)  # [1, T, D]
    calls = {
        (mode, stage): fn
        for mode, block in blocks.items()
        for stage, fn in (("block", block), ("attention", lambda x, b=block: b.attn(b.ln_1(x))))
    }
    for fn in calls.values():  # warm-up: allocator and kernel selection
        fn(x)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in calls}
    for _ in range(repeats):
        for key, fn in calls.items():
            times[key].append(_seconds(fn, x))
    return {mode: {f"{stage}_ms": common.median_ms(times[(mode, stage)]) for stage in ("block", "attention")}
            for mode in blocks}  # fmt: skip


def flop_share(design: Design, T: int) -> float:
    """The attention stage's share of a Block's matmul FLOPs at T positions (full T x T counted):
    (2·attention weights + 4·T·d) / (2·all block weights + 4·T·d)."""
    attention = 2 * design.value(design.attention_weights())
    block = attention + 2 * design.value(design.feed_forward_weights())
    scores = 4 * T * design.d_model
    return (attention + scores) / (block + scores)


def render(report: dict) -> str:
    columns = ["T", "attention", "Block ms", "attention ms", "rest ms", "attention share", "FLOP share"]
    lines = [
        [
            r["T"],
            r["attention"],
            r["block_ms"],
            r["attention_ms"],
            r["rest_ms"],
            f"{100 * r['share']:.1f}%",
            f"{100 * r['flop_share']:.1f}%",
        ]  # fmt: skip
        for r in report["rows"]
    ]
    out = [
        f"timing: one Block of {report['config']}, batch 1, {report['threads']} threads, "
        f"median of {report['repeats']} repeats; load average {report['load_average'][0]} at start, "
        f"{report['load_average'][1]} at end",
        "attention stage = attn(ln_1(x)) with its projections; rest = Block - attention (feed-forward, "
        "ln_2, the adds); share = attention ms / Block ms; FLOP share = the stage's share of the Block's "
        "matmul FLOPs, (8d^2 + 4Td) / (24d^2 + 4Td)",
        "",
        common.table(columns, lines),
    ]
    by_key = {(r["T"], r["attention"]): r for r in report["rows"]}
    for T in report["T"]:
        if (T, "eager") in by_key and (T, "sdpa") in by_key:
            ratio = by_key[(T, "eager")]["attention_ms"] / by_key[(T, "sdpa")]["attention_ms"]
            out.append(f"T={T}: eager attention takes {ratio:.2f}x sdpa's time")
    return "\n".join(out)


OWN_FIELDS = ("attention",)
"""GPTConfig's fields that are this command's own flags: timing compares the attention modes."""


@dataclass
class TimingOptions:
    """What to time."""

    T: tuple[PositiveInt, ...] = (256, 1024, 4096)
    """Positions."""
    attention: tuple[Literal["eager", "sdpa"], ...] = ("eager", "sdpa")
    """The attention implementations to time."""
    repeats: PositiveInt = 3
    """Timed runs per measurement."""
    threads: PositiveInt = 2
    """Torch threads."""


def timing_rows(cfg: GPTConfig, design: Design, options: TimingOptions) -> list[dict]:
    """Per T and attention mode, the Block's and its attention stage's median ms, and their shares."""
    rows = []
    for T in options.T:
        blocks = {}
        for attention in options.attention:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # the same weights for every mode
                blocks[attention] = Block(replace(cfg, attention=attention, dropout=0.0)).eval()
        for attention, ms in time_blocks(blocks, T, options.repeats).items():
            rows.append(
                {
                    "T": T,
                    "attention": attention,
                    **ms,
                    "rest_ms": ms["block_ms"] - ms["attention_ms"],
                    "share": ms["attention_ms"] / ms["block_ms"],
                    "flop_share": flop_share(design, T),
                }
            )
    return rows


def parser() -> flags.Parser:
    p = common.parser("timing", "The attention stage's share of one Block's wall time.")
    common.add_config_args(p, exclude=OWN_FIELDS)
    p.add_options(TimingOptions)
    common.add_output_args(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])

    options = flags.options(TimingOptions, args)
    torch.set_num_threads(options.threads)
    cfg = common.config_from_args(args, OWN_FIELDS)
    name = common.config_name(args, OWN_FIELDS)
    design = Design.from_config(cfg, name)
    load_before = common.load_average()
    rows = timing_rows(cfg, design, options)
    report = {
        "config": name,
        "threads": options.threads,
        "repeats": options.repeats,
        "T": list(options.T),
        "load_average": [load_before, common.load_average()],
        "rows": rows,
    }
    common.emit(args, report, render(report))
    return 0
