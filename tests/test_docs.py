"""README.md and docs/*.md point only at what the repository holds, and their commands parse.

Every relative link resolves (a ``#fragment`` to a heading of the target), every mention of a path
under one of the repository's folders (``lab/stall/cli.py``, ``configs/stall/*.yaml``) names files
that exist, every ``*.md`` mentioned is a file of the repository, and every command shown for the
training lab, the measurements and the benchmark scripts parses with the flags written there.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from lab import flags

ROOT = Path(__file__).parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FOLDERS = ("lab", "serve", "scripts", "configs", "docs", "tests", ".ci")

LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(re.escape(f) for f in FOLDERS) + r")/[\w.*{},/-]*)")
MARKDOWN = re.compile(r"(?<![\w.-])(/?[\w./-]*\w\.md)\b")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]+\b")  # NAME, OUT, N_LAYER: stands for any name

COMMANDS = {  # the commands whose parsers the training lab and the measurements own
    "stall": "lab.stall.cli",
    **{name: f"lab.analysis.{name}" for name in ("shapes", "params", "flops", "bus", "ablate", "timing")},
    "depth": "lab.analysis.depth",
    "cost": "lab.analysis.cost",
}
SCRIPTS = (
    "bench_train", "bench_decode", "bench_speculate", "bench_all", "bench_intmm", "bench_kernel_change",
)  # fmt: skip


def slug(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> set[str]:
    return {slug(line.lstrip("#")) for line in path.read_text().splitlines() if line.startswith("#")}


def expand(pattern: str) -> list[str]:
    """``a/{b,c}.py`` -> ``a/b.py``, ``a/c.py``."""
    match = re.search(r"\{([^{}]*)\}", pattern)
    if match is None:
        return [pattern]
    return [
        expanded
        for part in match.group(1).split(",")
        for expanded in expand(pattern[: match.start()] + part + pattern[match.end() :])
    ]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_resolve(doc):
    for target in LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        path = (doc.parent / file) if file else doc
        assert path.exists(), f"{doc.name}: link to {target}: no {path.relative_to(ROOT)}"
        if fragment and path.suffix == ".md":
            assert fragment in headings(path), f"{doc.name}: link to {target}: no such heading"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_paths_mentioned_exist(doc):
    for mention in PATH.findall(doc.read_text()):
        mention = mention.rstrip(".,")
        for pattern in expand(PLACEHOLDER.sub("*", mention)):
            assert list(ROOT.glob(pattern.rstrip("/"))), (
                f"{doc.name} mentions {mention}: not in the repository"
            )


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_markdown_files_mentioned_are_in_the_repository(doc):
    for mention in MARKDOWN.findall(doc.read_text()):
        assert not mention.startswith("/"), f"{doc.name} cites {mention}, outside the repository"
        candidates = [ROOT / mention, doc.parent / mention, ROOT / "docs" / mention]
        assert any(path.is_file() for path in candidates), (
            f"{doc.name} cites {mention}: not in the repository"
        )


def shown_commands(text: str) -> list[str]:
    """Every command line of the docs: a line of a code block (of a console block, a line after the
    prompt ``$``; the others are output), or an inline code span, that starts with ``blocklab`` or
    ``python scripts/``, its trailing comment cut."""
    spans = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        lines = block.splitlines()
        prompted = [line[2:] for line in lines if line.startswith("$ ")]
        spans += prompted or lines
    spans += [span.replace("\n", " ") for span in re.findall(r"(?<!`)`([^`]+)`(?!`)", text)]
    commands = []
    for span in spans:
        span = span.strip()
        if span.startswith(("blocklab ", "python scripts/")) and not span.endswith("\\"):
            commands.append(span.split(" #")[0].strip())
    return commands


def parser_of(command: list[str]):
    """The parser a shown command goes through (None: not one of the commands this test reads)."""
    if command[0] == "blocklab" and command[1] in COMMANDS:
        module = importlib.import_module(COMMANDS[command[1]])
        return (lambda argv: module.parse(argv)) if command[1] == "stall" else module.parser().parse
    script = re.fullmatch(r"scripts/(\w+)\.py", command[1])
    if command[0] == "python" and script and script.group(1) in SCRIPTS:
        spec = importlib.util.spec_from_file_location(script.group(1), ROOT / command[1])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return flags.script_parser(module.main).parse
    return None


def concrete(command: str) -> bool:
    """A command as typed, not a pattern: no NAME placeholders, alternatives, ellipses or shell, and
    not one that prints its help and exits."""
    pattern = PLACEHOLDER.search(command) or re.search(r"[|\[\]$]|\.\.\.|[<>]", command)
    return not pattern and "--help" not in command


def test_the_docs_show_commands_of_every_kind():
    shown = [shlex.split(c) for doc in DOCS for c in shown_commands(doc.read_text()) if concrete(c)]
    names = {c[1] for c in shown if c[0] == "blocklab"} | {c[1] for c in shown if c[0] == "python"}
    assert set(COMMANDS) <= names and {f"scripts/{s}.py" for s in SCRIPTS} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_shown_commands_parse(doc):
    for shown in shown_commands(doc.read_text()):
        if not concrete(shown):
            continue
        command = shlex.split(shown)
        parse = parser_of(command)
        if parse is not None:
            parse(command[2:])  # raises UserError naming the flag that does not parse
