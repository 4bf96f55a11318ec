"""``blocklab stall``: the post-LN warmup stall, reproduced.

    blocklab stall --preset cpu                       # ~9 minutes on 2 idle CPU cores
    blocklab stall --preset gpu --seeds 1 2 3 --out runs/stall-gpu

For each seed, three six-block character-level models are trained with the same settings: pre-LN
without warmup, post-LN without warmup, post-LN with a linear warmup. Without warmup the post-LN model
stays on the unigram line (it predicts character frequencies and never learns to use context) while
pre-LN goes below the bigram line; with warmup post-LN breaks through as well.

Writes ``OUT/<run>/`` TensorBoard runs, ``OUT/summary.json`` and ``OUT/stall.png``, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from lab.config import GPTConfig
from lab.data import CharDataModule
from lab.train import STREAM_TRAINER_ARGS, LitGPT

SMOOTH = 10  # "loss at step s" is the mean training loss over steps s-9..s


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


@dataclass(frozen=True)
class Variant:
    norm: str
    warmup: int

    @property
    def label(self) -> str:
        return f"{self.norm}-LN, " + (f"warmup {self.warmup}" if self.warmup else "no warmup")

    def run_name(self, seed: int) -> str:
        return f"{self.norm}ln_warmup{self.warmup}_seed{seed}"


class LossRecorder(L.Callback):
    """Keeps every training step's loss (None for a skipped step) and reports progress."""

    def __init__(self, report: Callable[[str], None], every: int = 100):
        self.losses: list[float | None] = []
        self.report, self.every = report, every
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].item() if outputs is not None else None
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


def train_variant(
    preset: StallPreset, variant: Variant, seed: int, data: CharDataModule, out: Path, report
) -> dict:
    """Train one model; its summary row, with the per-step losses under ``losses``."""
    L.seed_everything(seed, verbose=False)
    config = GPTConfig(
        n_layer=preset.n_layer,
        n_head=preset.n_head,
        n_embd=preset.n_embd,
        vocab_size=data.vocab_size,
        block_size=preset.seq_len,
        norm=variant.norm,
    )
    model = LitGPT(
        config,
        lr=preset.lr,
        betas=preset.betas,
        weight_decay=preset.weight_decay,
        warmup_steps=variant.warmup,
    )
    recorder = LossRecorder(report)
    trainer = L.Trainer(
        **STREAM_TRAINER_ARGS,
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
        "norm": variant.norm,
        "warmup": variant.warmup,
        "seed": seed,
        "loss_at": {str(step): round(curve[step - 1], 4) for step in marks},
        "val_loss": round(float(trainer.callback_metrics["val/loss"]), 4),
        "below_bigram_at": below,
        # Closer to the unigram line than to the bigram line after the whole budget.
        "stalled": final > (data.unigram_entropy + data.bigram_entropy) / 2,
        "s_per_step": round((time.perf_counter() - recorder.start) / preset.steps, 4),
        "skipped_steps": model.nonfinite_steps,
        "losses": recorder.losses,
    }


def plot(runs: list[dict], unigram: float, bigram: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {("pre", False): "tab:blue", ("post", False): "tab:red", ("post", True): "tab:green"}
    seeds = sorted({run["seed"] for run in runs})
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        curve = smoothed(run["losses"])
        label = Variant(run["norm"], run["warmup"]).label + f", seed {run['seed']}"
        colour = colours[(run["norm"], run["warmup"] > 0)]
        ax.plot(range(1, len(curve) + 1), curve, colour, ls=styles[seeds.index(run["seed"]) % 4], label=label)
    ax.axhline(unigram, color="grey", ls="--", lw=1, label=f"unigram line H(X) = {unigram:.2f}")
    ax.axhline(bigram, color="black", ls="--", lw=1, label=f"bigram line H(X_t | X_t-1) = {bigram:.2f}")
    ax.set(xlabel="step", ylabel=f"training loss, nats/char ({SMOOTH}-step mean)", title="The post-LN stall")
    ax.set_ylim(top=max(unigram + 0.6, 4.0))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(runs: list[dict], unigram: float, bigram: float) -> str:
    marks = list(runs[0]["loss_at"])
    head = ["run", "seed", *(f"step {m}" for m in marks), "val", "below bigram at", "stalled"]
    rows = [
        [
            Variant(run["norm"], run["warmup"]).label,
            str(run["seed"]),
            *(f"{run['loss_at'][m]:.3f}" for m in marks),
            f"{run['val_loss']:.3f}",
            str(run["below_bigram_at"] or "-"),
            "yes" if run["stalled"] else "no",
        ]
        for run in runs
    ]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in [head, *rows]]
    lines.append(f"reference lines: unigram {unigram:.3f}, bigram {bigram:.3f} nats/char (training split)")
    return "\n".join(lines)


def run_stall(preset: StallPreset, out: Path, report=print) -> dict:
    """Train every variant for every seed of ``preset``; writes summary.json and stall.png under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    variants = [Variant("pre", 0), Variant("post", 0), Variant("post", preset.warmup)]
    runs = []
    total = len(variants) * len(preset.seeds)
    for seed in preset.seeds:
        data = CharDataModule(
            seq_len=preset.seq_len, batch_size=preset.batch_size, seed=seed, val_batches=preset.val_batches
        )
        for variant in variants:
            report(f"[{len(runs) + 1}/{total}] {variant.label}, seed {seed}")
            runs.append(train_variant(preset, variant, seed, data, out, report))
    summary = {
        "preset": asdict(preset),
        "unigram": round(data.unigram_entropy, 4),
        "bigram": round(data.bigram_entropy, 4),
        "runs": runs,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(runs, data.unigram_entropy, data.bigram_entropy, out / "stall.png")
    return summary


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="blocklab stall", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    parser.add_argument("--seeds", type=int, nargs="+", help="default: the preset's")
    parser.add_argument("--steps", type=int, help="training steps per run (default: the preset's)")
    parser.add_argument("--warmup", type=int, help="warmup steps of the third run (default: the preset's)")
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

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    report = (lambda line: None) if args.json else print
    report(f"blocklab stall --preset {args.preset}: {preset}")
    start = time.perf_counter()
    summary = run_stall(preset, args.out, report)
    if args.json:
        runs = [{k: v for k, v in run.items() if k != "losses"} for run in summary["runs"]]
        print(json.dumps({**summary, "runs": runs}, indent=1))
    else:
        print(table(summary["runs"], summary["unigram"], summary["bigram"]))
        seconds = time.perf_counter() - start
        print(f"wrote {args.out / 'summary.json'} and {args.out / 'stall.png'} in {seconds:.0f} s")
        print(f"curves: tensorboard --logdir {args.out}")
    return 0
