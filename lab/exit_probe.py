"""A learned check for adaptive exit: per block, the probability that the read-out there already picks
the token the full stack would pick (CALM's trained confidence, Schuster et al. 2022).

    probe = fit_exit_probe(model, windows)   # full-depth passes over the windows, then a fit
    save_exit_probe(probe, directory)        # exit_probe.safetensors beside the weights
    # blocks "adaptive=0.9;check=probe": exit once the probe says 0.9

State saturation (the default check, ``lab.decode.stability``) asks whether the stream stopped
turning; it turns by a few degrees per block all the way up, so its cosine crosses a threshold at
about the same depth for every token. The probe asks the question exit needs answered, learned from
the model itself: it reads the same ``ln_f`` output, one logistic regression per block (D weights
and a bias), so a check costs a dot product over the width, like the cosine.

Fitting needs no labels from outside: on training text, the model's own top-1 at each block is
compared with its top-1 at the last block. The probe is a pair of tensors, not a module of the model:
the weights' files and state dicts stay the model's alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from lab import tokens
from lab.hooks import capture
from lab.model import GPT

FILE = "exit_probe.safetensors"


@dataclass
class ExitProbe:
    """weight [L, D] and bias [L]: P(top-1 after block i == final top-1) = sigmoid(read . w_i + b_i)."""

    weight: torch.Tensor
    bias: torch.Tensor

    def __call__(self, read: torch.Tensor, block: int) -> torch.Tensor:
        """read: ln_f of the stream after ``block``, [..., D] -> probability [...]. Computed in fp32
        on the read's device (the probe is not a module of the model: ``model.to`` does not move it).
        A product and a sum per row rather than a matrix-vector product: each row's value is the same
        whatever rows share the call (batch invariance, ``lab.rows.rows_alone``)."""
        weight, bias = self.weight[block].to(read.device), self.bias[block].to(read.device)
        return torch.sigmoid((read.float() * weight).sum(-1) + bias)

    def to(self, device: torch.device | str) -> ExitProbe:
        return ExitProbe(self.weight.to(device), self.bias.to(device))


@torch.no_grad()
def exit_features(model: GPT, window: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """For one window of tokens: reads [L, T, D] (ln_f after each block) and labels [L, T] (1 where
    that block's top-1 equals the last block's)."""
    n_layer = model.config.n_layer
    names = [f"blocks.{i}.resid_post" for i in range(n_layer)]
    with capture(model, names) as seen:
        model.residual_stream(torch.tensor([window], device=model.wte.weight.device))
    reads = torch.stack([model.ln_f(seen[name])[0] for name in names])  # [L, T, D]
    top = torch.stack([model.unembed(seen[name])[0].argmax(-1) for name in names])  # [L, T], block by block
    return reads.float(), (top == top[-1]).float()


def fit_exit_probe(model: GPT, windows: list[list[int]], l2: float = 1e-3, max_iter: int = 200) -> ExitProbe:
    """Fit the probe on ``windows`` of tokens (training text): L-BFGS on the logistic loss of every
    block but the last (never checked: nothing is above it), with an L2 penalty of ``l2`` per block."""
    features = [exit_features(model, window) for window in windows]
    reads = torch.cat([r for r, _ in features], dim=1)[:-1].cpu()  # [L-1, N, D]
    labels = torch.cat([y for _, y in features], dim=1)[:-1].cpu()  # [L-1, N]
    checked, _, width = reads.shape
    params = torch.zeros(checked, width + 1, requires_grad=True)  # weights and bias per checked block
    optimizer = torch.optim.LBFGS([params], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        logits = torch.einsum("lnd,ld->ln", reads, params[:, :-1]) + params[:, -1:]  # [L-1, N]
        penalty = l2 * params[:, :-1].pow(2).sum(dim=1).mean()
        loss = F.binary_cross_entropy_with_logits(logits, labels) + penalty
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    params = torch.cat([params.detach(), torch.zeros(1, width + 1)])  # the last block: never asked
    return ExitProbe(weight=params[:, :-1].contiguous(), bias=params[:, -1].contiguous())


def save_exit_probe(probe: ExitProbe, directory: Path) -> Path:
    """Written through a temporary name then renamed, as ``lab.weights.save_model`` writes weights;
    returns the file."""
    path = Path(directory) / FILE
    temporary = path.with_name(FILE + ".tmp")
    tensors = {"weight": probe.weight.cpu().contiguous(), "bias": probe.bias.cpu().contiguous()}
    save_file(tensors, str(temporary))
    temporary.replace(path)
    return path


def load_exit_probe(directory: Path, model: GPT | None = None) -> ExitProbe | None:
    """The probe saved in ``directory``, or None when there is none; checked against ``model``'s shape."""
    path = Path(directory) / FILE
    if not path.exists():
        return None
    tensors = load_file(str(path))
    probe = ExitProbe(weight=tensors["weight"], bias=tensors["bias"])
    if model is not None:
        check_fits(probe, model, str(path))
    return probe


def check_fits(probe: ExitProbe, model: GPT, source: str = "exit probe") -> None:
    """ValueError unless ``probe`` has a weight row and a bias per block of ``model`` at its width."""
    wanted = (model.config.n_layer, model.config.n_embd)
    if tuple(probe.weight.shape) != wanted or tuple(probe.bias.shape) != wanted[:1]:
        shape = tuple(probe.weight.shape)
        raise ValueError(f"{source}: a probe for {shape} (blocks, width), the model is {wanted}")


PROBE_WINDOWS = 32
"""Windows of the model's context from training files that an exit probe is fitted on."""


def probe_windows(
    files: list[Path], length: int, val_every: int, count: int = PROBE_WINDOWS
) -> list[list[int]]:
    """``count`` windows of ``length`` tokens from the middle of training files (never the held-out
    ones, every ``val_every``-th), spread over the standard library."""
    training = [path for i, path in enumerate(files) if i % val_every != 0]
    windows = []
    for path in training[:: max(len(training) // (2 * count), 1)]:
        ids = tokens.encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(ids) >= 2 * length:
            windows.append(ids[len(ids) // 3 : len(ids) // 3 + length])
        if len(windows) == count:
            break
    return windows


def fit_exit_probe_on_files(model: GPT, files: list[Path], val_every: int) -> ExitProbe:
    """``fit_exit_probe`` on ``probe_windows`` of the model's context from ``files``."""
    windows = probe_windows(files, model.config.block_size, val_every)
    if not windows:
        raise ValueError(f"no training file has {2 * model.config.block_size} tokens for the exit probe")
    return fit_exit_probe(model, windows)
