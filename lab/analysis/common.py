"""What every measurement command shares: its arguments, the model and text it reads, and its output.

Each command prints a markdown table (paste it into a README as is) or, with ``--json``, one JSON
object on stdout; commands that draw write a PNG (``--out``, default under ``runs/analysis/``).

Models come from a spec (``--model builtin|gpt2-random|HUB_ID|DIR|CKPT``, through
``lab.weights.load_model``) or from a config alone (``--config gpt2 --n-layer 2 ...``, random weights),
since counting parameters, FLOPs or time needs shapes, not trained weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lab.config import PRESETS, GPTConfig
from lab.errors import UserError
from lab.model import GPT

RUNS_DIR = Path("runs") / "analysis"
"""Default folder of the PNGs, relative to the working directory (never inside the package)."""


# ---------------------------------------------------------------------------------------------------
# Arguments


def parser(command: str, description: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"blocklab {command}", description=description)


def add_output_args(p: argparse.ArgumentParser, *, plot: str | None = None) -> None:
    """``--json``; and ``--out``/``--no-plot`` for a command that draws ``plot`` (its default file name)."""
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    if plot is not None:
        p.add_argument("--out", type=Path, default=RUNS_DIR / plot, help="PNG path (default: %(default)s)")
        p.add_argument("--no-plot", action="store_true", help="do not write the PNG")


def add_config_args(
    p: argparse.ArgumentParser,
    *,
    default: str | None = "gpt2",
    choices: Sequence[str] = tuple(PRESETS),
    exclude: Sequence[str] = (),
) -> None:
    """``--config PRESET`` plus one ``--field`` override per ``GPTConfig`` field (``--n-layer 2``),
    except the fields in ``exclude`` (a command that sets them itself)."""
    p.add_argument(
        "--config",
        default=default,
        choices=list(choices),
        help="preset whose shapes to use (default: %(default)s)",
    )
    hints = typing.get_type_hints(GPTConfig)
    group = p.add_argument_group("config overrides (GPTConfig fields)")
    for field in dataclasses.fields(GPTConfig):
        if field.name in exclude:
            p.set_defaults(**{field.name: None})
            continue
        hint = hints[field.name]
        flag = "--" + field.name.replace("_", "-")
        if typing.get_origin(hint) is typing.Literal:
            group.add_argument(flag, dest=field.name, choices=typing.get_args(hint), default=None)
        elif hint is bool:
            group.add_argument(flag, dest=field.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(flag, dest=field.name, type=hint, default=None)


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``GPTConfig`` fields given on the command line."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(GPTConfig)
        if getattr(args, f.name) is not None
    }


def config_from_args(args: argparse.Namespace) -> GPTConfig:
    return GPTConfig.from_name(args.config, **config_overrides(args))


def config_name(args: argparse.Namespace) -> str:
    """The preset and its overrides, e.g. ``gpt2 (n_layer=2, n_embd=32)``."""
    overrides = [f"{name}={value}" for name, value in config_overrides(args).items()]
    return args.config + (f" ({', '.join(overrides)})" if overrides else "")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model SPEC`` or a config with random weights; default: builtin if created, else gpt2-random."""
    p.add_argument(
        "--model",
        default=None,
        help="builtin | gpt2-random | HUB_ID | DIR | CKPT (default: builtin if created, else gpt2-random)",
    )
    add_config_args(p, default=None)
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights when --config is given")


def default_model_spec() -> str:
    """``builtin`` (shipped, or retrained by ``blocklab builtin``), else ``gpt2-random`` (an install
    without its assets)."""
    from lab.weights import FORMAT_FILE, builtin_source

    return "builtin" if (builtin_source() / FORMAT_FILE).exists() else "gpt2-random"


def load_model_from_args(args: argparse.Namespace) -> tuple[GPT, str]:
    """The model the arguments name and a description of it for the report."""
    if args.config is not None or config_overrides(args):
        if args.model is not None:
            raise UserError("give --model or --config (with overrides), not both")
        args.config = args.config or "gpt2"
        cfg = config_from_args(args)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            model = GPT(cfg).eval()
        return model, f"{config_name(args)}, random weights (seed {args.seed})"
    from lab.weights import load_model

    spec = args.model or default_model_spec()
    chosen = "" if args.model else " (default: builtin if created, else gpt2-random)"
    return load_model(spec), spec + chosen


# ---------------------------------------------------------------------------------------------------
# Text


def held_out_source(chars: int) -> tuple[str, str]:
    """At least ``chars`` characters of the standard-library files the builtin model never trained on
    (``lab.corpora.held_out_stdlib_files``), each followed by <|endoftext|> as in training; and their
    names."""
    from lab.corpora import held_out_stdlib_files

    parts, names, total = [], [], 0
    for path in held_out_stdlib_files():
        parts.append(path.read_text(encoding="utf-8", errors="replace") + "<|endoftext|>")
        names.append(path.name)
        total += len(parts[-1])
        if total >= chars:
            break
    return "".join(parts), ", ".join(names)


def add_text_args(p: argparse.ArgumentParser, *, tokens: int = 1024) -> None:
    p.add_argument(
        "--text",
        type=Path,
        default=None,
        help="UTF-8 text file (default: standard-library source the builtin model never trained on)",
    )
    p.add_argument(
        "--tokens",
        type=int,
        default=tokens,
        help="use the first N tokens of the text, at most the model's context (default: %(default)s)",
    )


def text_tokens(args: argparse.Namespace, model: GPT) -> tuple[list[int], str]:
    """The first ``--tokens`` GPT-2 tokens of the text (capped at the context) and where they came from."""
    from lab import tokens

    if model.config.vocab_size < tokens.VOCAB_SIZE:
        raise UserError(
            f"text needs a model with GPT-2's vocabulary ({tokens.VOCAB_SIZE}); "
            f"this one has vocab_size={model.config.vocab_size}"
        )
    n = min(args.tokens, model.config.block_size)
    # Encoding ~4 characters per token: no need to read or tokenise more than this for the first n.
    chars = 8 * n + 1024
    if args.text is None:
        text, names = held_out_source(chars)
        source = f"held-out standard-library source ({names})"
    else:
        text, source = args.text.read_text(encoding="utf-8"), str(args.text)
    ids = tokens.encode(text[:chars], allow_endoftext=True)[:n]
    if len(ids) < 2:
        raise UserError(f"{source}: need at least 2 tokens, got {len(ids)}")
    return ids, f"{source}, first {len(ids)} tokens"


# ---------------------------------------------------------------------------------------------------
# Output


def fmt(value: Any, digits: int = 4) -> str:
    """Integers with thousands separators; floats to ``digits`` significant figures, thousands and up
    as whole numbers with separators, and the very large or very small in scientific notation."""
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value != 0 and (abs(value) >= 1e15 or abs(value) < 1e-3):
            return f"{value:.{digits - 1}e}"
        if abs(value) >= 10 ** (digits - 1):
            return f"{value:,.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A markdown table; numbers right-aligned and formatted by ``fmt``."""
    cells = [[fmt(v) for v in row] for row in rows]

    def is_number(value: Any) -> bool:
        return (
            value is None
            or isinstance(value, (int, float))
            or (isinstance(value, str) and value.endswith("%"))
        )

    numeric = [all(is_number(row[i]) for row in rows) for i in range(len(columns))]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        padded = [
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if num else ("-" * (w + 2)) for w, num in zip(widths, numeric, strict=True)
        )
        + "|"
    )
    return "\n".join([line(columns), rule, *(line(r) for r in cells)])


def emit(args: argparse.Namespace, report: dict[str, Any], text: str) -> None:
    """Print ``report`` as JSON with ``--json``, else the human-readable ``text``."""
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(text)


def save_figure(fig, args: argparse.Namespace) -> str | None:
    """Write ``fig`` to ``--out`` unless ``--no-plot``; returns the path written."""
    import matplotlib.pyplot as plt

    if args.no_plot:
        plt.close(fig)
        return None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(args.out)


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): timings mean little when it exceeds the
    threads in use, so the timing commands report it."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def median_ms(times_s: Sequence[float]) -> float:
    """The median of wall times in seconds, in milliseconds."""
    return 1e3 * statistics.median(times_s)
