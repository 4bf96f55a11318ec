"""Per-block gradient norms and update sizes: where in the stack the early training signal lands.

    norms = grad_norms_at_init(model, batches)   # {"blocks": [L floats], "mlp.c_proj": [L floats]}

Xiong et al. 2020 plot the gradient norm of each layer's feed-forward output weight at initialisation:
post-LN's grows toward the output, pre-LN's is flat. ``LitGPT`` logs the same per block during the
first steps (``grad_norm/blocks.{i}``) with Adam's update-to-weight ratio (``update_ratio/blocks.{i}``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from lab.model import GPT


def block_grad_norms(model: GPT) -> dict[str, list[float]]:
    """The L2 norm of each block's gradient (all its parameters) and of its ``mlp.c_proj.weight``'s."""
    blocks, c_proj = [], []
    for block in model.blocks:
        grads = [p.grad for p in block.parameters() if p.grad is not None]
        blocks.append(float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0)
        grad = block.mlp.c_proj.weight.grad
        c_proj.append(float(grad.norm()) if grad is not None else 0.0)
    return {"blocks": blocks, "mlp.c_proj": c_proj}


def block_weights(model: GPT) -> list[list[torch.Tensor]]:
    """A copy of every block's parameters, to measure the next update against."""
    return [[p.detach().clone() for p in block.parameters()] for block in model.blocks]


def update_ratios(model: GPT, before: list[list[torch.Tensor]]) -> list[float]:
    """Per block, ||W_after - W_before|| / ||W_before|| over all its parameters: the update's size."""
    ratios = []
    for block, old in zip(model.blocks, before, strict=True):
        new = [p.detach() for p in block.parameters()]
        step = torch.nn.utils.get_total_norm([n - o for n, o in zip(new, old, strict=True)])
        ratios.append(float(step / torch.nn.utils.get_total_norm(old).clamp_min(1e-12)))
    return ratios


Batch = tuple[torch.Tensor, torch.Tensor]  # x, y: [B, T] each


def grad_norms_at_init(model: GPT, batches: Iterable[Batch]) -> dict[str, list[float]]:
    """``block_grad_norms`` of the cross-entropy loss, averaged over ``batches``; leaves no gradient."""
    sums: dict[str, list[float]] = {}
    count = 0
    for x, y in batches:  # [B, T] each
        model.zero_grad(set_to_none=True)
        logits = model(x)  # [B, T, V]
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        for name, values in block_grad_norms(model).items():
            sums[name] = [a + b for a, b in zip(sums.get(name, [0.0] * len(values)), values, strict=True)]
        count += 1
    model.zero_grad(set_to_none=True)
    if not count:
        raise ValueError("grad_norms_at_init needs at least one batch")
    return {name: [v / count for v in values] for name, values in sums.items()}
