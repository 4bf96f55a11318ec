"""The pictures of a stall experiment: loss curves, gradient norms at initialisation, the grid's map."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

from lab.stall.report import SMOOTH, by_variant, grad_norms_by_variant, smoothed
from lab.stall.settings import Variant


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot(runs: list[dict], unigram: float, bigram: float, path: Path) -> None:
    """The 10-step-mean loss curve of each variant: the mean over seeds, shaded between min and max."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for spec, group in by_variant(runs).items():
        curves = [smoothed(run["losses"]) for run in group]
        steps = range(1, len(curves[0]) + 1)
        mean = [statistics.fmean(values) for values in zip(*curves, strict=True)]
        label = Variant.parse(spec).label + (
            f", {len(group)} seeds" if len(group) > 1 else f", seed {group[0]['seed']}"
        )
        (line,) = ax.plot(steps, mean, label=label)
        if len(group) > 1:
            low = [min(v) for v in zip(*curves, strict=True)]
            high = [max(v) for v in zip(*curves, strict=True)]
            ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2, lw=0)
    ax.axhline(unigram, color="grey", ls="--", lw=1, label=f"unigram line H(X) = {unigram:.2f}")
    ax.axhline(bigram, color="black", ls="--", lw=1, label=f"bigram line H(X_t | X_t-1) = {bigram:.2f}")
    ax.set(xlabel="step", ylabel=f"training loss, nats/char ({SMOOTH}-step mean)", title="The post-LN stall")
    ax.set_ylim(top=max(unigram + 0.6, 4.0))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grad_norms(runs: list[dict], path: Path) -> None:
    """Gradient norm per block at initialisation, one line per variant (warmup does not change it, so
    variants differing only in warmup are drawn once): the block's whole gradient and, dashed, its
    feed-forward output weight's."""
    plt = _pyplot()
    blocks, c_proj = grad_norms_by_variant(runs), grad_norms_by_variant(runs, "mlp.c_proj")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = set()
    for spec in blocks:
        variant = Variant.parse(spec)
        if (variant.norm, variant.norm_type) in drawn:
            continue
        drawn.add((variant.norm, variant.norm_type))
        label = variant.label.rsplit(", ", 1)[0]
        layers = range(len(blocks[spec]))
        (line,) = ax.plot(layers, blocks[spec], marker="o", label=f"{label}: block")
        ax.plot(
            layers,
            c_proj[spec],
            marker="x",
            ls="--",
            color=line.get_color(),
            label=f"{label}: mlp.c_proj.weight",
        )
    ax.set(
        xlabel="block",
        ylabel="gradient norm at init",
        yscale="log",
        title="Gradient norm per block at initialisation",
    )
    ax.set_xticks(range(len(next(iter(blocks.values())))))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_grid(grid: dict, path: Path) -> None:
    """Heatmap of the final loss (mean over seeds) over the first two axes; stalled cells hatched."""
    plt = _pyplot()
    axes = list(grid["axes"].items())
    (row_name, row_values), (col_name, col_values) = axes[0], axes[1] if len(axes) == 2 else ("", [None])
    loss = [[float("nan")] * len(col_values) for _ in row_values]
    stalled = [[""] * len(col_values) for _ in row_values]
    for cell in grid["cells"]:
        r = row_values.index(cell["setting"][row_name])
        c = col_values.index(cell["setting"][col_name]) if col_name else 0
        loss[r][c] = cell["final_loss"]["mean"]
        if cell["stalled_seeds"]:
            stalled[r][c] = f"\nstalled {cell['stalled_seeds']}/{len(cell['seeds'])}"
    fig, ax = plt.subplots(figsize=(1.6 * len(col_values) + 2.5, 1.1 * len(row_values) + 1.8))
    image = ax.imshow(loss, cmap="viridis", aspect="auto")
    for r, c in itertools.product(range(len(row_values)), range(len(col_values))):
        light = image.norm(loss[r][c]) > 0.6  # viridis turns yellow: dark text reads there
        text = f"{loss[r][c]:.2f}{stalled[r][c]}"
        ax.text(c, r, text, ha="center", va="center", color="black" if light else "white", fontsize=9)
        if stalled[r][c]:
            ax.add_patch(
                plt.Rectangle((c - 0.5, r - 0.5), 1, 1, fill=False, hatch="//", edgecolor="red", lw=2)
            )
    ax.set_yticks(range(len(row_values)), [str(v) for v in row_values])
    ax.set_xticks(range(len(col_values)), [str(v) for v in col_values] if col_name else [""])
    label = Variant.parse(grid["variant"]).label
    if "warmup" in grid["axes"]:  # the label's warmup is the grid's to vary
        label = label.rsplit(", ", 1)[0]
    ax.set(ylabel=row_name, xlabel=col_name, title=f"{label}: final training loss")
    fig.colorbar(image, ax=ax, label=f"nats/char ({SMOOTH}-step mean at the last step)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_at_init(rows: list[dict], path: Path) -> None:
    """The feed-forward output weight's gradient norm at init against relative depth (block / last),
    a colour per variant and a line style per model depth (first seed)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    first_seed = rows[0]["seed"]
    colours = {spec: f"C{i}" for i, spec in enumerate(dict.fromkeys(row["variant"] for row in rows))}
    depths = sorted({row["n_layer"] for row in rows})
    styles = dict(zip(depths, itertools.cycle(["-", "--", ":", "-."])))
    for row in rows:
        if row["seed"] != first_seed:
            continue
        norms = row["mlp.c_proj"]
        at = [i / max(1, len(norms) - 1) for i in range(len(norms))]
        label = f"{Variant.parse(row['variant']).label.rsplit(', ', 1)[0]}, {row['n_layer']} blocks"
        ax.plot(at, norms, ls=styles[row["n_layer"]], color=colours[row["variant"]], label=label)
    ax.set(
        xlabel="block / last block",
        ylabel="mlp.c_proj.weight gradient norm at init",
        yscale="log",
        title="Gradient norm of each feed-forward output weight at initialisation",
    )
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
