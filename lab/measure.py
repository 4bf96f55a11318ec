"""What every tool that measures shares: latency statistics, bootstrap intervals and the significance
of a difference, the Pareto frontier, and the loopback check of a load generator's target.

    latency_ms([0.41, 0.38, 0.52])              # {"n": 3, "mean": 436.67, "p50": 410.0, ...}
    interleaved({"all": time_all, "skip": time_skip}, rounds=5)  # {"all": [5 values], "skip": [...]}
    interval(ttfts, np.median)                  # (low, high): 95% percentile bootstrap of the median
    shown(1.41, (1.02, 1.77))                   # "1.41 [1.02, 1.77]"
    skip, base = resampled(skip_ttfts, np.median, seed=1), resampled(all_ttfts, np.median, seed=2)
    significant(ends(skip - base))              # median(skip) - median(all): does its interval exclude 0?
    frontier(points, x=latency, y=loss)         # the points no other beats, fastest first

A percentile bootstrap: resample the values with replacement, take the statistic of each resample,
and read the 2.5th and 97.5th percentiles of those statistics. It assumes nothing about the shape of
the distribution (latencies are skewed, with long tails), only that the values are independent draws;
its width shrinks about as 1/sqrt(n). A difference of two statistics is significant when the interval
of the difference (resampling both sides) excludes 0; two intervals that overlap can still differ
significantly, which is why the difference is bootstrapped, not the two intervals compared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar
from urllib.parse import urlparse

import numpy as np

from lab.api_key import is_loopback
from lab.errors import UserError

RESAMPLES = 4000
"""Bootstrap resamples per interval: enough that another seed moves an interval's ends far less than
the interval is wide."""
CONFIDENCE = 0.95
CHUNK_VALUES = 1 << 22
"""Most resampled values held at once (resamples x n), so a long run's intervals stay in memory."""

Statistic = Callable[..., np.ndarray]
"""A numpy reduction taking ``axis`` (``np.median``, ``np.mean``)."""
T = TypeVar("T")


# ---------------------------------------------------------------------------------------------------
# Latency


def latency_ms(seconds: Sequence[float], quantiles: Sequence[int] = (50, 90, 99), digits: int = 2) -> dict:
    """Wall times in seconds summarised in milliseconds: ``n``, ``mean``, ``p50``, ``p90``, ... (the
    ``quantiles`` asked) and ``max``, rounded to ``digits`` decimals; None for each statistic when there
    are none."""
    names = ["mean", *(f"p{q}" for q in quantiles), "max"]
    if len(seconds) == 0:
        return {"n": 0, **dict.fromkeys(names)}
    values = np.asarray(seconds, dtype=np.float64) * 1e3
    stats = [values.mean(), *np.percentile(values, list(quantiles)), values.max()]
    return {"n": len(values), **{name: round(float(v), digits) for name, v in zip(names, stats, strict=True)}}


def interleaved(measures: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each measurement's values over ``rounds`` rounds, each round taking every measurement once in
    turn, after one warm-up call of each (compiles, caches): drift and load then fall on all alike.
    UserError for fewer than 2 rounds: the figures these feed carry an interval, which needs two."""
    if rounds < 2:
        raise UserError(f"--rounds {rounds}: at least 2 (every figure comes with its interval)")
    for measure in measures.values():
        measure()
    values: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            values[name].append(measure())
    return values


# ---------------------------------------------------------------------------------------------------
# Bootstrap


def resampled(values: Sequence[float], statistic: Statistic, *, resamples: int = RESAMPLES, seed: int = 0):
    """``statistic`` of each of ``resamples`` resamples (with replacement) of ``values``. [R]"""
    values = np.asarray(values, dtype=np.float64)  # [n]
    rng = np.random.default_rng(seed)
    rows = max(1, CHUNK_VALUES // len(values))
    parts = []
    for start in range(0, resamples, rows):
        picks = rng.integers(0, len(values), size=(min(rows, resamples - start), len(values)))  # [r, n]
        parts.append(statistic(values[picks], axis=1))  # [r]
    return np.concatenate(parts)  # [R]


def ends(statistics: np.ndarray) -> tuple[float, float]:
    """The 95% interval (low, high) of bootstrap statistics: their 2.5th and 97.5th percentiles. The
    interval of a difference is ``ends(resampled(a, ...) - resampled(b, ...))``."""
    tail = (1 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(statistics, [tail, 100 - tail])
    return float(low), float(high)


def interval(values: Sequence[float], statistic: Statistic = np.median, *, seed: int = 0):
    """The 95% percentile-bootstrap interval (low, high) of ``statistic`` over ``values``; None for
    fewer than 2 values (one value says nothing of the spread)."""
    if len(values) < 2:
        return None
    return ends(resampled(values, statistic, seed=seed))


def shown(value: float, low_high: Sequence[float] | None, digits: int = 2) -> str:
    """``value`` with ``digits`` decimals and, where there is one, its interval: ``1.41 [1.02, 1.77]``."""
    if low_high is None:
        return f"{value:.{digits}f}"
    low, high = low_high
    return f"{value:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}]"


def paired_difference(pairs: Sequence[tuple[float, float]], *, seed: int = 0) -> tuple[float, float] | None:
    """The 95% bootstrap interval of mean(a - b) over pairs measured on the same item (the loss of
    one prompt under two block sets): resampling the items, not each side apart, so what the items
    share cancels. None for fewer than 2 pairs."""
    if len(pairs) < 2:
        return None
    return interval([a - b for a, b in pairs], np.mean, seed=seed)


def significant(low_high: tuple[float, float] | None) -> bool | None:
    """Whether an interval of a difference excludes 0 (None: no interval)."""
    if low_high is None:
        return None
    low, high = low_high
    return low > 0 or high < 0


# ---------------------------------------------------------------------------------------------------
# Frontier


def dominates(q: tuple[float, float], p: tuple[float, float]) -> bool:
    """(x, y), lower is better on both: ``q`` no worse than ``p`` on either and better on one."""
    return q[0] <= p[0] and q[1] <= p[1] and q != p


def frontier(
    items: Sequence[T],
    x: Callable[[T], float],
    y: Callable[[T], float],
    beats: Callable[[T, T], bool] | None = None,
) -> list[T]:
    """The items no other beats, in order of ``x`` (lower is better on ``x`` and ``y``: latency and
    loss). ``beats(q, p)``: whether q rules p out; by default Pareto dominance on (x, y). One item
    that beats all others is a frontier of one."""
    beats = beats or (lambda q, p: dominates((x(q), y(q)), (x(p), y(p))))
    kept = [p for p in items if not any(q is not p and beats(q, p) for q in items)]
    return sorted(kept, key=lambda p: (x(p), y(p)))


# ---------------------------------------------------------------------------------------------------
# Where a load generator may point


def check_loopback(url: str, *, allow_remote: bool = False, allowed_by: str | None = None) -> None:
    """A load generator's target must be this machine unless ``allow_remote``; UserError otherwise,
    naming ``allowed_by``, the flag that allows a remote target, if the command has one."""
    host = urlparse(url).hostname or ""
    if not allow_remote and not is_loopback(host):
        hint = f"; pass {allowed_by} if you mean it" if allowed_by else ""
        raise UserError(f"{host or url!r} is not a loopback address{hint}")
