"""Fitting a tuned lens with the model frozen: KL(final distribution || translated exit's) on
calibration windows of text, measured on held-out windows, resumable from a checkpoint.

    lens = fit_tuned_lens(model, calibration, held_out, Recipe(steps=60))   # or with checkpoint=PATH

All blocks are fitted jointly, one optimiser over every translator: the loss is the sum over blocks of
each block's KL and translator i appears only in block i's term, so each gets exactly the gradient a
fit of its own would give (Adam's and SGD's updates are per parameter) — a joint fit is the per-block
fits sharing one pass of the frozen model and one final distribution per batch, which is where the
time would otherwise go twice. (Gradient clipping by the global norm, ``Recipe.clip``, which
tuned-lens uses, is the one thing that couples them.)

Two recipes:
- ``init="regression"`` with Adam (the default, for minutes on a CPU): every translator starts at the
  least-squares map from its block's stream to the final stream normalised as ``ln_f`` normalises it
  (closed form, one pass over the calibration text), then Adam on the KL from there.
- ``init="identity"`` with ``optimizer="sgd"``: Belrose et al.'s recipe as the ``tuned-lens`` package
  0.2.0 trains it (``tuned_lens/scripts/train_loop.py`` and ``ingredients.py``): identity at start, SGD
  with Nesterov momentum 0.9 at lr 1.0 x (1 - 0.9), weight decay 1e-3, the lr decayed linearly to zero,
  the gradient clipped to norm 1.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from lab import corpora, tokens
from lab.errors import UserError
from lab.exit_probe import probe_windows
from lab.lens.translator import ReadOut, TunedLens, model_fingerprint
from lab.model import GPT

CHECKPOINT = "tuned_lens.checkpoint.pt"
"""The fit's checkpoint, beside where the lens is saved; removed once the lens is."""


@dataclass
class Recipe:
    """How a lens is fitted."""

    steps: int = 60
    """Optimiser steps."""
    windows_per_step: int = 4
    """Calibration windows (of the model's context) whose positions make one step's batch."""
    rank: int | None = None
    """Translators of rank r (identity + U V^T); None: full D x D."""
    init: Literal["regression", "identity"] = "regression"
    """regression: start at the least-squares map to the normalised final stream; identity: the logit
    lens."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """adam; or sgd with Nesterov momentum, as tuned-lens trains."""
    lr: float | None = None
    """Peak learning rate (None: 1e-3 for Adam, tuned-lens's 1.0 x (1 - momentum) for SGD)."""
    momentum: float = 0.9
    """SGD's momentum, Adam's beta1."""
    weight_decay: float = 0.0
    """Pulls each translator towards the identity (tuned-lens: 1e-3)."""
    warmup_steps: int = 0
    """Steps of linear warm-up before the linear decay to zero."""
    clip: float | None = None
    """Clip the gradient of all translators together to this norm (tuned-lens: 1.0)."""
    seed: int = 0
    """Seeds the order of the calibration windows (and a low-rank identity's random factor)."""
    checkpoint_every: int = 10
    """Steps between checkpoints (when fitting with one)."""


BELROSE = Recipe(init="identity", optimizer="sgd", weight_decay=1e-3, clip=1.0)
"""tuned-lens 0.2.0's defaults (its steps and batch are sized for GPUs: 250 x 2^18 tokens)."""


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


def normalised(model: GPT, final: torch.Tensor) -> torch.Tensor:
    """The final stream [.., D] normalised as ``ln_f`` normalises it, without its gain and bias: what a
    translator's output should match for the read-out to see the final stream's direction."""
    norm = model.ln_f
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(final, norm.normalized_shape, eps=norm.eps)
    if isinstance(norm, nn.RMSNorm):
        return F.rms_norm(final, norm.normalized_shape, eps=norm.eps)
    return final  # post-LN and DeepNorm: the stream leaving the stack is already normalised


@torch.no_grad()
def regression_init(model: GPT, lens: TunedLens, windows: list[list[int]], blocks: list[int]) -> None:
    """Set ``blocks``' translators to the least-squares affine map from the block's stream to the
    normalised final stream over ``windows`` (at rank r: its best rank-r correction of the identity),
    in place. Normal equations in float64, with a ridge of 1e-6 of the mean diagonal for safety."""
    D = model.config.n_embd
    gram = torch.zeros(len(blocks), D + 1, D + 1, dtype=torch.float64)  # [n, D+1, D+1]
    cross = torch.zeros(len(blocks), D + 1, D, dtype=torch.float64)  # [n, D+1, D]
    for window in windows:
        leaving, final = streams(model, window, blocks)  # [n, T, D], [T, D]
        ones = leaving.new_ones(*leaving.shape[:2], 1)  # [n, T, 1]
        x = torch.cat([leaving, ones], dim=-1).double().cpu()  # [n, T, D+1]
        gram += x.transpose(1, 2) @ x  # [n, D+1, D+1]
        cross += x.transpose(1, 2) @ normalised(model, final).double().cpu()  # [n, D+1, D]
    ridge = 1e-6 * gram.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None]  # [n, 1, 1]
    solved = torch.linalg.solve(gram + ridge * torch.eye(D + 1, dtype=torch.float64), cross)  # [n, D+1, D]
    delta = (solved[:, :D] - torch.eye(D, dtype=torch.float64)).float()  # [n, D, D]
    index = torch.tensor(blocks)
    lens.bias[index] = solved[:, D].float().to(lens.bias.device)
    if lens.weight is not None:
        lens.weight[index] = delta.to(lens.weight.device)
        return
    u, s, vh = torch.linalg.svd(delta)  # [n, D, D], [n, D], [n, D, D]
    r = lens.rank
    root = s[:, :r].sqrt()  # [n, r]
    lens.down[index] = (u[:, :, :r] * root[:, None]).to(lens.down.device)  # [n, D, r]
    lens.up[index] = (root[:, :, None] * vh[:, :r]).to(lens.up.device)  # [n, r, D]


def block_kl(read_out: ReadOut, lens: TunedLens, block: int, stream: torch.Tensor, target: torch.Tensor):
    """Mean over positions of KL(target || read-out of the translated stream): stream [P, D] leaving
    ``block``, target the final distribution's log-probabilities [P, C]."""
    log_q = F.log_softmax(read_out.logits(lens(block, stream)).float(), dim=-1)  # [P, C]
    return F.kl_div(log_q, target, log_target=True, reduction="batchmean")


@torch.no_grad()
def held_out_kl(
    model: GPT, lens: TunedLens, windows: list[list[int]], blocks: list[int]
) -> dict[str, list[float]]:
    """Mean KL(final || exit) per block of ``blocks`` over every position of ``windows``: through
    ``lens`` ("tuned") and through no translator ("logit", the logit lens)."""
    read_out, identity = ReadOut(model), TunedLens.identity(lens.n_layer, lens.width).to(lens.bias.device)
    totals = {"tuned": torch.zeros(len(blocks)), "logit": torch.zeros(len(blocks))}
    positions = 0
    for window in windows:
        leaving, final = streams(model, window, blocks)  # [n, T, D], [T, D]
        target = F.log_softmax(read_out.logits(final).float(), dim=-1)  # [T, C]
        for name, applied in (("tuned", lens), ("logit", identity)):
            for j, block in enumerate(blocks):
                totals[name][j] += float(block_kl(read_out, applied, block, leaving[j], target)) * len(window)
        positions += len(window)
    return {name: (total / positions).tolist() for name, total in totals.items()}


def step_windows(count: int, per_step: int, step: int, seed: int) -> list[int]:
    """The calibration windows of ``step``: consecutive slices of seeded permutations, one per pass
    over the ``count`` windows. A function of the step alone, so a resumed fit reads what an
    uninterrupted one would."""
    picked = []
    for k in range(step * per_step, (step + 1) * per_step):
        epoch, offset = divmod(k, count)
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        picked.append(int(order[offset]))
    return picked


def make_optimizer(recipe: Recipe, parameters: list[torch.Tensor]) -> tuple[torch.optim.Optimizer, float]:
    """The optimiser and its peak learning rate."""
    if recipe.optimizer == "sgd":
        lr = recipe.lr if recipe.lr is not None else 1.0 * (1 - recipe.momentum)
        optimizer = torch.optim.SGD(
            parameters, lr=lr, momentum=recipe.momentum, nesterov=True, weight_decay=recipe.weight_decay
        )
        return optimizer, lr
    lr = recipe.lr if recipe.lr is not None else 1e-3
    betas = (recipe.momentum, 0.999)
    return torch.optim.Adam(parameters, lr=lr, betas=betas, weight_decay=recipe.weight_decay), lr


def learning_rate(recipe: Recipe, peak: float, step: int) -> float:
    """Linear warm-up over ``warmup_steps``, then linear decay to zero at ``steps``."""
    if step < recipe.warmup_steps:
        return peak * (step + 1) / recipe.warmup_steps
    return peak * (recipe.steps - step) / max(recipe.steps - recipe.warmup_steps, 1)


def check_blocks(blocks: list[int] | None, n_layer: int) -> list[int]:
    """The blocks to fit, sorted: every one but the last by default (its stream is the target)."""
    if blocks is None:
        return list(range(n_layer - 1))
    bad = sorted(set(i for i in blocks if not 0 <= i < n_layer - 1))
    if bad:
        raise UserError(f"blocks: {bad} out of 0..{n_layer - 2} (the last block's stream is the target)")
    if len(set(blocks)) != len(blocks) or not blocks:
        raise UserError(f"blocks: {blocks} names no block, or one twice")
    return sorted(blocks)


def save_checkpoint(path: Path, step: int, lens: TunedLens, optimizer, identity: dict) -> None:
    """The translators, the optimiser's state and what the fit is of (``identity``), through a
    temporary name then renamed."""
    temporary = path.with_name(path.name + ".tmp")
    tensors = {name: tensor.detach().cpu().clone() for name, tensor in lens.tensors().items()}
    torch.save({"step": step, "tensors": tensors, "optimizer": optimizer.state_dict(), **identity}, temporary)
    temporary.replace(path)


def load_checkpoint(path: Path, identity: dict) -> dict:
    """A checkpoint of this same fit (UserError naming what differs, or that there is none)."""
    if not path.exists():
        raise UserError(f"--resume: no checkpoint {path}: nothing to resume (fit without --resume)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    for key, value in identity.items():
        if state.get(key) != value:
            raise UserError(
                f"--resume: {path} is a fit of another {key} ({state.get(key)!r}, now {value!r}); "
                "fit without --resume to start again"
            )
    return state


@contextmanager
def frozen(model: GPT) -> Iterator[None]:
    """Within: no gradient reaches ``model``'s parameters (a fit only reads them)."""
    wanted = {name: p.requires_grad for name, p in model.named_parameters()}
    model.requires_grad_(False)
    try:
        yield
    finally:
        for name, p in model.named_parameters():
            p.requires_grad_(wanted[name])


def fit_tuned_lens(
    model: GPT,
    calibration: list[list[int]],
    held_out: list[list[int]],
    recipe: Recipe | None = None,
    blocks: list[int] | None = None,
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
) -> TunedLens:
    """A lens for ``model`` fitted on ``calibration`` windows, with the held-out KL per block (tuned and
    logit lens, on ``held_out``) in its metadata. ``checkpoint``: save the state there every
    ``recipe.checkpoint_every`` steps, and with ``resume`` continue from it (the same result as an
    uninterrupted fit); removed at the end. ``recipe``: default ``Recipe()``."""
    recipe = recipe or Recipe()
    blocks = check_blocks(blocks, model.config.n_layer)
    identity = {
        "calibration_sha256": fingerprint(calibration + held_out),
        "model_fingerprint": model_fingerprint(model),
        "blocks": blocks,
        "recipe": dataclasses.asdict(recipe),
    }
    state = load_checkpoint(checkpoint, identity) if resume else None
    with frozen(model):
        lens, optimizer, peak = start_fit(model, calibration, recipe, blocks, state)
        steps = tqdm(
            range(0 if state is None else state["step"], recipe.steps), total=recipe.steps,
            initial=0 if state is None else state["step"], desc="lens fit", unit="step",
            disable=not progress, dynamic_ncols=True,
        )  # fmt: skip
        for step in steps:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(recipe, peak, step)
            chosen = step_windows(len(calibration), recipe.windows_per_step, step, recipe.seed)
            kl = train_step(model, lens, [calibration[i] for i in chosen], blocks, optimizer, recipe.clip)
            steps.set_postfix(kl=f"{kl:.3f}")
            done = step + 1
            if checkpoint is not None and done % recipe.checkpoint_every == 0 and done < recipe.steps:
                save_checkpoint(checkpoint, done, lens, optimizer, identity)
        fitted = lens.detached()
        kl = held_out_kl(model, fitted, held_out, blocks)
    fitted.blocks = tuple(blocks)
    fitted.metadata = {
        **{key: identity[key] for key in ("calibration_sha256", "model_fingerprint", "recipe")},
        "steps": recipe.steps,
        "calibration_windows": len(calibration),
        "held_out_windows": len(held_out),
    }
    for name, values in kl.items():  # per block of the model, None where not fitted
        per_block = dict(zip(blocks, values, strict=True))
        fitted.metadata[f"held_out_kl_{name}"] = [per_block.get(i) for i in range(model.config.n_layer)]
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return fitted


def start_fit(
    model: GPT, calibration: list[list[int]], recipe: Recipe, blocks: list[int], state: dict | None
) -> tuple[TunedLens, torch.optim.Optimizer, float]:
    """The lens to fit (from the checkpoint ``state``, else initialised by ``recipe.init``), its
    optimiser (restored from ``state``) and the peak learning rate."""
    cfg, device = model.config, model.wte.weight.device
    if state is not None:
        lens = TunedLens(**state["tensors"]).to(device)
    else:
        lens = TunedLens.identity(cfg.n_layer, cfg.n_embd, recipe.rank, recipe.seed).to(device)
        if recipe.init == "regression":
            regression_init(model, lens, calibration, blocks)
    optimizer, peak = make_optimizer(recipe, [t.requires_grad_() for t in lens.tensors().values()])
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    return lens, optimizer, peak


def train_step(
    model: GPT, lens: TunedLens, batch: list[list[int]], blocks: list[int], optimizer, clip: float | None
) -> float:
    """One optimiser step on the positions of ``batch``; the mean KL over blocks before it."""
    read_out = ReadOut(model)
    leaving, final = batch_streams(model, batch, blocks)  # [n, P, D], [P, D]
    with torch.no_grad():
        target = F.log_softmax(read_out.logits(final).float(), dim=-1)  # [P, C]
    total = 0.0
    for j, block in enumerate(blocks):  # one block's logits at a time: [P, C] each, not [n, P, C]
        kl = block_kl(read_out, lens, block, leaving[j], target)
        kl.backward()
        total += float(kl.detach())
    if clip is not None:
        torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], clip)
    optimizer.step()
    optimizer.zero_grad()
    return total / len(blocks)
