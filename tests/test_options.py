"""Command-line options from dataclasses (``lab.options``): jsonargparse's parsing, spelled as shells do."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from lab.options import parse, parser


@dataclass
class Options:
    recipe: Literal["plain", "early-exit"] = "plain"
    """Which recipe."""
    steps: int | None = None
    """Optimiser steps."""
    force: bool = False
    """Train again."""
    max_new_tokens: int = 3
    """Tokens per request."""
    block_sets: list[str] | None = None
    """Block set specs."""
    rates: list[float] = field(default_factory=list)
    """Request rates."""
    out: Path = Path("out")
    """Where results go."""


def test_defaults_and_types():
    assert parse(Options, [], "p", "d") == Options()
    options = parse(Options, ["--steps", "5", "--out", "x", "--recipe", "early-exit"], "p", "d")
    assert (options.steps, options.out, options.recipe) == (5, Path("x"), "early-exit")


def test_dashed_and_underscored_names():
    assert parse(Options, ["--max-new-tokens", "7"], "p", "d").max_new_tokens == 7
    assert parse(Options, ["--max_new_tokens=8"], "p", "d").max_new_tokens == 8


def test_booleans_stand_alone_or_take_a_value():
    assert parse(Options, ["--force"], "p", "d").force is True
    assert parse(Options, ["--force", "--steps", "2"], "p", "d").force is True
    assert parse(Options, ["--force", "false"], "p", "d").force is False


def test_lists_as_words_or_json():
    options = parse(
        Options, ["--block-sets", "all", "skip=3,4,5", "--rates", "1", "2.5", "--force"], "p", "d"
    )
    assert options.block_sets == ["all", "skip=3,4,5"] and options.rates == [1.0, 2.5] and options.force
    assert parse(Options, ["--block-sets", '["all", "exit=6"]'], "p", "d").block_sets == ["all", "exit=6"]
    assert parse(Options, ["--block-sets", "1"], "p", "d").block_sets == ["1"]  # words stay words


def test_bad_values_exit_with_the_usage(capsys):
    with pytest.raises(SystemExit) as raised:
        parse(Options, ["--steps", "many"], "p", "d")
    assert raised.value.code == 2
    assert "steps" in capsys.readouterr().err


def test_help_shows_field_docstrings_and_dashed_names():
    text = parser(Options, "prog", "What it does.").format_help()
    assert "--max-new-tokens" in text and "Tokens per request." in text and "What it does." in text
