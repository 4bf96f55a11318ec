"""Fitting a tuned lens with the model frozen: KL(final distribution || translated exit's) on
calibration windows of text, measured on held-out windows, resumable from a checkpoint.

    lens = fit_tuned_lens(model, calibration, held_out, Recipe(steps=60))   # or with checkpoint=PATH

All blocks are fitted jointly, one optimiser over every translator: the loss is the sum over blocks of
each block's KL and translator i appears only in block i's term, so each gets exactly the gradient a
fit of its own would give (Adam's and SGD's updates are per parameter) — a joint fit is the per-block
fits sharing one pass of the frozen model and one final distribution per batch, which is where the
time would otherwise go twice. (Gradient clipping by the global norm, ``Recipe.clip``, which
tuned-lens uses, is the one thing that couples them.)

The default recipe starts each translator at the least-squares map from its block's stream to the
final stream normalised as ``ln_f`` normalises it (closed form, from one pass over the calibration
text), then runs Adam on the KL in whitened coordinates: the optimiser moves ``M~`` in
``translate(h) = h + [h, 1] R M~``, ``R`` the inverse Cholesky factor of the stream's second moment
``E[[h, 1]^T [h, 1]]`` at that block, so every direction of every block's stream has unit scale and one
learning rate fits them all (the raw streams' scales differ by orders of magnitude between features
and blocks, and Adam's step is the same size in each). The saved lens is mapped back to
``h + h A + b``: the whitening costs nothing at exit.

``BELROSE`` is Belrose et al.'s recipe as the ``tuned-lens`` package 0.2.0 trains it
(``tuned_lens/scripts/train_loop.py`` and ``ingredients.py``): identity at start, no whitening, SGD
with Nesterov momentum 0.9 at lr 1.0 x (1 - 0.9), weight decay 1e-3, the lr decayed linearly to zero,
the gradient clipped to norm 1.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from lab.errors import UserError
from lab.lens.data import batch_streams, fingerprint, streams
from lab.lens.translator import ReadOut, TunedLens, model_fingerprint
from lab.model import GPT

CHECKPOINT = "tuned_lens.checkpoint.pt"
"""The fit's checkpoint, beside where the lens is saved; removed once the lens is."""


@dataclass
class Recipe:
    """How a lens is fitted."""

    steps: int = 60
    """Optimiser steps."""
    windows_per_step: int = 2
    """Calibration windows (of the model's context) whose positions make one step's batch."""
    rank: int | None = None
    """Translators of rank r (identity + U V^T); None: full D x D."""
    init: Literal["regression", "identity"] = "regression"
    """regression: start at the least-squares map to the normalised final stream; identity: the logit
    lens."""
    whiten: bool = True
    """Optimise in the whitened coordinates of each block's stream (see the module docstring)."""
    optimizer: Literal["adam", "sgd"] = "adam"
    """adam; or sgd with Nesterov momentum, as tuned-lens trains."""
    lr: float | None = None
    """Peak learning rate (None: for Adam 0.01 / sqrt(D), see ``make_optimizer``; for SGD tuned-lens's
    1.0 x (1 - momentum))."""
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


BELROSE = Recipe(init="identity", whiten=False, optimizer="sgd", weight_decay=1e-3, clip=1.0)
"""tuned-lens 0.2.0's recipe (its steps and batch are sized for GPUs: 250 x 2^18 tokens)."""


def normalised(model: GPT, final: torch.Tensor) -> torch.Tensor:
    """The final stream [.., D] normalised as ``ln_f`` normalises it, without its gain and bias: what a
    translator's output should match for the read-out to see the final stream's direction."""
    norm = model.ln_f
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(final, norm.normalized_shape, eps=norm.eps)
    if isinstance(norm, nn.RMSNorm):
        return F.rms_norm(final, norm.normalized_shape, eps=norm.eps)
    return final  # post-LN and DeepNorm: the stream leaving the stack is already normalised


def with_ones(stream: torch.Tensor) -> torch.Tensor:
    """[.., D] -> [.., D + 1]: the stream and a 1, so that an affine map is one matrix."""
    return torch.cat([stream, stream.new_ones(*stream.shape[:-1], 1)], dim=-1)


@torch.no_grad()
def moments(model: GPT, windows: list[list[int]], blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Over every position of ``windows``, per block of ``blocks`` with x = [h, 1] its stream: the
    second moment E[x^T x] [n, D+1, D+1] and E[x^T z] [n, D+1, D] with z the normalised final stream
    (float64)."""
    D = model.config.n_embd
    gram = torch.zeros(len(blocks), D + 1, D + 1, dtype=torch.float64)  # [n, D+1, D+1]
    cross = torch.zeros(len(blocks), D + 1, D, dtype=torch.float64)  # [n, D+1, D]
    positions = 0
    for window in windows:
        leaving, final = streams(model, window, blocks)  # [n, T, D], [T, D]
        x = with_ones(leaving).double().cpu()  # [n, T, D+1]
        gram += x.transpose(1, 2) @ x  # [n, D+1, D+1]
        cross += x.transpose(1, 2) @ normalised(model, final).double().cpu()  # [n, D+1, D]
        positions += len(window)
    return gram / positions, cross / positions


class Translators:
    """The translators of the fitted blocks as the optimiser moves them: block j's is
    ``h + [h, 1] R_j M_j`` at full rank, ``h + ([h, 1] R_j U_j) V_j`` at rank r, ``R_j`` a fixed
    change of coordinates of its input (the whitening, or the identity). ``lens()`` maps them back to
    a ``TunedLens``."""

    def __init__(self, coordinates: torch.Tensor, factors: dict[str, torch.Tensor], blocks: list[int]):
        self.coordinates = coordinates  # [n, D+1, D+1]: R
        self.factors = factors  # {"M": [n, D+1, D]} or {"U": [n, D+1, r], "V": [n, r, D]}
        self.blocks = blocks

    @classmethod
    def start(cls, recipe: Recipe, gram: torch.Tensor, cross: torch.Tensor, blocks: list[int]) -> Translators:
        """At the recipe's start: the least-squares map to the normalised final stream (at rank r its
        best rank-r part in the optimiser's coordinates), or the identity. Solved with a ridge of 1e-6
        of the mean diagonal, in float64."""
        n, width = gram.shape[0], gram.shape[1]
        eye = torch.eye(width, dtype=torch.float64)
        ridged = gram + 1e-6 * gram.diagonal(dim1=1, dim2=2).mean(-1)[:, None, None] * eye  # [n, D+1, D+1]
        if recipe.whiten:  # x R has E[(x R)^T (x R)] = I: R = L^-T for ridged = L L^T
            inverse = torch.linalg.solve_triangular(
                torch.linalg.cholesky(ridged), eye.expand(n, -1, -1), upper=False
            )
            coordinates = inverse.transpose(1, 2)  # [n, D+1, D+1]
        else:
            coordinates = eye.expand(n, -1, -1).clone()
        correction = torch.zeros(n, width, width - 1, dtype=torch.float64)  # [n, D+1, D]: the identity
        if recipe.init == "regression":  # x B ~ z, B = ridged^-1 cross; the correction of h is B - [I; 0]
            correction = torch.linalg.solve(ridged, cross) - eye[:, : width - 1]
        moved = torch.linalg.solve(coordinates, correction)  # [n, D+1, D]: R M = correction
        if recipe.rank is None:
            return cls(coordinates.float(), {"M": moved.float()}, blocks)
        if recipe.init == "identity":  # LoRA's start: V zero, U small and random (seeded)
            generator = torch.Generator().manual_seed(recipe.seed)
            U = torch.randn(n, width, recipe.rank, generator=generator, dtype=torch.float64) / width**0.5
            return cls(
                coordinates.float(), {"U": U.float(), "V": torch.zeros(n, recipe.rank, width - 1)}, blocks
            )
        u, s, vh = torch.linalg.svd(moved, full_matrices=False)  # [n, D+1, D], [n, D], [n, D, D]
        root = s[:, : recipe.rank].sqrt()  # [n, r]
        U, V = u[:, :, : recipe.rank] * root[:, None], root[:, :, None] * vh[:, : recipe.rank]
        return cls(coordinates.float(), {"U": U.float(), "V": V.float()}, blocks)

    def parameters(self) -> list[torch.Tensor]:
        return list(self.factors.values())

    def translate(self, j: int, stream: torch.Tensor) -> torch.Tensor:
        """The stream [P, D] leaving ``blocks[j]``, translated: [P, D]."""
        x = with_ones(stream) @ self.coordinates[j]  # [P, D+1]
        if "M" in self.factors:
            return stream + x @ self.factors["M"][j]  # [P, D]
        return stream + (x @ self.factors["U"][j]) @ self.factors["V"][j]  # [P, r] -> [P, D]

    @torch.no_grad()
    def lens(self, n_layer: int) -> TunedLens:
        """The ``TunedLens`` these translators are, in the stream's own coordinates: ``h + h A + b``."""
        index = torch.tensor(self.blocks)
        if "M" in self.factors:
            correction = self.coordinates @ self.factors["M"]  # [n, D+1, D]: rows of h, then the bias
            width = correction.shape[-1]
            lens = TunedLens.identity(n_layer, width)
            lens.weight[index], lens.bias[index] = correction[:, :width], correction[:, width]
        else:
            down = self.coordinates @ self.factors["U"]  # [n, D+1, r]
            width = down.shape[1] - 1
            lens = TunedLens.identity(n_layer, width, rank=down.shape[2])
            lens.down[index], lens.up[index] = down[:, :width], self.factors["V"]
            lens.bias[index] = (down[:, width : width + 1] @ self.factors["V"])[:, 0]  # [n, D]
        lens.blocks = tuple(self.blocks)
        return lens


CHUNK_BYTES = 16 << 20
"""Exit logits are computed for as many positions at a time as fill this many bytes: glibc's malloc
maps each block over 32 MB afresh from the kernel and unmaps it on free, and the page faults of the
[P, C] tensors a step allocates and frees for every block then cost about as much system time as the
products themselves; under the threshold, freed memory is reused."""


def position_chunks(positions: int, columns: int) -> list[slice]:
    """Slices of ``positions`` rows of at most ``CHUNK_BYTES`` of fp32 logits of ``columns`` each."""
    rows = max(1, CHUNK_BYTES // (4 * columns))
    return [slice(start, min(start + rows, positions)) for start in range(0, positions, rows)]


class Target:
    """The final distribution of a batch's positions, as the fit compares each exit's with it."""

    def __init__(self, read_out: ReadOut, final: torch.Tensor):
        log_p = F.log_softmax(read_out.logits(final).float(), dim=-1)  # [P, C]
        self.probs = log_p.exp()  # [P, C]
        self.entropy = float(-(self.probs * log_p).sum(-1).mean())  # mean over positions, nats

    def cross_entropy(self, read_out: ReadOut, translated: torch.Tensor, rows: slice = slice(None)):
        """Mean over the positions ``rows`` of H(final, read-out of ``translated`` [P', D] there):
        KL(final || exit) plus the final entropy, which no translator changes, so the same gradient
        (one pass fewer over [P', C] than ``F.kl_div``)."""
        return F.cross_entropy(read_out.logits(translated).float(), self.probs[rows])


@torch.no_grad()
def held_out_kl(
    model: GPT, lens: TunedLens, windows: list[list[int]], blocks: list[int]
) -> dict[str, list[float]]:
    """Mean KL(final || exit) per block of ``blocks`` over every position of ``windows``: through
    ``lens`` ("tuned") and through no translator ("logit", the logit lens)."""
    read_out = ReadOut(model)
    totals = {"tuned": torch.zeros(len(blocks)), "logit": torch.zeros(len(blocks))}
    positions = 0
    for window in windows:
        leaving, final = streams(model, window, blocks)  # [n, T, D], [T, D]
        target = Target(read_out, final)
        for j, block in enumerate(blocks):
            for name, stream in (("tuned", lens(block, leaving[j])), ("logit", leaving[j])):
                kl = float(target.cross_entropy(read_out, stream)) - target.entropy
                totals[name][j] += kl * len(window)
        positions += len(window)
    return {name: (total / positions).tolist() for name, total in totals.items()}


RANKING_SIZES = (256, 1024, 2048, 4096)
"""Draft vocabularies whose held-out coverage a fit records (``ranking_coverage``)."""


@torch.no_grad()
def final_predictions(model: GPT, windows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The final read-out at every position of ``windows``: its most likely token, ids [P], and the
    probability it gives each token, summed over the positions [V]."""
    read_out, device = ReadOut(model), model.wte.weight.device
    mass = torch.zeros(model.config.vocab_size, device=device)  # [V]
    tops = []
    for window in windows:
        final = model.residual_stream(torch.tensor([window], device=device))[0]  # [T, D]
        logits = read_out.logits(final).float()  # [T, C]
        tops.append(read_out.top1(logits))
        probs = torch.softmax(logits, dim=-1)[:, : len(read_out.rows)].sum(0)  # [V_read]: read rows only
        mass.index_add_(0, read_out.rows, probs)
    return torch.cat(tops), mass  # [P], [V]


def top1_ranking(
    model: GPT, calibration: list[list[int]], held_out: list[list[int]]
) -> tuple[torch.Tensor, dict]:
    """The tokens the final read-out predicts on ``calibration``: the most often most likely first,
    then by the probability it gives them (``TunedLens.ranking``: a draft vocabulary of its first N),
    every token it gives any; and per N of ``RANKING_SIZES`` the share of ``held_out``'s positions
    whose most likely token is among the first N."""
    top, mass = final_predictions(model, calibration)
    counts = torch.bincount(top, minlength=model.config.vocab_size)  # [V]
    by_mass = torch.sort(mass, descending=True, stable=True).indices  # [V]
    order = by_mass[torch.sort(counts[by_mass], descending=True, stable=True).indices]  # [V]: count, mass
    ranking = order[: int((counts.gt(0) | mass.gt(0)).sum())]  # [R]
    rank = torch.full_like(counts, len(counts))  # [V]: each token's place in the ranking
    rank[ranking] = torch.arange(len(ranking), device=rank.device)
    held_out_rank = rank[final_predictions(model, held_out)[0]]  # [P]
    coverage = {str(n): round(float(held_out_rank.lt(n).float().mean()), 4) for n in RANKING_SIZES}
    return ranking, coverage


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


def make_optimizer(
    recipe: Recipe, parameters: list[torch.Tensor], width: int
) -> tuple[torch.optim.Optimizer, float]:
    """The optimiser and its peak learning rate. Adam moves every entry of a translator by about the
    learning rate per step; in whitened coordinates a translated feature then moves by about lr x
    sqrt(D) of the unit scale its target has, so the default, 0.01 / sqrt(D), moves each by about 1%
    a step at any width."""
    if recipe.optimizer == "sgd":
        lr = recipe.lr if recipe.lr is not None else 1.0 * (1 - recipe.momentum)
        optimizer = torch.optim.SGD(
            parameters, lr=lr, momentum=recipe.momentum, nesterov=True, weight_decay=recipe.weight_decay
        )
        return optimizer, lr
    lr = recipe.lr if recipe.lr is not None else 0.01 / width**0.5
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


def save_checkpoint(path: Path, step: int, translators: Translators, optimizer, identity: dict) -> None:
    """The translators, the optimiser's state and what the fit is of (``identity``), through a
    temporary name then renamed."""
    temporary = path.with_name(path.name + ".tmp")
    factors = {name: tensor.detach().cpu().clone() for name, tensor in translators.factors.items()}
    state = {
        "coordinates": translators.coordinates.cpu(),
        "factors": factors,
        "optimizer": optimizer.state_dict(),
    }
    torch.save({"step": step, **state, **identity}, temporary)
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
    start = 0 if state is None else state["step"]
    with frozen(model):
        translators, optimizer, peak = start_fit(model, calibration, recipe, blocks, state)
        steps = tqdm(
            range(start, recipe.steps), total=recipe.steps, initial=start, desc="lens fit", unit="step",
            disable=not progress, dynamic_ncols=True,
        )  # fmt: skip
        for step in steps:
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(recipe, peak, step)
            chosen = step_windows(len(calibration), recipe.windows_per_step, step, recipe.seed)
            kl = train_step(model, translators, [calibration[i] for i in chosen], optimizer, recipe.clip)
            steps.set_postfix(kl=f"{kl:.4f}")
            done = step + 1
            if checkpoint is not None and done % recipe.checkpoint_every == 0 and done < recipe.steps:
                save_checkpoint(checkpoint, done, translators, optimizer, identity)
        lens = translators.lens(model.config.n_layer).to(model.wte.weight.device)
        kl = held_out_kl(model, lens, held_out, blocks)
        lens.ranking, coverage = top1_ranking(model, calibration, held_out)
    lens.metadata = {
        **{key: identity[key] for key in ("calibration_sha256", "model_fingerprint", "recipe")},
        "steps": recipe.steps,
        "calibration_windows": len(calibration),
        "held_out_windows": len(held_out),
        "ranking_coverage": coverage,
    }
    for name, values in kl.items():  # per block of the model, None where not fitted
        per_block = dict(zip(blocks, values, strict=True))
        lens.metadata[f"held_out_kl_{name}"] = [per_block.get(i) for i in range(model.config.n_layer)]
    if checkpoint is not None:
        checkpoint.unlink(missing_ok=True)
    return lens


def start_fit(
    model: GPT, calibration: list[list[int]], recipe: Recipe, blocks: list[int], state: dict | None
) -> tuple[Translators, torch.optim.Optimizer, float]:
    """The translators to fit (from the checkpoint ``state``, else as ``recipe`` starts them), their
    optimiser (restored from ``state``) and the peak learning rate."""
    device = model.wte.weight.device
    if state is not None:
        translators = Translators(state["coordinates"], state["factors"], blocks)
    else:
        translators = Translators.start(recipe, *moments(model, calibration, blocks), blocks)
    translators.coordinates = translators.coordinates.to(device)
    translators.factors = {name: t.to(device).requires_grad_() for name, t in translators.factors.items()}
    optimizer, peak = make_optimizer(recipe, translators.parameters(), model.config.n_embd)
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
    return translators, optimizer, peak


def train_step(
    model: GPT, translators: Translators, batch: list[list[int]], optimizer, clip: float | None
) -> float:
    """One optimiser step on the positions of ``batch``; the mean KL over blocks before it."""
    read_out = ReadOut(model)
    leaving, final = batch_streams(model, batch, translators.blocks)  # [n, P, D], [P, D]
    with torch.no_grad():
        target = Target(read_out, final)
    total, positions = 0.0, final.size(0)
    for j in range(len(translators.blocks)):  # a block and a chunk of positions at a time (CHUNK_BYTES)
        for rows in position_chunks(positions, target.probs.size(1)):
            share = (rows.stop - rows.start) / positions
            cross_entropy = target.cross_entropy(read_out, translators.translate(j, leaving[j][rows]), rows)
            (cross_entropy * share).backward()
            total += float(cross_entropy.detach()) * share
        total -= target.entropy
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(translators.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad()
    return total / len(translators.blocks)
