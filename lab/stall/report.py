"""The numbers of a stall experiment: the loss curves' marks, per-variant statistics over the seeds,
and the tables ``blocklab stall`` prints."""

from __future__ import annotations

import statistics

from lab.stall.settings import Variant

SMOOTH = 10  # "loss at step s" is the mean training loss over steps s-9..s


def report_steps(steps: int) -> list[int]:
    """Where the summary reads the loss: every 100 steps (every third of a short run), and the end."""
    every = 100 if steps >= 300 else max(steps // 3, 1)
    marks = list(range(every, steps + 1, every))
    return marks if marks[-1] == steps else [*marks, steps]


def smoothed(losses: list[float | None], window: int = SMOOTH) -> list[float]:
    """Trailing mean over the last ``window`` finite losses at every step."""
    out, recent = [], []
    for loss in losses:
        if loss is not None and loss == loss:
            recent = (recent + [loss])[-window:]
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out


def by_variant(runs: list[dict]) -> dict[str, list[dict]]:
    """The runs grouped by variant spec, in the order the variants first ran."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["variant"], []).append(run)
    return groups


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": round(statistics.fmean(values), 4), "min": min(values), "max": max(values)}


def aggregate(runs: list[dict]) -> list[dict]:
    """One row per variant over its seeds: final loss and validation loss (mean, min, max), stalls."""
    rows = []
    for spec, group in by_variant(runs).items():
        last = list(group[0]["loss_at"])[-1]
        rows.append(
            {
                "variant": spec,
                "label": Variant.parse(spec).label,
                "seeds": [run["seed"] for run in group],
                "stalled_seeds": sum(run["stalled"] for run in group),
                "final_loss": spread([run["loss_at"][last] for run in group]),
                "val_loss": spread([run["val_loss"] for run in group]),
                "loss_at": {
                    m: round(statistics.fmean(r["loss_at"][m] for r in group), 4) for m in group[0]["loss_at"]
                },
                "below_bigram_at": [run["below_bigram_at"] for run in group],
            }
        )
    return rows


def grad_norms_by_variant(runs: list[dict], name: str = "blocks") -> dict[str, list[float]]:
    """Per variant, each block's gradient norm at init (``name``: blocks or mlp.c_proj), mean over seeds."""
    return {
        spec: [
            round(statistics.fmean(v), 6)
            for v in zip(*(r["grad_norms_at_init"][name] for r in group), strict=True)
        ]
        for spec, group in by_variant(runs).items()
    }


def xiong_ratio(norms: list[float]) -> float:
    """The last block's gradient norm over the first's: Xiong et al.'s contrast in one number (post-LN's
    grows toward the output, > 1; pre-LN's does not)."""
    return norms[-1] / norms[0]


def format_table(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in [head, *rows]]


def table(runs: list[dict], unigram: float, bigram: float) -> str:
    """One row per run for one seed; with several, one row per variant: means, and the final loss's range."""
    marks = list(runs[0]["loss_at"])
    seeds = {run["seed"] for run in runs}
    if len(seeds) == 1:
        head = ["run", "seed", *(f"step {m}" for m in marks), "val", "below bigram at", "stalled"]
        rows = [
            [
                Variant.parse(run["variant"]).label,
                str(run["seed"]),
                *(f"{run['loss_at'][m]:.3f}" for m in marks),
                f"{run['val_loss']:.3f}",
                str(run["below_bigram_at"] or "-"),
                "yes" if run["stalled"] else "no",
            ]
            for run in runs
        ]
    else:
        head = [
            "run",
            "seeds",
            *(f"step {m}" for m in marks),
            "final min-max",
            "val",
            "below bigram at",
            "stalled",
        ]
        rows = [
            [
                row["label"],
                str(len(row["seeds"])),
                *(f"{row['loss_at'][m]:.3f}" for m in marks),
                f"{row['final_loss']['min']:.3f}-{row['final_loss']['max']:.3f}",
                f"{row['val_loss']['mean']:.3f}",
                ",".join(str(b or "-") for b in row["below_bigram_at"]),
                f"{row['stalled_seeds']}/{len(row['seeds'])}",
            ]
            for row in aggregate(runs)
        ]
    lines = format_table(head, rows)
    if len(seeds) > 1:
        lines.append("step columns and val: means over the seeds; below bigram at: per seed")
    lines.append(f"reference lines: unigram {unigram:.3f}, bigram {bigram:.3f} nats/char (training split)")
    return "\n".join(lines)


def grid_table(grid: dict) -> str:
    names = list(grid["axes"])
    head = [*names, "final loss", "min-max", "stalled"]
    rows = [
        [
            *(str(cell["setting"][n]) for n in names),
            f"{cell['final_loss']['mean']:.3f}",
            f"{cell['final_loss']['min']:.3f}-{cell['final_loss']['max']:.3f}",
            f"{cell['stalled_seeds']}/{len(cell['seeds'])}",
        ]
        for cell in grid["cells"]
    ]
    return "\n".join(format_table(head, rows))


def at_init_table(summary: dict) -> str:
    """Per variant and depth, the last/first ratio of the feed-forward output weight's gradient norm
    (mean over seeds), and post-LN's ratio over pre-LN's at the same depth."""
    ratios: dict[tuple[str, int], list[float]] = {}
    for row in summary["rows"]:
        ratios.setdefault((row["variant"], row["n_layer"]), []).append(row["ratio_mlp_c_proj"])
    mean = {key: statistics.mean(values) for key, values in ratios.items()}
    head = ["variant", "blocks", "c_proj last/first", "vs pre-LN"]
    rows = []
    for (spec, depth), ratio in mean.items():
        pre = mean.get(("pre", depth))
        rows.append([spec, str(depth), f"{ratio:.3f}", f"{ratio / pre:.2f}x" if pre else "-"])
    return "\n".join(format_table(head, rows))
