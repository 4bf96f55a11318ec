"""Decode attention through lab.intmm's kernel: every row of a decode step's block in one C call.

    model = lab.weights.load_model("gpt2-random", "w4a8")   # on a CPU where lab.intmm builds: has it
    use_attention_kernel(model)                            # in place, on any model on the CPU

A decode step's attention is one query per row over that row's cache: a few hundred thousand
multiply-adds a block, less than torch's ``scaled_dot_product_attention`` costs to call (more in
bf16; docs/inference.md has the figures), and the eager step called it once per row and block,
after slicing each row's query, key and value out and writing them into the cache one at a time.
``KernelAttention`` is a ``lab.model.CausalSelfAttention`` (the same parameters and hook points)
whose rows of one token over their own caches (``CausalSelfAttention.attend_rows``, what
``lab.decode.decode_rows`` runs) go to ``lab.intmm.attend_rows`` instead: one call writes every
row's key and value and attends, each (row, head) summed in a fixed order, so each row's result is
the one it gets alone (batch invariance). Everything else keeps torch's attention: prompts
(several tokens), the compiled step (``lab.fast``), gradients, ``attention="eager"`` models, other
devices and dtypes, and any step while the ``scores`` or ``pattern`` hook points are hooked (they
are the explicit path's tensors).
"""

from __future__ import annotations

import torch

from lab import intmm
from lab.model import GPT, CausalSelfAttention, LayerCache


def uses_attention_kernel(device: torch.device | str) -> bool:
    """Whether ``lab.weights.load_model`` gives a model on ``device`` the kernel: a CPU where lab.intmm
    builds."""
    return torch.device(device).type == "cpu" and intmm.unavailable() is None


class KernelAttention(CausalSelfAttention):
    """``CausalSelfAttention`` whose one-token rows over their own caches are lab.intmm's (module
    docstring)."""

    def attend_rows(self, qkv: torch.Tensor, caches: list[LayerCache], positions: list[int]) -> torch.Tensor:
        if not self._kernel_takes(qkv, caches):
            return super().attend_rows(qkv, caches, positions)
        k_caches, v_caches = [k for k, _ in caches], [v for _, v in caches]
        y = intmm.attend_rows(qkv[:, 0], k_caches, v_caches, positions, self.n_head)  # [B, D]
        return y[:, None]  # [B, 1, D]

    def _kernel_takes(self, qkv: torch.Tensor, caches: list[LayerCache]) -> bool:
        if qkv.size(1) != 1 or qkv.device.type != "cpu" or qkv.dtype not in (torch.float32, torch.bfloat16):
            return False
        if self.attention == "eager" or self.scores.is_hooked or self.pattern.is_hooked:
            return False
        if torch.is_grad_enabled() and qkv.requires_grad or torch.compiler.is_compiling():
            return False
        return all(k.dtype is qkv.dtype and k.is_contiguous() and v.is_contiguous() for k, v in caches)


def use_attention_kernel(model: GPT) -> GPT:
    """Give ``model``'s attention stages the kernel (module docstring), in place; returns it."""
    for module in model.modules():
        if type(module) is CausalSelfAttention:
            module.__class__ = KernelAttention  # the same parameters; only the rows' attention differs
    return model
