"""``blocklab lens report``: per block, what an early exit there costs through the logit lens and
through the tuned lens, on text the lens was not fitted on.

For each block i (the stream leaving it, read by ``exit=i+1``), over every position of the text's
windows that has a next token: the next-token loss read out there (nats/token) and its excess over
full depth, KL(final distribution || the exit's), and how often the exit's top-1 token is the final
one's. "logit" reads the stream as is (``GPT.unembed``), "tuned" through the block's translator; a
block the lens was not fitted at shows no tuned numbers. The last block's stream is the final one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lab.analysis import common
from lab.lens.data import streams
from lab.lens.translator import ReadOut, TunedLens
from lab.model import GPT

METRICS = ("loss", "kl", "top1")


@torch.inference_mode()
def window_sums(model: GPT, lens: TunedLens, window: list[int], read_out: ReadOut) -> dict[str, torch.Tensor]:
    """For one window, sums over its positions that have a next token, per block [L] and per lens:
    next-token loss, KL(final || exit) and top-1 agreement with the final top-1."""
    L = model.config.n_layer
    leaving, final = streams(model, window, list(range(L)))  # [L, T, D], [T, D]
    leaving, final = leaving[:, :-1], final[:-1]  # [L, T-1, D], [T-1, D]: positions with a next token
    targets = torch.tensor(window[1:], device=final.device)  # [T-1]
    final_logits = read_out.logits(final).float()  # [T-1, C]
    final_log_p = F.log_softmax(final_logits, dim=-1)  # [T-1, C]
    final_top = read_out.top1(final_logits)  # [T-1]
    sums = {f"{metric}_{name}": torch.zeros(L) for metric in METRICS for name in ("logit", "tuned")}
    for block in range(L):
        for name in ("logit", "tuned"):
            stream = leaving[block] if name == "logit" else lens(block, leaving[block])  # [T-1, D]
            logits = read_out.logits(stream).float()  # [T-1, C]
            log_q = F.log_softmax(logits, dim=-1)  # [T-1, C]
            sums[f"loss_{name}"][block] = -read_out.token_log_probs(log_q, targets).sum()
            sums[f"kl_{name}"][block] = (final_log_p.exp() * (final_log_p - log_q)).sum()
            sums[f"top1_{name}"][block] = (read_out.top1(logits) == final_top).sum()
    return sums


def lens_report(model: GPT, lens: TunedLens, windows: list[list[int]]) -> dict:
    """The per-block rows (block, exit, loss/kl/top1 for each lens, the loss's excess over full
    depth), averaged over the positions of ``windows`` that have a next token."""
    read_out = ReadOut(model)
    totals, positions = None, 0
    for window in windows:
        sums = window_sums(model, lens, window, read_out)
        totals = sums if totals is None else {key: totals[key] + value for key, value in sums.items()}
        positions += len(window) - 1
    means = {key: (value / positions).tolist() for key, value in totals.items()}
    L = model.config.n_layer
    full = means["loss_logit"][L - 1]
    rows = []
    for block in range(L):
        fitted = block in lens.blocks or block == L - 1  # the last block: the final stream, no translator
        row = {"block": block, "exit": block + 1, "fitted": block in lens.blocks}
        for metric in METRICS:
            row[f"{metric}_logit"] = means[f"{metric}_logit"][block]
            row[f"{metric}_tuned"] = means[f"{metric}_tuned"][block] if fitted else None
        row["excess_logit"] = row["loss_logit"] - full
        row["excess_tuned"] = None if row["loss_tuned"] is None else row["loss_tuned"] - full
        rows.append(row)
    return {"positions": positions, "windows": len(windows), "full_depth_loss": full, "rows": rows}


def render(report: dict) -> str:
    columns = ["block", "exit", "loss logit", "loss tuned", "excess logit", "excess tuned", "KL logit",
               "KL tuned", "top-1 logit", "top-1 tuned"]  # fmt: skip
    keys = ["block", "exit", "loss_logit", "loss_tuned", "excess_logit", "excess_tuned", "kl_logit",
            "kl_tuned", "top1_logit", "top1_tuned"]  # fmt: skip
    lines = [[row[key] for key in keys] for row in report["rows"]]
    out = [
        f"lens report: {report['model']}",
        f"lens: {report['lens']}",
        f"text: {report['text']} ({report['positions']:,} positions in {report['windows']} windows)",
        f"full depth: {report['full_depth_loss']:.4f} nats/token; exit=E reads the stream leaving block E-1",
        "",
        common.table(columns, lines),
        "loss: next-token nats/token read out after the block; excess: over full depth; KL: "
        "KL(final || exit) in nats; top-1: share of positions whose top-1 is the final top-1",
    ]
    return common.joined(out, report)


def plot(report: dict, args) -> str | None:
    plt, rows = common.pyplot(), report["rows"]
    blocks = [row["block"] for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = (
        ("loss", "next-token loss (nats/token)", "linear"),
        ("kl", "KL(final || exit) (nats)", "log"),
        ("top1", "top-1 agrees with the final top-1", "linear"),
    )
    for ax, (metric, title, scale) in zip(axes, panels, strict=True):
        for name, style in (("logit", "o--"), ("tuned", "s-")):
            values = [(row["block"], row[f"{metric}_{name}"]) for row in rows]
            # no tuned value where the lens was not fitted; a log axis cannot show the last block's KL of 0
            values = [(b, v) for b, v in values if v is not None and (scale == "linear" or v > 0)]
            if values:
                ax.plot([b for b, _ in values], [v for _, v in values], style, label=f"{name} lens")
        if metric == "loss":
            ax.axhline(report["full_depth_loss"], color="gray", lw=0.8, label="full depth")
        ax.set_yscale(scale)
        ax.set_xticks(blocks)
        ax.set_xlabel("block (exit=block+1)")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle(f"lens report: {report['model']}", fontsize=9)
    return common.save_figure(fig, args)
