"""What every measurement command shares: its options, the model and text it reads, and its output.

Each command prints a markdown table (paste it into a README as is) or, with ``--json``, one JSON
object on stdout; commands that draw write a PNG (``--out``, default under ``runs/analysis/``).

Models come from a spec (``--model builtin|gpt2-random|HUB_ID|DIR|CKPT`` in ``--dtype``, through
``lab.weights.load_model``) or from a config alone (``--config gpt2 --n-layer 2 ...``, random weights),
since counting parameters, FLOPs or time needs shapes, not trained weights.

A command's flags are the fields of the option dataclasses below and of its own (``lab.flags``): the
field's docstring is its ``--help``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from jsonargparse.typing import PositiveInt

from lab.analysis.designs import DESIGNS, Design
from lab.config import PRESETS, GPTConfig
from lab.errors import UserError
from lab.flags import Namespace, Parser
from lab.model import GPT
from lab.quantize import QUANTIZED_DTYPES, WEIGHT_DTYPES
from lab.weights import load_model

RUNS_DIR = Path("runs") / "analysis"
"""Default folder of the PNGs, relative to the working directory (never inside the package)."""

Preset = Literal[tuple(PRESETS)]
"""The GPT-2 presets of ``lab.config``, which ``lab.model.GPT`` builds."""
DesignName = Literal[tuple(DESIGNS)]
"""Every design ``lab.analysis.designs`` counts, the GPT-2 presets and ones blocklab cannot build."""
WeightDtype = Literal[WEIGHT_DTYPES]


# ---------------------------------------------------------------------------------------------------
# Options


@dataclass
class Output:
    """What the command prints."""

    json: bool = False
    """Print one JSON object instead of tables."""


@dataclass
class Plot:
    """The picture."""

    out: Path = RUNS_DIR / "plot.png"
    """Where to write the PNG."""
    no_plot: bool = False
    """Do not write the PNG."""


@dataclass
class PresetConfig:
    """The model's shapes."""

    config: Preset = "gpt2"
    """Preset whose shapes to use; the GPTConfig flags below override its fields."""


@dataclass
class DesignConfig:
    """The model's shapes."""

    config: DesignName = "gpt2"
    """Design whose shapes to use (the GPT-2 presets take the GPTConfig flags below as overrides)."""


@dataclass
class DesignModel:
    """Or a model's shapes."""

    model: str | None = None
    """Use the shapes of a model blocklab loads (builtin, gpt2-random, HUB_ID, DIR, CKPT)."""
    dtype: WeightDtype = "float32"
    """The --model's weights' type: float32, bfloat16, float16; weight-only int8 / int4; or w8a8 / w4a8
    (int8 activations too)."""


@dataclass
class ModelSpec:
    """The model."""

    model: str | None = None
    """builtin | gpt2-random | HUB_ID | DIR | CKPT (default: the builtin model)."""
    dtype: WeightDtype = "float32"
    """The weights' type: float32, bfloat16, float16, or weight-only int8 / int4 (lab.quantize)."""


@dataclass
class RandomWeights:
    """Or random weights."""

    config: Preset | None = None
    """Instead of --model: random weights in this preset's shapes, overridden by the GPTConfig flags."""
    seed: int = 0
    """Seed of the random weights when --config is given."""


@dataclass
class Text:
    """The text."""

    text: Path | None = None
    """UTF-8 text file (default: standard-library source the builtin model never trained on)."""
    tokens: PositiveInt = 1024
    """Use the first N tokens of the text, at most the model's context."""


def parser(command: str, description: str) -> Parser:
    """The parser of ``blocklab command``, before its options are added (``add_*_args``, ``add_options``)."""
    return Parser(f"blocklab {command}", description)


def add_output_args(p: Parser, *, plot: str | None = None) -> None:
    """``--json``; and ``--out``/``--no-plot`` for a command that draws ``plot`` (its default file name)."""
    p.add_options(Output)
    if plot is not None:
        p.add_options(Plot, out=RUNS_DIR / plot)


def add_config_args(p: Parser, options: type = PresetConfig, *, exclude: Sequence[str] = ()) -> None:
    """``--config NAME`` (the field of ``options``) plus one flag per ``GPTConfig`` field that overrides
    it (``--n-layer 2``), except the fields in ``exclude`` (a command that sets them itself)."""
    p.add_options(options)
    fields = [field.name for field in dataclasses.fields(GPTConfig) if field.name not in exclude]
    p.add_options(GPTConfig, skip=exclude, **dict.fromkeys(fields))  # None: not given


def add_design_args(p: Parser) -> None:
    """``--config DESIGN`` with GPTConfig overrides, or ``--model SPEC --dtype D`` for its shapes."""
    add_config_args(p, DesignConfig)
    p.add_options(DesignModel)


def design_from_args(args: Namespace) -> tuple[Design, GPT | None]:
    """The design the arguments name and, where blocklab can build it, a model of it: ``--model`` (loaded
    in ``--dtype``), a GPT-2 preset with its overrides (on the meta device: shapes only, no memory), or
    a design by name alone (formula only: no model)."""
    if args.model is not None:
        model = load_model(args.model, args.dtype)
        return Design.from_config(model.config, args.model), model
    if args.config in PRESETS:
        cfg = config_from_args(args)
        with torch.device("meta"):  # no memory, no initialisation
            model = GPT(cfg)
        source = DESIGNS[args.config].source if not config_overrides(args) else "GPTConfig"
        return Design.from_config(cfg, config_name(args), source), model
    if config_overrides(args):
        raise UserError(f"{args.config}: GPTConfig overrides apply to the GPT-2 presets only")
    return DESIGNS[args.config], None


def add_model_args(p: Parser) -> None:
    """``--model SPEC --dtype D`` or a config with random weights; default: the builtin model."""
    p.add_options(ModelSpec)
    add_config_args(p, RandomWeights)


def config_overrides(args: Namespace, exclude: Sequence[str] = ()) -> dict[str, Any]:
    """The ``GPTConfig`` fields given on the command line (``exclude``: as in ``add_config_args``)."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(GPTConfig)
        if f.name not in exclude and getattr(args, f.name, None) is not None
    }


def config_from_args(args: Namespace, exclude: Sequence[str] = ()) -> GPTConfig:
    try:
        return GPTConfig.from_name(args.config, **config_overrides(args, exclude))
    except ValueError as error:  # GPTConfig's own checks, e.g. n_embd divisible by n_head
        raise UserError(str(error)) from None


def config_name(args: Namespace, exclude: Sequence[str] = ()) -> str:
    """The preset and its overrides, e.g. ``gpt2 (n_layer=2, n_embd=32)``."""
    overrides = [f"{name}={value}" for name, value in config_overrides(args, exclude).items()]
    return args.config + (f" ({', '.join(overrides)})" if overrides else "")


def default_model_spec() -> str:
    """``builtin`` (shipped, or retrained by ``blocklab builtin``), else ``gpt2-random`` (an install
    without its assets)."""
    from lab.weights import FORMAT_FILE, builtin_source

    return "builtin" if (builtin_source() / FORMAT_FILE).exists() else "gpt2-random"


def in_dtype(model: GPT, dtype: str) -> GPT:
    """``model`` with its weights in ``dtype``, as ``load_model`` gives them."""
    from lab.quantize import quantize

    return quantize(model, dtype) if dtype in QUANTIZED_DTYPES else model.to(getattr(torch, dtype))


def weights(*modules: torch.nn.Module) -> int:
    """The parameters of ``modules``; a quantized linear layer (``lab.quantize``) keeps its weights in
    buffers and counts as the matrix and bias it stands for."""
    from lab.quantize import QuantizedLinear

    quantized = [q for m in modules for q in m.modules() if isinstance(q, QuantizedLinear)]
    stood_for = sum(q.in_features * q.out_features + (q.out_features if q.bias is not None else 0)
                    for q in quantized)  # fmt: skip
    return sum(p.numel() for m in modules for p in m.parameters()) + stood_for


def total_weights(model: GPT) -> int:
    """``GPT.num_params`` in any ``--dtype``: the tied table once, though a quantized model reads out
    through a copy of it (``model.read_out``)."""
    return weights(model) - (weights(model.read_out) if model.read_out is not None else 0)


def load_model_from_args(args: Namespace) -> tuple[GPT, str]:
    """The model the arguments name and a description of it for the report."""
    if args.config is not None or config_overrides(args):
        if args.model is not None:
            raise UserError("give --model or --config (with overrides), not both")
        args.config = args.config or "gpt2"
        cfg = config_from_args(args)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            model = in_dtype(GPT(cfg).eval(), args.dtype)
        dtype = "" if args.dtype == "float32" else f", {args.dtype}"
        return model, f"{config_name(args)}, random weights (seed {args.seed}{dtype})"
    spec = args.model or default_model_spec()
    chosen = "" if args.model else " (default: the builtin model)"
    dtype = "" if args.dtype == "float32" else f" in {args.dtype}"
    return load_model(spec, args.dtype), spec + dtype + chosen


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


def add_text_args(p: Parser, *, tokens: int = 1024) -> None:
    p.add_options(Text, tokens=tokens)


def text_tokens(args: Namespace, model: GPT) -> tuple[list[int], str]:
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


def on_text(args: Namespace, measure: Callable[[GPT, list[int]], dict]) -> dict:
    """The report of ``measure(model, ids)`` on the model and the text the arguments name."""
    model, name = load_model_from_args(args)
    ids, text = text_tokens(args, model)
    return {"model": name, "text": text, **measure(model, ids)}


def emit(args: Namespace, report: dict[str, Any], text: str) -> None:
    """Print ``report`` as JSON with ``--json``, else the human-readable ``text``."""
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(text)


def save_figure(fig, args: Namespace) -> str | None:
    """Write ``fig`` to ``--out`` unless ``--no-plot``; returns the path written."""
    import matplotlib.pyplot as plt

    if args.no_plot:
        plt.close(fig)
        return None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return str(args.out)


def joined(lines: list[str], report: dict) -> str:
    """A command's printed report: ``lines``, then the picture it wrote, if it wrote one."""
    return "\n".join(lines + ([f"wrote {report['png']}"] if report.get("png") else []))


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
