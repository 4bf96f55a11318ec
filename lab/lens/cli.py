"""``blocklab lens``: fit a model's tuned lens, and report what early exit costs through it.

    blocklab lens fit --model builtin                   # the standard library's training files, ~minutes
    blocklab lens fit --model DIR --prompts my_text.txt --steps 100 --rank 32
    blocklab lens fit --model builtin --resume          # continue an interrupted fit from its checkpoint
    blocklab lens report --model builtin                # held-out standard-library text; a table and a PNG
    blocklab lens report --model DIR --text other.txt --json
    blocklab lens cost --model gpt2-random              # a translator against a block at GPT-2's shapes

``fit`` saves ``tuned_lens.safetensors`` beside the model's weights (``lab.lens.home.lens_home``: for
the shipped builtin models the user's cache dir, never the package), with a checkpoint there every
``--checkpoint-every`` steps while it runs. ``report`` reads the lens from there (or ``--lens DIR``).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from jsonargparse.typing import PositiveInt

from lab import tokens
from lab.analysis import common
from lab.errors import UserError
from lab.flags import parse
from lab.lens import cost, data, fit, report
from lab.lens.home import find_tuned_lens, lens_home
from lab.lens.translator import FILE, save_tuned_lens

SUBCOMMANDS = {
    "fit": "fit a tuned lens (the model frozen)",
    "report": "per block: exit loss, KL and top-1 agreement through the logit lens and the tuned lens",
    "cost": "a translator's weights and batch-1 time against one block's",
}


@dataclass
class FitOptions:
    """What to fit a lens to, on which text, and how."""

    model: str | None = None
    """builtin | builtin-early-exit | gpt2-random | HUB_ID | DIR | CKPT (default: builtin if there,
    else gpt2-random)."""
    prompts: Path | None = None
    """Fit on this UTF-8 text, cut into windows of the model's context (default: the standard
    library's training files)."""
    blocks: list[int] | None = None
    """Block indices whose translators to fit (exit=E reads block E-1; default: all but the last)."""
    steps: PositiveInt = fit.Recipe.steps
    """Optimiser steps."""
    rank: int | None = None
    """Translators of rank R (identity + U V^T); default: full D x D."""
    out: Path | None = None
    """Save the lens in this directory (default: beside the model; the cache dir for builtin models)."""
    resume: bool = False
    """Continue from the checkpoint an interrupted fit left in the output directory."""
    windows: PositiveInt = data.CALIBRATION_WINDOWS
    """At most this many windows of text; every 8th is held out to measure the fit."""
    windows_per_step: int = fit.Recipe.windows_per_step
    """Windows whose positions make one step's batch."""
    recipe: Literal["whitened", "tuned-lens"] = "whitened"
    """whitened: start from the least-squares map to the final stream, then Adam in each block's
    whitened coordinates; tuned-lens: tuned-lens 0.2.0's (identity start, SGD with Nesterov momentum,
    weight decay 1e-3, gradients clipped to norm 1)."""
    init: Literal["regression", "identity"] | None = None
    """Override the recipe's start: regression (least squares), or identity (the logit lens)."""
    lr: float | None = None
    """Peak learning rate, decayed linearly to zero (default: 0.01 / sqrt(width) for whitened, 0.1 for
    tuned-lens)."""
    threads: PositiveInt | None = None
    """Torch threads (default: the cores; on a loaded machine 1 can be much faster)."""
    seed: int = 0
    """Seeds the order of the windows."""
    checkpoint_every: int = fit.Recipe.checkpoint_every
    """Steps between checkpoints."""


@dataclass
class ReportOptions:
    """Which model's lens to measure, on which text."""

    model: str | None = None
    """builtin | builtin-early-exit | gpt2-random | HUB_ID | DIR | CKPT (default: builtin if there,
    else gpt2-random)."""
    text: Path | None = None
    """UTF-8 text to measure on (default: standard-library files the builtin models never trained on,
    which the default fit never reads either)."""
    tokens: PositiveInt = 8192
    """Use the first N tokens of the text, in windows of the model's context."""
    lens: Path | None = None
    """The directory holding tuned_lens.safetensors (default: where `blocklab lens fit` saves it)."""
    json: bool = False
    """Print one JSON object instead of the table."""
    out: Path = common.RUNS_DIR / "lens.png"
    """The PNG's path."""
    no_plot: bool = False
    """Do not write the PNG."""


@dataclass
class CostOptions:
    """Whose shapes to time."""

    model: str | None = None
    """Whose shapes to time (weights do not matter: gpt2-random is GPT-2 small's shapes)."""
    repeats: PositiveInt = 200
    """Timed calls of each."""
    json: bool = False
    """Print one JSON object instead of the table."""


def run_fit(options: FitOptions) -> int:
    from lab.weights import load_model

    spec = options.model or common.default_model_spec()
    if options.threads is not None:
        torch.set_num_threads(options.threads)
    model = load_model(spec)
    windows, source = data.calibration_windows(model, options.prompts, options.windows)
    calibration, held_out = data.split_held_out(windows)
    directory = options.out or lens_home(spec)
    recipe = fit_recipe(options)
    print(f"calibration: {source}; {len(calibration)} to fit on, {len(held_out)} held out", file=sys.stderr)
    directory.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    lens = fit.fit_tuned_lens(
        model, calibration, held_out, recipe, options.blocks, directory / fit.CHECKPOINT, options.resume
    )
    lens.metadata |= {
        "calibration": source,
        "model": spec,
        "fit_seconds": round(time.perf_counter() - started, 1),
    }
    path = save_tuned_lens(lens, directory)
    rows = [
        [
            block,
            block + 1,
            lens.metadata["held_out_kl_logit"][block],
            lens.metadata["held_out_kl_tuned"][block],
        ]
        for block in lens.blocks
    ]
    print(common.table(["block", "exit", "held-out KL logit lens", "held-out KL tuned lens"], rows))
    coverage = ", ".join(f"{n}: {share:.1%}" for n, share in lens.metadata["ranking_coverage"].items())
    print(f"draft vocabulary (speculate=E;vocab=N), held-out top-1 covered by the first N: {coverage}")
    seconds = lens.metadata["fit_seconds"]
    print(f"saved {path} ({seconds:.0f} s); `blocklab lens report --model {spec}` measures it")
    return 0


def fit_recipe(options: FitOptions) -> fit.Recipe:
    base = fit.Recipe() if options.recipe == "whitened" else fit.BELROSE
    overrides = {"init": options.init} if options.init is not None else {}
    return dataclasses.replace(
        base, steps=options.steps, windows_per_step=options.windows_per_step, rank=options.rank,
        lr=options.lr, seed=options.seed, checkpoint_every=options.checkpoint_every, **overrides,
    )  # fmt: skip


def run_report(options: ReportOptions) -> int:
    from lab.weights import load_model

    spec = options.model or common.default_model_spec()
    model = load_model(spec)
    if model.config.vocab_size < tokens.VOCAB_SIZE:
        raise UserError(f"text needs a model with GPT-2's vocabulary; this one has {model.config.vocab_size}")
    lens, directory = find_tuned_lens(spec, model, options.lens)
    ids, source = report_tokens(options.text, options.tokens)
    windows = data.text_windows(ids, model.config.block_size)
    result = {
        "model": spec,
        "lens": str(directory / FILE),
        "text": source,
        **report.lens_report(model, lens, windows),
    }
    result["lens_metadata"] = lens.metadata
    result["png"] = report.plot(result, options)
    common.emit(options, result, report.render(result))
    return 0


def run_cost(options: CostOptions) -> int:
    from lab.weights import load_model

    spec = options.model or common.default_model_spec()
    result = {"model": spec, **cost.translator_cost(load_model(spec), options.repeats)}
    common.emit(options, result, cost.render(result))
    return 0


def report_tokens(text: Path | None, count: int) -> tuple[list[int], str]:
    """The first ``count`` tokens of ``text`` (default: the held-out standard-library files) and
    where they came from."""
    chars = 8 * count + 1024  # ~4 characters a token: enough text for the first ``count``
    if text is None:
        content, names = common.held_out_source(chars)
        source = f"held-out standard-library source ({names})"
    else:
        content, source = text.read_text(encoding="utf-8"), str(text)
    ids = tokens.encode(content[:chars], allow_endoftext=True)[:count]
    return ids, f"{source}, first {len(ids):,} tokens"


def main(argv: list[str]) -> int:
    summary = __doc__.split("\n\n")[0].removeprefix("``blocklab lens``: ")
    if len(argv) < 2 or argv[1] not in SUBCOMMANDS:
        lines = [f"usage: blocklab lens {{{','.join(SUBCOMMANDS)}}} [--help]", "", summary, ""]
        lines += [f"  {name:8s}{help_}" for name, help_ in SUBCOMMANDS.items()]
        wanted = argv[1:2] in (["-h"], ["--help"])
        print("\n".join(lines), file=sys.stdout if wanted else sys.stderr)
        return 0 if wanted else 2
    name, rest = argv[1], argv[2:]
    options_class, run = {
        "fit": (FitOptions, run_fit), "report": (ReportOptions, run_report), "cost": (CostOptions, run_cost)
    }[name]  # fmt: skip
    return run(parse(options_class, rest, prog=f"blocklab lens {name}", description=SUBCOMMANDS[name]))
