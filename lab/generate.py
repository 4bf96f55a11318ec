"""Batch-1 decoding and scoring under a block set: prefill, then one token at a time from a KV cache.

    for step in generate(model, tokens.encode("def main("), 40, block_set=BlockSet.parse("skip=5", 12)):
        print(step.token, step.blocks_run)
    score(model, tokens.encode(text)).mean_loss  # nats per token

Adaptive exit (``BlockSet(adaptive_threshold=0.9, adaptive_min_blocks=4)``, spec ``adaptive=0.9;min=4``)
decides per generated token how deep to go:

- The check is *state saturation* (as in CALM, Schuster et al. 2022): after each block, the cosine
  between what the read-out would see now and before the block, ``cos(ln_f(resid_post), ln_f(resid_pre))``.
  Once it reaches the threshold (and at least ``adaptive_min_blocks`` blocks ran) the block barely
  turned the prediction's direction, and the token is read out from there. The check costs one
  LayerNorm and a dot product over the width D, against a block's 12 D^2 multiply-adds: no
  50k-wide unembedding per block. ``scripts/bench_decode.py`` measures its cost per block.
  With ``check=probe`` the threshold applies instead to the model's learned exit probe
  (``lab.exit_probe``, CALM's trained confidence): the probability that the read-out here already
  picks the token the full stack would, at the same cost (a dot product over ``ln_f``'s output).
- State propagation: a token that exited after block e still leaves keys and values at blocks
  e+1.. for the tokens after it. They are computed from its exit state, ``c_attn(ln_1(h_e))`` of each
  deeper block (CALM's propagation), so later tokens that do go deep attend to every earlier
  position. That costs the K and V projections of each skipped block (about 1/6 of the block);
  the alternatives (attend only to positions that reached the depth, or copy the exit layer's K/V)
  change what deep blocks see in ways the trained model never saw.
- The prompt is prefilled through every block (one batched pass; its keys and values are exact),
  so the first generated token is read out from the full stack; adaptive exit starts at the second.
- ``score`` under adaptive exit decides for every position, with the same arithmetic as decoding:
  block by block over all positions, an exited position's stream frozen at its exit state (so the
  deeper blocks' keys and values come from that state, as in propagation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from lab.blocks import BlockSet
from lab.errors import UserError
from lab.exit_probe import check_fits
from lab.model import GPT, Block, KVCache, Linear, extend_cache
from lab.quantize import WEIGHT_DTYPES, load


@dataclass
class Step:
    """One generated token, the blocks that ran to produce it, and why generation stopped (last step)."""

    token: int
    blocks_run: list[int]
    logprob: float
    """Log-probability (nats) of ``token`` under the model's (unscaled, full-vocabulary) distribution."""
    finish_reason: str | None = None
    """On the last step only: 'stop_token', 'max_new_tokens' or 'context_length'."""


@dataclass
class Score:
    """Next-token loss of a text under a block set."""

    mean_loss: float
    token_losses: list[float]  # nats, for tokens 1..n-1 given the ones before
    blocks_run: list[int]
    """The blocks a token may run: all of them for fixed sets, the deepest possible for adaptive exit."""
    blocks_per_token: list[list[int]]
    """The blocks that ran for each predicted position (differs per position under adaptive exit)."""

    @property
    def mean_blocks(self) -> float:
        return sum(map(len, self.blocks_per_token)) / len(self.blocks_per_token)


def mean_blocks(steps: list[Step]) -> float:
    """Mean number of blocks run per generated token."""
    return sum(len(step.blocks_run) for step in steps) / len(steps) if steps else 0.0


def stability(read_now: torch.Tensor, read_before: torch.Tensor) -> torch.Tensor:
    """Cosine between consecutive read-out inputs ln_f(x), per position. [..., D] x 2 -> [...]."""
    return F.cosine_similarity(read_now, read_before, dim=-1)


def exit_score(
    model: GPT, block_set: BlockSet, block: int, read_now: torch.Tensor, read_before: torch.Tensor | None
) -> torch.Tensor:
    """What the adaptive threshold applies to after ``block``, per position [...]: the exit probe's
    probability (``check=probe``) or the cosine of consecutive reads. reads [..., D]."""
    if block_set.adaptive_check == "probe":
        return model.exit_probe(read_now, block)
    return stability(read_now, read_before)


def require_exit_probe(model: GPT, block_set: BlockSet) -> None:
    if block_set.adaptive_check != "probe":
        return
    if model.exit_probe is None:
        raise UserError(
            "blocks: check=probe needs the model's exit probe (lab.exit_probe), and this model has "
            "none; `blocklab builtin` fits the builtin model's, lab.exit_probe.fit_exit_probe any model's"
        )
    check_fits(model.exit_probe, model)


def propagate_kv(block: Block, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], pos: int) -> None:
    """Write ``block``'s keys and values for stream ``x`` [B, T, D] at positions pos.. without running it.

    What the block's attention would have stored had the stream entered it unchanged (CALM's state
    propagation for tokens that exited before this block). Only the K and V columns of c_attn are
    used; a quantized c_attn (lab.quantize), whose packed weights cannot be sliced, runs whole.
    """
    B, T, D = x.shape
    attn, c_attn = block.attn, block.attn.c_attn
    H, Dh = attn.n_head, attn.head_dim
    h = block.ln_1(x) if block.norm_first else x  # [B, T, D]
    if isinstance(c_attn, Linear):
        kv = h @ c_attn.weight[:, D:]  # [B, T, 2D]: the key and value columns of [D, 3D]
        if c_attn.bias is not None:
            kv = kv + c_attn.bias[D:]
    else:
        kv = c_attn(h)[..., D:]  # [B, T, 2D]
    k, v = kv.reshape(B, T, 2, H, Dh).permute(2, 0, 3, 1, 4)  # 2 x [B, H, T, Dh]
    extend_cache(cache, k, v, pos)


class Decoder:
    """Incremental decoding of one sequence under one block set: a model, its cache, a position.

    Several decoders step together, each at its own position under its own block set, through
    ``decode_rows``; ``step`` is that with one row.
    """

    def __init__(self, model: GPT, block_set: BlockSet | None = None, max_len: int | None = None):
        self.model = model
        self.cfg = model.config
        self.block_set = (block_set or BlockSet()).validate(self.cfg.n_layer)
        require_exit_probe(model, self.block_set)
        self.blocks = self.block_set.blocks_to_run(self.cfg.n_layer)
        self.runs = frozenset(self.blocks)
        weight = model.wte.weight
        self.cache = KVCache(self.cfg, max_len=max_len, device=weight.device, dtype=weight.dtype)
        # adaptive exit: the prompt runs every block of the set (keys and values exact for all depths)
        bs = self.block_set
        self.prefill_set = BlockSet(skip=bs.skip, overwrite=bs.overwrite) if bs.is_adaptive else bs

    @property
    def position(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def extend(self, tokens: list[int]) -> torch.Tensor:
        """Run ``tokens`` (the prompt, or its next chunk) through the set's blocks in one pass, after
        what the cache holds; the stream [T, D] leaving the last block, for every position."""
        if not tokens:
            raise ValueError("prompt: needs at least one token")
        if self.position + len(tokens) > self.cache.max_len:
            raise ValueError(
                f"prompt: {self.position + len(tokens)} tokens exceed the context of {self.cache.max_len}"
            )
        idx = torch.tensor([tokens], device=self.model.wte.weight.device)  # [1, T]
        return self.model.residual_stream(idx, self.cache, self.prefill_set)[0]  # [T, D]

    @torch.inference_mode()
    def prefill(self, tokens: list[int]) -> torch.Tensor:
        """``extend`` by the prompt; the logits [V] after its last token (the only position read out)."""
        return self.model.unembed(self.extend(tokens)[None, -1:])[0, -1]  # [V]

    def step(self, token: int) -> tuple[torch.Tensor, list[int]]:
        """Feed one token; the logits [V] for the next one and the blocks that ran."""
        logits, blocks_run = decode_rows(self.model, [self], [token])
        return logits[0], blocks_run[0]


@torch.inference_mode()
def decode_rows(
    model: GPT, decoders: list[Decoder], tokens: list[int]
) -> tuple[torch.Tensor, list[list[int]]]:
    """One token for each decoder, all in one pass: the logits [B, V] for the next tokens and the
    blocks each row ran. The one decoding loop: ``Decoder.step`` and the server's steps use it.

    Each row is at its own position with its own cache, under its own block set: block i runs on
    the rows whose set includes it (the others' streams pass through); an ``exit`` row stops at its
    block and is read out there; ``overwrite`` applies per row; an adaptive row stops once its check
    passes, and its deeper blocks get this position's keys and values from its exit state
    (``propagate_kv``). Under ``lab.model.rows_alone`` a row's logits are bit for bit those it gets
    alone.
    """
    device = model.wte.weight.device
    B = len(decoders)
    positions = [decoder.position for decoder in decoders]
    for decoder in decoders:
        if decoder.position >= decoder.cache.max_len:
            raise ValueError(f"context full: {decoder.cache.max_len} positions")
    idx = torch.tensor(tokens, device=device)[:, None]  # [B, 1]
    x = model.embed_tokens(idx, torch.tensor(positions, device=device))  # [B, 1, D]
    ran = [0] * B  # blocks each row has run
    going = [True] * B  # False once an adaptive row exits
    read_before: list[torch.Tensor | None] = [None] * B  # ln_f before the block just run, once checking
    for i, block in enumerate(model.blocks):
        rows = [b for b in range(B) if going[b] and i in decoders[b].runs]
        if not rows:
            continue
        checking = [b for b in rows if _checks_after(decoders[b], ran[b] + 1)]
        for b in checking:
            if read_before[b] is None and decoders[b].block_set.adaptive_check == "cosine":
                read_before[b] = model.ln_f(x[b : b + 1])  # [1, 1, D]: only the cosine compares reads
        overwrite = [i in decoders[b].block_set.overwrite for b in rows]
        caches = [decoders[b].cache.layer(i) for b in rows]
        at = [positions[b] for b in rows]
        flags = torch.tensor(overwrite, device=device) if any(overwrite) else False  # [b] or no row
        if len(rows) == B:
            x = block(x, caches, at, overwrite=flags)  # [B, 1, D]
        else:
            index = torch.tensor(rows, device=device)
            x = x.index_copy(0, index, block(x[index], caches, at, overwrite=flags))  # [B, 1, D]
        for b in rows:
            ran[b] += 1
        for b in checking:
            decoder = decoders[b]
            read_now = model.ln_f(x[b : b + 1])  # [1, 1, D]
            score = exit_score(model, decoder.block_set, i, read_now, read_before[b])
            if float(score) >= decoder.block_set.adaptive_threshold:
                going[b] = False
            read_before[b] = read_now
    for b, decoder in enumerate(decoders):
        for i in decoder.blocks[ran[b] :]:  # exited early: deeper blocks still need this position's K/V
            propagate_kv(model.blocks[i], x[b : b + 1], decoder.cache.layer(i), positions[b])
    logits = model.unembed(x)[:, -1]  # [B, V]
    for b, decoder in enumerate(decoders):  # last: a step that raised can be run again as it was
        decoder.cache.length = positions[b] + 1
    return logits, [decoder.blocks[: ran[b]] for b, decoder in enumerate(decoders)]


def _checks_after(decoder: Decoder, ran: int) -> bool:
    """Whether an adaptive row checks for exit after its ``ran``-th block (never after its last)."""
    block_set = decoder.block_set
    return block_set.is_adaptive and block_set.adaptive_min_blocks <= ran < len(decoder.blocks)


def token_probabilities(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float = 1.0
) -> torch.Tensor:
    """The distribution a token is drawn from at temperature > 0: the softmax of logits [V] /
    temperature, restricted to the ``top_k`` most likely and then to the smallest set whose
    probability reaches ``top_p`` (nucleus sampling). [V]."""
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)  # [V]
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)  # [V] each
        before = sorted_probs.cumsum(-1) - sorted_probs  # [V] mass of the more likely tokens
        sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)  # the most likely always stays
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)  # [V]
        probs = probs / probs.sum()
    return probs


def pick_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    top_p: float = 1.0,
) -> int:
    """Greedy when temperature is 0, else a draw from ``token_probabilities``. logits [V]. The one
    sampler: ``generate``, speculation and the server all draw with it."""
    if temperature == 0.0:
        return int(logits.argmax())
    probs = token_probabilities(logits, temperature, top_k, top_p)  # [V]
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass
class SpeculationStats:
    """What self-speculative decoding did for one sequence."""

    rounds: int = 0
    """Verification passes."""
    drafted: int = 0
    accepted: int = 0
    """Drafted tokens the full model agreed with."""

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class Speculator:
    """Self-speculative decoding of one sequence (LayerSkip, Elhoushi et al. 2024).

    Each round the set's blocks below ``speculate`` draft up to ``draft_tokens`` tokens one at a
    time, read out through ``ln_f`` and the unembedding; the remaining blocks then verify every
    drafted position in one pass, continuing the draft's streams and keys and values (the first
    blocks never run twice). Greedy: the drafts up to the first the full model disagrees with, then
    the full model's token there (or after the last draft). Sampling: speculative sampling's rule
    (accept a draft d with probability min(1, p(d)/q(d)), else draw from max(0, p - q) normalised),
    so tokens are distributed as the full set's. The keys and values of rejected drafts are left
    past the cache's length and overwritten later.
    """

    def __init__(self, model: GPT, block_set: BlockSet, max_len: int):
        self.model = model
        self.k = block_set.draft_tokens
        self.decoder = Decoder(model, block_set.without_speculation(), max_len=max_len)
        self.draft_blocks = [i for i in self.decoder.blocks if i < block_set.speculate]
        self.verify_blocks = [i for i in self.decoder.blocks if i >= block_set.speculate]
        self.overwrite = block_set.overwrite
        self.stats = SpeculationStats()

    def _through(self, blocks: list[int], x: torch.Tensor, pos: int) -> torch.Tensor:
        """The stream x [1, T, D] at positions pos.. through ``blocks``, writing their keys and values."""
        return self.model.run_blocks(x, blocks, self.decoder.cache, pos, self.overwrite)  # [1, T, D]

    @torch.inference_mode()
    def round(
        self, last: int, wanted: int, temperature: float, top_k: int | None, top_p: float, generator
    ) -> list[tuple[int, float]]:
        """Feed ``last``; the next tokens (1 to ``wanted``, at most k + 1) and their log-probabilities
        under the full set."""
        model, decoder = self.model, self.decoder
        start = decoder.position
        k = min(self.k, wanted - 1, decoder.cache.max_len - start - 1)
        if k <= 0:  # no room to draft: one plain step
            logits, _ = decoder.step(last)
            logits = logits.float()
            token = pick_token(logits, temperature, top_k, generator, top_p)
            return [(token, float(logits[token] - torch.logsumexp(logits, dim=-1)))]
        device = model.wte.weight.device
        streams, drafts, draft_probs = [], [], []
        token = last
        for j in range(k + 1):  # the last draft is fed too: verification reads the full model after it
            x = model.embed_tokens(torch.tensor([[token]], device=device), start + j)  # [1, 1, D]
            streams.append(self._through(self.draft_blocks, x, start + j))
            if j == k:
                break
            logits = model.unembed(streams[-1])[0, -1].float()  # [V]: the draft's read-out
            if temperature == 0.0:
                token = int(logits.argmax())
            else:
                draft_probs.append(token_probabilities(logits, temperature, top_k, top_p))
                token = int(torch.multinomial(draft_probs[-1], 1, generator=generator))
            drafts.append(token)
        x = self._through(self.verify_blocks, torch.cat(streams, dim=1), start)  # [1, k+1, D]
        target = model.unembed(x)[0].float()  # [k+1, V]: the full set's logits after each input
        logprobs = torch.log_softmax(target, dim=-1)  # [k+1, V]
        out = []
        for j, draft in enumerate(drafts):
            if temperature == 0.0:
                agreed = int(target[j].argmax()) == draft
            else:
                p = token_probabilities(target[j], temperature, top_k, top_p)
                q = draft_probs[j]
                u = float(torch.rand((), generator=generator, device=device))
                agreed = u * float(q[draft]) < float(p[draft])  # u < p/q, without dividing by 0
            if agreed:
                out.append((draft, float(logprobs[j, draft])))
                continue
            if temperature == 0.0:
                token = int(target[j].argmax())
            else:
                residual = (p - q).clamp(min=0.0)
                total = float(residual.sum())
                residual = residual / total if total > 0 else p
                token = int(torch.multinomial(residual, 1, generator=generator))
            out.append((token, float(logprobs[j, token])))
            break
        else:  # every draft agreed: the full model's next token comes free
            token = pick_token(target[k], temperature, top_k, generator, top_p)
            out.append((token, float(logprobs[k, token])))
        self.stats.rounds += 1
        self.stats.drafted += k
        self.stats.accepted += len(out) - 1
        decoder.cache.length = start + len(out)  # the inputs kept: last and the accepted drafts
        return out


def generate(
    model: GPT,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_token: int | None = None,
    block_set: BlockSet | None = None,
    speculation: SpeculationStats | None = None,
) -> Iterator[Step]:
    """Yield tokens one at a time after ``prompt``; stop at ``stop_token``, max_new_tokens or the context.

    ``temperature`` 0 is greedy; otherwise sampling (``pick_token``), drawn
    from a generator seeded with ``seed`` (None: a fresh random seed). Under a speculating block set
    (``Speculator``) tokens come a round at a time, counted in ``speculation`` when given.
    """
    cfg = model.config
    if temperature < 0:
        raise UserError(f"temperature: must be >= 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise UserError(f"top_k: must be >= 1, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"top_p: must be in (0, 1], got {top_p}")
    if not prompt:
        raise UserError("prompt: needs at least one token")
    if len(prompt) > cfg.block_size:
        raise UserError(f"prompt: {len(prompt)} tokens exceed the context length {cfg.block_size}")
    room = cfg.block_size - len(prompt)
    budget = min(max_new_tokens, room)
    if budget <= 0:
        return
    block_set = (block_set or BlockSet()).validate(cfg.n_layer)
    speculator = None
    if block_set.is_speculative:
        speculator = Speculator(model, block_set, max_len=len(prompt) + budget)
        if speculation is not None:
            speculator.stats = speculation
        decoder = speculator.decoder
    else:
        decoder = Decoder(model, block_set, max_len=len(prompt) + budget)
    generator = torch.Generator(device=model.wte.weight.device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    logits = decoder.prefill(prompt).float()
    token = pick_token(logits, temperature, top_k, generator, top_p)
    ready = [(token, float(logits[token] - torch.logsumexp(logits, dim=-1)), decoder.blocks)]
    produced = 0
    while True:
        for token, logprob, blocks_run in ready:
            produced += 1
            if token == stop_token:
                reason = "stop_token"
            elif produced == budget:
                reason = "max_new_tokens" if produced == max_new_tokens else "context_length"
            else:
                reason = None
            yield Step(token=token, blocks_run=blocks_run, logprob=logprob, finish_reason=reason)
            if reason is not None:
                return
        if speculator is not None:
            tokens_ = speculator.round(token, budget - produced, temperature, top_k, top_p, generator)
            ready = [(next_token, logprob, decoder.blocks) for next_token, logprob in tokens_]
        else:
            logits, blocks_run = decoder.step(token)
            logits = logits.float()
            token = pick_token(logits, temperature, top_k, generator, top_p)
            ready = [(token, float(logits[token] - torch.logsumexp(logits, dim=-1)), blocks_run)]


@torch.inference_mode()
def adaptive_forward(
    model: GPT, idx: torch.Tensor, block_set: BlockSet, n_full: int = 0
) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits [B, T, V] under adaptive exit for all positions at once, and the blocks each position ran.

    The same arithmetic as decoding token by token (``Decoder``), block by block over all positions:
    an exited position's stream stays at its exit state, so deeper blocks compute its keys and values
    from that state. Positions before ``n_full`` (a prompt) run every block. Batch size 1.
    """
    B, T = idx.shape
    if B != 1:
        raise ValueError(f"adaptive_forward: batch size 1 only, got {B}")
    block_set = block_set.validate(model.config.n_layer)
    require_exit_probe(model, block_set)
    blocks = block_set.blocks_to_run(model.config.n_layer)
    x = model.embed_tokens(idx)  # [1, T, D]
    active = torch.ones(T, dtype=torch.bool, device=idx.device)  # [T] still going deeper
    may_exit = torch.arange(T, device=idx.device) >= n_full  # [T]
    depth = torch.zeros(T, dtype=torch.long)  # [T] blocks run so far
    first = max(block_set.adaptive_min_blocks, 1)  # the first check comes after this many blocks
    cosine = block_set.adaptive_check == "cosine"  # only the cosine compares consecutive reads
    read_before = model.ln_f(x) if cosine and first == 1 else None  # [1, T, D]
    ran = 0

    def check(i: int, x: torch.Tensor) -> None:
        nonlocal ran, read_before
        ran += 1
        depth.add_(active.cpu())
        if first <= ran < len(blocks):
            read_now = model.ln_f(x)  # [1, T, D]
            stable = exit_score(model, block_set, i, read_now, read_before)[0] >= block_set.adaptive_threshold
            active.logical_and_(~(stable & may_exit))  # exited positions keep their exit state
            read_before = read_now
        elif cosine and ran == first - 1:
            read_before = model.ln_f(x)  # [1, T, D]: the read entering the first checked block

    keep = lambda i: active[None, :, None]  # [1, T, 1]
    x = model.run_blocks(x, blocks, overwrite=block_set.overwrite, keep=keep, after=check)  # [1, T, D]
    return model.unembed(x), [blocks[:d] for d in depth.tolist()]


@torch.inference_mode()
def score(model: GPT, tokens: list[int], block_set: BlockSet | None = None) -> Score:
    """Mean next-token loss (nats) of ``tokens`` under ``block_set``, with the loss of each token."""
    cfg = model.config
    block_set = (block_set or BlockSet()).validate(cfg.n_layer)
    if not 2 <= len(tokens) <= cfg.block_size + 1:
        raise UserError(f"tokens: need 2..{cfg.block_size + 1} tokens to score, got {len(tokens)}")
    idx = torch.tensor([tokens], device=model.wte.weight.device)  # [1, T+1]
    blocks = block_set.blocks_to_run(cfg.n_layer)
    if block_set.is_adaptive:
        logits, per_token = adaptive_forward(model, idx[:, :-1], block_set)
    else:
        logits, per_token = model(idx[:, :-1], block_set=block_set), [blocks] * (len(tokens) - 1)
    losses = F.cross_entropy(logits[0].float(), idx[0, 1:], reduction="none")  # [T]
    return Score(
        mean_loss=float(losses.mean()),
        token_losses=losses.tolist(),
        blocks_run=blocks,
        blocks_per_token=per_token,
    )


# ---------------------------------------------------------------------------------------------------
# blocklab generate / blocklab score


def _parser(command: str) -> argparse.ArgumentParser:
    what = "generate text after a prompt" if command == "generate" else "mean next-token loss of a text"
    parser = argparse.ArgumentParser(prog=f"blocklab {command}", description=f"{what}, under a block set.")
    parser.add_argument("--model", default="builtin", help="builtin | gpt2-random | HF id or dir | ckpt.pt")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", "--text", dest="text", help="the text (prompt for generate)")
    text.add_argument("--file", help="read the text from this UTF-8 file ('-': stdin)")
    parser.add_argument(
        "--blocks", default="all", help="block set spec, e.g. skip=3,4 | exit=6 | adaptive=0.9;min=4"
    )
    parser.add_argument(
        "--dtype", choices=WEIGHT_DTYPES, default="float32", help="int8 / int4: weight-only (lab.quantize)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    if command == "generate":
        parser.add_argument("--max-new-tokens", type=int, default=64)
        parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
        parser.add_argument("--top-k", type=int, default=None)
        parser.add_argument("--seed", type=int, default=None)
    return parser


def _read_text(args: argparse.Namespace) -> str:
    if args.text is not None:
        return args.text
    if args.file == "-":
        return sys.stdin.read()
    with open(args.file, encoding="utf-8") as f:
        return f.read()


def _run_generate(model: GPT, block_set: BlockSet, args: argparse.Namespace, text: str) -> dict:
    from lab import tokens

    prompt = tokens.encode(text, allow_endoftext=True)
    steps: list[Step] = []
    times: list[float] = [time.perf_counter()]  # start, then the moment each token was ready
    speculation = SpeculationStats()

    def generated_tokens() -> Iterator[int]:
        stream = generate(
            model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
            seed=args.seed, stop_token=tokens.EOT, block_set=block_set, speculation=speculation,
        )  # fmt: skip
        for step in stream:
            times.append(time.perf_counter())
            steps.append(step)
            yield step.token

    for piece in tokens.text_pieces(generated_tokens()):
        if not args.json:
            print(piece, end="", flush=True)
    decode_ms = (times[-1] - times[1]) * 1e3 / (len(steps) - 1) if len(steps) > 1 else float("nan")
    return {
        "model": args.model,
        "blocks": str(block_set),
        "prompt_tokens": len(prompt),
        "text": tokens.decode([s.token for s in steps]),
        "tokens": [s.token for s in steps],
        "blocks_per_token": [s.blocks_run for s in steps],
        "mean_blocks": mean_blocks(steps),
        "finish_reason": steps[-1].finish_reason if steps else "context_length",
        "first_token_ms": (times[1] - times[0]) * 1e3 if steps else float("nan"),
        "decode_ms_per_token": decode_ms,
        "speculation": {**asdict(speculation), "acceptance_rate": speculation.acceptance_rate}
        if block_set.is_speculative
        else None,
    }


def _run_score(model: GPT, block_set: BlockSet, args: argparse.Namespace, text: str) -> dict:
    from lab import tokens

    ids = tokens.encode(text, allow_endoftext=True)
    limit = model.config.block_size + 1
    if len(ids) > limit:
        print(f"note: scoring the first {limit} of {len(ids)} tokens (the context length)", file=sys.stderr)
        ids = ids[:limit]
    result = score(model, ids, block_set)
    return {
        "model": args.model,
        "blocks": str(block_set),
        **asdict(result),
        "mean_blocks": result.mean_blocks,
    }


def main(argv: list[str]) -> int:
    """``blocklab generate ...`` / ``blocklab score ...``: argv[0] is the subcommand."""
    command, rest = argv[0], argv[1:]
    args = _parser(command).parse_args(rest)
    if args.threads:
        torch.set_num_threads(args.threads)
    text = _read_text(args)  # before the model loads: a wrong path fails at once
    model = load(args.model, args.dtype)
    try:
        block_set = BlockSet.parse(args.blocks, model.config.n_layer)
    except ValueError as error:
        raise UserError(f"--blocks: {error}") from None
    if command == "generate":
        result = _run_generate(model, block_set, args, text)
        speculation = result["speculation"]
        accepted = f", drafts accepted {speculation['acceptance_rate']:.0%}" if speculation else ""
        if args.json:
            print(json.dumps(result))
        else:
            print(
                f"\n[{len(result['tokens'])} tokens, {result['mean_blocks']:.2f} of {model.config.n_layer} "
                f"blocks/token, {result['decode_ms_per_token']:.1f} ms/token, "
                f"stopped: {result['finish_reason']}{accepted}]",
                file=sys.stderr,
            )
        return 0
    result = _run_score(model, block_set, args, text)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['mean_loss']:.4f} nats/token over {len(result['token_losses'])} tokens, "
            f"blocks {result['blocks']}, {result['mean_blocks']:.2f} of {model.config.n_layer} blocks/token"
        )
    return 0
