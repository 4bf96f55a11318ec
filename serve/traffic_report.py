"""``blocklab traffic``'s results: per block set (and rate) the serving benchmarks' statistics with 95%
bootstrap intervals, each set's differences from ``all`` and which differences are significant, the
frontier of the sets worth serving, and the table, CSV, JSON and plots that show them.

Intervals: percentile bootstrap (``lab.measure``) of the median TTFT, TPOT and end-to-end latency over
a set's requests, and of its mean prompt loss. A difference from ``all`` is significant when the
bootstrap interval of the difference excludes 0: for latencies the two sets' requests resampled
independently, for the loss the prompts both sets scored resampled together (each prompt's loss under
the two sets is a pair, so what the prompts themselves cost cancels).
"""

from __future__ import annotations

import csv
import json
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from lab.analysis.common import pyplot, table
from lab.measure import (
    CONFIDENCE,
    ends,
    frontier,
    interval,
    latency_ms,
    paired_difference,
    resampled,
    significant,
)
from serve.client import Reply

SLO_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
"""What ``--slo`` may bound, per request (itl: its longest gap between tokens)."""
MEDIANS = ("ttft", "tpot", "e2el")
"""The latencies whose medians get intervals."""


@dataclass
class Run:
    """What one block set got at one request rate, over all its turns."""

    block_set: str
    rate: float | None
    replies: list[Reply] = field(default_factory=list)
    wall_s: float = 0.0
    """Wall time of the turns it ran in (throughput is per this time)."""

    @property
    def ok(self) -> list[Reply]:
        return [reply for reply in self.replies if reply.ok]

    def seconds(self, metric: str) -> list[float]:
        """Per completed request: ``ttft``, ``tpot`` or ``e2el`` (seconds); ``itl``: every gap."""
        if metric == "itl":
            return [gap for reply in self.ok for gap in reply.itl_s]
        values = [{"ttft": r.ttft_s, "tpot": r.tpot_s, "e2el": r.latency_s}[metric] for r in self.ok]
        return [value for value in values if value is not None]

    def losses(self) -> dict[str, float]:
        """Prompt -> its mean loss under this set (a prompt scores the same every time it is sent)."""
        return {r.body["prompt"]: r.response.score.mean_loss for r in self.ok if r.response.score is not None}

    def medians_resampled(self, metric: str, seed: int) -> np.ndarray | None:
        """Bootstrap medians (ms) of ``metric``; None for fewer than 2 values. [R]"""
        values = self.seconds(metric)
        if len(values) < 2:
            return None
        salt = zlib.crc32(f"{self.block_set}@{self.rate}/{metric}".encode())
        return resampled(np.asarray(values) * 1e3, np.median, seed=seed + salt)


@dataclass
class Summary:
    """One block set's run (at one request rate), with the names serving benchmarks use; ``_low`` and
    ``_high``: the 95% bootstrap interval of the statistic before them; ``_diff_low``/``_diff_high``:
    of this set's statistic minus ``all``'s."""

    block_set: str
    request_rate: float | None
    """Requests per second sent (open loop); None for a closed loop of ``concurrency`` clients."""
    concurrency: int | None
    completed: int
    errors: int
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    median_ttft_ms_low: float | None
    median_ttft_ms_high: float | None
    p99_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    median_tpot_ms_low: float | None
    median_tpot_ms_high: float | None
    p99_tpot_ms: float | None
    mean_itl_ms: float | None
    median_itl_ms: float | None
    p99_itl_ms: float | None
    mean_e2el_ms: float | None
    median_e2el_ms: float | None
    median_e2el_ms_low: float | None
    median_e2el_ms_high: float | None
    p90_e2el_ms: float | None
    p99_e2el_ms: float | None
    request_throughput: float
    output_throughput: float
    request_goodput: float | None
    """Requests per second that met every ``--slo`` (None without SLOs)."""
    mean_loss: float | None
    mean_loss_low: float | None
    mean_loss_high: float | None
    loss_increase: float | None
    """Mean loss minus that of ``all`` (None when ``all`` was not run)."""
    mean_blocks_per_token: float | None
    first_error: str | None
    median_ttft_ms_diff_low: float | None = None
    median_ttft_ms_diff_high: float | None = None
    median_tpot_ms_diff_low: float | None = None
    median_tpot_ms_diff_high: float | None = None
    median_e2el_ms_diff_low: float | None = None
    median_e2el_ms_diff_high: float | None = None
    loss_increase_low: float | None = None
    loss_increase_high: float | None = None
    frontier: bool = False
    """No other set at this rate is significantly faster (median end-to-end) and lower in loss."""

    def differs(self, statistic: str) -> bool | None:
        """Whether ``statistic`` (``median_ttft_ms``, ..., ``loss_increase``) differs significantly from
        ``all``'s; None where there is no interval."""
        name = statistic if statistic == "loss_increase" else f"{statistic}_diff"
        if not hasattr(self, f"{name}_low"):
            return None
        low, high = getattr(self, f"{name}_low"), getattr(self, f"{name}_high")
        return None if low is None else significant((low, high))


def _rounded(pair: tuple[float, float] | None, digits: int = 2) -> tuple[float | None, float | None]:
    return (None, None) if pair is None else (round(pair[0], digits), round(pair[1], digits))


def meets(reply: Reply, slo: dict[str, float]) -> bool:
    """Whether a completed request met every SLO (``SLO_METRICS`` -> milliseconds)."""
    measured = {
        "ttft_ms": reply.ttft_s,
        "tpot_ms": reply.tpot_s,
        "itl_ms": max(reply.itl_s) if reply.itl_s else None,
        "e2el_ms": reply.latency_s,
    }
    return all(measured[name] is None or measured[name] * 1000.0 <= bound for name, bound in slo.items())


def summarize(
    run: Run, *, concurrency: int | None = None, slo: dict[str, float] | None = None, seed: int = 0
) -> Summary:
    """``run``'s statistics with their intervals; the comparisons with ``all`` come from ``compare``."""
    ok = run.ok
    errors = [reply.error for reply in run.replies if reply.error is not None]
    named = {}  # mean_ttft_ms, median_ttft_ms, median_ttft_ms_low, ..., p99_e2el_ms
    quantiles_of = {"ttft": (50, 99), "tpot": (50, 99), "itl": (50, 99), "e2el": (50, 90, 99)}
    for metric, quantiles in quantiles_of.items():
        stats = latency_ms(run.seconds(metric), quantiles)
        named[f"mean_{metric}_ms"] = stats["mean"]
        for q in quantiles:
            named[f"{'median' if q == 50 else f'p{q}'}_{metric}_ms"] = stats[f"p{q}"]
        if metric in MEDIANS:
            boot = run.medians_resampled(metric, seed)
            low_high = _rounded(None if boot is None else ends(boot))
            named[f"median_{metric}_ms_low"], named[f"median_{metric}_ms_high"] = low_high
    losses = [reply.response.score.mean_loss for reply in ok if reply.response.score is not None]
    loss_interval = _rounded(interval(losses, np.mean, seed=seed), 4)
    blocks = [reply.response.mean_blocks_per_token for reply in ok]
    per_s = (lambda count: round(count / run.wall_s, 3)) if run.wall_s > 0 else (lambda count: 0.0)
    return Summary(
        block_set=run.block_set,
        request_rate=run.rate,
        concurrency=concurrency,
        completed=len(ok),
        errors=len(errors),
        **named,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(sum(len(reply.response.tokens) for reply in ok)),
        request_goodput=per_s(sum(meets(reply, slo) for reply in ok)) if slo else None,
        mean_loss=round(float(np.mean(losses)), 4) if losses else None,
        mean_loss_low=loss_interval[0],
        mean_loss_high=loss_interval[1],
        loss_increase=None,
        mean_blocks_per_token=round(float(np.mean(blocks)), 3) if blocks else None,
        first_error=errors[0] if errors else None,
    )


def compare(runs: list[Run], summaries: list[Summary], seed: int = 0) -> list[Summary]:
    """Fill each summary's differences from ``all`` at the same rate (loss increase, the medians'
    difference intervals) and mark the frontier of each rate; the summaries, in ``runs``' order."""
    for rate in dict.fromkeys(run.rate for run in runs):
        pairs = [(run, s) for run, s in zip(runs, summaries, strict=True) if run.rate == rate]
        boots = {id(run): {m: run.medians_resampled(m, seed) for m in MEDIANS} for run, _ in pairs}
        base = next(((run, s) for run, s in pairs if run.block_set == "all"), None)
        if base is not None:
            for run, summary in pairs:
                _against(run, summary, *base, boots, seed)
        measured = [s for _, s in pairs if s.median_e2el_ms is not None and s.mean_loss is not None]
        best = frontier(
            measured, lambda s: s.median_e2el_ms, lambda s: s.mean_loss, _beats(pairs, boots, seed)
        )
        for summary in best:
            summary.frontier = True
    return summaries


def _loss_pairs(run: Run, other: Run) -> list[tuple[float, float]]:
    """(loss under ``run``, loss under ``other``) of every prompt both scored."""
    mine, theirs = run.losses(), other.losses()
    return [(mine[prompt], theirs[prompt]) for prompt in sorted(mine.keys() & theirs.keys())]


def _against(run: Run, summary: Summary, base_run: Run, base: Summary, boots: dict, seed: int) -> None:
    """``summary``'s differences from ``base`` (the ``all`` of its rate)."""
    if summary.mean_loss is not None and base.mean_loss is not None:
        summary.loss_increase = round(summary.mean_loss - base.mean_loss, 4)
        if run is not base_run:
            low_high = _rounded(paired_difference(_loss_pairs(run, base_run), seed=seed), 4)
            summary.loss_increase_low, summary.loss_increase_high = low_high
    for metric in MEDIANS:
        mine, theirs = boots[id(run)][metric], boots[id(base_run)][metric]
        if mine is not None and theirs is not None and run is not base_run:
            low, high = _rounded(ends(mine - theirs))
            setattr(summary, f"median_{metric}_ms_diff_low", low)
            setattr(summary, f"median_{metric}_ms_diff_high", high)


def _beats(pairs: list[tuple[Run, Summary]], boots: dict, seed: int):
    """``beats(q, p)`` for the frontier: q significantly faster end to end and lower in loss than p."""
    run_of = {id(summary): run for run, summary in pairs}

    def beats(q: Summary, p: Summary) -> bool:
        fast, slow = run_of[id(q)], run_of[id(p)]
        q_e2el, p_e2el = boots[id(fast)]["e2el"], boots[id(slow)]["e2el"]
        if q_e2el is None or p_e2el is None or not ends(q_e2el - p_e2el)[1] < 0:
            return False
        loss = paired_difference(_loss_pairs(fast, slow), seed=seed)
        return loss is not None and loss[1] < 0

    return beats


# ---------------------------------------------------------------------------------------------------
# Table


def _number(value: float, like: float, digits: int | None) -> str:
    """``value`` with ``digits`` decimals, or as many as ``like``'s size calls for (676, 33.4, 4.12)."""
    if digits is None:
        digits = 0 if abs(like) >= 100 else 1 if abs(like) >= 10 else 2
    return f"{value:.{digits}f}"


def _with_interval(summary: Summary, statistic: str, digits: int | None = None) -> str | None:
    """``676 [650, 702]``, and `` ~`` after it when it does not differ significantly from ``all``'s."""
    value = getattr(summary, statistic)
    if value is None:
        return None
    low, high = getattr(summary, f"{statistic}_low"), getattr(summary, f"{statistic}_high")
    text = _number(value, value, digits)
    if low is not None:
        text += f" [{_number(low, value, digits)}, {_number(high, value, digits)}]"
    return text + (" ~" if summary.differs(statistic) is False else "")


def _loss_increase(summary: Summary) -> str | None:
    if summary.loss_increase is None:
        return None
    return f"{summary.loss_increase:+.4f}" + (" ~" if summary.differs("loss_increase") is False else "")


COLUMNS = (
    ("block set", lambda s: s.block_set),
    ("rate", lambda s: s.request_rate),
    ("done", lambda s: s.completed),
    ("err", lambda s: s.errors),
    ("e2el p50 ms", lambda s: _with_interval(s, "median_e2el_ms")),
    ("e2el p99", lambda s: s.p99_e2el_ms),
    ("ttft p50 ms", lambda s: _with_interval(s, "median_ttft_ms")),
    ("tpot p50 ms", lambda s: _with_interval(s, "median_tpot_ms")),
    ("itl p99", lambda s: s.p99_itl_ms),
    ("req/s", lambda s: s.request_throughput),
    ("tok/s", lambda s: s.output_throughput),
    ("goodput", lambda s: s.request_goodput),
    ("loss", lambda s: _with_interval(s, "mean_loss", 4)),
    ("+loss", _loss_increase),
    ("blocks", lambda s: s.mean_blocks_per_token),
)
"""The table's columns; one that is empty in every row (the rate of a closed loop, goodput without
SLOs) is left out."""


def render(summaries: list[Summary]) -> str:
    """The table (intervals in brackets, ``~``: no significant difference from ``all``), then the
    frontier of each rate."""
    cells = [[value(s) for _, value in COLUMNS] for s in summaries]
    shown = [i for i in range(len(COLUMNS)) if any(row[i] is not None for row in cells)]
    columns = [COLUMNS[i][0] for i in shown]
    rows = [[row[i] for i in shown] for row in cells]
    lines = [
        table(columns, rows),
        "",
        f"[low, high]: {CONFIDENCE:.0%} bootstrap interval; ~: not significantly "
        "different from all (the interval of the difference includes 0)",
    ]
    for rate in dict.fromkeys(s.request_rate for s in summaries):
        best = [s.block_set for s in summaries if s.request_rate == rate and s.frontier]
        where = "" if rate is None else f" at {rate:g} req/s"
        lines.append(
            f"worth serving{where} (no other set is significantly faster end to end and lower in loss): "
            + (", ".join(best) or "-")
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------
# Files


def _error_bars(summaries: list[Summary], statistic: str) -> np.ndarray:
    """[2, N]: the distance from each value down to its interval's low end and up to its high end."""
    bars = []
    for summary in summaries:
        value = getattr(summary, statistic)
        low, high = getattr(summary, f"{statistic}_low"), getattr(summary, f"{statistic}_high")
        bars.append([0.0, 0.0] if low is None else [value - low, high - value])
    return np.array(bars).T.reshape(2, len(summaries))


def plot_frontier(summaries: list[Summary], path: Path, title: str) -> None:
    """Median end-to-end latency against mean loss, both with their intervals; the frontier in colour
    and joined, the sets it rules out in grey."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    points = [s for s in summaries if s.median_e2el_ms is not None and s.mean_loss is not None]
    for group, style in (
        ([s for s in points if not s.frontier], {"color": "tab:gray", "alpha": 0.6, "label": "ruled out"}),
        ([s for s in points if s.frontier], {"color": "tab:orange", "label": "frontier"}),
    ):
        if group:
            ax.errorbar(
                [s.median_e2el_ms for s in group],
                [s.mean_loss for s in group],
                fmt="o",
                capsize=3,
                xerr=_error_bars(group, "median_e2el_ms"),
                yerr=_error_bars(group, "mean_loss"),
                zorder=3,
                **style,
            )
    best = sorted((s for s in points if s.frontier), key=lambda s: s.median_e2el_ms)
    ax.plot([s.median_e2el_ms for s in best], [s.mean_loss for s in best], color="tab:orange", lw=1, ls="--")
    for summary in points:
        ax.annotate(
            summary.block_set,
            (summary.median_e2el_ms, summary.mean_loss),
            textcoords="offset points",
            xytext=(5, 4),
            fontsize=8,
            color="black" if summary.frontier else "tab:gray",
        )
    ax.ticklabel_format(axis="y", useOffset=False)
    ax.set_xlabel(f"median end-to-end latency per request (ms, {CONFIDENCE:.0%} interval)")
    ax.set_ylabel("mean prompt loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(
        loc="best", fontsize=8, title="no other set significantly faster and lower in loss", title_fontsize=7
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_latency_vs_rate(summaries: list[Summary], path: Path, title: str) -> None:
    """Median end-to-end latency and median TTFT (with intervals) against the request rate, a line per
    block set."""
    plt = pyplot()
    fig, (e2el, ttft) = plt.subplots(1, 2, figsize=(10, 4.2))
    for block_set in dict.fromkeys(s.block_set for s in summaries):
        runs = sorted((s for s in summaries if s.block_set == block_set), key=lambda s: s.request_rate)
        for ax, statistic in ((e2el, "median_e2el_ms"), (ttft, "median_ttft_ms")):
            timed = [s for s in runs if getattr(s, statistic) is not None]
            ax.errorbar(
                [s.request_rate for s in timed],
                [getattr(s, statistic) for s in timed],
                marker="o",
                capsize=2,
                yerr=_error_bars(timed, statistic) if timed else None,
                label=block_set,
            )
    for ax, what in ((e2el, "median end-to-end latency (ms)"), (ttft, "median time to first token (ms)")):
        ax.set_xlabel("request rate (requests/s, open loop)")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    e2el.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(summaries: list[Summary], out: Path, meta: dict) -> dict[str, Path]:
    """traffic.csv and traffic.json (every run), frontier.png (the first rate's runs) and, when
    several rates ran, latency_vs_rate.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "traffic.csv", "json": out / "traffic.json", "png": out / "frontier.png"}
    rows = [asdict(summary) for summary in summaries]
    with paths["csv"].open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    paths["json"].write_text(json.dumps({**meta, "block_sets": rows}, indent=2) + "\n")
    first_rate = summaries[0].request_rate
    load = f"{first_rate:g} req/s" if first_rate is not None else f"{meta.get('concurrency')} clients"
    plot_frontier(
        [s for s in summaries if s.request_rate == first_rate],
        paths["png"],
        f"{meta.get('model')}: latency vs loss ({load})",
    )
    if len({s.request_rate for s in summaries}) > 1:
        paths["rates_png"] = out / "latency_vs_rate.png"
        plot_latency_vs_rate(summaries, paths["rates_png"], f"{meta.get('model')}: latency vs request rate")
    return paths
