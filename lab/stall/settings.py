"""What one stall experiment fixes and what it varies: the preset (``configs/stall/NAME.yaml``), the
variants (where the norms sit, their type, the warmup) and the axes of a grid over the preset."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "stall"
"""``blocklab stall --preset NAME`` reads ``PRESET_DIR/NAME.yaml`` (the repository's configs/stall/)."""


@dataclass(frozen=True)
class StallPreset:
    """Everything the runs of one experiment share; a preset file (configs/stall/NAME.yaml) sets each."""

    n_embd: int
    """Width of the residual stream; divisible by n_head."""
    n_head: int
    """Attention heads per block."""
    seq_len: int
    """Characters per training window: the model's context."""
    batch_size: int
    """Windows per batch."""
    lr: float
    """AdamW's learning rate (after the warmup, constant)."""
    steps: int
    """Training steps per run."""
    warmup: int
    """Linear warmup steps of the default third run (post-LN with warmup)."""
    n_layer: int
    """Blocks."""
    betas: tuple[float, float]
    """AdamW's moment decay rates."""
    weight_decay: float
    """Decoupled weight decay, on the weight matrices and tables only."""
    grad_clip: float
    """The gradient norm is clipped to this."""
    precision: str
    """Lightning's precision: 32-true, bf16-mixed, ..."""
    val_batches: int
    """Validation batches, spread over the held-out tenth of the text."""
    seeds: tuple[int, ...]
    """Each variant trains once per seed (the weights' and the data order's)."""

    def fit_config(self) -> dict:
        """This preset as `blocklab fit`'s config (``stall_preset: NAME`` in configs/*.yaml): one run of
        the experiment, its variant (``model.config.norm``, ``model.warmup_steps``) the config's own."""
        return {
            "seed_everything": self.seeds[0],
            "trainer": {
                "max_steps": self.steps,
                "gradient_clip_val": self.grad_clip,
                "precision": self.precision,
            },
            "model": {
                "config": {
                    "n_layer": self.n_layer,
                    "n_head": self.n_head,
                    "n_embd": self.n_embd,
                    "block_size": self.seq_len,
                },
                "lr": self.lr,
                "betas": list(self.betas),
                "weight_decay": self.weight_decay,
                "warmup_steps": self.warmup,
            },
            "data": {
                "seq_len": self.seq_len,
                "batch_size": self.batch_size,
                "val_batches": self.val_batches,
                "seed": self.seeds[0],
            },
        }


PRESET_NAMES = tuple(sorted(path.stem for path in PRESET_DIR.glob("*.yaml")))

NORM_LABELS = {"pre": "pre-LN", "post": "post-LN", "deepnorm": "DeepNorm", "peri": "Peri-LN"}


@dataclass(frozen=True)
class Variant:
    """What differs between the runs: ``GPTConfig.norm`` and ``norm_type``, and the warmup steps."""

    norm: str
    warmup: int = 0
    norm_type: str = "layer"

    @classmethod
    def parse(cls, spec: str) -> Variant:
        """``NORM[+warmup=N][+rms]``: ``post``, ``post+warmup=100``, ``peri+rms``."""
        norm, *options = spec.split("+")
        if norm not in NORM_LABELS:
            raise ValueError(f"variant {spec!r}: the norm must be one of {', '.join(NORM_LABELS)}")
        variant = cls(norm)
        for option in options:
            if option == "rms":
                variant = replace(variant, norm_type="rms")
            elif option.startswith("warmup=") and option[7:].isdigit():
                variant = replace(variant, warmup=int(option[7:]))
            else:
                raise ValueError(f"variant {spec!r}: unknown option {option!r} (warmup=N or rms)")
        return variant

    @property
    def spec(self) -> str:
        return (
            self.norm
            + (f"+warmup={self.warmup}" if self.warmup else "")
            + ("+rms" if self.norm_type == "rms" else "")
        )

    @property
    def label(self) -> str:
        rms = ", RMSNorm" if self.norm_type == "rms" else ""
        return f"{NORM_LABELS[self.norm]}{rms}, " + (f"warmup {self.warmup}" if self.warmup else "no warmup")

    def run_name(self, seed: int) -> str:
        rms = "_rms" if self.norm_type == "rms" else ""
        return f"{self.norm}ln_warmup{self.warmup}{rms}_seed{seed}"


def default_variants(preset: StallPreset) -> list[Variant]:
    """The original experiment: pre-LN and post-LN without warmup, post-LN with the preset's warmup."""
    return [Variant("pre"), Variant("post"), Variant("post", preset.warmup)]


GRID_SETTINGS = [f.name for f in fields(StallPreset) if f.type in ("int", "float", "str")]


def parse_axis(text: str, preset: StallPreset) -> tuple[str, list]:
    """``NAME=V1,V2,...`` for a setting of the preset: (name, values of the setting's type)."""
    name, _, values = text.partition("=")
    if name not in GRID_SETTINGS or not values:
        raise ValueError(f"grid axis {text!r}: want NAME=V1,V2 with NAME one of {', '.join(GRID_SETTINGS)}")
    kind = type(getattr(preset, name))
    try:
        return name, [kind(float(v)) if kind is int else kind(v) for v in values.split(",")]
    except ValueError:
        raise ValueError(f"grid axis {text!r}: {name} takes {kind.__name__} values") from None


def cell_name(setting: dict) -> str:
    return "_".join(f"{name}={value}" for name, value in setting.items())
