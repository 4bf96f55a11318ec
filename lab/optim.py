"""Optimisers ``lab.train.LitGPT`` can choose besides AdamW: Muon for the blocks' matrices.

Muon (Jordan et al. 2024) orthogonalises each matrix's momentum with a Newton-Schulz iteration; the
embedding tables, norms and biases stay with AdamW. ``MuonAdamW`` steps both as one optimiser so that
Lightning's automatic optimisation, the schedule and gradient clipping reach every parameter.
"""

from __future__ import annotations

import math

import torch


def orthogonalize(update: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """Muon's Newton-Schulz iteration (Jordan et al. 2024, torch.optim.Muon's coefficients) for a
    matrix [A, B], in its own dtype: torch's casts to bf16, which a CPU without bf16 units (AVX2 only)
    runs far slower than fp32 (docs/inference.md has the measurement)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    x = update.T if update.size(0) > update.size(1) else update  # [small, large]
    x = x / x.norm().clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.T  # [small, small]
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if update.size(0) > update.size(1) else x


class Muon(torch.optim.Muon):
    """torch.optim.Muon's update (Nesterov momentum, orthogonalised, scaled by sqrt(max(1, A/B)),
    decoupled weight decay) with the Newton-Schulz iteration in the parameters' dtype
    (``orthogonalize``)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                buf = state["momentum_buffer"]
                buf.lerp_(param.grad, 1 - momentum)
                update = param.grad.lerp(buf, momentum) if group["nesterov"] else buf
                update = orthogonalize(update, group["ns_steps"], group["eps"])
                param.mul_(1 - lr * group["weight_decay"])
                param.add_(update, alpha=-lr * math.sqrt(max(1.0, param.size(0) / param.size(1))))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """Muon for some parameters and AdamW for the rest, stepped as one optimiser.

    Lightning's automatic optimisation drives one optimiser: this one holds both and shares their
    param groups, so the learning-rate schedule, gradient clipping and ``zero_grad`` reach every
    parameter.
    """

    def __init__(self, muon: torch.optim.Muon, adamw: torch.optim.AdamW):
        self.muon, self.adamw = muon, adamw
        super().__init__(muon.param_groups + adamw.param_groups, {})  # the same group dicts

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning passes forward + backward as the closure
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss


def muon_adamw(
    model: torch.nn.Module, muon_lr: float, lr: float, betas: tuple[float, float], weight_decay: float
) -> MuonAdamW:
    """Muon for the blocks' weight matrices (``blocks.*``, 2-d), AdamW for the rest: the tables with
    ``weight_decay``, norms and biases without."""
    matrices = {n: p for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    rest = [p for n, p in model.named_parameters() if n not in matrices]
    muon = Muon(list(matrices.values()), lr=muon_lr, weight_decay=0.0)
    adamw = torch.optim.AdamW(
        [
            {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=lr,
        betas=betas,
    )
    return MuonAdamW(muon, adamw)
