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
                        the set's own (see lab.generate.Speculator)
    speculate=6;k=3     ... drafting 3 tokens a round (default 4)

The grammar, the same in every place, with the rules of the ``BlockSet`` fields:

    spec      'all', or parts joined by ';': key=value, each key at most once
    indices   skip, keep, overwrite: one or more block indices joined by ',', none twice
    index     exit, min, speculate, k and each block index: ASCII digits only (no sign, '_' or other
              scripts' digits)
    number    adaptive: ASCII digits with an optional fraction and exponent (0.9, .5, 1e-3)
    check     cosine | probe
    together  skip or keep, not both; min and check only with adaptive; exit not with adaptive;
              k only with speculate; speculate not with exit or adaptive
    spaces    ignored around parts, keys, values and indices (' skip = 3, 4 ; exit=9'), refused inside

``str(BlockSet)`` writes the canonical spec (sorted indices, no spaces, defaults left out), which
parses back to an equal set. Errors name the part at fault, e.g. ``'skip=1,,2': empty index in skip``;
``BlockSet`` fields are validated against the model's depth, naming the field at fault.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# spec key -> BlockSet field (keep is BlockSet.keep's argument)
_FIELDS = {
    "skip": "skip",
    "keep": "keep",
    "overwrite": "overwrite",
    "exit": "exit_at",
    "adaptive": "adaptive_threshold",
    "min": "adaptive_min_blocks",
    "check": "adaptive_check",
    "speculate": "speculate",
    "k": "draft_tokens",
}
# [0-9], not \d and not int() alone: both also take other scripts' digits, and int() takes '+6' and '1_2'
_INDEX = re.compile(r"[0-9]+")
_NUMBER = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
_CHECKS = ("cosine", "probe")


def _parse_value(key: str, value: str, part: str) -> object:
    """The value of one ``key=value`` part; ValueError naming the part."""
    if key in ("skip", "keep", "overwrite"):
        indices = []
        for item in (item.strip(" ") for item in value.split(",")):
            if not item:
                raise ValueError(f"{part!r}: empty index in {key}")
            if not _INDEX.fullmatch(item):
                raise ValueError(f"{part!r}: {item!r} is not a block index (ASCII digits) in {key}")
            if int(item) in indices:
                raise ValueError(f"{part!r}: duplicated block index {int(item)} in {key}")
            indices.append(int(item))
        return tuple(indices)
    if key in ("exit", "min", "speculate", "k"):
        if not _INDEX.fullmatch(value):
            raise ValueError(f"{part!r}: {key} takes a whole number in ASCII digits, got {value!r}")
        return int(value)
    if key == "adaptive":
        if not _NUMBER.fullmatch(value):
            raise ValueError(f"{part!r}: adaptive takes a decimal number such as 0.9, got {value!r}")
        return float(value)
    if value not in _CHECKS:
        raise ValueError(f"{part!r}: check is 'cosine' or 'probe', got {value!r}")
    return value


@dataclass(frozen=True)
class BlockSet:
    """Which Blocks run in one call. Indices count from 0."""

    skip: frozenset[int] = field(default_factory=frozenset)
    overwrite: frozenset[int] = field(default_factory=frozenset)
    exit_at: int | None = None
    """Run blocks 0..exit_at-1, then read out. None runs to the top."""
    adaptive_threshold: float | None = None
    """Adaptive exit: stop a token once its stability score reaches this (0, 1]. None: off."""
    adaptive_min_blocks: int = 1
    """Adaptive exit never stops a token before this many blocks."""
    adaptive_check: str = "cosine"
    """What the threshold applies to: 'cosine' (state saturation, any model) or 'probe' (the
    probability of the model's exit probe, lab.exit_probe)."""
    speculate: int | None = None
    """Self-speculative decoding: the set's blocks below this one draft tokens (read out through
    ln_f and the unembedding), the rest verify them in one pass. None: off. The tokens are the set's."""
    draft_tokens: int = 4
    """Tokens drafted per round when speculating."""

    MAX_DRAFT_TOKENS = 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip", frozenset(self.skip))
        object.__setattr__(self, "overwrite", frozenset(self.overwrite))

    @classmethod
    def keep(cls, keep: set[int] | list[int], n_layer: int, **kwargs) -> BlockSet:
        """Only ``keep`` runs; every other block of ``n_layer`` is skipped."""
        kept = set(keep)
        if not kept:
            raise ValueError("keep: needs at least one block")
        if len(kept) != len(list(keep)):
            raise ValueError(f"keep: duplicated block index in {sorted(keep)}")
        out_of_range = sorted(i for i in kept if not 0 <= i < n_layer)
        if out_of_range:
            raise ValueError(f"keep: block indices {out_of_range} out of range 0..{n_layer - 1}")
        return cls(skip=frozenset(range(n_layer)) - kept, **kwargs)

    @property
    def is_adaptive(self) -> bool:
        return self.adaptive_threshold is not None

    @property
    def is_speculative(self) -> bool:
        return self.speculate is not None

    def without_speculation(self) -> BlockSet:
        """The set whose output speculation reproduces (what scoring under this set measures)."""
        return BlockSet(skip=self.skip, overwrite=self.overwrite)

    def validate(self, n_layer: int) -> BlockSet:
        """Raise ValueError naming the field when this set does not fit a model of ``n_layer`` blocks."""
        for name, indices in (("skip", self.skip), ("overwrite", self.overwrite)):
            bad = sorted(i for i in indices if not 0 <= i < n_layer)
            if bad:
                raise ValueError(f"{name}: block indices {bad} out of range 0..{n_layer - 1}")
        both = sorted(self.skip & self.overwrite)
        if both:
            raise ValueError(f"overwrite: blocks {both} are also skipped")
        if self.exit_at is not None and not 1 <= self.exit_at <= n_layer:
            raise ValueError(f"exit_at: must be in 1..{n_layer}, got {self.exit_at}")
        if self.is_adaptive:
            if not 0.0 < self.adaptive_threshold <= 1.0:
                raise ValueError(f"adaptive_threshold: must be in (0, 1], got {self.adaptive_threshold}")
            if not 1 <= self.adaptive_min_blocks <= n_layer:
                raise ValueError(
                    f"adaptive_min_blocks: must be in 1..{n_layer}, got {self.adaptive_min_blocks}"
                )
            if self.exit_at is not None:
                raise ValueError("exit_at: cannot be combined with adaptive exit")
        if self.adaptive_check not in ("cosine", "probe"):
            raise ValueError(f"adaptive_check: 'cosine' or 'probe', got {self.adaptive_check!r}")
        if self.adaptive_check != "cosine" and not self.is_adaptive:
            raise ValueError("adaptive_check: needs adaptive=THRESHOLD")
        if self.adaptive_min_blocks != 1 and not self.is_adaptive:
            raise ValueError("adaptive_min_blocks: needs adaptive=THRESHOLD")
        if self.is_speculative:
            if self.exit_at is not None or self.is_adaptive:
                raise ValueError("speculate: cannot be combined with exit or adaptive exit")
            blocks = self.blocks_to_run(n_layer)
            if not any(i < self.speculate for i in blocks) or not any(i >= self.speculate for i in blocks):
                raise ValueError(
                    f"speculate: the set needs blocks both below and from {self.speculate} "
                    f"(drafting and verifying), in 1..{n_layer - 1}"
                )
        if not 1 <= self.draft_tokens <= self.MAX_DRAFT_TOKENS:
            raise ValueError(f"draft_tokens: must be in 1..{self.MAX_DRAFT_TOKENS}, got {self.draft_tokens}")
        if self.draft_tokens != 4 and not self.is_speculative:
            raise ValueError("draft_tokens: needs speculate=BLOCK")
        return self

    def blocks_to_run(self, n_layer: int) -> list[int]:
        """The block indices a fixed (non-adaptive) pass runs, in order."""
        top = n_layer if self.exit_at is None else self.exit_at
        return [i for i in range(top) if i not in self.skip]

    @classmethod
    def parse(cls, spec: str, n_layer: int) -> BlockSet:
        """A validated BlockSet for a model of ``n_layer`` blocks from a spec string (the grammar in
        the module docstring); ValueError naming the part at fault."""
        if spec.strip(" ") == "all":
            return cls()
        if not spec.strip(" "):
            raise ValueError(f"{spec!r}: empty spec (every block is 'all')")
        values: dict[str, object] = {}
        parts: dict[str, str] = {}  # key -> its part as written, to name it in errors
        for part in (part.strip(" ") for part in spec.split(";")):
            key, sep, value = (text.strip(" ") for text in part.partition("="))
            if not part:
                raise ValueError(f"{spec!r}: empty part (parts are key=value joined by ';')")
            if part == "all":
                raise ValueError(f"{spec!r}: 'all' stands alone")
            if not sep:
                raise ValueError(f"{part!r}: expected key=value")
            if key not in _FIELDS:
                raise ValueError(f"{part!r}: unknown key {key!r} (known: {', '.join(_FIELDS)})")
            if key in parts:
                raise ValueError(f"{part!r}: {key} given twice (also {parts[key]!r})")
            if not value:
                raise ValueError(f"{part!r}: {key} needs a value")
            values[key], parts[key] = _parse_value(key, value, part), part
        if "skip" in parts and "keep" in parts:
            raise ValueError(f"{parts['keep']!r}: give skip or keep, not both")
        for key in ("min", "check"):
            if key in parts and "adaptive" not in parts:
                raise ValueError(f"{parts[key]!r}: only with adaptive=THRESHOLD")
        if "k" in parts and "speculate" not in parts:
            raise ValueError(f"{parts['k']!r}: only with speculate=BLOCK")
        keep = values.pop("keep", None)
        fields = {_FIELDS[key]: value for key, value in values.items()}
        try:
            if keep is not None:
                return cls.keep(keep, n_layer, **fields).validate(n_layer)
            return cls(**fields).validate(n_layer)
        except ValueError as error:  # messages start with the field: say the part as written
            name, _, message = str(error).partition(": ")
            key = next((key for key, field_ in _FIELDS.items() if field_ == name), None)
            raise ValueError(f"{parts.get(key, spec)!r}: {message}") from None

    def __str__(self) -> str:
        parts = []
        if self.skip:
            parts.append("skip=" + ",".join(map(str, sorted(self.skip))))
        if self.overwrite:
            parts.append("overwrite=" + ",".join(map(str, sorted(self.overwrite))))
        if self.exit_at is not None:
            parts.append(f"exit={self.exit_at}")
        if self.is_adaptive:
            parts.append(f"adaptive={float(self.adaptive_threshold)!r}")  # repr: the shortest exact form
            if self.adaptive_min_blocks != 1:
                parts.append(f"min={self.adaptive_min_blocks}")
            if self.adaptive_check != "cosine":
                parts.append(f"check={self.adaptive_check}")
        if self.is_speculative:
            parts.append(f"speculate={self.speculate}")
            if self.draft_tokens != 4:
                parts.append(f"k={self.draft_tokens}")
        return ";".join(parts) or "all"
