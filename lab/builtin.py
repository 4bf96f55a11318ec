"""``blocklab builtin``: train the embedded default model once, into the user's cache dir.

    blocklab builtin            # ~10 minutes on 2 CPU cores; then `--model builtin` works everywhere
    blocklab builtin --force    # train again
    blocklab builtin --recipe early-exit   # the same with LayerSkip's recipe: `--model builtin-early-exit`

GPT-2's own weights cannot be downloaded everywhere, so blocklab makes a GPT-2-shaped model of its own:
the GPT-2 tokenizer, 12 blocks, narrower (width 128, 4 heads, context 256), trained with the Lightning
lab (``lab.train.LitGPT``) on the CPython standard library's own source (``lab.token_data``): every
Python install carries the same corpus, so nothing is downloaded. It trains in a compact vocabulary
of the tokens the corpus uses and is widened to GPT-2's 50257 rows before saving (see
``lab.token_data``). The report gives its validation loss and the loss with each block skipped, to
show that every block matters. Saved with ``lab.weights.save_model`` in ``lab.weights.builtin_dir()``
(``~/.cache/blocklab/builtin``, or ``$BLOCKLAB_CACHE/builtin``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger

from lab import tokens
from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.corpora import HELD_OUT_EVERY, stdlib_files
from lab.exit_probe import ExitProbe, fit_exit_probe_on_files, load_exit_probe, save_exit_probe
from lab.model import GPT
from lab.token_data import TokenDataModule, lowest_log_normaliser, ngram_baselines, widen_vocabulary
from lab.train import STREAM_TRAINER_ARGS, LitGPT
from lab.weights import FORMAT_FILE, builtin_dir, load_model, read_metadata, save_model


@dataclass
class Recipe:
    """How the builtin model is made. The defaults fit ~10 minutes on 2 CPU cores."""

    n_layer: int = 12
    n_head: int = 4
    n_embd: int = 128
    """Narrow: at GPT-2's vocabulary the unembedding is most of a step; 128 trains far enough in time."""
    block_size: int = 256
    batch_size: int = 8
    """Windows of block_size tokens per step: small batches, many steps, for a short budget."""
    max_steps: int | None = None
    """Optimiser steps; None: as many as fit in ``minutes``, measured on this machine before training."""
    minutes: float = 10.0
    """Budget of the whole command (corpus, training, evaluation); training stops here regardless."""
    muon_lr: float = 0.02
    """Muon's learning rate for the blocks' matrices (``lab.optim``)."""
    lr: float = 3e-3
    """AdamW's learning rate for the token and position tables, norms and biases."""
    min_lr_fraction: float = 0.1
    """The cosine ends at this fraction of both learning rates."""
    weight_decay: float = 0.1
    precision: str | None = None
    """Lightning precision ('32-true', 'bf16-mixed'); None: the faster of the two, measured here."""
    max_files: int | None = None
    """Use only the first files of the standard library (tests use a handful)."""
    val_every: int = HELD_OUT_EVERY
    """Every 20th file of the standard library is held out for validation."""
    eval_batches: int = 4
    """Validation batches (of batch_size windows of block_size tokens) for the report."""
    seed: int = 1
    layer_dropout: float = 0.0
    """LayerSkip's layer dropout at the last block (``lab.train.LitGPT``); 0: off."""
    layer_dropout_curriculum: str = "constant"
    """constant, or exponential: the rates grow from none to full over training."""
    early_exit_loss: float = 0.0
    """LayerSkip's early-exit loss scale (``lab.train.LitGPT``); 0: off."""
    early_exit_every: int = 1
    """Its rotational curriculum: every this-many-th block's read-out trained per step."""
    early_exit_tokens: float = 1.0
    """The share of a batch's positions whose exit losses are computed (``lab.train.LitGPT``)."""


RECIPES = {
    "plain": {},
    # LayerSkip's recipe at the builtin's size. At width 128 one read-out (the compact vocabulary's
    # unembedding) costs about half a plain step, and in a ten-minute budget every step counts: exits
    # are trained on every other block per step and a 32nd of the positions, which costs a few
    # percent per step (the s/step `blocklab builtin` prints). Their weights together are about a
    # quarter of the last block's, and layer dropout is mild and rises from none as training goes
    # (LayerSkip's pretraining curriculum): a few hundred steps leave no depth to spare.
    "early-exit": {
        "layer_dropout": 0.05,
        "layer_dropout_curriculum": "exponential",
        "early_exit_loss": 0.1,
        "early_exit_every": 2,
        "early_exit_tokens": 1 / 32,
    },
}
"""``blocklab builtin --recipe NAME``: the Recipe fields each one sets."""


UNSEEN_MARGIN = 15.0
"""Nats below the lowest log-normaliser seen on validation text at which never-seen tokens sit."""


@torch.inference_mode()
def evaluate(model: GPT, compact: GPT, dm: TokenDataModule) -> dict:
    """Validation loss (nats/token) of the widened ``model``, the probability it puts on tokens the
    corpus never uses, and the loss with each block skipped. The skips run on the ``compact`` model:
    the same logits for every token that occurs, so the same loss up to that (measured) probability,
    at 1/2.6 of the unembedding's cost."""
    compact_batches = list(dm.val_dataloader())
    unseen = torch.ones(tokens.VOCAB_SIZE, dtype=torch.bool)  # [50257]
    unseen[dm.gpt2_ids] = False
    val_loss, unseen_mass = 0.0, 0.0
    for x, y in compact_batches:
        logits = model(dm.gpt2_ids[x])  # [B, T, 50257]: GPT-2 ids in, GPT-2 ids out
        val_loss += float(F.cross_entropy(logits.flatten(0, 1), dm.gpt2_ids[y].flatten()))
        unseen_mass += float(logits.softmax(-1)[..., unseen].sum(-1).mean())

    def compact_loss(block_set: BlockSet) -> float:
        losses = [
            F.cross_entropy(compact(x, block_set=block_set).flatten(0, 1), y.flatten())
            for x, y in compact_batches
        ]
        return float(torch.stack(losses).mean())

    n_layer = model.config.n_layer
    return {
        "val_loss": val_loss / len(compact_batches),
        "unseen_token_mass": unseen_mass / len(compact_batches),
        "val_loss_skip": [compact_loss(BlockSet(skip={i})) for i in range(n_layer)],
        "val_loss_exit": [compact_loss(BlockSet(exit_at=e)) for e in range(1, n_layer)],
    }


def layerskip_options(recipe: Recipe) -> dict:
    """The recipe's LayerSkip fields, as ``LitGPT`` takes them."""
    names = [f.name for f in dataclasses.fields(Recipe) if f.name.startswith(("layer_dropout", "early_exit"))]
    return {name: getattr(recipe, name) for name in names}


def seconds_per_step(
    cfg: GPTConfig,
    initial: dict,
    dm: TokenDataModule,
    recipe: Recipe,
    threads: int,
    precision: str,
    give_up_after: float = math.inf,
) -> float:
    """Wall time of one training step (forward, backward, optimiser) on this machine with ``threads``
    torch threads at ``precision``, measured on a throwaway copy of the model. A setting whose first
    step takes longer than ``give_up_after`` seconds is abandoned (inf): it cannot be the fastest."""
    torch.set_num_threads(threads)
    probe = LitGPT(
        cfg, optimizer="muon", muon_lr=recipe.muon_lr, lr=recipe.lr, max_steps=1, **layerskip_options(recipe)
    )
    probe.model.load_state_dict(initial)
    optimizer = probe.configure_optimizers()["optimizer"]
    x, y = next(iter(dm.train_dataloader()))  # [B, T] each
    times = []
    for _ in range(3):  # the first is a warm-up
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            loss, _ = probe.objective(x, y)  # the recipe's own step: its read-outs cost time too
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
        if times[0] > give_up_after:
            return math.inf
    return min(times[1:])


def create_builtin(recipe: Recipe | None = None, directory: Path | None = None) -> dict:
    """Train, widen, evaluate and save the builtin model; returns the report saved as its metadata."""
    threads = torch.get_num_threads()
    try:
        return _create(recipe or Recipe(), directory or builtin_dir())
    finally:
        torch.set_num_threads(threads)  # training may pick fewer threads (see _create)


def _create(recipe: Recipe, directory: Path) -> dict:
    started = time.perf_counter()
    files = stdlib_files(recipe.max_files)
    dm = TokenDataModule(
        files, seq_len=recipe.block_size, batch_size=recipe.batch_size, val_every=recipe.val_every,
        val_batches=recipe.eval_batches, seed=recipe.seed,
    )  # fmt: skip
    print(
        f"corpus: {len(files)} files of the Python {platform.python_version()} standard library, "
        f"{len(dm.train_ids):,} training and {len(dm.val_ids):,} validation tokens, "
        f"{dm.vocab_size:,} distinct tokens",
        file=sys.stderr,
    )
    cfg = GPTConfig(
        n_layer=recipe.n_layer, n_head=recipe.n_head, n_embd=recipe.n_embd, vocab_size=dm.vocab_size,
        block_size=recipe.block_size,
    )  # fmt: skip
    L.seed_everything(recipe.seed, verbose=False)
    initial = GPT(cfg).state_dict()  # the seeded initialisation: the same for the probes and the run
    # On a CPU shared with other jobs, 2 threads can be several times slower than 1 (each op waits for
    # its slowest thread), and bf16 pays only where the CPU has bf16 units: measure, train the fastest.
    precisions = [recipe.precision] if recipe.precision else ["32-true", "bf16-mixed"]
    step_seconds, threads, precision = math.inf, 1, precisions[0]
    for n in sorted({1, torch.get_num_threads()}):
        for p in precisions:
            # a warm-up step takes longer than the steps after it, but not three times as long
            seconds = seconds_per_step(cfg, initial, dm, recipe, n, p, give_up_after=3 * step_seconds)
            if seconds < step_seconds:
                step_seconds, threads, precision = seconds, n, p
    torch.set_num_threads(threads)
    # The evaluation at the end: a validation batch forward is ~1/3 of a plain step, for each of
    # 1.5 n_layer + 2 passes (the widened model once, the compact one with each block skipped, the
    # exits at half a pass each on average), and the baselines.
    evaluation = 0.5 * recipe.eval_batches * (1.5 * recipe.n_layer + 2) * step_seconds + 5 + PROBE_SECONDS
    train_seconds = recipe.minutes * 60 - (time.perf_counter() - started) - evaluation
    # Validation runs VALIDATIONS times inside the training time: eval_batches forwards of ~1/3 of a plain
    # step each, plus (under the early-exit loss) every block's read-out, half a forward each.
    passes = 1 + (recipe.n_layer - 1) / 2 if recipe.early_exit_loss > 0 else 1
    validation = VALIDATIONS * recipe.eval_batches * passes * step_seconds / 3
    max_steps = recipe.max_steps or max(int((train_seconds - validation) / step_seconds), 10)
    print(
        f"{step_seconds:.2f} s/step with {threads} thread(s) at {precision}: training {max_steps} steps",
        file=sys.stderr,
    )
    lit = LitGPT(
        cfg, optimizer="muon", muon_lr=recipe.muon_lr,
        train_seconds=train_seconds if recipe.max_steps is None else None,
        lr=recipe.lr, weight_decay=recipe.weight_decay,
        warmup_steps=max(max_steps // 10, 1), schedule="cosine", min_lr=recipe.lr * recipe.min_lr_fraction,
        max_steps=max_steps, **layerskip_options(recipe),
    )  # fmt: skip
    lit.model.load_state_dict(initial)
    with tempfile.TemporaryDirectory() as scratch:
        logs = Path(scratch) / "logs"
        trainer = L.Trainer(
            **STREAM_TRAINER_ARGS,
            accelerator="cpu",
            devices=1,
            precision=precision,
            max_steps=max_steps,
            max_epochs=1,
            limit_train_batches=max_steps,  # one "epoch" is the whole run: the bar shows its end
            val_check_interval=max(max_steps // VALIDATIONS, 1),
            limit_val_batches=recipe.eval_batches,
            num_sanity_val_steps=0,
            max_time={"seconds": max(train_seconds, 1)},
            gradient_clip_val=1.0,
            logger=TensorBoardLogger(logs, name="", version=""),
            enable_checkpointing=False,
            enable_model_summary=False,
            log_every_n_steps=10,
        )
        trainer.fit(lit, datamodule=dm)
        train_seconds = time.perf_counter() - started
        compact = lit.model.eval()
        n_unseen = tokens.VOCAB_SIZE - dm.vocab_size
        unseen_logit = lowest_log_normaliser(compact, dm) - math.log(n_unseen) - UNSEEN_MARGIN
        model = widen_vocabulary(compact, dm.gpt2_ids, unseen_logit)
        report = {
            "python": platform.python_version(),
            "files": len(files),
            "val_files": dm.n_val_files,
            "train_tokens": len(dm.train_ids),
            "distinct_tokens": dm.vocab_size,
            "unseen_logit": unseen_logit,
            "steps": trainer.global_step,
            "planned_steps": max_steps,
            "tokens_seen": trainer.global_step * recipe.batch_size * recipe.block_size,
            "seconds_per_step": round(step_seconds, 3),
            "threads": threads,
            "precision": precision,
            "train_seconds": round(train_seconds, 1),
            "baselines": ngram_baselines(dm),
            "recipe": dataclasses.asdict(recipe),
            **evaluate(model, compact, dm),
        }
        model.exit_probe = fit_probe(model, files, recipe.val_every)
        report["total_seconds"] = round(time.perf_counter() - started, 1)
        save_model(model, directory, metadata=report)  # with the probe
        shutil.rmtree(directory / "logs", ignore_errors=True)  # a model made again: only its own run
        shutil.copytree(logs, directory / "logs")  # TensorBoard: train/loss, val/loss
    return report


VALIDATIONS = 4
"""Validations during training (TensorBoard's val/loss curve)."""
PROBE_SECONDS = 30
"""What fitting the probe takes on 2 cores (reserved from the training budget)."""


def fit_probe(model: GPT, files: list[Path], val_every: int) -> ExitProbe:
    """The model's exit probe, fitted on windows of the training files, and the time it took."""
    started = time.perf_counter()
    probe = fit_exit_probe_on_files(model, files, val_every)
    print(f"exit probe: fitted in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return probe


def format_report(report: dict) -> str:
    loss = report["val_loss"]
    lines = [
        f"builtin: {report['steps']} steps ({report['tokens_seen']:,} tokens), "
        f"{report['total_seconds']:.0f} s in all, on the Python {report['python']} standard library "
        f"({report['files']} files)",
        f"validation loss {loss:.3f} nats/token (perplexity {math.exp(loss):.1f}); count models of the "
        f"training split on the same text: unigram {report['baselines']['unigram']:.3f}, bigram "
        f"{report['baselines']['bigram']:.3f}; probability on never-seen tokens "
        f"{report['unseen_token_mass']:.1e}",
        "validation loss with one block skipped:",
    ]
    for i, skipped in enumerate(report["val_loss_skip"]):
        lines.append(f"  skip={i:<3d} {skipped:.3f}  (+{skipped - loss:.3f})")
    if "val_loss_exit" in report:
        lines.append("validation loss read out early:")
        for exit_at, early in enumerate(report["val_loss_exit"], start=1):
            lines.append(f"  exit={exit_at:<3d} {early:.3f}  (+{early - loss:.3f})")
    if loss >= report["baselines"]["bigram"]:
        # measured: 804 steps on 2 idle cores reach 2.71; 341 steps on a busy machine stayed at 3.31
        lines.append(
            f"note: {report['steps']} steps left the model short of the bigram count model; the budget "
            "is wall time, so a busy machine trains less: run again on a quieter one, or with --minutes 20"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``blocklab builtin [--force] [--minutes M] [--steps N]``."""
    parser = argparse.ArgumentParser(prog="blocklab builtin", description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="train again even if the model exists")
    parser.add_argument("--minutes", type=float, default=Recipe.minutes, help="time budget of the command")
    parser.add_argument("--steps", type=int, default=None, help="optimiser steps (default: fit the budget)")
    parser.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default="plain",
        help="early-exit: LayerSkip's layer dropout and early-exit loss, saved as builtin-early-exit",
    )
    args = parser.parse_args(argv[1:])
    name = "builtin" if args.recipe == "plain" else f"builtin-{args.recipe}"
    directory = builtin_dir(name)
    if (directory / FORMAT_FILE).exists() and not args.force:
        report = read_metadata(directory)
        if load_exit_probe(directory) is None:  # made before the probe existed: fit it now
            recipe = report["recipe"]
            probe = fit_probe(load_model(name), stdlib_files(recipe["max_files"]), recipe["val_every"])
            save_exit_probe(probe, directory)
        print(f"{directory} exists (train again with --force)\n{format_report(report)}")
        return 0
    recipe = Recipe(max_steps=args.steps, minutes=args.minutes, **RECIPES[args.recipe])
    report = create_builtin(recipe, directory)
    print(f"saved to {directory}\n{format_report(report)}")
    return 0
