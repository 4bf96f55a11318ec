"""float32 and bf16 weights multiplied by lab.intmm's kernels where decoding needs them: the same
parameters, faster products.

    model = lab.weights.load_model("gpt2-random")   # the loader does this on a CPU where lab.intmm builds
    model = lab.weights.load_model("gpt2-random", kernels=False)   # torch's products throughout
    use_float_kernels(model)                        # in place, on a float32 or bf16 model on the CPU

A decoding step multiplies every weight by one row, so its time is the weights' bytes over the rate
its products stream them. torch's matrix-vector products stream bf16 weights at a fraction of the
memory's rate (they widen them first), and float32 weights too once they come from memory rather
than cache (docs/inference.md has the rates); lab.intmm's ``f32_mm`` and ``bf16_mm`` stream both at
it. This module puts them behind the model's own layers:

- ``KernelLinear`` is a ``lab.model.Linear``, its parameters, state dict and hooks unchanged, whose
  product is the kernel's for up to ``SHORT_RUN`` rows, or any number under ``lab.rows.rows_alone``
  (each of the kernel's outputs is one fixed-order sum whatever the number of rows: batch-invariant
  as it is). A longer prompt's prefill keeps torch's matrix-matrix product, and so does
  anything that needs gradients (training, fitting through the model) or another device or dtype.
- ``KernelReadOut`` is ``GPT.read_out``: the same product over the token table the model holds (its
  read rows, where ``GPT.compact_read_out`` chose them), no copy.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from lab import intmm
from lab.model import GPT, Linear
from lab.rows import taking_rows_alone

FLOAT_KERNELS = {torch.float32: intmm.f32_matmul, torch.bfloat16: intmm.bf16_matmul}
"""The weights' dtypes these kernels take, and each one's product."""

SHORT_RUN = 8
"""Rows up to this many (a speculation round's verification: its drafts and one more) take the kernel
too, rows alone or not: one load of each weight serves them all, where torch's matrix-matrix product
of a few rows is slower than its matrix-vector product of one (docs/inference.md); a longer prompt
keeps torch's product."""


def uses_float_kernels(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether ``lab.weights.load_model`` gives a model of ``dtype`` on ``device`` these kernels:
    float32 and bf16 on a CPU where lab.intmm builds (elsewhere torch's products stay)."""
    cpu = torch.device(device).type == "cpu"
    return dtype in FLOAT_KERNELS and cpu and intmm.unavailable() is None


def _kernel_takes(x2d: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel multiplies x2d [N, Din] by ``weight``: rows that decode (a short run, or
    each alone), on the CPU, in the weight's dtype, with no gradient to carry."""
    if x2d.device.type != "cpu" or x2d.dtype is not weight.dtype or weight.dtype not in FLOAT_KERNELS:
        return False
    if torch.is_grad_enabled() and (x2d.requires_grad or weight.requires_grad):
        return False  # the kernels have no backward: torch's product carries the gradient
    return x2d.size(0) <= SHORT_RUN or taking_rows_alone()


class KernelLinear(Linear):
    """``lab.model.Linear`` whose one-row products are lab.intmm's (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *lead, d_in = x.shape
        x2d = x.reshape(-1, d_in)  # [N, Din]
        if not _kernel_takes(x2d, self.weight):
            return super().forward(x)
        product = FLOAT_KERNELS[self.weight.dtype]
        return product(x2d, self.weight.t(), self.bias).view(*lead, -1)  # [..., Dout]: weight.t() [Dout, Din]


class KernelReadOut(nn.Module):
    """``GPT.read_out`` of a float model: its final norm's output times the token table it holds
    (the read rows under ``compact_read_out``, outside training), with the kernel where it takes the
    rows. [B, T, D] -> [B, T, V or V_read]."""

    def __init__(self, model: GPT):
        super().__init__()
        self.model = weakref.ref(model)  # the model holds this module: a plain reference would be a cycle

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        model = self.model()
        sparse = model.read_rows is not None and not model.training
        table = model.read_table if sparse else model.wte.weight  # [V_read or V, D]: [out, in], dense
        h2d = h.reshape(-1, h.size(-1))  # [B*T, D]
        if _kernel_takes(h2d, table):
            logits = FLOAT_KERNELS[table.dtype](h2d, table)  # [B*T, V_read or V]
        else:
            logits = F.linear(h2d, table)  # [B*T, V_read or V]
        return logits.view(*h.shape[:-1], -1)


def use_float_kernels(model: GPT) -> GPT:
    """Give ``model``'s Linear layers and read-out the kernels (module docstring), in place; returns it."""
    if model.read_out is not None:
        raise ValueError("the model already has a read-out of its own (quantized, or these kernels)")
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = KernelLinear  # the same parameters; only the forward differs
    model.read_out = KernelReadOut(model)
    model.read_columns = None  # the transposed table torch's read-out used: no longer read
    return model
