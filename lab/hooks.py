"""Capture named tensors of the forward pass (the residual stream and each stage's writes).

    with capture(model, ["embed", "blocks.*.attn_out", "blocks.*.resid_post"]) as seen:
        model(idx)
    seen["blocks.3.attn_out"]  # [B, T, D]

Names are the module names of ``HookPoint``s in ``lab.model``; patterns use shell wildcards.
Capturing ``*.attn.scores`` or ``*.attn.pattern`` runs that attention eagerly for the call, since
the fused kernel never forms the scores; the logits are the same either way.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from lab.model import HookPoint


def hook_names(model: nn.Module) -> list[str]:
    """Every capturable name of ``model``, in forward order."""
    return [name for name, module in model.named_modules() if isinstance(module, HookPoint)]


def hooked(modules: Iterable[nn.Module]) -> bool:
    """Whether a forward hook would see any of ``modules`` run: one registered on any of them, or a
    global one (``torch.nn.modules.module.register_module_forward_hook`` and its pre-hook twin). A
    path that runs the modules' work without calling them (one C call, a compiled step) must not
    take the work then."""
    if _global_forward_hooks or _global_forward_pre_hooks:
        return True
    return any(module._forward_hooks or module._forward_pre_hooks for module in modules)


@contextmanager
def capture(model: nn.Module, names: str | Iterable[str] = "*") -> Iterator[dict[str, torch.Tensor]]:
    """Record, detached, the tensor at each named HookPoint during the forward passes inside.

    A name seen twice (a second forward pass) keeps the latest tensor.
    """
    patterns = [names] if isinstance(names, str) else list(names)
    points = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, HookPoint) and any(fnmatch.fnmatchcase(name, p) for p in patterns)
    }
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in points)]
    if unmatched:
        raise KeyError(f"no hook point matches {unmatched}; see lab.hooks.hook_names(model)")
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in points.items():

        def record(_module, _inputs, output, name=name):
            seen[name] = output.detach()

        handles.append(module.register_forward_hook(record))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()
