"""Incremental decoding under a block set: a KV cache per sequence, many sequences in one step.

    decoder = Decoder(model, BlockSet.parse("skip=5", 12))
    logits = decoder.prefill(tokens.encode("def main("))   # [V] after the prompt
    logits, blocks_run = decoder.step(token)                # one token more
    logits, blocks_run = decode_rows(model, decoders, fed)  # one token for each of many decoders

``decode_rows`` is the one decoding loop: ``Decoder.step``, ``lab.generate`` and the server's engine
all take their steps through it. Each row is at its own position with its own cache, under its own
block set.

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
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from lab.blocks import BlockSet
from lab.errors import UserError
from lab.exit_probe import check_fits
from lab.lens.translator import exit_translator, require_tuned_lens, translate_exits
from lab.model import GPT, Block, KVCache, Linear, extend_cache
from lab.rows import ROWS_ALONE
from lab.sampling import greedy_token


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
        self.lens = require_tuned_lens(model, self.block_set)  # None: exits read out as they are
        self.blocks = self.block_set.blocks_to_run(self.cfg.n_layer)
        self.runs = frozenset(self.blocks)
        fast = model.fast  # lab.fast: a static-shape step where the set allows one
        self.fast = fast if fast is not None and fast.takes(self.block_set) else None
        weight = model.wte.weight
        if self.fast is not None:
            self.cache = self.fast.cache(self, max_len or self.cfg.block_size)  # a length bucket
        else:
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
        return self.read_out(self.extend(tokens)[None, -1:])[0, -1]  # [V]

    def read_out(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [1, T, V] of streams x [1, T, D] that left every block of the prefill's set (through
        the tuned lens's translator of its last block under lens=tuned)."""
        return self.model.unembed(translate_exits(self.lens, x, [self.exit_translator(len(self.blocks))]))

    def exit_translator(self, ran: int) -> int | None:
        """The translator that reads this decoder's stream after its first ``ran`` blocks (None: none)."""
        return exit_translator(self.lens, self.blocks[:ran])

    def step(self, token: int) -> tuple[torch.Tensor, list[int]]:
        """Feed one token; the logits [V] for the next one and the blocks that ran."""
        logits, blocks_run = decode_rows(self.model, [self], [token])
        return logits[0], blocks_run[0]

    def fast_step(self, token: int) -> tuple[torch.Tensor, list[int]]:
        """``step`` through the model's fast step (``lab.fast``; ``decode_rows`` decides when)."""
        if self.position >= self.cache.max_len:
            raise ValueError(f"context full: {self.cache.max_len} positions")
        lens_block = self.exit_translator(len(self.blocks))
        logits = self.fast.step(self.blocks, self.block_set.overwrite, self.cache, token, lens_block)  # [V]
        self.cache.length += 1
        return logits, list(self.blocks)


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
    (``propagate_kv``); a ``lens=tuned`` row that left early is read out through the translator of
    its last block (``lab.lens.translator.translate_exits``: one D x D product, at the read-out only).
    Under ``lab.rows.rows_alone`` a row's logits are bit for bit those it gets alone. Where the model
    has ``run_rows`` (``lab.block_kernel``), every row runs all its blocks in one call, computing what
    the loop over blocks computes; an adaptive row's check and its propagated keys and values in the
    call too (its arithmetic C's, torch's rounding kept: the same exits, the same values up to the
    last bits), unless the call cannot make the check (a hooked ``ln_f``): then that row takes the
    loop and the others the call. A row whose decoder has a fast step (``lab.fast``) takes it, alone,
    when it is the only row or under ``rows_alone``; the others run together here.
    """
    alone = len(decoders) == 1 or ROWS_ALONE.get()
    fast = [b for b, d in enumerate(decoders) if alone and d.fast is not None and d.fast.ready()]
    if not fast:
        return _decode_together(model, decoders, tokens)
    logits: list[torch.Tensor | None] = [None] * len(decoders)
    blocks_run: list[list[int] | None] = [None] * len(decoders)
    rest = [b for b in range(len(decoders)) if b not in fast]
    if rest:
        together = _decode_together(model, [decoders[b] for b in rest], [tokens[b] for b in rest])
        for b, row_logits, row_blocks in zip(rest, *together, strict=True):
            logits[b], blocks_run[b] = row_logits, row_blocks
    for b in fast:
        logits[b], blocks_run[b] = decoders[b].fast_step(tokens[b])
    return torch.stack(logits), blocks_run


def _decode_together(
    model: GPT, decoders: list[Decoder], tokens: list[int]
) -> tuple[torch.Tensor, list[list[int]]]:
    """``decode_rows``'s eager step: every row in one pass."""
    device = model.wte.weight.device
    B = len(decoders)
    positions = [decoder.position for decoder in decoders]
    for decoder in decoders:
        if decoder.position >= decoder.cache.max_len:
            raise ValueError(f"context full: {decoder.cache.max_len} positions")
    idx = torch.tensor(tokens, device=device)[:, None]  # [B, 1]
    x = model.embed_tokens(idx, torch.tensor(positions, device=device))  # [B, 1, D]
    ran = [0] * B  # blocks each row has run
    going = [True] * B  # False once a row is done: run in one call, or an adaptive row that exited
    called: list[int] = []  # the rows run_rows took: their unrun blocks' keys and values are written
    if model.run_rows is not None:
        fixed = [b for b, decoder in enumerate(decoders) if not decoder.block_set.is_adaptive]
        # every row's blocks in one call (lab.block_kernel), the same sums as block by block; where the
        # call cannot make an adaptive row's check, the fixed rows alone, the adaptive ones in the loop
        for rows in (list(range(B)), fixed) if len(fixed) < B else (fixed,):
            picked = [decoders[b] for b in rows]
            adaptive = [d.block_set if d.block_set.is_adaptive else None for d in picked]
            x_rows = x if len(rows) == B else x[rows]  # [R, 1, D]
            at = [positions[b] for b in rows]
            out = model.run_rows(
                model, x_rows, [d.blocks for d in picked], [d.cache for d in picked], at,
                [d.block_set.overwrite for d in picked], adaptive,
            ) if rows else None  # fmt: skip
            if out is not None:
                x_out, rows_ran = out  # [R, 1, D], blocks per row
                x = x_out if len(rows) == B else x.index_copy(0, torch.tensor(rows, device=device), x_out)
                for b, row_ran in zip(rows, rows_ran, strict=True):
                    ran[b], going[b] = row_ran, False
                called = rows
                break
    read_before: list[torch.Tensor | None] = [None] * B  # ln_f before the block just run, once checking
    for i, block in enumerate(model.blocks):
        if not any(going):  # every row done: in the one call, or exited
            break
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
        if b in called:
            continue
        for i in decoder.blocks[ran[b] :]:  # exited early: deeper blocks still need this position's K/V
            propagate_kv(model.blocks[i], x[b : b + 1], decoder.cache.layer(i), positions[b])
    exits = [decoder.exit_translator(ran[b]) for b, decoder in enumerate(decoders)]  # lens=tuned rows
    logits = model.unembed(translate_exits(model.tuned_lens, x, exits))[:, -1]  # [B, V]
    for b, decoder in enumerate(decoders):  # last: a step that raised can be run again as it was
        decoder.cache.length = positions[b] + 1
    return logits, [decoder.blocks[: ran[b]] for b, decoder in enumerate(decoders)]


def _checks_after(decoder: Decoder, ran: int) -> bool:
    """Whether an adaptive row checks for exit after its ``ran``-th block (never after its last)."""
    block_set = decoder.block_set
    return block_set.is_adaptive and block_set.adaptive_min_blocks <= ran < len(decoder.blocks)


def greedy_ms_per_token(model: GPT, block_set: BlockSet, prompt: list[int], n_tokens: int) -> float:
    """ms per token of batch-1 greedy decoding of ``n_tokens`` after ``prompt`` (its prefill not
    counted): what the benchmarks time."""
    decoder = Decoder(model, block_set, max_len=len(prompt) + n_tokens + 1)
    token = greedy_token(decoder.prefill(prompt))
    start = time.perf_counter()
    for _ in range(n_tokens):
        logits, _ = decoder.step(token)
        token = greedy_token(logits)
    return (time.perf_counter() - start) * 1e3 / n_tokens
