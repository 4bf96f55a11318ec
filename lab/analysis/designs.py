"""Decoder designs as architecture facts, and the parameter and FLOP arithmetic that follows from them.

A ``Design`` holds only what fixes the counts: widths, depth, heads (and key/value heads for
grouped-query attention), the feed-forward's width and whether it is gated, the norm, biases, the
position table and whether the output head is tied. Every count is a small polynomial in the design's
symbols (``d``, ``d_ff``, ``d_kv``, ``V``, ``T``, ``L``), so the formula printed beside a number is the
expression that produced it.

Symbols: d the stream's width, d_ff the feed-forward's hidden width, d_kv = n_kv_head * d_head the
width of the keys (and of the values), V the vocabulary, T the context length, L the number of Blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lab.config import PRESETS, GPTConfig

# Term -> its value for a design. Terms print in this order.
_TERMS = ("d^2", "d·d_kv", "d·d_ff", "d_ff", "d_kv", "d", "V·d", "T·d")


@dataclass(frozen=True)
class Poly:
    """A sum of integer multiples of the terms above, e.g. 12d^2 + 13d."""

    coefficients: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, **terms: int) -> Poly:
        names = {
            "d2": "d^2",
            "d_dkv": "d·d_kv",
            "d_dff": "d·d_ff",
            "dff": "d_ff",
            "dkv": "d_kv",
            "d": "d",
            "Vd": "V·d",
            "Td": "T·d",
        }
        return cls(tuple((names[k], c) for k, c in terms.items() if c))

    def __add__(self, other: Poly) -> Poly:
        total = dict(self.coefficients)
        for term, c in other.coefficients:
            total[term] = total.get(term, 0) + c
        return Poly(tuple((t, total[t]) for t in _TERMS if total.get(t)))

    def __str__(self) -> str:
        parts = [
            t if c == 1 else f"{c}{t}"
            for t, c in sorted(self.coefficients, key=lambda tc: _TERMS.index(tc[0]))
        ]
        return " + ".join(parts) or "0"


@dataclass(frozen=True)
class Count:
    """One component's parameters: what it is, the formula, the number."""

    component: str
    formula: str
    params: int


@dataclass(frozen=True)
class Design:
    """The architecture facts of a decoder-only transformer that fix its parameter count and FLOPs."""

    name: str
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    """Key/value heads: n_head for multi-head attention, fewer for grouped-query attention."""
    d_ff: int
    vocab_size: int
    context: int
    gated_ff: bool
    """SwiGLU-style: gate and up projections (two d x d_ff matrices) then down, instead of up then down."""
    norm: Literal["layernorm", "rmsnorm"]
    bias: bool
    """Biases in the linear layers (and LayerNorm's shift)."""
    position_table: bool
    """A learned [T, d] position table (GPT-2); False for rotary positions (Llama)."""
    final_norm: bool
    """A norm before the unembedding (pre-LN models; a post-LN stack ends normalised already)."""
    tied_head: bool
    """The output projection is the token table (GPT-2) rather than its own V x d matrix (Llama)."""
    source: str = ""

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_head

    @property
    def d_kv(self) -> int:
        return self.n_kv_head * self.d_head

    @classmethod
    def from_config(cls, cfg: GPTConfig, name: str, source: str = "") -> Design:
        """The design of ``lab.model.GPT(cfg)``: GPT-2's architecture."""
        return cls(
            name=name,
            n_layer=cfg.n_layer,
            d_model=cfg.n_embd,
            n_head=cfg.n_head,
            n_kv_head=cfg.n_head,
            d_ff=4 * cfg.n_embd,
            vocab_size=cfg.vocab_size,
            context=cfg.block_size,
            gated_ff=False,
            norm="layernorm",
            bias=cfg.bias,
            position_table=True,
            final_norm=cfg.norm == "pre",
            tied_head=True,
            source=source,
        )

    # --- formulas -------------------------------------------------------------------------------

    def value(self, poly: Poly) -> int:
        d = self.d_model
        values = {
            "d^2": d * d,
            "d·d_kv": d * self.d_kv,
            "d·d_ff": d * self.d_ff,
            "d_ff": self.d_ff,
            "d_kv": self.d_kv,
            "d": d,
            "V·d": self.vocab_size * d,
            "T·d": self.context * d,
        }
        return sum(c * values[t] for t, c in poly.coefficients)

    def _norm_poly(self) -> Poly:
        # LayerNorm: a scale and (with biases) a shift per channel; RMSNorm: a scale only.
        return Poly.of(d=2 if self.norm == "layernorm" and self.bias else 1)

    def attention_weights(self) -> Poly:
        """q and the output projection are d x d; k and v are d x d_kv (d_kv = d without GQA)."""
        if self.d_kv == self.d_model:
            return Poly.of(d2=4)
        return Poly.of(d2=2, d_dkv=2)

    def attention(self) -> Poly:
        if not self.bias:
            return self.attention_weights()
        if self.d_kv == self.d_model:
            return self.attention_weights() + Poly.of(d=4)
        return self.attention_weights() + Poly.of(d=2, dkv=2)

    def feed_forward_weights(self) -> Poly:
        matrices = 3 if self.gated_ff else 2
        if self.d_ff == 4 * self.d_model and not self.gated_ff:
            return Poly.of(d2=4 * matrices)
        return Poly.of(d_dff=matrices)

    def feed_forward(self) -> Poly:
        if not self.bias:
            return self.feed_forward_weights()
        hidden_biases = 2 if self.gated_ff else 1  # gate and up each have a d_ff bias when gated
        if self.d_ff == 4 * self.d_model and not self.gated_ff:
            return self.feed_forward_weights() + Poly.of(d=4 * hidden_biases + 1)
        return self.feed_forward_weights() + Poly.of(dff=hidden_biases, d=1)

    def norms(self) -> Poly:
        return self._norm_poly() + self._norm_poly()

    def block(self) -> Poly:
        return self.attention() + self.feed_forward() + self.norms()

    # --- counts ---------------------------------------------------------------------------------

    def block_counts(self) -> list[Count]:
        attention = "attention (q, k, v, out)" + (
            f", GQA {self.n_kv_head} kv heads" if self.d_kv != self.d_model else ""
        )
        ff = "feed-forward, gated (gate, up, down)" if self.gated_ff else "feed-forward (up, down)"
        norm = "two LayerNorms" if self.norm == "layernorm" else "two RMSNorms"
        return [
            Count(attention, str(self.attention()), self.value(self.attention())),
            Count(ff, str(self.feed_forward()), self.value(self.feed_forward())),
            Count(norm, str(self.norms()), self.value(self.norms())),
            Count("block", str(self.block()), self.value(self.block())),
        ]

    def model_counts(self) -> list[Count]:
        counts = [
            Count(f"{self.n_layer} blocks", f"L·({self.block()})", self.n_layer * self.value(self.block())),
            Count("token table", "V·d", self.vocab_size * self.d_model),
        ]
        if self.position_table:
            counts.append(Count("position table", "T·d", self.context * self.d_model))
        if self.final_norm:
            counts.append(Count("final norm", str(self._norm_poly()), self.value(self._norm_poly())))
        if self.tied_head:
            counts.append(Count("output head (tied: the token table)", "0", 0))
        else:
            counts.append(Count("output head (untied)", "V·d", self.vocab_size * self.d_model))
        return counts

    def total_params(self) -> int:
        """Every parameter, the tied table counted once."""
        return sum(c.params for c in self.model_counts())

    def embedding_params(self) -> int:
        """Token and position tables (lookups, not matmuls on the input side)."""
        return self.vocab_size * self.d_model + (self.context * self.d_model if self.position_table else 0)

    # --- FLOPs (Kaplan et al. 2020, Table 1; nanoGPT's estimate_mfu) -----------------------------

    def flop_params(self) -> int:
        """N of the 2N rule: the weights every token is multiplied by, i.e. the Blocks' matrices plus the
        unembedding (V·d, tied or not). Biases, norms and the table lookups are not matmuls; excluded."""
        per_block = self.value(self.attention_weights() + self.feed_forward_weights())
        return self.n_layer * per_block + self.vocab_size * self.d_model

    def forward_flops_per_token(self, T: int) -> dict[str, int]:
        """Forward FLOPs per token with T positions attended to (multiply-add = 2 FLOPs).

        linear: 2 x (the Blocks' matrices); unembedding: 2·V·d; attention: 4·L·T·d, for q·k^T (2·T·d per
        layer) and pattern·v (2·T·d), over the full T x T (the causal mask's zero half counted, as
        nanoGPT and PaLM count it; a kernel that skips it does about half that on average).
        """
        per_block = self.value(self.attention_weights() + self.feed_forward_weights())
        return {
            "linear": 2 * self.n_layer * per_block,
            "unembedding": 2 * self.vocab_size * self.d_model,
            "attention": 4 * self.n_layer * T * self.d_model,
        }

    def attention_crossover(self) -> tuple[float, float]:
        """T at which attention's 4·L·T·d reaches the Blocks' linear FLOPs, and all linear FLOPs
        (unembedding included)."""
        flops = self.forward_flops_per_token(1)  # attention at T = 1 is 4·L·d
        return flops["linear"] / flops["attention"], (flops["linear"] + flops["unembedding"]) / flops[
            "attention"
        ]


_HF = "the checkpoint's config.json on the Hugging Face hub"

DESIGNS: dict[str, Design] = {
    **{
        name: Design.from_config(cfg, name, source=f"openai-community/{name}: {_HF}")
        for name, cfg in PRESETS.items()
    },
    "llama3.1-8b": Design(
        name="llama3.1-8b",
        n_layer=32,
        d_model=4096,
        n_head=32,
        n_kv_head=8,
        d_ff=14336,
        vocab_size=128256,
        context=131072,
        gated_ff=True,
        norm="rmsnorm",
        bias=False,
        position_table=False,
        final_norm=True,
        tied_head=False,
        source=f"meta-llama/Llama-3.1-8B: {_HF}",
    ),
}
"""Presets by name: the four GPT-2 sizes and Llama 3.1 8B."""
