"""blocklab flops: forward FLOPs per token, from the formula and from torch's FLOP counter.

    blocklab flops                          # GPT-2 small at T = 256 and 1024
    blocklab flops --T 1024 4096 --config gpt2-medium
    blocklab flops --config llama3.1-8b     # formula only (blocklab cannot build that design)

The convention (Kaplan et al. 2020, Table 1; nanoGPT's estimate_mfu; PaLM appendix B): a multiply-add is
2 FLOPs, and a token costs

    2N + 4·L·T·d,   N = the Blocks' weight matrices + the unembedding (V·d)

where T is the number of positions the token attends to (the context, in a full-length forward pass),
and attention's q·k^T and pattern·v are counted over the full T x T: the causal mask's zero half is not
discounted (a kernel that skips it does about half of that term on average). Biases, norms, softmax and
the table lookups are left out: they are O(d) per token, not O(d^2).

torch.utils.flop_counter.FlopCounterMode counts the matmuls it sees. With eager attention it sees every
product and agrees with the formula exactly. With sdpa the count depends on the kernel: on CUDA the
flash / memory-efficient kernels have formulas; on CPU the fused kernel has none and counts 0, so the
counter misses attention's whole term.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from jsonargparse.typing import PositiveInt
from torch.utils.flop_counter import FlopCounterMode

from lab import flags
from lab.analysis import common
from lab.analysis.designs import Design
from lab.config import GPTConfig
from lab.model import GPT


def counting_model(cfg: GPTConfig, max_T: int, attention: str, device: str = "cpu") -> GPT:
    """A random model of ``cfg`` with ``attention``, its context stretched to ``max_T`` positions."""
    cfg = replace(cfg, attention=attention, block_size=max(cfg.block_size, max_T), dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(cfg).to(device).eval()


def counted_flops_per_token(model: GPT, T: int) -> dict[str, int]:
    """FlopCounterMode's count of one forward pass over T tokens (batch 1), per token, by aten op."""
    device = model.wte.weight.device
    idx = torch.randint(0, model.config.vocab_size, (1, T), device=device)  # [1, T]
    with torch.inference_mode(), FlopCounterMode(display=False) as counter:
        model(idx)
    by_op = {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}
    return {"total": int(counter.get_total_flops()) // T, **{op: n // T for op, n in by_op.items()}}


def analyse(design: Design, Ts: list[int], cfg: GPTConfig | None, device: str = "cpu") -> dict:
    """Formula per T, and the counter's eager and sdpa counts beside it when ``cfg`` can be built."""
    rows = []
    if cfg is not None:
        eager_model = counting_model(cfg, max(Ts), "eager", device)
        sdpa_model = counting_model(cfg, max(Ts), "sdpa", device)
    for T in Ts:
        f = design.forward_flops_per_token(T)
        total = sum(f.values())
        row = {"T": T, **f, "total": total, "attention_share": f["attention"] / total}
        if cfg is not None:
            eager = counted_flops_per_token(eager_model, T)
            sdpa = counted_flops_per_token(sdpa_model, T)
            row |= {
                "counted_eager": eager["total"],
                "counted_sdpa": sdpa["total"],
                "sdpa_missed": total - sdpa["total"],
                "sdpa_missed_share": (total - sdpa["total"]) / total,
                "counted_eager_ops": eager,
                "counted_sdpa_ops": sdpa,
            }
        rows.append(row)
    blocks_crossover, all_crossover = design.attention_crossover()
    return {
        "design": design.name,
        "N": design.flop_params(),
        "L": design.n_layer,
        "d": design.d_model,
        "V": design.vocab_size,
        "convention": (
            "2N + 4·L·T·d per token; N = Blocks' matrices + unembedding; full T x T (mask not discounted)"
        ),
        "rows": rows,
        "crossover_T_blocks": blocks_crossover,
        "crossover_T_all_linear": all_crossover,
        "counter_device": device if cfg is not None else None,
    }


def render(report: dict) -> str:
    counted = "counted_eager" in report["rows"][0]
    columns = ["T", "linear 2N_blocks", "unembed 2Vd", "attention 4LTd", "total", "attn share"]
    if counted:
        columns += ["counter eager", "counter sdpa", "sdpa missed"]
    lines = []
    for r in report["rows"]:
        line = [
            r["T"],
            r["linear"],
            r["unembedding"],
            r["attention"],
            r["total"],
            f"{100 * r['attention_share']:.1f}%",
        ]
        if counted:
            line += [r["counted_eager"], r["counted_sdpa"], f"{100 * r['sdpa_missed_share']:.1f}%"]
        lines.append(line)
    out = [
        f"flops: {report['design']}  forward FLOPs per token; N = {report['N']:,} "
        f"(Blocks' matrices + unembedding), L={report['L']} d={report['d']} V={report['V']}",
        f"convention: {report['convention']}",
        "",
        common.table(columns, lines),
        "",
        "attention's 4·L·T·d overtakes the Blocks' linear layers at "
        f"T = {report['crossover_T_blocks']:,.0f}, and all linear layers (unembedding included) "
        f"at T = {report['crossover_T_all_linear']:,.0f}",
    ]
    if counted:
        exact = all(r["counted_eager"] == r["total"] for r in report["rows"])
        worst = max(r["sdpa_missed_share"] for r in report["rows"])
        out += [
            f"FlopCounterMode on {report['counter_device']}: eager "
            + ("equals the formula exactly" if exact else "DIFFERS from the formula (see --json)")
            + f"; sdpa misses up to {100 * worst:.1f}% of the FLOPs"
            + (" (the fused CPU attention kernel has no FLOP formula: it counts 0)" if worst > 0 else "")
        ]
    return common.joined(out, report)


def plot(design: Design, report: dict, args) -> str | None:
    """Left: each part's share of a token's FLOPs against T. Right: the FLOPs, with the counter's points."""
    plt = common.pyplot()
    Ts = [2**k for k in range(6, 18)]  # 64 .. 131072
    parts = [design.forward_flops_per_token(T) for T in Ts]
    names = {
        "linear": "Blocks' linear (2N_blocks)",
        "unembedding": "unembedding (2Vd)",
        "attention": "attention (4LTd)",
    }
    fig, (share_ax, abs_ax) = plt.subplots(1, 2, figsize=(11, 4))
    totals = [sum(p.values()) for p in parts]
    share_ax.stackplot(
        Ts,
        *[[p[k] / t for p, t in zip(parts, totals, strict=True)] for k in names],
        labels=names.values(),
        alpha=0.8,
    )
    share_ax.set_ylabel("share of a token's forward FLOPs")
    share_ax.set_ylim(0, 1)
    for k, name in names.items():
        abs_ax.plot(Ts, [p[k] for p in parts], label=name)
    abs_ax.plot(Ts, totals, "k-", lw=1, label="total (2N + 4LTd)")
    if "counted_sdpa" in report["rows"][0]:
        rows = report["rows"]
        device = report["counter_device"]
        abs_ax.plot([r["T"] for r in rows], [r["counted_eager"] for r in rows], "ko", label="counter, eager")
        abs_ax.plot(
            [r["T"] for r in rows],
            [r["counted_sdpa"] for r in rows],
            "rx",
            ms=8,
            label=f"counter, sdpa ({device})",
        )
    abs_ax.set_yscale("log")
    abs_ax.set_ylabel("forward FLOPs per token")
    for ax in (share_ax, abs_ax):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("T (positions attended to)")
        ax.axvline(report["crossover_T_blocks"], color="k", ls=":", lw=1)
        ax.legend(fontsize=8, loc="upper left")
    share_ax.set_title(
        f"{design.name}: attention = Blocks' linear at T = {report['crossover_T_blocks']:,.0f}"
    )
    abs_ax.set_title("FLOPs per token, formula and FlopCounterMode")
    return common.save_figure(fig, args)


@dataclass
class FlopsOptions:
    """What to count."""

    T: tuple[PositiveInt, ...] = (256, 1024)
    """Positions attended to."""
    no_count: bool = False
    """Formula only: skip the FLOP counter's forward passes."""
    device: str = "cpu"
    """Where the counted forward passes run."""


def parser() -> flags.Parser:
    p = common.parser("flops", "Forward FLOPs per token: 2N + 4·L·T·d, beside torch's FLOP counter.")
    common.add_design_args(p)
    p.add_options(FlopsOptions)
    common.add_output_args(p, plot="flops.png")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])

    design, model = common.design_from_args(args)
    cfg = None if model is None or args.no_count else model.config
    report = analyse(design, list(args.T), cfg, args.device)
    report["png"] = plot(design, report, args) if not args.no_plot else None
    common.emit(args, report, render(report))
    return 0
