"""How a token is drawn and when generation stops: one ``SamplingParams``, passed whole.

    sampling = SamplingParams(temperature=0.8, top_k=40, seed=1, stop=("\\n\\n",))
    token = pick_token(logits, sampling, generator)

``lab.generate`` (one sequence) and the server's engine (many) both draw every token with
``pick_token`` and end a generation for one of the ``FinishReason``s.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from lab import intmm
from lab.errors import UserError

FinishReason = Literal["stop", "length", "scored"]
"""Why a generation ended (OpenAI's words): ``stop``, the end-of-text token was drawn or a stop
string generated; ``length``, ``max_new_tokens`` or the context was reached; ``scored``, nothing was
to be generated (the prompt was scored)."""


class SamplingError(UserError):
    """Sampling settings that cannot be used; ``field`` names the setting at fault."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are drawn and when generation stops (vLLM's name for the same thing)."""

    temperature: float = 0.0
    """0: greedy; otherwise the logits are divided by it before the softmax."""
    top_k: int | None = None
    """Draw from the k most likely tokens only (None: all)."""
    top_p: float = 1.0
    """Nucleus sampling: draw from the smallest set of tokens whose probability reaches this."""
    seed: int | None = None
    """Seed of the draws (None: a fresh random one)."""
    min_tokens: int = 0
    """Neither end-of-text (not drawn) nor a stop string ends generation before this many new tokens."""
    ignore_eos: bool = False
    """End-of-text does not end the generation (it runs to its length: load tools)."""
    stop: tuple[str, ...] = ()
    """Generation ends once its text contains one of these; the text returned ends before it."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        if not self.temperature >= 0:
            raise SamplingError("temperature", f"must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise SamplingError("top_k", f"must be >= 1, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.min_tokens < 0:
            raise SamplingError("min_tokens", f"must be >= 0, got {self.min_tokens}")


GREEDY = SamplingParams()


def token_probabilities(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from at temperature > 0: the softmax of logits [V] /
    temperature, restricted to the ``top_k`` most likely and then to the smallest set whose
    probability reaches ``top_p`` (nucleus sampling). [V]."""
    logits = logits / sampling.temperature
    if sampling.top_k is not None:
        kth = torch.topk(logits, min(sampling.top_k, logits.size(-1))).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)  # [V]
    if sampling.top_p < 1.0:
        probs = _nucleus(probs, sampling.top_p)
    return probs


# A positive float32's bits, shifted right this far, keep its exponent and its 7 leading mantissa
# bits: buckets 1/128 of an octave wide, in the order of the values (bits of positive floats sort as
# the floats do), so every token of a bucket is more likely than every token of the buckets below.
BUCKET_SHIFT = 16


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [V] kept on their smallest most likely set whose probability reaches ``top_p``, renormalised.

    A token is kept when the tokens more likely than it hold less than ``top_p``. The tokens are
    bucketed by the bits of their probability (``BUCKET_SHIFT``) and the buckets' masses summed
    (float64): every token of a bucket whose more likely buckets hold less than ``top_p`` and that
    reaches it with its own is kept; the one bucket where the running mass crosses ``top_p`` is
    sorted, and only it. The kept set is a full sort's with float64 running sums (float32 ones can
    misplace the cut by a token), up to which of tokens tied at the cut are kept (as many of them),
    without sorting the vocabulary, which cost more than a decode step (docs/inference.md,
    "Sampling's cost")."""
    total = float(probs.sum())  # 1 up to rounding: a top_p at or above it keeps every token
    if not total > top_p:  # a NaN total too: the draw refuses it
        return probs / total
    values = probs.float()  # [V]
    bucket = values.view(torch.int32) >> BUCKET_SHIFT  # [V]
    mass = torch.bincount(bucket, weights=values.double())  # [B]
    from_bucket = mass.flip(0).cumsum(0).flip(0)  # [B] mass of each bucket and those above it
    above = torch.cat([from_bucket[1:], from_bucket.new_zeros(1)])  # [B] of those above: non-increasing
    cut = int((above >= top_p).sum())  # the bucket in which the kept mass reaches top_p
    edge = torch.nonzero(bucket == cut).view(-1)  # [E] its tokens
    edge_probs, order = probs[edge].sort(descending=True, stable=True)  # [E] each
    before = float(above[cut]) + edge_probs.double().cumsum(0) - edge_probs.double()  # [E]
    kept = edge[order[before < top_p]]  # [K]: the most likely token is always kept
    nucleus = torch.where(bucket > cut, probs, 0.0)  # [V]
    nucleus[kept] = probs[kept]
    return nucleus / nucleus.sum()


def inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token of probs [V] at ``u`` in [0, 1) of their cumulative sums: the first whose cumulative
    sum passes u times their total (a negative probability, or a total that is not finite and above
    0, raises ValueError, as ``torch.multinomial`` refuses them). A token of probability 0 is never the
    answer: rounding that carries u times the total to the end gives the last token with any."""
    cdf = probs.cumsum(0, dtype=torch.float64)  # [V]
    total = float(cdf[-1])
    if not 0.0 < total < math.inf or float(probs.min()) < 0:  # NaN fails too
        raise ValueError(f"draw: probabilities of at least 0 with a finite positive total, got {probs}")
    token = int(torch.searchsorted(cdf, u * total, right=True))
    if token < probs.size(0):
        return token
    return int(torch.nonzero(probs).max())


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """A token drawn from probs [V] (non-negative, not all 0; their total need not be 1) with one
    uniform number from ``generator`` (inverse transform sampling). ``torch.multinomial`` draws an
    exponential number per token of the vocabulary instead: on a CPU, over GPT-2's, more time than a
    small model's decode step, for every sampled token (docs/inference.md, "Sampling's cost")."""
    u = float(torch.rand((), generator=generator, dtype=torch.float64, device=probs.device))
    return inverse_cdf(probs, u)


@functools.cache
def _kernels_build() -> bool:
    return intmm.unavailable() is None


def greedy_token(logits: torch.Tensor) -> int:
    """The most likely token of logits [V] (the first of equals): ``lab.intmm.argmax`` where it takes
    them (float32 or bf16 on a CPU where it builds; torch's argmax is several times slower over
    GPT-2's vocabulary, a share of a decode step), else torch's."""
    kernel = logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16)
    if kernel and logits.dim() == 1 and logits.is_contiguous() and _kernels_build():
        return intmm.argmax(logits)
    return int(logits.argmax())


def token_logprob(logits: torch.Tensor, token: int) -> float:
    """log p(token) under logits [V]: ``logits[token]`` less their ``lab.intmm.logsumexp`` where it
    takes them (float32 on a CPU where it builds; torch's is several times slower over GPT-2's
    vocabulary, a share of a decode step), else torch's."""
    kernel = logits.device.type == "cpu" and logits.dtype is torch.float32 and logits.dim() == 1
    if kernel and _kernels_build():
        return float(logits[token]) - intmm.logsumexp(logits.contiguous())
    return float(logits[token] - torch.logsumexp(logits.float(), dim=-1))


def pick_token(logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator) -> int:
    """Greedy when the temperature is 0, else a draw from ``token_probabilities``. logits [V]. The one
    sampler: ``lab.generate``, speculation and the server all draw with it."""
    if sampling.temperature == 0.0:
        return greedy_token(logits)
    return draw(token_probabilities(logits, sampling), generator)


def seeded_generator(sampling: SamplingParams, device: torch.device) -> torch.Generator:
    """The generator of a sequence's draws, seeded with ``sampling.seed`` (None: a fresh seed)."""
    generator = torch.Generator(device=device)
    if sampling.seed is None:
        generator.seed()
    else:
        generator.manual_seed(sampling.seed)
    return generator
