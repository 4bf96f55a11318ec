"""blocklab ablate: the loss with each block skipped, and with each block overwriting the stream.

    blocklab ablate                         # the builtin model; 512 corpus tokens
    blocklab ablate --mode skip --tokens 512
    blocklab ablate --model path/to/hf_dir --text notes.txt

skip=i: block i passes the stream through unchanged (``BlockSet(skip={i})``): what the model loses
without that block's writes. overwrite=i: block i hands on only its own writes, attn_out + mlp_out,
dropping the stream it received (``BlockSet(overwrite={i})``): how much later blocks rely on what came
before. Losses are mean next-token losses in nats (``lab.generate.score``), beside the intact loss and
the uniform guess ln(V); relative change = (loss - intact) / intact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lab import flags
from lab.analysis import common
from lab.blocks import BlockSet
from lab.generate import score
from lab.model import GPT

MODES = {"skip": "skip", "overwrite": "overwrite", "both": "skip overwrite"}


def ablation_report(model: GPT, ids: list[int], modes: list[str]) -> dict:
    """The intact loss, ln(V), and per block the loss (and relative change) under each mode."""
    intact = score(model, ids).mean_loss
    rows = []
    for i in range(model.config.n_layer):
        row: dict = {"block": i}
        for mode in modes:
            loss = score(model, ids, BlockSet(**{mode: frozenset({i})})).mean_loss
            row[mode] = loss
            row[f"{mode}_change"] = (loss - intact) / intact
        rows.append(row)
    return {"intact": intact, "uniform": math.log(model.config.vocab_size), "modes": modes, "rows": rows}


def render(report: dict) -> str:
    modes = report["modes"]
    columns = ["block"] + [c for m in modes for c in (f"{m} loss", f"{m} change")]
    lines = [
        [r["block"]] + [v for m in modes for v in (r[m], f"{100 * r[f'{m}_change']:+.1f}%")]
        for r in report["rows"]
    ]
    out = [
        f"ablate: {report['model']}",
        f"text: {report['text']}",
        f"intact loss {report['intact']:.4f} nats; uniform guess ln(V) = {report['uniform']:.4f}",
        "",
        common.table(columns, lines),
    ]
    for m in modes:
        worst = max(report["rows"], key=lambda r, m=m: r[m])
        mildest = min(report["rows"], key=lambda r, m=m: r[m])
        out.append(
            f"{m}: block {worst['block']} costs the most ({worst[m]:.4f}, "
            f"{100 * worst[f'{m}_change']:+.1f}%), block {mildest['block']} the least ({mildest[m]:.4f}, "
            f"{100 * mildest[f'{m}_change']:+.1f}%)"
        )
    return common.joined(out, report)


def plot(report: dict, args) -> str | None:
    plt = common.pyplot()
    rows, modes = report["rows"], report["modes"]
    width = 0.8 / len(modes)
    fig, ax = plt.subplots(figsize=(8, 4))
    for k, mode in enumerate(modes):
        offset = (k - (len(modes) - 1) / 2) * width
        ax.bar([r["block"] + offset for r in rows], [r[mode] for r in rows], width, label=f"{mode} block i")
    ax.axhline(report["intact"], color="k", lw=1, label=f"intact {report['intact']:.3f}")
    ax.axhline(report["uniform"], color="k", ls="--", lw=1, label=f"uniform ln(V) {report['uniform']:.3f}")
    ax.set_xlabel("block i")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_xticks([r["block"] for r in rows])
    ax.set_title(f"ablate: {report['model']}", fontsize=9)
    ax.legend(fontsize=8)
    return common.save_figure(fig, args)


@dataclass
class AblateOptions:
    """The ablation."""

    mode: Literal["skip", "overwrite", "both"] = "both"
    """Skip each block, let each overwrite the stream, or both."""


def parser() -> flags.Parser:
    p = common.parser("ablate", "Loss with each block skipped or overwriting the stream.")
    common.add_model_args(p)
    common.add_text_args(p, tokens=512)
    p.add_options(AblateOptions)
    common.add_output_args(p, plot="ablate.png")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])
    report = common.on_text(args, lambda model, ids: ablation_report(model, ids, MODES[args.mode].split()))
    report["png"] = plot(report, args)
    common.emit(args, report, render(report))
    return 0
