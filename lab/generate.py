"""Batch-1 decoding and scoring under a block set: prefill, then one token at a time from a KV cache."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab.blocks import BlockSet
from lab.model import GPT, KVCache


@dataclass
class Step:
    """One generated token and the blocks that ran to produce it."""

    token: int
    blocks_run: list[int]


@dataclass
class Score:
    """Next-token loss of a text under a block set."""

    mean_loss: float
    token_losses: list[float]  # nats, for tokens 1..n-1 given the ones before
    blocks_run: list[int]


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> int:
    """Greedy when temperature is 0, else sample from the (top-k) softmax. logits [V]."""
    if temperature == 0.0:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator))


@torch.inference_mode()
def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int | None = None,
    stop_token: int | None = None,
    block_set: BlockSet | None = None,
) -> Iterator[Step]:
    """Yield tokens one at a time after ``prompt``, stopping at ``stop_token`` or the context length."""
    cfg = model.config
    block_set = (block_set or BlockSet()).validate(cfg.n_layer)
    if not prompt:
        raise ValueError("prompt: needs at least one token")
    max_new_tokens = min(max_new_tokens, cfg.block_size - len(prompt))
    if max_new_tokens <= 0:
        return
    device = model.wte.weight.device
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(seed)
    cache = KVCache(cfg, max_len=len(prompt) + max_new_tokens, device=device, dtype=model.wte.weight.dtype)
    blocks_run = block_set.blocks_to_run(cfg.n_layer)
    idx = torch.tensor([prompt], device=device)  # [1, T]
    logits = model(idx, cache=cache, block_set=block_set)[0, -1]  # [V]
    for produced in range(max_new_tokens):
        token = _pick(logits.float(), temperature, top_k, generator)
        yield Step(token=token, blocks_run=blocks_run)
        if token == stop_token or produced + 1 == max_new_tokens:
            return
        idx = torch.tensor([[token]], device=device)  # [1, 1]
        logits = model(idx, cache=cache, block_set=block_set)[0, -1]  # [V]


@torch.inference_mode()
def score(model: GPT, tokens: list[int], block_set: BlockSet | None = None) -> Score:
    """Mean next-token loss (nats) of ``tokens`` under ``block_set``, with the loss of each token."""
    cfg = model.config
    block_set = (block_set or BlockSet()).validate(cfg.n_layer)
    if not 2 <= len(tokens) <= cfg.block_size:
        raise ValueError(f"tokens: need 2..{cfg.block_size} tokens to score, got {len(tokens)}")
    idx = torch.tensor([tokens], device=model.wte.weight.device)  # [1, T]
    logits = model(idx[:, :-1], block_set=block_set)[0].float()  # [T-1, V]
    losses = F.cross_entropy(logits, idx[0, 1:], reduction="none")  # [T-1]
    return Score(
        mean_loss=float(losses.mean()),
        token_losses=losses.tolist(),
        blocks_run=block_set.blocks_to_run(cfg.n_layer),
    )
