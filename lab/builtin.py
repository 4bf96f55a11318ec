"""``blocklab builtin``: the embedded default models, how they are made, and making them again.

    blocklab builtin --show                 # the shipped model's training report (nothing is trained)
    blocklab builtin                        # train it again into your cache dir: the same steps, seed, data
    blocklab builtin --recipe early-exit    # the same with LayerSkip's recipe: `--model builtin-early-exit`
    blocklab builtin --minutes 5            # time-boxed instead: as many steps as fit (differs per machine)
    blocklab builtin --reset                # forget your copy: `--model builtin` is the shipped one again

GPT-2's own weights cannot be downloaded everywhere, so blocklab ships a GPT-2-shaped model of its own
(lab/assets/builtin): the GPT-2 tokenizer, 12 blocks, narrower (width 128, 4 heads, context 256),
trained with the Lightning lab (``lab.train.LitGPT``) on the CPython standard library's own source
(``lab.token_data``): every Python install carries the same corpus, so nothing is downloaded.

A run is a fixed number of optimiser steps at a fixed precision over a seeded data order, so the same
command with the same seed and thread count gives the same weights on a machine, and the machine only
changes how long it takes. The model trains in a compact vocabulary of the tokens the corpus uses;
only those rows are stored (fp16) and loading widens it to GPT-2's 50257 (``lab.weights.save_model``).
The report beside the weights gives the command, the validation loss, the loss with each block skipped
and each early exit, the n-gram baselines and the machine it ran on. A retrained model is written to
``lab.weights.builtin_dir()`` (``~/.cache/blocklab/builtin``, or ``$BLOCKLAB_CACHE/builtin``), which
``--model builtin`` then prefers; ``--out DIR`` writes elsewhere (``--out lab/assets/builtin``
remakes the shipped one).
"""

from __future__ import annotations

import dataclasses
import math
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lightning as L
import torch
import torch.nn.functional as F
from jsonargparse.typing import PositiveInt
from lightning.pytorch.loggers import TensorBoardLogger

from lab import tokens
from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.corpora import HELD_OUT_EVERY, stdlib_files
from lab.exit_probe import ExitProbe, fit_exit_probe_on_files
from lab.flags import parse
from lab.machine import cpu_description
from lab.model import GPT
from lab.threads import ThreadTuner
from lab.token_data import TokenDataModule, lowest_log_normaliser, ngram_baselines, widen_vocabulary
from lab.train import FreeCoreThreads, LitGPT, make_trainer
from lab.weights import (
    FORMAT_FILE,
    builtin_dir,
    builtin_source,
    read_metadata,
    save_model,
    shipped_dir,
)

STORED_DTYPE = torch.float16
"""The builtin models' weights as stored: their report is measured on these values, not on fp32's."""


@dataclass
class Recipe:
    """How a builtin model is made."""

    n_layer: int = 12
    n_head: int = 4
    n_embd: int = 128
    """Narrow: at GPT-2's vocabulary the unembedding is most of a step, and 128 trains far on a CPU."""
    block_size: int = 256
    batch_size: int = 8
    """Windows of block_size tokens per step: small batches, many steps."""
    steps: int = 1200
    """Optimiser steps (``minutes`` replaces them with as many as fit)."""
    minutes: float | None = None
    """A wall-clock budget for the whole command instead of ``steps``: the steps that fit, measured
    here first (so the model differs from machine to machine)."""
    precision: Literal["32-true", "bf16-mixed"] = "32-true"
    """Lightning's precision. fp32 everywhere: bf16 is fast only on CPUs with bf16 units."""
    threads: int | None = None
    """Torch threads for training, fixed (None: one per free core, chosen again every few seconds:
    ``lab.train.FreeCoreThreads``); the weights depend on them."""
    muon_lr: float = 0.02
    """Muon's learning rate for the blocks' matrices (``lab.optim``)."""
    lr: float = 3e-3
    """AdamW's learning rate for the token and position tables, norms and biases."""
    min_lr_fraction: float = 0.1
    """The cosine ends at this fraction of both learning rates."""
    weight_decay: float = 0.1
    max_files: int | None = None
    """Use only the first files of the standard library (tests use a handful)."""
    val_every: int = HELD_OUT_EVERY
    """Every 20th file of the standard library is held out for validation."""
    eval_batches: int = 4
    """Validation batches (of batch_size windows of block_size tokens) for the report."""
    seed: int = 1
    """Seeds the initialisation, the data order and layer dropout."""
    layerskip: dict[str, float | str] = field(default_factory=dict)
    """LayerSkip's options of ``lab.train.LitGPT`` (layer_dropout, early_exit_loss, ...); none: off."""


RECIPES: dict[str, dict] = {
    "plain": {},
    # LayerSkip's recipe at the builtin's size. At width 128 one read-out (the compact vocabulary's
    # unembedding) costs about half a plain step: exits are trained on every other block per step
    # and a 32nd of the positions. Their weights together are about a quarter of the last block's,
    # and layer dropout is mild and rises from none as training goes (LayerSkip's curriculum).
    "early-exit": {
        "layerskip": {
            "layer_dropout": 0.05,
            "layer_dropout_curriculum": "exponential",
            "early_exit_loss": 0.1,
            "early_exit_every": 2,
            "early_exit_tokens": 1 / 32,
        }
    },
}
"""``blocklab builtin --recipe NAME``: the Recipe fields each one sets."""

UNSEEN_MARGIN = 15.0
"""Nats below the lowest log-normaliser seen on validation text at which never-seen tokens sit."""
VALIDATIONS = 4
"""Validations during training (TensorBoard's val/loss curve)."""


def model_name(recipe: str) -> str:
    """The ``--model`` name of a recipe's model."""
    return "builtin" if recipe == "plain" else f"builtin-{recipe}"


@torch.inference_mode()
def evaluate(model: GPT, compact: GPT, dm: TokenDataModule) -> dict:
    """Validation loss (nats/token) of the widened ``model``, the probability it puts on tokens the
    corpus never uses, and the loss with each block skipped and with each early exit. The skips and
    exits run on the ``compact`` model: the same logits for every token that occurs, so the same loss
    up to that (measured) probability."""
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


def seconds_per_step(lit: LitGPT, dm: TokenDataModule, precision: str) -> float:
    """Wall time of one training step (forward, backward, optimiser) here, on a throwaway copy of
    ``lit``'s model: the faster of two steps after a warm-up. Random state is left as it was."""
    probe = LitGPT(lit.config, **{k: v for k, v in lit.hparams.items() if k != "config"})
    probe.model.load_state_dict(lit.model.state_dict())
    optimizer = probe.configure_optimizers()["optimizer"]
    x, y = next(iter(dm.train_dataloader()))  # [B, T] each
    times = []
    with torch.random.fork_rng(devices=[]):
        for _ in range(3):
            start = time.perf_counter()
            training_step(probe, optimizer, x, y, precision)
            times.append(time.perf_counter() - start)
    return min(times[1:])


def training_step(lit: LitGPT, optimizer, x: torch.Tensor, y: torch.Tensor, precision: str) -> None:
    """One optimiser step of the recipe on tokens x and targets y [B, T]: forward, backward, update."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss, _ = lit.objective(x, y)  # the recipe's own step: its read-outs cost time too
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def data_module(recipe: Recipe) -> TokenDataModule:
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
    return dm


def lightning_module(recipe: Recipe, cfg: GPTConfig, steps: int, train_seconds: float | None) -> LitGPT:
    return LitGPT(
        cfg, optimizer="muon", muon_lr=recipe.muon_lr, lr=recipe.lr, weight_decay=recipe.weight_decay,
        warmup_steps=max(steps // 10, 1), schedule="cosine", min_lr=recipe.lr * recipe.min_lr_fraction,
        max_steps=steps, train_seconds=train_seconds, **recipe.layerskip,
    )  # fmt: skip


def plan(recipe: Recipe, lit: LitGPT, dm: TokenDataModule, started: float) -> tuple[int, float | None]:
    """The steps to train and the training time budget (None: steps alone), with the estimate printed
    before training: the measured time of a step, times the steps, plus evaluation and the probe."""
    step_seconds = seconds_per_step(lit, dm, recipe.precision)
    # Afterwards: a validation forward is ~1/3 of a step, for each of 1.5 L + 2 passes (the widened
    # model, the compact one per skipped block and per exit), and the exit probe ~L/2 of those.
    after = recipe.eval_batches * (2 * recipe.n_layer + 2) * step_seconds / 3
    passes = 1 + (recipe.n_layer - 1) / 2 if recipe.layerskip.get("early_exit_loss", 0) > 0 else 1
    validation = VALIDATIONS * recipe.eval_batches * passes * step_seconds / 3
    train_seconds = None
    steps = recipe.steps
    if recipe.minutes is not None:
        train_seconds = recipe.minutes * 60 - (time.perf_counter() - started) - after
        steps = max(int((train_seconds - validation) / step_seconds), 10)
    total = steps * step_seconds + validation + after
    threads, boxed = torch.get_num_threads(), " (time-boxed)" if train_seconds else ""
    print(
        f"{step_seconds:.2f} s/step here ({threads} threads, {recipe.precision}): {steps} steps, "
        f"about {total / 60:.0f} min in all{boxed}",
        file=sys.stderr,
    )
    return steps, train_seconds


def train(
    recipe: Recipe, lit: LitGPT, dm: TokenDataModule, steps: int, train_seconds, logs: Path, callbacks: list
) -> int:
    """Fit ``lit`` on ``dm`` for ``steps`` steps (or until ``train_seconds``); the steps taken."""
    trainer = make_trainer(
        steps,
        accelerator="cpu",
        precision=recipe.precision,
        max_epochs=1,
        limit_train_batches=steps,  # one "epoch" is the whole run: the bar shows its end and its ETA
        val_check_interval=max(steps // VALIDATIONS, 1),
        limit_val_batches=recipe.eval_batches,
        max_time=None if train_seconds is None else {"seconds": max(train_seconds, 1)},
        logger=TensorBoardLogger(logs, name="", version=""),
        log_every_n_steps=10,
        enable_progress_bar=True,
        callbacks=callbacks,
    )
    L.seed_everything(recipe.seed, verbose=False)  # layer dropout's draws start from the seed too
    trainer.fit(lit, datamodule=dm)
    return trainer.global_step


def create_builtin(recipe: Recipe | None = None, directory: Path | None = None, command: str = "") -> dict:
    """Train, round to the stored precision, evaluate, fit the exit probe and save a builtin model;
    returns the report saved as its metadata."""
    recipe = recipe or Recipe()
    directory = directory or builtin_dir()
    threads = torch.get_num_threads()
    if recipe.threads is not None:
        torch.set_num_threads(recipe.threads)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            report = _create(recipe, directory, Path(scratch) / "logs", command)
    finally:
        torch.set_num_threads(threads)
    return report


def _create(recipe: Recipe, directory: Path, logs: Path, command: str) -> dict:
    started = time.perf_counter()
    # --threads fixes the threads (and so the weights); else they follow the cores left free
    tuning = None if recipe.threads is not None else FreeCoreThreads(ThreadTuner())
    dm = data_module(recipe)
    cfg = GPTConfig(
        n_layer=recipe.n_layer, n_head=recipe.n_head, n_embd=recipe.n_embd, vocab_size=dm.vocab_size,
        block_size=recipe.block_size,
    )  # fmt: skip
    L.seed_everything(recipe.seed, verbose=False)
    initial = GPT(cfg).state_dict()  # the seeded initialisation
    if tuning is not None:
        tuning.tuner.tick()  # the step is measured with the threads it will start with
    steps, train_seconds = plan(recipe, lightning_module(recipe, cfg, recipe.steps, None), dm, started)
    lit = lightning_module(recipe, cfg, steps, train_seconds)
    lit.model.load_state_dict(initial)
    taken = train(recipe, lit, dm, steps, train_seconds, logs, callbacks=[tuning] if tuning else [])
    trained = time.perf_counter() - started
    compact = lit.model.eval().to(STORED_DTYPE).float()  # the values stored: the report measures these
    n_unseen = tokens.VOCAB_SIZE - dm.vocab_size
    unseen_logit = lowest_log_normaliser(compact, dm) - math.log(n_unseen) - UNSEEN_MARGIN
    print("evaluating: the loss with each block skipped and each early exit ...", file=sys.stderr)
    model = widen_vocabulary(compact, dm.gpt2_ids, unseen_logit)
    report = {
        "command": command,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": cpu_description(),
        "threads": torch.get_num_threads() if tuning is None else "-".join(map(str, sorted(tuning.chosen))),
        "files": dm.n_files,
        "val_files": dm.n_val_files,
        "train_tokens": len(dm.train_ids),
        "distinct_tokens": dm.vocab_size,
        "unseen_logit": unseen_logit,
        "steps": taken,
        "planned_steps": steps,
        "tokens_seen": taken * recipe.batch_size * recipe.block_size,
        "precision": recipe.precision,
        "stored_dtype": str(STORED_DTYPE).removeprefix("torch."),
        "train_seconds": round(trained, 1),
        "baselines": ngram_baselines(dm),
        "recipe": dataclasses.asdict(recipe),
        **evaluate(model, compact, dm),
    }
    files = stdlib_files(recipe.max_files)
    compact.exit_probe = fit_probe(model, files, recipe.val_every)
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    vocabulary = (dm.gpt2_ids, unseen_logit)
    save_model(compact, directory, metadata=report, vocabulary=vocabulary, dtype=STORED_DTYPE)
    shutil.rmtree(directory / "logs", ignore_errors=True)  # a model made again: only its own run
    shutil.copytree(logs, directory / "logs")  # TensorBoard: train/loss, val/loss
    (directory / "REPORT.txt").write_text(format_report(report) + "\n")
    return report


def fit_probe(model: GPT, files: list[Path], val_every: int) -> ExitProbe:
    """The model's exit probe, fitted on windows of the training files."""
    started = time.perf_counter()
    probe = fit_exit_probe_on_files(model, files, val_every)
    print(f"exit probe: fitted in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return probe


def format_report(report: dict) -> str:
    loss = report["val_loss"]
    lines = [
        f"`{report['command']}`" if report.get("command") else "builtin",
        f"{report['steps']} steps ({report['tokens_seen']:,} tokens) at {report['precision']} with "
        f"{report.get('threads', '?')} threads, {report['total_seconds']:.0f} s in all on "
        f"{report.get('machine', 'an unrecorded machine')}, on the Python {report['python']} standard "
        f"library ({report['files']} files)",
        f"validation loss {loss:.3f} nats/token (perplexity {math.exp(loss):.1f}); count models of the "
        f"training split on the same text: unigram {report['baselines']['unigram']:.3f}, bigram "
        f"{report['baselines']['bigram']:.3f}; probability on never-seen tokens "
        f"{report['unseen_token_mass']:.1e}",
        "validation loss with one block skipped:",
    ]
    for i, skipped in enumerate(report["val_loss_skip"]):
        lines.append(f"  skip={i:<3d} {skipped:.3f}  ({skipped - loss:+.3f})")
    lines.append("validation loss read out early:")
    for exit_at, early in enumerate(report["val_loss_exit"], start=1):
        lines.append(f"  exit={exit_at:<3d} {early:.3f}  ({early - loss:+.3f})")
    if loss >= report["baselines"]["bigram"]:
        lines.append(
            f"note: {report['steps']} steps left the model short of the bigram count model: train "
            "longer (--steps)"
        )
    return "\n".join(lines)


@dataclass
class BuiltinOptions:
    """Retrain the builtin model from its recipe into your cache dir, or show or remove your copy."""

    recipe: Literal["plain", "early-exit"] = "plain"
    """plain, or early-exit: LayerSkip's layer dropout and early-exit losses (--model
    builtin-early-exit)."""
    steps: PositiveInt = Recipe.steps
    """Optimiser steps."""
    minutes: float | None = None
    """Time-boxed instead: as many steps as fit in this many minutes here (the model then differs per
    machine)."""
    seed: int = Recipe.seed
    """Seeds the initialisation, the data order and layer dropout."""
    threads: PositiveInt | None = None
    """Torch threads, fixed: the same seed and threads give the same weights (default: one per core
    that other processes leave free, chosen again every few seconds; lab.threads)."""
    out: Path | None = None
    """Write the model here instead of the cache dir (lab/assets/builtin remakes the shipped one)."""
    force: bool = False
    """Train again even if the cache dir already holds a model."""
    show: bool = False
    """Print the report of the model --model uses now (yours if you retrained, else the shipped one)."""
    reset: bool = False
    """Remove your retrained copy: --model uses the shipped one again."""


def main(argv: list[str]) -> int:
    summary = __doc__.split("\n\n")[0]
    options = parse(BuiltinOptions, argv[1:], prog="blocklab builtin", description=summary)
    name = model_name(options.recipe)
    directory = options.out or builtin_dir(name)
    if options.reset:
        shutil.rmtree(builtin_dir(name), ignore_errors=True)
        print(f"removed {builtin_dir(name)}: --model {name} is the shipped one ({shipped_dir(name)})")
        return 0
    if options.show or ((directory / FORMAT_FILE).exists() and not options.force):
        source = builtin_source(name) if options.show else directory
        shipped = "shipped" if source == shipped_dir(name) else "retrained"
        hint = "" if options.show else " (train again with --force)"
        print(f"{source} ({shipped}){hint}\n{format_report(read_metadata(source))}")
        return 0
    recipe = Recipe(
        steps=options.steps, minutes=options.minutes, seed=options.seed, threads=options.threads,
        **RECIPES[options.recipe],
    )  # fmt: skip
    # what makes the model: its destination and --force do not change it
    made_by = [f"--recipe {options.recipe}"] * (options.recipe != "plain") + [f"--steps {options.steps}"]
    made_by += [
        f"--{name} {getattr(options, name)}" for name in ("minutes", "threads") if getattr(options, name)
    ]
    command = " ".join(["blocklab builtin", *made_by, f"--seed {options.seed}"])
    report = create_builtin(recipe, directory, command)
    note = f"; --model {name} now uses it" if directory == builtin_dir(name) else ""
    print(f"saved to {directory}{note}\n{format_report(report)}")
    return 0
