"""The text a lens is fitted and measured on, and the streams the frozen model leaves in it.

windows, source = calibration_windows(model, prompts=None)   # the standard library's training files
calibration, held_out = split_held_out(windows)              # every 8th window held out
leaving, final = streams(model, window, blocks=[0, 1, 2])     # [n, T, D], [T, D]
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from lab import corpora, tokens
from lab.errors import UserError
from lab.exit_probe import probe_windows
from lab.model import GPT

CALIBRATION_WINDOWS = 96
"""Windows of the model's context drawn from the standard library's training files by default."""
HELD_OUT_EVERY = 8
"""Every 8th calibration window is held out of the fit, to measure it."""


def text_windows(ids: list[int], length: int) -> list[list[int]]:
    """``ids`` cut into consecutive windows of ``length`` tokens (at least two windows: shorter ones
    for a short text); the last, shorter window kept if it has two tokens or more."""
    length = min(length, len(ids) // 2)
    if length < 2:
        raise UserError(f"the text has {len(ids)} tokens: a lens needs at least 4 to fit and measure on")
    windows = [ids[start : start + length] for start in range(0, len(ids), length)]
    return [window for window in windows if len(window) >= 2]


def calibration_windows(
    model: GPT, prompts: Path | None, count: int = CALIBRATION_WINDOWS
) -> tuple[list[list[int]], str]:
    """Windows of the model's context to fit on, and what they are: of the text in ``prompts``, or by
    default the standard library's training files as ``lab.exit_probe.probe_windows`` draws them (one
    from the middle of each of ``count`` files spread over it; never the files it holds out)."""
    if model.config.vocab_size < tokens.VOCAB_SIZE:
        raise UserError(f"text needs a model with GPT-2's vocabulary; this one has {model.config.vocab_size}")
    length = model.config.block_size
    if prompts is not None:
        ids = tokens.encode(Path(prompts).read_text(encoding="utf-8"), allow_endoftext=True)
        return text_windows(ids, length)[:count], f"{prompts} ({len(ids):,} tokens)"
    windows = probe_windows(corpora.stdlib_files(), length, corpora.HELD_OUT_EVERY, count)
    if len(windows) < 2:
        raise UserError(f"the standard library has fewer than 2 training files of {2 * length} tokens")
    return windows, f"{len(windows)} windows of {length} tokens from the standard library's training files"


def split_held_out(
    windows: list[list[int]], every: int = HELD_OUT_EVERY
) -> tuple[list[list[int]], list[list[int]]]:
    """(calibration, held out): every ``every``-th window, the first included, is held out."""
    held_out = windows[::every]
    calibration = [window for i, window in enumerate(windows) if i % every != 0]
    if not calibration:
        raise UserError(f"{len(windows)} window(s): too few to hold every {every}th out and fit on the rest")
    return calibration, held_out


def fingerprint(windows: list[list[int]]) -> str:
    """sha256 of the windows' tokens (int32, each window's length first): the calibration text."""
    digest = hashlib.sha256()
    for window in windows:
        digest.update(torch.tensor([len(window), *window], dtype=torch.int32).numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def streams(model: GPT, window: list[int], blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For one window: the streams leaving ``blocks`` [n, T, D] and the final stream [T, D]."""
    taps: dict[int, torch.Tensor] = {}
    final = model.residual_stream(torch.tensor([window], device=model.wte.weight.device), taps=taps)
    return torch.stack([taps[i][0] for i in blocks]), final[0]  # [n, T, D], [T, D]


def batch_streams(
    model: GPT, windows: list[list[int]], blocks: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``streams`` of several windows, their positions concatenated: [n, P, D] and [P, D]."""
    parts = [streams(model, window, blocks) for window in windows]
    return torch.cat([s for s, _ in parts], dim=1), torch.cat([f for _, f in parts])
