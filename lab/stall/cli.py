"""``blocklab stall``: its flags are ``StallPreset``'s fields and ``StallOptions``'; its defaults come from
a preset file, ``configs/stall/NAME.yaml`` (``--preset NAME``), read by the same parser, and
``--config FILE`` reads any YAML of the same keys on top of it."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from jsonargparse import ActionConfigFile

import lab.stall
from lab import flags
from lab.errors import UserError
from lab.stall.report import at_init_table, grid_table, table
from lab.stall.settings import GRID_SETTINGS, PRESET_DIR, PRESET_NAMES, StallPreset, Variant, parse_axis

DEFAULT_PRESET = "cpu"


@dataclass
class StallOptions:
    """What to run."""

    preset: Literal[PRESET_NAMES] = DEFAULT_PRESET
    """The settings every other flag and --config override: configs/stall/NAME.yaml."""
    variants: tuple[str, ...] | None = None
    """NORM[+warmup=N][+rms], NORM one of pre post deepnorm peri; default: pre post post+warmup=W (W:
    --warmup); with --grid one variant (default: post)."""
    grid: tuple[str, ...] | None = None
    """NAME=V1,V2 ...: one variant over a grid of the preset's settings, 1 or 2 axes."""
    at_init: tuple[int, ...] | None = None
    """No training: gradient norms at initialisation of models this many blocks deep, per variant."""
    out: Path = Path("runs/stall")
    """Where the TensorBoard runs, the JSON summary and the PNGs go."""
    json: bool = False
    """Print the JSON summary instead of the table."""


def preset_path(name: str) -> Path:
    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        raise UserError(f"{path}: no such preset (the presets are the repository's configs/stall/*.yaml)")
    return path


def parser(preset: str = DEFAULT_PRESET) -> flags.Parser:
    """The stall command's parser, its defaults read from the preset file ``preset``."""
    p = flags.Parser("blocklab stall", lab.stall.__doc__, default_config_files=[str(preset_path(preset))])
    p.add_argument("--config", action=ActionConfigFile, help="a YAML file of these flags' names and values")
    p.add_options(StallOptions)
    p.add_options(StallPreset)
    return p


def parse(argv: list[str]) -> tuple[StallPreset, StallOptions]:
    """The preset with the flags' changes, and what to run with it."""
    args = parser().parse(argv)
    if args.preset != DEFAULT_PRESET:  # the defaults come from the file it names
        args = parser(args.preset).parse(argv)
    preset, options = flags.options(StallPreset, args), flags.options(StallOptions, args)
    if preset.steps < 3 or preset.warmup < 1:
        raise UserError(f"need --steps >= 3 and --warmup >= 1, got {preset.steps} and {preset.warmup}")
    return preset, options


def load_preset(name: str) -> StallPreset:
    """``configs/stall/NAME.yaml`` as ``blocklab stall --preset NAME`` reads it."""
    return parse(["--preset", name])[0]


def plan(
    preset: StallPreset, options: StallOptions
) -> tuple[list[Variant] | None, list[tuple[str, list]] | None]:
    """The variants and the grid's axes the options ask for (None: the default), checked."""
    try:
        variants = [Variant.parse(spec) for spec in options.variants] if options.variants else None
        axes = [parse_axis(text, preset) for text in options.grid] if options.grid else None
    except ValueError as error:
        raise UserError(str(error)) from None
    if axes is not None and (len(axes) > 2 or len(variants or [None]) != 1):
        raise UserError(f"--grid takes one or two axes of {', '.join(GRID_SETTINGS)}, and one variant")
    if options.at_init and (axes is not None or min(options.at_init) < 2):
        raise UserError("--at-init takes depths of at least 2 blocks, and no --grid")
    return variants, axes


def main(argv: list[str]) -> int:
    from lab.stall import experiment

    preset, options = parse(argv[1:])
    variants, axes = plan(preset, options)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    report = (lambda line: None) if options.json else print
    report(f"blocklab stall --preset {options.preset}: {preset}")
    start, out = time.perf_counter(), options.out
    if options.at_init:
        variants = variants or [Variant("pre"), Variant("post")]
        summary = experiment.run_at_init(preset, list(options.at_init), variants, out, report)
        print(json.dumps(summary, indent=1) if options.json else at_init_table(summary))
    elif axes is not None:
        grid = experiment.run_grid(preset, (variants or [Variant("post")])[0], axes, out, report)
        print(json.dumps(grid, indent=1) if options.json else grid_table(grid))
        report(f"wrote {out / 'grid.json'} and {out / 'grid.png'} in {time.perf_counter() - start:.0f} s")
    else:
        summary = experiment.run_stall(preset, out, report, variants)
        if options.json:
            runs = [{k: v for k, v in run.items() if k != "losses"} for run in summary["runs"]]
            print(json.dumps({**summary, "runs": runs}, indent=1))
            return 0
        print(table(summary["runs"], summary["unigram"], summary["bigram"]))
        seconds = time.perf_counter() - start
        print(f"wrote {out / 'summary.json'}, stall.png and grad_norms.png in {seconds:.0f} s")
        print(f"curves: tensorboard --logdir {out}")
    return 0
