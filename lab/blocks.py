"""Block sets: which Blocks run, and how, for one call. Chosen per call; the weights never reload.

A spec string names a block set on the command line, in the server and in the traffic tool:

    all                 every block
    skip=3,4            blocks 3 and 4 let the stream pass through unchanged (pruning)
    keep=0,1,2          only these blocks run; the others pass the stream through
    overwrite=5         block 5's output is its own writes (attn_out + mlp_out), not stream + writes
    exit=6              run blocks 0..5, then ln_f and the unembedding (logit lens)
    adaptive=0.9        per token, stop once the prediction is judged stable (see lab.generate)
    adaptive=0.9;check=probe   ... judged by the model's learned exit probe (lab.exit_probe)

Parts combine with ';', e.g. ``skip=3;exit=9`` or ``adaptive=0.9;min=4``. Spec strings and
``BlockSet`` fields are validated against the model's depth, naming the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _index_list(text: str, name: str) -> tuple[int, ...]:
    try:
        indices = tuple(int(part) for part in text.split(",") if part.strip() != "")
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated block indices, got {text!r}") from None
    if len(set(indices)) != len(indices):
        raise ValueError(f"{name}: duplicated block index in {text!r}")
    return indices


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "skip", frozenset(self.skip))
        object.__setattr__(self, "overwrite", frozenset(self.overwrite))

    @classmethod
    def keep(cls, keep: set[int] | list[int], n_layer: int, **kwargs) -> BlockSet:
        """Only ``keep`` runs; every other block of ``n_layer`` is skipped."""
        kept = set(keep)
        if len(kept) != len(list(keep)):
            raise ValueError(f"keep: duplicated block index in {sorted(keep)}")
        out_of_range = sorted(i for i in kept if not 0 <= i < n_layer)
        if out_of_range:
            raise ValueError(f"keep: block indices {out_of_range} out of range 0..{n_layer - 1}")
        return cls(skip=frozenset(range(n_layer)) - kept, **kwargs)

    @property
    def is_adaptive(self) -> bool:
        return self.adaptive_threshold is not None

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
        return self

    def blocks_to_run(self, n_layer: int) -> list[int]:
        """The block indices a fixed (non-adaptive) pass runs, in order."""
        top = n_layer if self.exit_at is None else self.exit_at
        return [i for i in range(top) if i not in self.skip]

    @classmethod
    def parse(cls, spec: str, n_layer: int) -> BlockSet:
        """A validated BlockSet for a model of ``n_layer`` blocks from a spec string (module docstring)."""
        spec = spec.strip()
        if spec in ("", "all"):
            return cls()
        kwargs: dict = {}
        keep: tuple[int, ...] | None = None
        for part in spec.split(";"):
            key, sep, value = part.strip().partition("=")
            if not sep:
                raise ValueError(f"block set: expected key=value, got {part!r}")
            if key == "skip":
                kwargs["skip"] = frozenset(_index_list(value, "skip"))
            elif key == "keep":
                keep = _index_list(value, "keep")
            elif key == "overwrite":
                kwargs["overwrite"] = frozenset(_index_list(value, "overwrite"))
            elif key == "check":
                kwargs["adaptive_check"] = value.strip()
            elif key in ("exit", "adaptive", "min"):
                name, kind = {
                    "exit": ("exit_at", int),
                    "adaptive": ("adaptive_threshold", float),
                    "min": ("adaptive_min_blocks", int),
                }[key]
                try:
                    kwargs[name] = kind(value)
                except ValueError:
                    raise ValueError(f"{name}: expected a number, got {value!r}") from None
            else:
                raise ValueError(
                    f"block set: unknown key {key!r} "
                    "(known: skip, keep, overwrite, exit, adaptive, min, check)"
                )
        if keep is not None:
            if "skip" in kwargs:
                raise ValueError("block set: give skip or keep, not both")
            return cls.keep(keep, n_layer, **kwargs).validate(n_layer)
        return cls(**kwargs).validate(n_layer)

    def __str__(self) -> str:
        parts = []
        if self.skip:
            parts.append("skip=" + ",".join(map(str, sorted(self.skip))))
        if self.overwrite:
            parts.append("overwrite=" + ",".join(map(str, sorted(self.overwrite))))
        if self.exit_at is not None:
            parts.append(f"exit={self.exit_at}")
        if self.is_adaptive:
            parts.append(f"adaptive={self.adaptive_threshold:g}")
            if self.adaptive_min_blocks != 1:
                parts.append(f"min={self.adaptive_min_blocks}")
            if self.adaptive_check != "cosine":
                parts.append(f"check={self.adaptive_check}")
        return ";".join(parts) or "all"
