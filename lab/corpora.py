"""The texts every CPython install carries, so that nothing is downloaded.

- ``embedded_corpus()``: the pydoc help topics (~465 KB of English technical prose), for
  character-level work (``lab.data``).
- ``stdlib_files()``: the standard library's own ``.py`` source, for GPT-2-token work (the builtin
  model's corpus, ``lab.token_data``); ``held_out_stdlib_files()`` the files it keeps out of training.

No Lightning here: the measurement commands read these texts and start in a fraction of a second.
"""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

TEST_DIRS = {"test", "tests", "idle_test"}
"""Directories of the standard library that hold its test suites, left out of the corpus: they are
half its size and much of it is data (long literal tables) rather than code."""

HELD_OUT_EVERY = 20
"""Every 20th file of the standard library (in sorted order) is held out of training for validation."""


def embedded_corpus() -> str:
    """The help-topic text that ships with every CPython (~465 KB), topics joined in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))


def stdlib_files(max_files: int | None = None) -> list[Path]:
    """The standard library's ``.py`` files (no site-packages, no test suites), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"site-packages", "__pycache__", *TEST_DIRS}
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in excluded]  # prune: site-packages is large
        found += [Path(directory, name) for name in names if name.endswith(".py")]
    files = sorted(found, key=lambda p: p.relative_to(root).as_posix())
    return files[:max_files] if max_files is not None else files


def held_out_stdlib_files() -> list[Path]:
    """The standard-library files the builtin model never trains on (its validation split)."""
    return stdlib_files()[::HELD_OUT_EVERY]


def held_out_snippets(count: int, seed: int = 0) -> list[str]:
    """``count`` pieces of held-out standard-library source (the text between two blank lines, 80 to
    2000 characters: a function, a class, a block of statements), drawn with ``seed``: code the builtin
    model never trained on, of the lengths requests have."""
    import random

    pieces = [
        piece.strip("\n")
        for path in held_out_stdlib_files()
        for piece in path.read_text(encoding="utf-8", errors="replace").split("\n\n")
        if 80 <= len(piece.strip()) <= 2000
    ]
    return random.Random(seed).sample(pieces, min(count, len(pieces)))
