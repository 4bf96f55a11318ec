"""blocklab bus: the residual stream along the stack, and how much each stage writes into it.

    blocklab bus                            # the builtin model; 1024 tokens of the corpus
    blocklab bus --model gpt2-random --tokens 256
    blocklab bus --text notes.txt

Per block, each a median over positions (position 0 included; medians are not pulled by its outlying
norm): the stream's norm entering (``resid_pre``) and leaving (``resid_post``); attention's write
``‖attn_out‖`` as a share of the stream it reads, ``‖resid_pre‖``; the feed-forward's write ``‖mlp_out‖``
as a share of ``‖resid_mid‖``; and the cosine between the stream entering and leaving (1: the block
barely turned it). In a pre-LN model ``resid_post = resid_pre + attn_out + mlp_out`` exactly; the
``bookkeeping`` column is the largest relative error of that identity in the captured tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab import flags
from lab.analysis import common
from lab.hooks import capture
from lab.model import GPT, NORM_FIRST

STREAM = ["embed", "blocks.*.resid_pre", "blocks.*.attn_out", "blocks.*.resid_mid", "blocks.*.mlp_out",
          "blocks.*.resid_post"]  # fmt: skip


def median(x: torch.Tensor) -> float:
    """The median over positions of a [T] tensor (the mean of the two middle values when T is even)."""
    return float(x.double().quantile(0.5))


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine per position between two [T, D] streams. [T]"""
    return F.cosine_similarity(a.double(), b.double(), dim=-1)


@torch.inference_mode()
def stream_report(model: GPT, ids: list[int]) -> dict:
    """Norms, write shares and cosines of the stream for one sequence ``ids``."""
    idx = torch.tensor([ids], device=model.wte.weight.device)  # [1, T]
    with capture(model, STREAM) as seen:
        model(idx)
    embed = seen["embed"][0]  # [T, D]
    rows = []
    for i in range(len(model.blocks)):
        pre, attn, mid, mlp, post = (
            seen[f"blocks.{i}.{name}"][0].double()  # [T, D]
            for name in ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
        )
        norm = {"pre": pre, "attn": attn, "mid": mid, "mlp": mlp, "post": post}
        norm = {name: t.norm(dim=-1) for name, t in norm.items()}  # [T] each
        bookkeeping = None
        if model.blocks[i].norm_first:  # the stream is the plain sum of the writes
            bookkeeping = float(((post - (pre + attn + mlp)).norm(dim=-1) / norm["post"]).max())
        rows.append(
            {
                "block": i,
                "resid_pre": median(norm["pre"]),
                "attn_out": median(norm["attn"]),
                "attn_share": median(norm["attn"] / norm["pre"]),
                "resid_mid": median(norm["mid"]),
                "mlp_out": median(norm["mlp"]),
                "mlp_share": median(norm["mlp"] / norm["mid"]),
                "resid_post": median(norm["post"]),
                "cosine_in_out": median(cosine(pre, post)),
                "bookkeeping": bookkeeping,
            }
        )
    return {
        "tokens": len(ids),
        "embed": median(embed.double().norm(dim=-1)),
        "norm": model.config.norm,
        "rows": rows,
    }


def render(report: dict) -> str:
    columns = ["block", "‖resid_pre‖", "‖attn_out‖/‖resid_pre‖", "‖mlp_out‖/‖resid_mid‖", "‖resid_post‖",
               "cos(pre, post)", "bookkeeping"]  # fmt: skip
    lines = [
        [
            r["block"],
            r["resid_pre"],
            r["attn_share"],
            r["mlp_share"],
            r["resid_post"],
            r["cosine_in_out"],
            r["bookkeeping"],
        ]
        for r in report["rows"]
    ]
    out = [
        f"bus: {report['model']}",
        f"text: {report['text']}",
        f"medians over positions; the embedding's norm ‖embed‖ = {report['embed']:.4g}",
        "",
        common.table(columns, lines),
    ]
    if report["norm"] in NORM_FIRST:
        out.append(
            "bookkeeping: the largest over positions of "
            "‖resid_post - (resid_pre + attn_out + mlp_out)‖ / ‖resid_post‖"
        )
    else:
        out.append("bookkeeping: - (post-LN, DeepNorm normalise each sum: the stream is not the writes' sum)")
    return common.joined(out, report)


def plot(report: dict, args) -> str | None:
    plt = common.pyplot()
    rows = report["rows"]
    blocks = [r["block"] for r in rows]
    fig, (norm_ax, share_ax) = plt.subplots(1, 2, figsize=(11, 4))
    stream = [report["embed"]] + [r["resid_post"] for r in rows]
    norm_ax.plot(
        [-0.5] + [b + 0.5 for b in blocks], stream, "o-", label="stream: embed, then each resid_post"
    )
    norm_ax.plot(blocks, [r["attn_out"] for r in rows], "s--", label="‖attn_out‖")
    norm_ax.plot(blocks, [r["mlp_out"] for r in rows], "^--", label="‖mlp_out‖")
    norm_ax.set_yscale("log")
    norm_ax.set_xlabel("block")
    norm_ax.set_ylabel("median norm over positions")
    norm_ax.set_title("the stream grows; what each stage writes")
    norm_ax.legend(fontsize=8)
    width = 0.4
    share_ax.bar(
        [b - width / 2 for b in blocks],
        [r["attn_share"] for r in rows],
        width,
        label="‖attn_out‖ / ‖resid_pre‖",
    )
    share_ax.bar(
        [b + width / 2 for b in blocks],
        [r["mlp_share"] for r in rows],
        width,
        label="‖mlp_out‖ / ‖resid_mid‖",
    )
    share_ax.plot(blocks, [r["cosine_in_out"] for r in rows], "ko-", label="cos(resid_pre, resid_post)")
    share_ax.set_xlabel("block")
    share_ax.set_title("each write as a share of the stream it reads")
    share_ax.legend(fontsize=8)
    fig.suptitle(f"bus: {report['model']}", fontsize=9)
    return common.save_figure(fig, args)


def parser() -> flags.Parser:
    p = common.parser("bus", "Residual-stream norms and each stage's write along the stack.")
    common.add_model_args(p)
    common.add_text_args(p)
    common.add_output_args(p, plot="bus.png")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])
    report = common.on_text(args, stream_report)
    report["png"] = plot(report, args)
    common.emit(args, report, render(report))
    return 0
