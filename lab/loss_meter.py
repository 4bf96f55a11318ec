"""Text cut into windows of tokens, and the mean next-token loss of those windows under any block set,
each measured once: what ``blocklab plan`` chooses and grades block sets with.

    windows, source = read_windows(model, None, max_tokens=20_000, window=256)
    calibration, evaluation = split(windows)
    meter = LossMeter(model, evaluation)
    meter(BlockSet(skip=frozenset({3, 4})))       # nats per predicted token
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.blocks import BlockSet
from lab.errors import UserError
from lab.generate import score
from lab.hooks import capture
from lab.lens.translator import exit_translator, require_tuned_lens, translate_exits
from lab.model import GPT
from lab.quantize import QuantizedLinear

BATCH_TOKENS = 512
"""Positions per batched forward pass. Small, so that one batch's logits (positions x V floats) come
back from the allocator's free memory instead of being mapped afresh from the OS every batch, which
spent as much system time as the work itself."""
CACHE_BYTES = 2**30
"""Most memory ``LossMeter`` keeps the full stack's stream in (the input of every block, every token)."""


# ---------------------------------------------------------------------------------------------------
# Text: windows of tokens, split into calibration and evaluation


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    """Cut ``ids`` into windows of ``window`` + 1 tokens overlapping by one, so each token after the
    first is predicted exactly once; the last window may be shorter (at least 2 tokens)."""
    return [ids[start : start + window + 1] for start in range(0, max(len(ids) - 1, 0), window)]


def read_windows(
    model: GPT, prompts: Path | None, max_tokens: int, window: int
) -> tuple[list[list[int]], str]:
    """Windows of at most ``max_tokens`` GPT-2 tokens in all, and where the text came from.

    ``prompts``: a ``.jsonl`` file (a ``prompt`` field or a string per line, each prompt windowed on its
    own) or any other UTF-8 text file, windowed whole. None: the standard-library source the builtin
    model never trained on (``lab.corpora.held_out_stdlib_files``), as ``ablate`` and ``bus`` read.
    """
    from lab import tokens
    from lab.analysis.common import held_out_source

    if model.config.vocab_size < tokens.VOCAB_SIZE:
        raise UserError(
            f"the text is GPT-2 tokens and this model's vocabulary has {model.config.vocab_size} rows"
        )
    window = min(window, model.config.block_size)
    if prompts is None:
        text, names = held_out_source(8 * max_tokens + 1024)  # ~4 characters a token: enough text
        names = names.split(", ")
        texts, source = [text], f"held-out standard-library source ({names[0]} .. {names[-1]})"
    elif prompts.suffix == ".jsonl":
        texts, source = [], str(prompts)
        for number, line in enumerate(prompts.read_text(encoding="utf-8").splitlines(), start=1):
            record = json.loads(line) if line.strip() else ""
            text = record.get("prompt") if isinstance(record, dict) else record
            if not isinstance(text, str):
                raise UserError(f"{prompts}:{number}: expected a string or an object with a prompt field")
            texts.append(text)
    else:
        texts, source = [prompts.read_text(encoding="utf-8")], str(prompts)
    windows, total = [], 0
    for text in texts:
        for piece in windows_of(tokens.encode(text, allow_endoftext=True), window):
            piece = piece[: max_tokens - total + 1]  # the +1: a window's first token is not predicted
            if len(piece) >= 2:
                windows.append(piece)
                total += len(piece) - 1
        if total >= max_tokens:
            break
    if total == 0:
        raise UserError(f"{source}: no text in it")
    if len(windows) < 2:
        raise UserError(
            f"{source}: {total} tokens to predict in {len(windows)} window(s); a plan needs at least two "
            "windows (one to choose on, one to measure on)"
        )
    return windows, f"{source}, {total} tokens"


def split(
    windows: list[list[int]], calibration_share: float = 0.5
) -> tuple[list[list[int]], list[list[int]]]:
    """The first ``calibration_share`` of the windows to choose on, the rest to measure on: contiguous
    parts, so the two share at most the file (or prompt) that the cut falls in."""
    cut = min(max(1, round(len(windows) * calibration_share)), len(windows) - 1)
    return windows[:cut], windows[cut:]


def batches(windows: list[list[int]], device: torch.device) -> Iterator[torch.Tensor]:
    """Windows of equal length stacked, at most ``BATCH_TOKENS`` positions a batch. [B, T+1] each."""
    by_length: dict[int, list[list[int]]] = defaultdict(list)
    for w in windows:
        by_length[len(w)].append(w)
    for length, group in by_length.items():
        rows = max(1, BATCH_TOKENS // length)
        for start in range(0, len(group), rows):
            yield torch.tensor(group[start : start + rows], device=device)  # [B, T+1]


# ---------------------------------------------------------------------------------------------------
# Loss under a block set


class LossMeter:
    """Mean next-token loss of a set of windows under any block set, each set measured once.

    Fixed sets run batched. The stream entering every block under all blocks is kept (within
    ``CACHE_BYTES``), so a set starts at its first skipped block or its exit: the blocks before it
    would compute the same stream again; a ``lens=tuned`` set reads its exit through the model's tuned
    lens (``lab.lens.translator``). Adaptive sets decide per token, so they run window by window
    through ``lab.generate.score``. The read-out uses the token table's distinct rows, each counted as
    often as it repeats: exact, and for a model whose never-seen tokens share one row (the builtin models,
    docs/analysis.md) it skips most of the unembedding, the bulk of a narrow model's work.
    """

    def __init__(self, model: GPT, windows: list[list[int]]):
        self.model, self.windows = model, windows
        self.tokens = sum(len(w) - 1 for w in windows)
        self.batches = list(batches(windows, model.wte.weight.device))  # [B, T+1] each
        self.measured: dict[str, float] = {}
        self.mean_blocks: dict[str, float] = {}
        """Blocks run per predicted token, per measured set (varies only under adaptive exit)."""
        self.table = None
        if not isinstance(model.read_out, QuantizedLinear):  # a quantized read-out has no rows to compare
            weight = model.wte.weight.detach()  # [V, D]
            bias = model.logit_bias if model.logit_bias is not None else weight.new_zeros(len(weight))  # [V]
            rows, self.row_of, counts = torch.unique(
                torch.cat([weight, bias[:, None]], dim=1), dim=0, return_inverse=True, return_counts=True
            )  # [U, D + 1]: a row and its bias, [V] token -> its row, [U]
            self.table, self.table_bias = rows[:, :-1], rows[:, -1]  # [U, D], [U]
            self.repeated = (counts > 1).nonzero()[:, 0]  # [R] rows that stand for several tokens
            self.log_repeats = counts[self.repeated].float().log()  # [R]
        cfg, weight = model.config, model.wte.weight
        size = self.tokens * cfg.n_embd * (cfg.n_layer + 1) * weight.element_size()
        self.cached = None
        if size <= CACHE_BYTES:
            self.cached = list(self.streams())

    def streams(self) -> Iterator[list[torch.Tensor]]:
        """Per batch, the stream entering each block under all blocks, then leaving the last.
        L+1 x [B, T, D]"""
        if self.cached is not None:
            yield from self.cached
            return
        L = self.model.config.n_layer
        names = [f"blocks.{i}.resid_pre" for i in range(L)] + [f"blocks.{L - 1}.resid_post"]
        for idx in self.batches:
            with torch.inference_mode(), capture(self.model, names) as seen:
                self.model.residual_stream(idx[:, :-1])
            yield [seen[name] for name in names]

    def __call__(self, block_set: BlockSet) -> float:
        spec = str(block_set)
        if spec not in self.measured:
            if block_set.is_adaptive:
                scores = [score(self.model, w, block_set) for w in self.windows]
                total = sum(s.mean_loss * len(s.token_losses) for s in scores)
                ran = sum(sum(s.blocks_per_token) for s in scores)
            else:
                total = self._fixed_total(block_set)
                ran = len(block_set.blocks_to_run(self.model.config.n_layer)) * self.tokens
            self.measured[spec] = total / self.tokens
            self.mean_blocks[spec] = ran / self.tokens
        return self.measured[spec]

    @torch.inference_mode()
    def _fixed_total(self, block_set: BlockSet) -> float:
        model, L = self.model, self.model.config.n_layer
        top = L if block_set.exit_at is None else block_set.exit_at
        first = min([*block_set.skip, *block_set.overwrite, top])  # the first block that differs
        lens = require_tuned_lens(model, block_set)
        exit_block = exit_translator(lens, block_set.blocks_to_run(L))  # lens=tuned: read through it
        total = 0.0
        for b, idx in enumerate(self.batches):
            if self.cached is None:
                x = model.residual_stream(idx[:, :-1], block_set=block_set)  # [B, T, D]
            else:
                x = self.cached[b][first]  # [B, T, D]
                for i in [i for i in block_set.blocks_to_run(L) if i >= first]:
                    x = model.blocks[i](x, overwrite=i in block_set.overwrite)
            x = translate_exits(lens, x, [exit_block] * len(x))  # [B, T, D]
            total += float(self.token_losses(x, idx[:, 1:]).double().sum())
        return total

    def token_losses(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of ``targets`` [B, T] under the read-out of stream ``x`` [B, T, D]. [B, T]"""
        if self.table is None:
            logits = self.model.unembed(x).float()  # [B, T, V]
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        logits = F.linear(self.model.ln_f(x), self.table, self.table_bias).float()  # [B, T, U]
        target = logits.gather(-1, self.row_of[targets][..., None])[..., 0]  # [B, T]
        logits[..., self.repeated] += self.log_repeats  # a row counts once per token it stands for
        return torch.logsumexp(logits, dim=-1) - target


# ---------------------------------------------------------------------------------------------------
# Proxies: how far each block (or run of blocks) turns the stream


def stream_angles(meter: LossMeter, max_span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over tokens of cos(x_l, x_l+k) and of arccos(cos(x_l, x_l+k)) / pi, for every start l and
    span k <= ``max_span`` (x_l: the stream entering block l; x_L: leaving the last), on ``meter``'s
    windows. [L, K+1] each, NaN where l + k > L; column 0 unused."""
    L = meter.model.config.n_layer
    cos_sum = torch.zeros(L, max_span + 1, dtype=torch.float64)
    angle_sum = torch.zeros_like(cos_sum)
    for streams in meter.streams():
        stream = [x.flatten(0, 1).double() for x in streams]  # L+1 x [N, D]
        for start in range(L):
            for k in range(1, min(max_span, L - start) + 1):
                cos = F.cosine_similarity(stream[start], stream[start + k], dim=-1).clamp(-1.0, 1.0)  # [N]
                cos_sum[start, k] += cos.sum()
                angle_sum[start, k] += (torch.arccos(cos) / math.pi).sum()
    valid = torch.tensor([[1 <= k <= L - start for k in range(max_span + 1)] for start in range(L)])
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    count = meter.tokens
    return torch.where(valid, cos_sum / count, nan), torch.where(valid, angle_sum / count, nan)
