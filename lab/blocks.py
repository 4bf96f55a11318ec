"""Block sets: which Blocks run, and how, for one call. Chosen per call; the weights never reload.

A spec string names a block set on the command line, in the server and in the traffic tool:

    all                 every block
    skip=3,4            blocks 3 and 4 let the stream pass through unchanged (pruning)
    keep=0,1,2          only these blocks run; the others pass the stream through
    overwrite=5         block 5's output is its own writes (attn_out + mlp_out), not stream + writes
    exit=6              run blocks 0..5, then ln_f and the unembedding (logit lens)
    adaptive=0.9        per token, stop once the prediction is judged stable (see lab.generate)
    adaptive=0.9;min=4  ... never before 4 blocks
    adaptive=0.9;check=probe   ... judged by the model's learned exit probe (lab.exit_probe)
    speculate=6         self-speculative decoding: blocks 0..5 draft, the rest verify; the output is
                        the set's own (see lab.speculate.Speculator)
    speculate=6;k=3     ... drafting 3 tokens a round
    speculate=6;vocab=2048  ... the drafts read out over the 2048 tokens the model most often
                        predicts (its tuned lens's ranking, fitted by ``blocklab lens fit``)
    exit=6;lens=tuned   read out through the tuned lens's translator of the exit block (lab.lens):
                        also adaptive=...;lens=tuned, and speculate=6;lens=tuned (the drafts)

The grammar, the same in every place, with the rules of the ``BlockSet`` fields:

    spec      'all', or parts joined by ';': key=value, each key at most once
    index     skip, keep, overwrite: one or more block indices joined by ',', none twice; each
              index ASCII digits only (no sign, '_' or other scripts' digits)
    count     exit, min, speculate, k, vocab: ASCII digits only
    number    adaptive: ASCII digits with an optional fraction and exponent (0.9, .5, 1e-3)
    choice    check: cosine | probe; lens: logit | tuned
    together  skip or keep, not both; min and check only with adaptive; exit not with adaptive;
              k and vocab only with speculate; speculate not with exit or adaptive; min at most the blocks
              the set runs (``keep=0,1;adaptive=0.9;min=3`` is refused)
    serves    what a set cannot give a request (``Key.cannot_serve``): adaptive exit no most likely
              token per scored position (OpenAI's ``logprobs`` 1), speculate no ``min_tokens``
    spaces    ignored around parts, keys, values and indices (' skip = 3, 4 ; exit=9'), refused inside

``KEYS`` is that grammar as a table (spec key, ``BlockSet`` field, kind, default, the ``/predict``
field, bounds, what a key needs and excludes): parsing, ``str()``, validation, the errors and the
server's request fields (``serve.schema``) all read it. ``str(BlockSet)`` writes the canonical spec
(sorted indices, no spaces, defaults left out), which parses back to an equal set. Errors are
``BlockSetError``, which carries the key at fault: a spec names the part as written, e.g.
``'skip=1,,2': empty index in skip``; a ``BlockSet`` checked against the model's depth names its field.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["index", "count", "number", "choice"]


@dataclass(frozen=True)
class Key:
    """One key of the spec grammar and the ``BlockSet`` field it sets."""

    key: str
    """As written in a spec: ``exit=6``."""
    field: str
    """The ``BlockSet`` field (keep: ``BlockSet.keep``'s argument, the complement of skip)."""
    kind: Kind
    default: object
    """The field's value when the key is not given."""
    request: str | None
    """The field of a ``/predict`` body that names it too (None: only in a spec)."""
    help: str
    noun: str
    """What an error calls it."""
    metavar: str = "N"
    """What its value is, in an error that asks for it."""
    low: float | None = None
    """count: the least value; number: the value it must exceed."""
    high: float | None = None
    """count, number: the largest value (a count without one is bounded by the model's depth)."""
    choices: tuple[str, ...] = ()
    needs: str | None = None
    """The key it is meaningful only with."""
    excludes: tuple[str, ...] = ()
    """Keys it cannot be given with."""
    cannot_serve: tuple[tuple[str, str], ...] = ()
    """(option, why): what a request may ask for that a set with this key cannot give
    (``BlockSet.cannot_serve``): the server refuses it before running it."""


VOCABULARY_BOUND = 1 << 20
"""The largest ``vocab=N`` a spec may give: above any token table (a larger N than the model's
ranking holds drafts over the whole ranking)."""

KEYS: dict[str, Key] = {
    key.key: key
    for key in (
        Key("skip", "skip", "index", frozenset(), "skip", "Blocks that pass the stream through.", "skip"),
        Key(
            "keep", "keep", "index", None, "keep",
            "Only these blocks run; the others pass the stream through.",
            "keep", excludes=("skip",),
        ),
        Key(
            "overwrite", "overwrite", "index", frozenset(), "overwrite",
            "Blocks whose output is their own writes, not stream + writes.", "overwrite",
        ),
        Key(
            "exit", "exit_at", "count", None, "exit_at", "Run blocks 0..exit_at-1, then read out.", "exit",
            low=1, excludes=("adaptive",),
        ),
        Key(
            "adaptive", "adaptive_threshold", "number", None, "adaptive",
            "Adaptive exit: stop a token once its check reaches this threshold.", "adaptive exit",
            "THRESHOLD", low=0.0, high=1.0,
            cannot_serve=(("top_tokens", "its scoring pass gives each position's loss, not its most likely "
                           "token"),),
        ),
        Key(
            "min", "adaptive_min_blocks", "count", 1, "adaptive_min_blocks",
            "Adaptive exit never stops a token before this many blocks.", "min", low=1, needs="adaptive",
        ),
        Key(
            "check", "adaptive_check", "choice", "cosine", "adaptive_check",
            "What the threshold applies to: cosine (state saturation) or the exit probe.", "check",
            choices=("cosine", "probe"), needs="adaptive",
        ),
        Key(
            "speculate", "speculate", "count", None, None,
            "Self-speculative decoding: the blocks below this one draft, the rest verify.", "speculate",
            "BLOCK", excludes=("exit", "adaptive"),
            cannot_serve=(("min_tokens", "drafts are drawn without it"),),
        ),
        Key(
            "k", "draft_tokens", "count", 4, None, "Tokens drafted per round when speculating.", "k",
            low=1, high=16, needs="speculate",
        ),
        Key(
            "vocab", "draft_vocabulary", "count", None, None,
            "Drafts read out over this many tokens only: the first of the model's tuned-lens ranking "
            "(its most frequent final tokens); verification reads every token.", "vocab",
            low=1, high=VOCABULARY_BOUND, needs="speculate",
        ),
        Key(
            "lens", "lens", "choice", "logit", "lens",
            "The read-out at an exit (exit, adaptive, a draft): logit (as is) or tuned (the model's "
            "tuned-lens translator of the exit block first).", "lens", choices=("logit", "tuned"),
        ),
    )
}  # fmt: skip
"""The grammar's keys, in the order ``str()`` writes them."""

# [0-9], not \d and not int() alone: both also take other scripts' digits, and int() takes '+6' and '1_2'
_INDEX = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


class BlockSetError(ValueError):
    """A block set that cannot be run. ``key`` is the ``KEYS`` entry at fault (None: the spec as a
    whole), ``reason`` what is wrong with it. The message names the part of a spec as written, else
    the ``BlockSet`` field."""

    def __init__(self, key: Key | None, reason: str, part: str | None = None):
        self.key = key
        self.reason = reason
        super().__init__(f"{part!r}: {reason}" if part is not None else f"{key.field}: {reason}")


def _parse_value(key: Key, value: str, part: str) -> object:
    """The value of one ``key=value`` part, by the key's kind; BlockSetError naming the part."""
    if key.kind == "index":
        indices = []
        for item in (item.strip(" ") for item in value.split(",")):
            if not item:
                raise BlockSetError(key, f"empty index in {key.key}", part)
            if not _INDEX.fullmatch(item):
                raise BlockSetError(key, f"{item!r} is not a block index (ASCII digits) in {key.key}", part)
            indices.append(int(item))
        return indices
    if key.kind == "count":
        if not _INDEX.fullmatch(value):
            raise BlockSetError(key, f"{key.key} takes a whole number in ASCII digits, got {value!r}", part)
        return int(value)
    if key.kind == "number":
        if not _NUMBER.fullmatch(value):
            raise BlockSetError(key, f"{key.key} takes a decimal number such as 0.9, got {value!r}", part)
        return float(value)
    if value not in key.choices:
        raise BlockSetError(key, f"{key.key} is {' or '.join(map(repr, key.choices))}, got {value!r}", part)
    return value


def check_together(given: Iterable[str]) -> None:
    """BlockSetError unless the keys ``given`` (spec keys) may be given together (``Key.needs`` and
    ``Key.excludes``); the key at fault is the one that needs or excludes."""
    given = set(given)
    for key in KEYS.values():
        if key.key not in given:
            continue
        if key.needs is not None and key.needs not in given:
            needed = KEYS[key.needs]
            raise BlockSetError(key, f"only with {needed.key}={needed.metavar}")
        for other in key.excludes:
            if other in given:
                raise BlockSetError(key, f"cannot be combined with {KEYS[other].noun}")


def _distinct(key: Key, indices: Iterable[int]) -> frozenset[int]:
    seen: set[int] = set()
    for i in indices:
        if i in seen:
            raise BlockSetError(key, f"duplicated block index {i} in {key.key}")
        seen.add(i)
    return frozenset(seen)


@dataclass(frozen=True)
class BlockSet:
    """Which Blocks run in one call. Indices count from 0. The fields' rules are ``KEYS``."""

    skip: frozenset[int] = field(default_factory=frozenset)
    overwrite: frozenset[int] = field(default_factory=frozenset)
    exit_at: int | None = KEYS["exit"].default
    """Run blocks 0..exit_at-1, then read out. None runs to the top."""
    adaptive_threshold: float | None = KEYS["adaptive"].default
    """Adaptive exit: stop a token once its stability score reaches this (0, 1]. None: off."""
    adaptive_min_blocks: int = KEYS["min"].default
    """Adaptive exit never stops a token before this many blocks."""
    adaptive_check: str = KEYS["check"].default
    """What the threshold applies to: 'cosine' (state saturation, any model) or 'probe' (the
    probability of the model's exit probe, lab.exit_probe)."""
    speculate: int | None = KEYS["speculate"].default
    """Self-speculative decoding: the set's blocks below this one draft tokens (read out through
    ln_f and the unembedding), the rest verify them in one pass. None: off. The tokens are the set's."""
    draft_tokens: int = KEYS["k"].default
    """Tokens drafted per round when speculating."""
    draft_vocabulary: int | None = KEYS["vocab"].default
    """Speculating, the drafts are read out over the first this many tokens of the model's
    tuned-lens ranking only (a cheaper read-out, FR-Spec's frequency-ranked draft vocabulary); the
    verification reads every token, so the output is the same. None: over every token."""
    lens: str = KEYS["lens"].default
    """How a stream that leaves before the last block is read out: 'logit' (``ln_f`` and the
    unembedding, as is) or 'tuned' (first the model's tuned-lens translator of the last block it ran,
    ``lab.lens``): an exit, an adaptive exit, a speculation's drafts; the final block has none."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip", frozenset(self.skip))
        object.__setattr__(self, "overwrite", frozenset(self.overwrite))

    @classmethod
    def keep(cls, keep: set[int] | list[int], n_layer: int, **kwargs) -> BlockSet:
        """Only ``keep`` runs; every other block of ``n_layer`` is skipped."""
        key = KEYS["keep"]
        kept = _distinct(key, keep)
        if not kept:
            raise BlockSetError(key, "needs at least one block")
        _check_indices(key, kept, n_layer)
        return cls(skip=frozenset(range(n_layer)) - kept, **kwargs)

    @classmethod
    def from_values(cls, values: dict[str, object], n_layer: int) -> BlockSet:
        """A validated set from values by spec key (lists of indices for skip, keep, overwrite), as a
        spec or a request gives them; BlockSetError naming the key at fault."""
        check_together(values)
        fields = {}
        for name, value in values.items():
            key = KEYS[name]
            fields[key.field] = _distinct(key, value) if key.kind == "index" else value
        keep = fields.pop("keep", None)
        if keep is not None:
            return cls.keep(keep, n_layer, **fields).validate(n_layer)
        return cls(**fields).validate(n_layer)

    @property
    def is_adaptive(self) -> bool:
        return self.adaptive_threshold is not None

    @property
    def is_speculative(self) -> bool:
        return self.speculate is not None

    def without_speculation(self) -> BlockSet:
        """The set whose output speculation reproduces (what scoring under this set measures)."""
        return BlockSet(skip=self.skip, overwrite=self.overwrite)

    def given(self) -> dict[str, object]:
        """The fields that differ from their defaults, by spec key, in ``KEYS``' order."""
        values = {key.key: getattr(self, key.field) for key in KEYS.values() if key.key != "keep"}
        return {name: value for name, value in values.items() if value != KEYS[name].default}

    def validate(self, n_layer: int) -> BlockSet:
        """BlockSetError naming the field when this set does not fit a model of ``n_layer`` blocks."""
        check_together(self.given())
        for name, value in self.given().items():
            _check_value(KEYS[name], value, n_layer)
        both = sorted(self.skip & self.overwrite)
        if both:
            raise BlockSetError(KEYS["overwrite"], f"blocks {both} are also skipped")
        runs = len(self.blocks_to_run(n_layer))
        if self.is_adaptive and runs == 0:
            raise BlockSetError(KEYS["adaptive"], "needs at least one block to run")
        if self.is_adaptive and self.adaptive_min_blocks > runs:  # the set's blocks, not the model's
            raise BlockSetError(
                KEYS["min"], f"must be at most the {runs} blocks the set runs, got {self.adaptive_min_blocks}"
            )
        if self.is_speculative:
            blocks = self.blocks_to_run(n_layer)
            if not any(i < self.speculate for i in blocks) or not any(i >= self.speculate for i in blocks):
                raise BlockSetError(
                    KEYS["speculate"],
                    f"the set needs blocks both below and from {self.speculate} "
                    f"(drafting and verifying), in 1..{n_layer - 1}",
                )
        return self

    def cannot_serve(self, option: str) -> str | None:
        """Why this set cannot give ``option`` (a name in ``Key.cannot_serve``: ``top_tokens``,
        ``min_tokens``), or None when it can."""
        for name in self.given():
            for refused, why in KEYS[name].cannot_serve:
                if refused == option:
                    return f"not with {name} ({why})"
        return None

    def blocks_to_run(self, n_layer: int) -> list[int]:
        """The block indices a fixed (non-adaptive) pass runs, in order."""
        top = n_layer if self.exit_at is None else self.exit_at
        return [i for i in range(top) if i not in self.skip]

    @classmethod
    def parse(cls, spec: str, n_layer: int) -> BlockSet:
        """A validated BlockSet for a model of ``n_layer`` blocks from a spec string (the grammar in
        the module docstring); BlockSetError naming the part at fault."""
        if spec.strip(" ") == "all":
            return cls()
        if not spec.strip(" "):
            raise BlockSetError(None, "empty spec (every block is 'all')", spec)
        values: dict[str, object] = {}
        parts: dict[str, str] = {}  # key -> its part as written, to name it in errors
        for part in (part.strip(" ") for part in spec.split(";")):
            name, sep, value = (text.strip(" ") for text in part.partition("="))
            if not part:
                raise BlockSetError(None, "empty part (parts are key=value joined by ';')", spec)
            if part == "all":
                raise BlockSetError(None, "'all' stands alone", spec)
            if not sep:
                raise BlockSetError(None, "expected key=value", part)
            if name not in KEYS:
                raise BlockSetError(None, f"unknown key {name!r} (known: {', '.join(KEYS)})", part)
            if name in parts:
                raise BlockSetError(KEYS[name], f"{name} given twice (also {parts[name]!r})", part)
            if not value:
                raise BlockSetError(KEYS[name], f"{name} needs a value", part)
            values[name], parts[name] = _parse_value(KEYS[name], value, part), part
        try:
            return cls.from_values(values, n_layer)
        except BlockSetError as error:  # say the part as written
            raise BlockSetError(error.key, error.reason, parts.get(error.key.key, spec)) from None

    def __str__(self) -> str:
        parts = [f"{name}={_format(KEYS[name], value)}" for name, value in self.given().items()]
        return ";".join(parts) or "all"


def _check_indices(key: Key, indices: frozenset[int], n_layer: int) -> None:
    bad = sorted(i for i in indices if not 0 <= i < n_layer)
    if bad:
        raise BlockSetError(key, f"block indices {bad} out of range 0..{n_layer - 1}")


def _check_value(key: Key, value: object, n_layer: int) -> None:
    """One given field's bounds (``Key.low``, ``Key.high``, the depth, the choices)."""
    if key.kind == "index":
        _check_indices(key, value, n_layer)
    elif key.kind == "count" and key.low is not None:
        high = n_layer if key.high is None else int(key.high)
        if not key.low <= value <= high:
            raise BlockSetError(key, f"must be in {key.low}..{high}, got {value}")
    elif key.kind == "number" and not key.low < value <= key.high:
        raise BlockSetError(key, f"must be in ({key.low:g}, {key.high:g}], got {value}")
    elif key.kind == "choice" and value not in key.choices:
        raise BlockSetError(key, f"{' or '.join(map(repr, key.choices))}, got {value!r}")


def _format(key: Key, value: object) -> str:
    if key.kind == "index":
        return ",".join(map(str, sorted(value)))
    if key.kind == "number":
        return repr(float(value))  # the shortest exact form
    return str(value)
