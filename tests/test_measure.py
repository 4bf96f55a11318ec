"""lab.measure: latency statistics, bootstrap intervals that cover what they should and narrow with n,
significance of a difference, the frontier, the loopback check."""

import numpy as np
import pytest

from lab.errors import UserError
from lab.measure import (
    check_loopback,
    ends,
    frontier,
    interleaved,
    interval,
    is_loopback,
    latency_ms,
    paired_difference,
    resampled,
    significant,
)


def test_latency_statistics_in_milliseconds():
    stats = latency_ms([0.1, 0.2, 0.3, 0.4], quantiles=(50, 99))
    assert stats["n"] == 4 and stats["mean"] == pytest.approx(250.0) and stats["p50"] == pytest.approx(250.0)
    assert stats["max"] == pytest.approx(400.0) and 390.0 < stats["p99"] < 400.0
    assert latency_ms([]) == {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_the_interval_covers_a_known_median_about_95_times_in_100():
    rng = np.random.default_rng(0)
    median = float(np.exp(1.0))  # of a lognormal(1, 0.5): skewed, like latencies
    covered = 0
    for trial in range(100):
        low, high = interval(rng.lognormal(1.0, 0.5, size=41), np.median, seed=trial)
        covered += low <= median <= high
    assert 88 <= covered <= 100


def test_the_interval_narrows_as_one_over_root_n():
    rng = np.random.default_rng(1)
    widths = {}
    for n in (100, 1600):
        trials = [interval(rng.lognormal(1.0, 0.5, size=n), np.median, seed=n) for _ in range(10)]
        widths[n] = np.mean([high - low for low, high in trials])
    assert widths[1600] / widths[100] == pytest.approx(0.25, rel=0.35)  # sqrt(100 / 1600)


def test_resampling_is_seeded_and_needs_two_values():
    values = np.arange(50.0)
    assert np.array_equal(resampled(values, np.median, seed=3), resampled(values, np.median, seed=3))
    assert not np.array_equal(resampled(values, np.median, seed=3), resampled(values, np.median, seed=4))
    assert interval([1.0], np.median) is None and paired_difference([(1.0, 2.0)]) is None


def test_a_difference_is_significant_only_when_there_is_one():
    rng = np.random.default_rng(2)
    same = [rng.lognormal(1.0, 0.5, size=60) for _ in range(2)]
    shifted = rng.lognormal(1.0, 0.5, size=60) * 1.5
    for seed in range(5):
        a, b = resampled(same[0], np.median, seed=seed), resampled(same[1], np.median, seed=seed + 100)
        assert significant(ends(a - b)) is False
    low, high = ends(resampled(shifted, np.median, seed=0) - resampled(same[0], np.median, seed=1))
    assert significant((low, high)) and low > 0
    assert significant(None) is None


def test_pairs_find_a_shift_the_two_intervals_hide():
    """The loss of each prompt under two block sets: the prompts differ far more than the sets do, so
    the sets' intervals overlap, while the interval of the paired difference excludes 0."""
    rng = np.random.default_rng(3)
    prompts = rng.normal(6.0, 1.0, size=40)
    base, worse = prompts + rng.normal(0, 0.01, 40), prompts + 0.05 + rng.normal(0, 0.01, 40)
    (base_low, base_high), (worse_low, worse_high) = interval(base, np.mean), interval(worse, np.mean)
    assert worse_low < base_high and base_low < worse_high  # they overlap
    low, high = paired_difference(list(zip(worse, base, strict=True)))
    assert significant((low, high)) and 0.04 < low < 0.05 < high < 0.06


def test_the_frontier_keeps_what_nothing_beats_and_one_that_beats_all():
    points = {"all": (1.0, 2.0), "a": (0.5, 2.5), "b": (0.6, 3.0), "c": (0.2, 4.0)}
    x, y = (lambda name: points[name][0]), (lambda name: points[name][1])
    assert frontier(list(points), x, y) == ["c", "a", "all"]  # b is slower and worse than a
    points["best"] = (0.1, 1.0)
    assert frontier(list(points), x, y) == ["best"]  # a frontier of one
    nobody_beats = frontier(list(points), x, y, beats=lambda q, p: False)
    assert nobody_beats == ["best", "c", "a", "b", "all"]


def test_only_loopback_targets_unless_allowed():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("example.com")
    check_loopback("http://127.0.0.1:8000")
    check_loopback("http://10.0.0.5:8000", allow_remote=True)
    with pytest.raises(UserError, match=r"'10.0.0.5' is not a loopback address; pass --allow-remote"):
        check_loopback("http://10.0.0.5:8000", allowed_by="--allow-remote")
    with pytest.raises(UserError, match=r"is not a loopback address$"):
        check_loopback("http://example.com")


def test_interleaved_warms_up_each_then_takes_every_measurement_once_per_round():
    calls = []

    def measure(name):
        return lambda: calls.append(name) or float(len(calls))

    values = interleaved({"a": measure("a"), "b": measure("b")}, rounds=2)
    assert calls == ["a", "b"] * 3  # a warm-up call of each, then two rounds in turn
    assert values == {"a": [3.0, 5.0], "b": [4.0, 6.0]}  # the warm-up's values are not kept


def test_one_round_is_refused_before_anything_is_measured():
    calls = []
    with pytest.raises(UserError, match="at least 2"):
        interleaved({"a": lambda: calls.append("a") or 1.0}, rounds=1)
    assert calls == []
