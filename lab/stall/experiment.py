"""The training runs of a stall experiment: one model per variant and seed, a grid of presets, and
gradient norms at initialisation without training."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from lab.config import GPTConfig
from lab.data import CharDataModule, RandomWindows
from lab.gradients import grad_norms_at_init
from lab.model import GPT
from lab.stall.plots import plot, plot_at_init, plot_grad_norms, plot_grid
from lab.stall.report import (
    aggregate,
    grad_norms_by_variant,
    report_steps,
    smoothed,
    spread,
    xiong_ratio,
)
from lab.stall.settings import StallPreset, Variant, cell_name, default_variants
from lab.train import LitGPT, make_trainer

INIT_BATCHES = 4  # gradient norms at initialisation: the mean over the first training batches
# Per-block gradient norms and update ratios in TensorBoard: every step while the stall sets in, then
# sparsely (each costs a copy of the blocks' weights).
BLOCK_STATS_FIRST, BLOCK_STATS_EVERY = 100, 25


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
    trainer = make_trainer(
        preset.steps,
        gradient_clip_val=preset.grad_clip,
        precision=preset.precision,
        logger=TensorBoardLogger(out, name="", version=variant.run_name(seed)),
        callbacks=[recorder],
    )
    trainer.fit(model, data)
    return {
        **run_summary(variant, seed, data, recorder, float(trainer.callback_metrics["val/loss"])),
        "skipped_steps": model.nonfinite_steps,
        "grad_norms_at_init": {name: [round(v, 6) for v in values] for name, values in at_init.items()},
        "losses": recorder.losses,
    }


def run_summary(
    variant: Variant, seed: int, data: CharDataModule, recorder: LossRecorder, val_loss: float
) -> dict:
    """A finished run's row: its variant and seed, the loss at the report steps and on the validation
    split, where it crossed the bigram line, whether it stalled, its speed."""
    steps = len(recorder.losses)
    curve = smoothed(recorder.losses)
    below = next((i + 1 for i, loss in enumerate(curve) if loss < data.bigram_entropy), None)
    return {
        "variant": variant.spec,
        "norm": variant.norm,
        "norm_type": variant.norm_type,
        "warmup": variant.warmup,
        "seed": seed,
        "loss_at": {str(step): round(curve[step - 1], 4) for step in report_steps(steps)},
        "val_loss": round(val_loss, 4),
        "below_bigram_at": below,
        # Closer to the unigram line than to the bigram line after the whole budget.
        "stalled": curve[-1] > (data.unigram_entropy + data.bigram_entropy) / 2,
        "s_per_step": round((time.perf_counter() - recorder.start) / steps, 4),
    }


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


def run_grid(
    preset: StallPreset, variant: Variant, axes: list[tuple[str, list]], out: Path, report=print
) -> dict:
    """Train ``variant`` for each cell of the grid (and each seed), one after another. A cell's result
    is written to ``out/cells/<cell>_seed<S>.json`` when it ends, and a rerun skips the cells found
    there, so an interrupted grid resumes. Writes grid.json and the heatmap grid.png."""
    (out / "cells").mkdir(parents=True, exist_ok=True)
    names = [name for name, _ in axes]
    settings = [dict(zip(names, values, strict=True)) for values in itertools.product(*(v for _, v in axes))]
    cells, total = [], len(settings) * len(preset.seeds)
    for setting in settings:
        runs = []
        for seed in preset.seeds:
            done = len(cells) * len(preset.seeds) + len(runs)
            progress = f"[{done + 1}/{total}] {cell_name(setting)}, seed {seed}"
            runs.append(grid_run(preset, variant, setting, seed, out, report, progress))
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


def grid_run(
    preset: StallPreset,
    variant: Variant,
    setting: dict,
    seed: int,
    out: Path,
    report: Callable[[str], None],
    progress: str,
) -> dict:
    """One seed of one cell of a grid: read from ``out/cells/`` if a run before finished it, else trained
    and written there; ``progress`` is its line for ``report``."""
    path = out / "cells" / f"{cell_name(setting)}_seed{seed}.json"
    if path.exists():
        report(f"{progress}: done before, skipped")
        return json.loads(path.read_text())
    report(progress)
    cell_preset = replace(preset, **setting)
    cell_variant = replace(variant, warmup=setting["warmup"]) if "warmup" in setting else variant
    data = char_data(cell_preset, seed)
    run = train_variant(cell_preset, cell_variant, seed, data, out / cell_name(setting), report)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(run))
    partial.rename(path)  # whole or absent: a cell killed mid-write runs again
    return run


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
