"""lab.flags: parsers from dataclasses and typed functions (jsonargparse) that read argparse's spellings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest
import torch
from jsonargparse.typing import PositiveInt

from lab import cli, flags
from lab.errors import UserError


@dataclass
class Options:
    """The options of a test command."""

    n_embd: int | None = None
    """Width of the stream."""
    T: tuple[int, ...] = (256, 1024)
    """Positions."""
    grid: list[str] | None = None
    """Axes NAME=V1,V2."""
    betas: tuple[float, float] = (0.9, 0.99)
    """Two rates."""
    json: bool = False
    """Print JSON."""
    bias: bool = True
    """Biases."""
    no_plot: bool = False
    """No PNG."""
    mode: Literal["skip", "both"] = "both"
    """Which ablation."""
    out: Path = Path("runs/x.png")
    """Where."""


def command(steps: int, seeds: tuple[int, ...] = (1,), quiet: bool = False) -> dict:
    """Train.

    Args:
        steps: Training steps per run.
        seeds: One run per seed.
        quiet: Print nothing.
    """
    return {"steps": steps, "seeds": seeds, "quiet": quiet}


def parse(*argv: str) -> dict:
    parser = flags.Parser("test")
    parser.add_options(Options)
    return parser.parse(list(argv)).as_dict()


def test_argparse_spellings_read_as_jsonargparse_reads_its_own():
    assert parse("--n-embd", "384") == parse("--n_embd", "384") == {**parse(), "n_embd": 384}
    assert parse("--T", "8", "16")["T"] == parse("--T", "[8, 16]")["T"] == parse("--T=[8,16]")["T"] == (8, 16)
    assert parse("--T=8")["T"] == (8,)
    assert parse("--grid", "lr=5e-4,1e-3", "warmup=0,25")["grid"] == ["lr=5e-4,1e-3", "warmup=0,25"]
    assert parse("--betas", "0.8", "0.9")["betas"] == (0.8, 0.9)
    assert parse("--json")["json"] is True and parse("--json", "false")["json"] is False
    assert parse("--json", "--no-plot")["no_plot"] is True
    assert parse("--no-bias")["bias"] is False and parse("--bias")["bias"] is True
    assert parse("--mode", "skip", "--out", "a/b.png")["out"] == Path("a/b.png")
    assert parse("--n-em", "3")["n_embd"] == 3  # an unambiguous abbreviation, as argparse takes it


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mode", "ablate"], "mode"),
        (["--T", "8", "x"], "Got value: x"),
        (["--betas", "1", "2", "3"], "2 elements"),
        (["--nope"], "unrecognized arguments: --nope"),
        (["--n-embd", "wide"], "n_embd"),
    ],
)
def test_a_bad_flag_or_value_is_a_user_error_naming_it(argv, message):
    with pytest.raises(UserError, match=message):
        parse(*argv)


def test_help_is_the_fields_docstrings(capsys):
    parser = flags.Parser("test", "A test command.")
    parser.add_options(Options, mode="skip")
    with pytest.raises(SystemExit) as exited:
        parser.parse(["--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    for text in (
        "A test command.",
        "Width of the stream.",
        "Axes NAME=V1,V2.",
        "default: skip",
        "--seeds 1 7",
    ):
        assert text in shown


def test_a_typed_function_is_a_command():
    assert flags.run(command, ["--steps", "3", "--seeds", "1", "7", "--quiet"], "test") == {
        "steps": 3,
        "seeds": (1, 7),
        "quiet": True,
    }
    with pytest.raises(UserError, match="steps"):
        flags.run(command, [], "test")
    assert "Training steps per run." in flags.command_parser(command, "test").format_help()


def test_a_script_prints_a_user_error_from_main_as_one_line(capsys):
    def main(rounds: int = 5) -> int:
        """A script.

        Args:
            rounds: Rounds.
        """
        raise UserError(f"--rounds {rounds}: at least\n    2")

    with pytest.raises(SystemExit) as exit_:
        flags.call(main, ["--rounds", "1"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith("--rounds 1: at least 2")


def test_options_make_the_dataclass():
    parser = flags.Parser("test")
    parser.add_options(Options)
    options = flags.options(Options, parser.parse(["--T", "4", "--json"]))
    assert options == Options(T=(4,), json=True)


def test_blocklab_tokenizer_writes_the_directory_and_refuses_no_out(tmp_path, capsys):
    assert cli.main(["tokenizer", "--out", str(tmp_path / "gpt2")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "gpt2")
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text()) == {"model_type": "gpt2"}
    assert cli.main(["tokenizer"]) == 2
    assert capsys.readouterr().err.strip() == "blocklab tokenizer: the following arguments are required: out"


@dataclass
class Counts:
    """Counts of a test command."""

    steps: PositiveInt = 3
    """Steps."""
    sizes: tuple[PositiveInt, ...] = (1,)
    """Sizes."""
    threads: PositiveInt | None = None
    """Threads."""


def test_counts_are_checked_and_come_out_as_plain_ints(tmp_path):
    """``PositiveInt`` checks a count; its value is a plain int afterwards, so it pickles into a
    checkpoint that ``torch.load(weights_only=True)`` reads back (a lens fit resumed failed on it)."""
    parsed = flags.parse(Counts, ["--steps", "5", "--sizes", "2", "7", "--threads", "2"], "test")
    assert (parsed.steps, parsed.sizes, parsed.threads) == (5, (2, 7), 2)
    assert {type(value) for value in (parsed.steps, *parsed.sizes, parsed.threads)} == {int}
    torch.save({"recipe": vars(parsed)}, tmp_path / "checkpoint.pt")
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["recipe"]["steps"] == 5
    for argv in (["--steps", "0"], ["--threads", "-2"], ["--sizes", "3", "0"]):
        with pytest.raises(UserError, match=r"must be a whole number of at least 1, got -?0|-2"):
            flags.parse(Counts, argv, "test")
