"""Prefills a row copies instead of computing again: of rows running beside it, and of rows that ended.

A prompt's prefill writes its keys and values chunk by chunk (``serve.engine``: whole chunks of
``prefill_chunk`` tokens from position 0, the boundaries set by the prompt alone). Two rows that feed
the same tokens through the same blocks therefore compute the same chunks on the same inputs, and
get the same bits, whatever path the model's products take. So a row may copy, instead of computing:

- every position, the stream leaving the last one and the losses, from a prefill of the same tokens
  (``Prefill.usable``: and of the same loss targets when the row scores them);
- else the longest run of whole chunks it shares with a prefill and that leaves it a token of its own
  (and, when it scores, the target after the run too: a chunk's losses read the token after it); it
  then prefills the rest as it would have.

Rows that ended leave their prefill in a ``PromptCache``, the most recently used kept within a byte
budget (vLLM's automatic prefix caching, at the granularity of prefill chunks).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

import torch


def copies_whole(
    tokens: list[int], targets: list[int], reader: Hashable,
    prefill_tokens: tuple[int, ...], prefill_targets: tuple[int, ...] | None, prefill_reader: Hashable,
) -> bool:  # fmt: skip
    """Whether a row feeding ``tokens`` and scoring ``targets`` through ``reader`` (no targets: it does
    not score) copies the whole of a prefill of ``prefill_tokens`` that scored ``prefill_targets``
    through ``prefill_reader`` (None: it did not score): the same tokens, and, when the row scores,
    the same targets read out the same way."""
    if tuple(tokens) != tuple(prefill_tokens):
        return False
    return not targets or (prefill_targets == tuple(targets) and prefill_reader == reader)


@dataclass(frozen=True)
class Prefill:
    """One prompt's prefill: under ``setting`` (its blocks and the blocks that overwrite), the tokens
    fed, their keys and values [L, 1, H, T, Dh] each, the stream leaving the last position [D], and,
    when it scored them, its loss targets, what its losses are read out through (``reader``: the
    tuned lens's translator, or None) and the losses of each chunk (``serve.engine._scores``' [n, 3])."""

    setting: Hashable
    tokens: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    last_stream: torch.Tensor
    targets: tuple[int, ...] | None
    reader: Hashable
    chunk_scores: tuple[torch.Tensor, ...] | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.last_stream))

    def kept(self) -> Prefill:
        """A copy of its own (a row's cache is freed when it ends; a view would keep all of it)."""
        keys, values = self.keys.clone(), self.values.clone()
        last, scores = self.last_stream.clone(), self.chunk_scores
        return Prefill(self.setting, self.tokens, keys, values, last, self.targets, self.reader, scores)

    def usable(self, tokens: list[int], targets: list[int], reader: Hashable, chunk: int) -> int:
        """How many of a row's first positions it copies from this prefill, the row feeding ``tokens``
        in chunks of ``chunk`` and scoring ``targets`` through ``reader`` (no targets: it does not
        score): len(tokens) when they are this prefill's (and so are the targets, when it scores);
        else a whole number of chunks that both feed, that leaves the row a token, and whose losses,
        if it scores, read targets both have; 0 for none."""
        if targets and (self.chunk_scores is None or reader != self.reader):
            return 0
        if copies_whole(tokens, targets, reader, self.tokens, self.targets, self.reader):
            return len(tokens)
        shared = 0
        for mine, theirs in zip(tokens, self.tokens, strict=False):
            if mine != theirs:
                break
            shared += 1
        room = min(shared - 1 if targets else shared, len(tokens) - 1)  # a chunk's losses read one more
        return room // chunk * chunk


class PromptCache:
    """The prefills of rows that ended, at most ``max_bytes`` of them: the least recently used go
    first. Found by their setting and first ``chunk`` tokens (a copy shares at least those)."""

    def __init__(self, max_bytes: int, chunk: int):
        self.max_bytes = max_bytes
        self.chunk = chunk
        self.prefills: OrderedDict[tuple[Hashable, tuple[int, ...]], Prefill] = OrderedDict()
        self.starts: dict[tuple[Hashable, tuple[int, ...]], dict[tuple, None]] = {}  # -> their keys
        self.nbytes = 0

    def keep(self, prefill: Prefill) -> int:
        """Keep ``prefill`` (unless it alone is over the budget), dropping the least recently used
        past it; the change in the bytes kept."""
        before = self.nbytes
        if prefill.nbytes > self.max_bytes:
            return 0
        key = (prefill.setting, prefill.tokens)
        if key in self.prefills:
            old = self.prefills.pop(key)
            self.nbytes -= old.nbytes
            if old.chunk_scores is not None and prefill.chunk_scores is None:
                prefill = old  # the one with losses serves rows that score too
        self.prefills[key] = prefill
        self.starts.setdefault(self._start(key), {})[key] = None
        self.nbytes += prefill.nbytes
        while self.nbytes > self.max_bytes:
            evicted_key, evicted = self.prefills.popitem(last=False)
            self.nbytes -= evicted.nbytes
            keys = self.starts[self._start(evicted_key)]
            del keys[evicted_key]
            if not keys:
                del self.starts[self._start(evicted_key)]
        return self.nbytes - before

    def _start(self, key: tuple[Hashable, tuple[int, ...]]) -> tuple[Hashable, tuple[int, ...]]:
        setting, tokens = key
        return setting, tokens[: self.chunk]

    def beginning(self, setting: Hashable, first: list[int]) -> list[Prefill]:
        """The prefills kept under ``setting`` whose first chunk is ``first``."""
        return [self.prefills[key] for key in self.starts.get((setting, tuple(first[: self.chunk])), ())]

    def used(self, prefill: Prefill) -> None:
        """Mark ``prefill`` (one of these) as the most recently used."""
        key = (prefill.setting, prefill.tokens)
        if self.prefills.get(key) is prefill:
            self.prefills.move_to_end(key)
