"""Model configuration: one dataclass, presets reached by name."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal


@dataclass
class GPTConfig:
    """Shape and variant of a GPT-2-architecture decoder. Defaults give a tiny valid model."""

    n_layer: int = 2
    """Number of Blocks."""
    n_head: int = 2
    """Attention heads per Block."""
    n_embd: int = 32
    """Width of the residual stream (d_model)."""
    vocab_size: int = 64
    """Token table rows; the unembedding shares this table."""
    block_size: int = 64
    """Context length: the most positions one forward pass (or a KV cache) may hold."""
    bias: bool = True
    """Biases in the linear layers and LayerNorms, as in GPT-2."""
    dropout: float = 0.0
    """Dropout on the embedding, attention pattern and each stage's write."""
    norm: Literal["pre", "post", "deepnorm", "peri"] = "pre"
    """Where the norms sit: pre: x + f(ln(x)) (GPT-2); post: ln(x + f(x)) (original transformer,
    GPT-1); deepnorm: ln(alpha x + f(x)) with a scaled init (DeepNet); peri: x + ln(f(ln(x))) (Peri-LN)."""
    norm_type: Literal["layer", "rms"] = "layer"
    """layer: LayerNorm (GPT-2); rms: RMSNorm (no mean subtraction, no bias)."""
    attention: Literal["eager", "sdpa"] = "sdpa"
    """eager writes the [B, H, T, T] scores out; sdpa calls the fused kernel. Same logits."""
    layer_norm_eps: float = 1e-5
    """LayerNorm epsilon (GPT-2 uses 1e-5)."""
    logit_bias: bool = False
    """A fixed bias [V] added to the read-out's logits (``GPT.logit_bias``, a buffer, not trained): how
    a model trained on part of the vocabulary gives the rest one low logit (``lab.token_data``)."""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.norm not in ("pre", "post", "deepnorm", "peri"):
            raise ValueError(f"norm must be 'pre', 'post', 'deepnorm' or 'peri', got {self.norm!r}")
        if self.norm_type not in ("layer", "rms"):
            raise ValueError(f"norm_type must be 'layer' or 'rms', got {self.norm_type!r}")
        if self.attention not in ("eager", "sdpa"):
            raise ValueError(f"attention must be 'eager' or 'sdpa', got {self.attention!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_name(cls, name: str, **overrides) -> GPTConfig:
        """A preset by name, e.g. ``GPTConfig.from_name("gpt2", attention="eager")``."""
        if name not in PRESETS:
            raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
        return replace(PRESETS[name], **overrides)


GPT2_VOCAB_SIZE = 50257

# Source: the config.json of each checkpoint on the Hugging Face hub (openai-community/gpt2*),
# the same numbers as Table 2 of the GPT-2 paper.
PRESETS: dict[str, GPTConfig] = {
    "gpt2": GPTConfig(n_layer=12, n_head=12, n_embd=768, vocab_size=GPT2_VOCAB_SIZE, block_size=1024),
    "gpt2-medium": GPTConfig(n_layer=24, n_head=16, n_embd=1024, vocab_size=GPT2_VOCAB_SIZE, block_size=1024),
    "gpt2-large": GPTConfig(n_layer=36, n_head=20, n_embd=1280, vocab_size=GPT2_VOCAB_SIZE, block_size=1024),
    "gpt2-xl": GPTConfig(n_layer=48, n_head=25, n_embd=1600, vocab_size=GPT2_VOCAB_SIZE, block_size=1024),
}
