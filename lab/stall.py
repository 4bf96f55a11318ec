"""``blocklab stall``: the post-LN warmup stall, reproduced.

    blocklab stall --preset cpu                       # ~9 minutes on 2 idle CPU cores
    blocklab stall --preset gpu --seeds 1 2 3 --out runs/stall-gpu
    blocklab stall --variants pre post post+warmup=100 deepnorm peri peri+rms
    blocklab stall --grid lr=5e-4,1e-3,2e-3 warmup=0,25,100 --variants post --out runs/grid
    blocklab stall --at-init 6 12 24 48 --variants pre post deepnorm peri   # no training: Xiong's figure

For each seed, six-block character-level models are trained with the same settings but for the
variant (where the norms sit, their type, the warmup); by default pre-LN without warmup, post-LN
without warmup, post-LN with a linear warmup. Without warmup the post-LN model stays on the unigram line
(it predicts character frequencies and never learns to use context) while pre-LN goes below the
bigram line; with warmup post-LN breaks through as well. Before training, each model's per-block
gradient norms at initialisation are measured (Xiong et al. 2020's figure).

Writes ``OUT/<run>/`` TensorBoard runs, ``OUT/summary.json``, ``OUT/stall.png`` (loss curves) and
``OUT/grad_norms.png`` (gradient norm per block at init), and prints a table. ``--grid`` instead trains
one variant over a grid of preset settings, cell by cell (a rerun skips the cells already in
``OUT/cells/``), and writes ``OUT/grid.json`` and the heatmap ``OUT/grid.png``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from lab.config import GPTConfig
from lab.data import CharDataModule, RandomWindows
from lab.gradients import grad_norms_at_init
from lab.model import GPT
from lab.train import STREAM_TRAINER_ARGS, LitGPT

SMOOTH = 10  # "loss at step s" is the mean training loss over steps s-9..s
INIT_BATCHES = 4  # gradient norms at initialisation: the mean over the first training batches
# Per-block gradient norms and update ratios in TensorBoard: every step while the stall sets in, then
# sparsely (each costs a copy of the blocks' weights).
BLOCK_STATS_FIRST, BLOCK_STATS_EVERY = 100, 25


def report_steps(steps: int) -> list[int]:
    """Where the summary reads the loss: every 100 steps (every third of a short run), and the end."""
    every = 100 if steps >= 300 else max(steps // 3, 1)
    marks = list(range(every, steps + 1, every))
    return marks if marks[-1] == steps else [*marks, steps]


@dataclass(frozen=True)
class StallPreset:
    """Everything the three runs share. Six blocks, as in the original finding."""

    n_embd: int
    n_head: int
    seq_len: int
    batch_size: int
    lr: float
    steps: int = 300
    warmup: int = 100
    n_layer: int = 6
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    precision: str = "32-true"
    val_batches: int = 8
    seeds: tuple[int, ...] = (1,)


PRESETS = {
    # Searched on 2 CPU cores (docs/training.md has the table): at width 256 no learning rate both
    # stalls post-LN and lets pre-LN cross the bigram line; at width 384 and 1e-3 both happen, pre-LN
    # crossing after 250-350 steps, hence 400 steps. One seed: three runs take ~9 minutes (two: 17).
    "cpu": StallPreset(n_embd=384, n_head=6, seq_len=64, batch_size=16, lr=1e-3, steps=400),
    # nanoGPT's shakespeare-char model (6 layers, 6 heads, width 384, context 256, batch 64), bf16.
    "gpu": StallPreset(
        n_embd=384, n_head=6, seq_len=256, batch_size=64, lr=1e-3, precision="bf16-mixed", seeds=(1, 2, 3)
    ),
}


NORM_LABELS = {"pre": "pre-LN", "post": "post-LN", "deepnorm": "DeepNorm", "peri": "Peri-LN"}


@dataclass(frozen=True)
class Variant:
    """What differs between the runs: ``GPTConfig.norm`` and ``norm_type``, and the warmup steps."""

    norm: str
    warmup: int = 0
    norm_type: str = "layer"

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """``NORM[+warmup=N][+rms]``: ``post``, ``post+warmup=100``, ``peri+rms``."""
        norm, *options = spec.split("+")
        if norm not in NORM_LABELS:
            raise ValueError(f"variant {spec!r}: the norm must be one of {', '.join(NORM_LABELS)}")
        variant = cls(norm)
        for option in options:
            if option == "rms":
                variant = replace(variant, norm_type="rms")
            elif option.startswith("warmup=") and option[7:].isdigit():
                variant = replace(variant, warmup=int(option[7:]))
            else:
                raise ValueError(f"variant {spec!r}: unknown option {option!r} (warmup=N or rms)")
        return variant

    @property
    def spec(self) -> str:
        return (
            self.norm
            + (f"+warmup={self.warmup}" if self.warmup else "")
            + ("+rms" if self.norm_type == "rms" else "")
        )

    @property
    def label(self) -> str:
        rms = ", RMSNorm" if self.norm_type == "rms" else ""
        return f"{NORM_LABELS[self.norm]}{rms}, " + (f"warmup {self.warmup}" if self.warmup else "no warmup")

    def run_name(self, seed: int) -> str:
        rms = "_rms" if self.norm_type == "rms" else ""
        return f"{self.norm}ln_warmup{self.warmup}{rms}_seed{seed}"


def default_variants(preset: StallPreset) -> list[Variant]:
    """The original experiment: pre-LN and post-LN without warmup, post-LN with the preset's warmup."""
    return [Variant("pre"), Variant("post"), Variant("post", preset.warmup)]


class LossRecorder(L.Callback):
    """Keeps every training step's loss (None for a skipped step) and reports progress."""

    def __init__(self, report: Callable[[str], None], every: int = 100):
        self.losses: list[float | None] = []
        self.report, self.every = report, every
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = None if outputs["skipped"] else outputs["loss"].item()
        self.losses.append(loss)
        step = len(self.losses)
        if step % self.every == 0:
            per_step = (time.perf_counter() - self.start) / step
            self.report(f"    step {step}: loss {smoothed(self.losses)[-1]:.3f} ({per_step:.2f} s/step)")


def smoothed(losses: list[float | None], window: int = SMOOTH) -> list[float]:
    """Trailing mean over the last ``window`` finite losses at every step."""
    out, recent = [], []
    for loss in losses:
        if loss is not None and loss == loss:
            recent = (recent + [loss])[-window:]
        out.append(sum(recent) / len(recent) if recent else float("nan"))
    return out


def model_config(preset: StallPreset, variant: Variant, vocab_size: int) -> GPTConfig:
    """The model a run of ``variant`` under ``preset`` trains."""
    return GPTConfig(
        n_layer=preset.n_layer,
        n_head=preset.n_head,
        n_embd=preset.n_embd,
        vocab_size=vocab_size,
        block_size=preset.seq_len,
        norm=variant.norm,
        norm_type=variant.norm_type,
    )


def init_batches(preset: StallPreset, data: CharDataModule, seed: int) -> list:
    """The first training batches of ``seed``, on which gradient norms at initialisation are measured.
    The stream is a pure function of seed and index: no RNG is used, so the run that follows is the same
    as without this measurement."""
    windows = RandomWindows(data.train_ids, preset.seq_len, preset.batch_size, seed)
    return [windows[i] for i in range(INIT_BATCHES)]


def train_variant(
    preset: StallPreset, variant: Variant, seed: int, data: CharDataModule, out: Path, report
) -> dict:
    """Train one model; its summary row, with the per-step losses under ``losses``."""
    L.seed_everything(seed, verbose=False)
    model = LitGPT(
        model_config(preset, variant, data.vocab_size),
        lr=preset.lr,
        betas=preset.betas,
        weight_decay=preset.weight_decay,
        warmup_steps=variant.warmup,
        block_stats_first=BLOCK_STATS_FIRST,
        block_stats_every=BLOCK_STATS_EVERY,
    )
    at_init = grad_norms_at_init(model.model, init_batches(preset, data, seed))
    recorder = LossRecorder(report)
    trainer = L.Trainer(
        **STREAM_TRAINER_ARGS,
        # One device per run, whatever the machine has: DDP over several would multiply the batch and
        # change the experiment (a multi-GPU machine runs variants side by side: docs/training.md).
        devices=1,
        max_steps=preset.steps,
        val_check_interval=preset.steps,
        num_sanity_val_steps=0,
        gradient_clip_val=preset.grad_clip,
        precision=preset.precision,
        logger=TensorBoardLogger(out, name="", version=variant.run_name(seed)),
        log_every_n_steps=1,
        callbacks=[recorder],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    curve = smoothed(recorder.losses)
    marks = report_steps(preset.steps)
    below = next((i + 1 for i, loss in enumerate(curve) if loss < data.bigram_entropy), None)
    final = curve[-1]
    return {
        "variant": variant.spec,
        "norm": variant.norm,
        "norm_type": variant.norm_type,
        "warmup": variant.warmup,
        "seed": seed,
        "loss_at": {str(step): round(curve[step - 1], 4) for step in marks},
        "val_loss": round(float(trainer.callback_metrics["val/loss"]), 4),
        "below_bigram_at": below,
        # Closer to the unigram line than to the bigram line after the whole budget.
        "stalled": final > (data.unigram_entropy + data.bigram_entropy) / 2,
        "s_per_step": round((time.perf_counter() - recorder.start) / preset.steps, 4),
        "skipped_steps": model.nonfinite_steps,
        "grad_norms_at_init": {name: [round(v, 6) for v in values] for name, values in at_init.items()},
        "losses": recorder.losses,
    }


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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[dict], unigram: float, bigram: float, path: Path) -> None:
    """The 10-step-mean loss curve of each variant: the mean over seeds, shaded between min and max."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for spec, group in by_variant(runs).items():
        curves = [smoothed(run["losses"]) for run in group]
        steps = range(1, len(curves[0]) + 1)
        mean = [statistics.fmean(values) for values in zip(*curves, strict=True)]
        label = Variant.parse(spec).label + (
            f", {len(group)} seeds" if len(group) > 1 else f", seed {group[0]['seed']}"
        )
        (line,) = ax.plot(steps, mean, label=label)
        if len(group) > 1:
            low = [min(v) for v in zip(*curves, strict=True)]
            high = [max(v) for v in zip(*curves, strict=True)]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, lw=0)
    ax.axhline(unigram, color="grey", ls="--", lw=1, label=f"unigram line H(X) = {unigram:.2f}")
    ax.axhline(bigram, color="black", ls="--", lw=1, label=f"bigram line H(X_t | X_t-1) = {bigram:.2f}")
    ax.set(xlabel="step", ylabel=f"training loss, nats/char ({SMOOTH}-step mean)", title="The post-LN stall")
    ax.set_ylim(top=max(unigram + 0.6, 4.0))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grad_norms(runs: list[dict], path: Path) -> None:
    """Gradient norm per block at initialisation, one line per variant (warmup does not change it, so
    variants differing only in warmup are drawn once): the block's whole gradient and, dashed, its
    feed-forward output weight's."""
    plt = _pyplot()
    blocks, c_proj = grad_norms_by_variant(runs), grad_norms_by_variant(runs, "mlp.c_proj")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = set()
    for spec in blocks:
        variant = Variant.parse(spec)
        if (variant.norm, variant.norm_type) in drawn:
            continue
        drawn.add((variant.norm, variant.norm_type))
        label = variant.label.rsplit(", ", 1)[0]
        layers = range(len(blocks[spec]))
        (line,) = ax.plot(layers, blocks[spec], marker="o", label=f"{label}: block")
        ax.plot(
            layers,
            c_proj[spec],
            marker="x",
            ls="--",
            color=line.get_color(),
            label=f"{label}: mlp.c_proj.weight",
        )
    ax.set(
        xlabel="block",
        ylabel="gradient norm at init",
        yscale="log",
        title="Gradient norm per block at initialisation",
    )
    ax.set_xticks(range(len(next(iter(blocks.values())))))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


def char_data(preset: StallPreset, seed: int) -> CharDataModule:
    return CharDataModule(
        seq_len=preset.seq_len, batch_size=preset.batch_size, seed=seed, val_batches=preset.val_batches
    )


def run_stall(preset: StallPreset, out: Path, report=print, variants: list[Variant] | None = None) -> dict:
    """Train every variant (default: ``default_variants``) for every seed of ``preset``; writes
    summary.json, stall.png and grad_norms.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    variants = variants or default_variants(preset)
    runs = []
    total = len(variants) * len(preset.seeds)
    for seed in preset.seeds:
        data = char_data(preset, seed)
        for variant in variants:
            report(f"[{len(runs) + 1}/{total}] {variant.label}, seed {seed}")
            runs.append(train_variant(preset, variant, seed, data, out, report))
    summary = {
        "preset": asdict(preset),
        "unigram": round(data.unigram_entropy, 4),
        "bigram": round(data.bigram_entropy, 4),
        "variants": aggregate(runs),
        "grad_norms_at_init": grad_norms_by_variant(runs),
        "grad_norms_at_init_mlp_c_proj": grad_norms_by_variant(runs, "mlp.c_proj"),
        "runs": runs,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(runs, data.unigram_entropy, data.bigram_entropy, out / "stall.png")
    plot_grad_norms(runs, out / "grad_norms.png")
    return summary


GRID_SETTINGS = [f.name for f in fields(StallPreset) if f.type in ("int", "float", "str")]


def parse_axis(text: str, preset: StallPreset) -> tuple[str, list]:
    """``NAME=V1,V2,...`` for a setting of the preset: (name, values of the setting's type)."""
    name, _, values = text.partition("=")
    if name not in GRID_SETTINGS or not values:
        raise ValueError(f"grid axis {text!r}: want NAME=V1,V2 with NAME one of {', '.join(GRID_SETTINGS)}")
    kind = type(getattr(preset, name))
    try:
        return name, [kind(float(v)) if kind is int else kind(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(f"grid axis {text!r}: {name} takes {kind.__name__} values") from None


def cell_name(setting: dict) -> str:
    return "_".join(f"{name}={value}" for name, value in setting.items())


def run_grid(
    preset: StallPreset, variant: Variant, axes: list[tuple[str, list]], out: Path, report=print
) -> dict:
    """Train ``variant`` for each cell of the grid (and each seed), one after another. A cell's result
    is written to ``out/cells/<cell>_seed<S>.json`` when it ends, and a rerun skips the cells found
    there, so an interrupted grid resumes. Writes grid.json and the heatmap grid.png."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    names = [name for name, _ in axes]
    settings = [dict(zip(names, values, strict=True)) for values in itertools.product(*(v for _, v in axes))]
    cells, total, done = [], len(settings) * len(preset.seeds), 0
    for setting in settings:
        cell_preset = replace(preset, **setting)
        cell_variant = replace(variant, warmup=setting["warmup"]) if "warmup" in setting else variant
        runs = []
        for seed in preset.seeds:
            done += 1
            path = out / "cells" / f"{cell_name(setting)}_seed{seed}.json"
            if path.exists():
                report(f"[{done}/{total}] {cell_name(setting)}, seed {seed}: done before, skipped")
                runs.append(json.loads(path.read_text()))
                continue
            report(f"[{done}/{total}] {cell_name(setting)}, seed {seed}")
            run = train_variant(
                cell_preset,
                cell_variant,
                seed,
                char_data(cell_preset, seed),
                out / cell_name(setting),
                report,
            )
            partial = path.with_suffix(".partial")
            partial.write_text(json.dumps(run))
            partial.rename(path)  # whole or absent: a cell killed mid-write runs again
            runs.append(run)
        last = list(runs[0]["loss_at"])[-1]
        cells.append(
            {
                "setting": setting,
                "final_loss": spread([run["loss_at"][last] for run in runs]),
                "stalled_seeds": sum(run["stalled"] for run in runs),
                "seeds": [run["seed"] for run in runs],
            }
        )
    grid = {"preset": asdict(preset), "variant": variant.spec, "axes": dict(axes), "cells": cells}
    (out / "grid.json").write_text(json.dumps(grid, indent=1))
    plot_grid(grid, out / "grid.png")
    return grid


def plot_grid(grid: dict, path: Path) -> None:
    """Heatmap of the final loss (mean over seeds) over the first two axes; stalled cells hatched."""
    plt = _pyplot()
    axes = list(grid["axes"].items())
    (row_name, row_values), (col_name, col_values) = axes[0], axes[1] if len(axes) == 2 else ("", [None])
    loss = [[float("nan")] * len(col_values) for _ in row_values]
    stalled = [[""] * len(col_values) for _ in row_values]
    for cell in grid["cells"]:
        r = row_values.index(cell["setting"][row_name])
        c = col_values.index(cell["setting"][col_name]) if col_name else 0
        loss[r][c] = cell["final_loss"]["mean"]
        if cell["stalled_seeds"]:
            stalled[r][c] = f"\nstalled {cell['stalled_seeds']}/{len(cell['seeds'])}"
    fig, ax = plt.subplots(figsize=(1.6 * len(col_values) + 2.5, 1.1 * len(row_values) + 1.8))
    image = ax.imshow(loss, cmap="viridis", aspect="auto")
    for r, c in itertools.product(range(len(row_values)), range(len(col_values))):
        light = image.norm(loss[r][c]) > 0.6  # viridis turns yellow: dark text reads there
        text = f"{loss[r][c]:.2f}{stalled[r][c]}"
        ax.text(c, r, text, ha="center", va="center", color="black" if light else "white", fontsize=9)
        if stalled[r][c]:
            ax.add_patch(
                plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="//", edgecolor="red", lw=2)
            )
    ax.set_yticks(range(len(row_values)), [str(v) for v in row_values])
    ax.set_xticks(range(len(col_values)), [str(v) for v in col_values] if col_name else [""])
    label = Variant.parse(grid["variant"]).label
    if "warmup" in grid["axes"]:  # the label's warmup is the grid's to vary
        label = label.rsplit(", ", 1)[0]
    ax.set(ylabel=row_name, xlabel=col_name, title=f"{label}: final training loss")
    fig.colorbar(image, ax=ax, label=f"nats/char ({SMOOTH}-step mean at the last step)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


def xiong_ratio(norms: list[float]) -> float:
    """The last block's gradient norm over the first's: Xiong et al.'s contrast in one number (post-LN's
    grows toward the output, > 1; pre-LN's does not)."""
    return norms[-1] / norms[0]


def run_at_init(preset: StallPreset, depths: list[int], variants: list[Variant], out: Path, report) -> dict:
    """Gradient norms at initialisation only (no training), per variant and model depth, for every seed
    of ``preset``: what ``train_variant`` measures before training, at several depths. Writes
    ``OUT/at_init.json`` and ``OUT/at_init.png``."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in preset.seeds:
        data = char_data(preset, seed)
        batches = init_batches(preset, data, seed)
        # warmup does not change the initialisation: variants differing only in it are measured once
        distinct = dict.fromkeys(replace(v, warmup=0) for v in variants)
        for depth, variant in itertools.product(depths, distinct):
            L.seed_everything(seed, verbose=False)
            config = model_config(replace(preset, n_layer=depth), variant, data.vocab_size)
            norms = grad_norms_at_init(GPT(config), batches)
            rows.append(
                {
                    "variant": variant.spec,
                    "n_layer": depth,
                    "seed": seed,
                    "blocks": [round(v, 6) for v in norms["blocks"]],
                    "mlp.c_proj": [round(v, 6) for v in norms["mlp.c_proj"]],
                    "ratio_blocks": round(xiong_ratio(norms["blocks"]), 4),
                    "ratio_mlp_c_proj": round(xiong_ratio(norms["mlp.c_proj"]), 4),
                }
            )
            name = variant.label.rsplit(", ", 1)[0]
            ratios = f"block {rows[-1]['ratio_blocks']:.3f}, mlp.c_proj {rows[-1]['ratio_mlp_c_proj']:.3f}"
            report(f"    {name}, {depth} blocks, seed {seed}: last/first {ratios}")
    summary = {"preset": asdict(preset), "depths": depths, "rows": rows}
    (out / "at_init.json").write_text(json.dumps(summary, indent=1))
    plot_at_init(rows, out / "at_init.png")
    return summary


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


def plot_at_init(rows: list[dict], path: Path) -> None:
    """The feed-forward output weight's gradient norm at init against relative depth (block / last),
    a colour per variant and a line style per model depth (first seed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    first_seed = rows[0]["seed"]
    colours = {spec: f"C{i}" for i, spec in enumerate(dict.fromkeys(row["variant"] for row in rows))}
    depths = sorted({row["n_layer"] for row in rows})
    styles = dict(zip(depths, itertools.cycle(["-", "--", ":", "-."])))
    for row in rows:
        if row["seed"] != first_seed:
            continue
        norms = row["mlp.c_proj"]
        at = [i / max(1, len(norms) - 1) for i in range(len(norms))]
        label = f"{Variant.parse(row['variant']).label.rsplit(', ', 1)[0]}, {row['n_layer']} blocks"
        ax.plot(at, norms, ls=styles[row["n_layer"]], color=colours[row["variant"]], label=label)
    ax.set(
        xlabel="block / last block",
        ylabel="mlp.c_proj.weight gradient norm at init",
        yscale="log",
        title="Gradient norm of each feed-forward output weight at initialisation",
    )
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="blocklab stall", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the preset's")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the preset's)")
    parser.add_argument(
        "--warmup", type=int, help="warmup steps of the default third run (default: the preset's)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        help="NORM[+warmup=N][+rms], NORM one of pre post deepnorm peri; default: pre post post+warmup=W "
        "(W: --warmup); with --grid one variant (default: post)",
    )
    parser.add_argument(
        "--grid",
        nargs="+",
        metavar="NAME=V1,V2",
        help=f"one variant over a grid of preset settings, 1 or 2 axes (NAME: {', '.join(GRID_SETTINGS)})",
    )
    parser.add_argument(
        "--at-init",
        type=int,
        nargs="+",
        metavar="N_LAYER",
        help="no training: gradient norms at initialisation of models this many blocks deep, per variant",
    )
    explore = parser.add_argument_group("explore: change one setting of the preset")
    explore.add_argument("--lr", type=float)
    explore.add_argument("--n-embd", type=int, help="width; keep it divisible by --n-head")
    explore.add_argument("--n-head", type=int)
    explore.add_argument("--batch-size", type=int)
    explore.add_argument("--seq-len", type=int)
    parser.add_argument("--out", type=Path, default=Path("runs/stall"))
    parser.add_argument("--json", action="store_true", help="print summary.json instead of the table")
    args = parser.parse_args(argv[1:])
    overrides = {name: getattr(args, name) for name in ("steps", "warmup", "lr", "n_embd", "n_head")}
    overrides |= {"batch_size": args.batch_size, "seq_len": args.seq_len}
    overrides["seeds"] = tuple(args.seeds) if args.seeds else None
    preset = replace(PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None})
    if preset.steps < 3 or preset.warmup < 1:
        parser.error(f"need --steps >= 3 and --warmup >= 1, got {preset.steps} and {preset.warmup}")
    try:
        variants = [Variant.parse(spec) for spec in args.variants] if args.variants else None
        axes = [parse_axis(text, preset) for text in args.grid] if args.grid else None
    except ValueError as error:
        parser.error(str(error))
    if axes is not None and (len(axes) > 2 or len(variants or [None]) != 1):
        parser.error("--grid takes one or two axes and one variant")

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    report = (lambda line: None) if args.json else print
    report(f"blocklab stall --preset {args.preset}: {preset}")
    start = time.perf_counter()
    if args.at_init:
        if axes is not None or min(args.at_init) < 2:
            parser.error("--at-init takes depths of at least 2 blocks, and no --grid")
        variants = variants or [Variant("pre"), Variant("post")]
        summary = run_at_init(preset, args.at_init, variants, args.out, report)
        print(json.dumps(summary, indent=1) if args.json else at_init_table(summary))
        return 0
    if axes is not None:
        grid = run_grid(preset, (variants or [Variant("post")])[0], axes, args.out, report)
        print(json.dumps(grid, indent=1) if args.json else grid_table(grid))
        if not args.json:
            seconds = time.perf_counter() - start
            print(f"wrote {args.out / 'grid.json'} and {args.out / 'grid.png'} in {seconds:.0f} s")
        return 0
    summary = run_stall(preset, args.out, report, variants)
    if args.json:
        runs = [{k: v for k, v in run.items() if k != "losses"} for run in summary["runs"]]
        print(json.dumps({**summary, "runs": runs}, indent=1))
    else:
        print(table(summary["runs"], summary["unigram"], summary["bigram"]))
        seconds = time.perf_counter() - start
        print(f"wrote {args.out / 'summary.json'}, stall.png and grad_norms.png in {seconds:.0f} s")
        print(f"curves: tensorboard --logdir {args.out}")
    return 0
