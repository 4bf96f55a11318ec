"""int8 and int4 weights for batch-1 decoding on the CPU: fewer bytes per token, bf16 activations.

    model = lab.weights.load_model("builtin", "int4")   # or "int8": the loader quantizes
    quantize(model, "int8")                             # in place, on a bf16 model already loaded

A decoding step reads every weight once, so its time is the weight bytes over the rate the kernels
stream them; torch's bf16 matrix-vector kernel is compute-bound on CPUs without AVX512-BF16, so
bf16 alone saves less time than bytes (docs/inference.md has the rates). This module puts the
quantized products behind ``lab.model.Linear``'s interface:

- int8: one symmetric scale per output row, the activations as they are (weight-only);
- int4: asymmetric, a scale and a zero point per group of 64 inputs of a row (32 where 64 does not divide),
  weight-only, packed two per byte;
- w4a8: int4's weights and groups of 64, each product's input quantized to int8 per group of 64 (one
  scale each) and multiplied in integers (``lab.intmm``, llama.cpp's q4_0 x q8_0 scheme; AVX2 or
  AVX-512 VNNI);
- w8a8: int8's weights and scales, the inputs quantized as w4a8's (``lab.intmm``, q8_0 x q8_0).

int8 and int4 are computed by ``lab.intmm``'s weight-only products where its kernels build (int4's
weights in w4a8's layout, its input widths multiples of 64), and elsewhere by the fused
dequantize-and-multiply kernels torch ships, the ones gpt-fast and torchao use on the CPU
(``torch.ops.aten._weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``): the same weights, and
lab.intmm's stream them at the memory's rate where torch's take about twice as long a decode step
(docs/inference.md).

Every ``Linear`` of the blocks becomes a ``QuantizedLinear`` and the tied unembedding gets a quantized
copy of the token table (``GPT.read_out``); the embedding lookup keeps the bf16 table. Norms, biases,
attention and the KV cache stay bf16. Hooks, block sets and adaptive exit work unchanged; training
does not (the weights are buffers). Dynamic int8 (activations quantized too, fbgemm's
``linear_dynamic``) streams faster but costs far more loss: the residual stream's outlier features do
not survive one scale per tensor (docs/inference.md); w8a8's and w4a8's scale per 64 inputs keeps them.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import nn

from lab import intmm
from lab.errors import UserError
from lab.model import GPT, Linear

WeightDtype = Literal["float32", "bfloat16", "float16", "int8", "int4", "w4a8", "w8a8"]
"""What ``lab.weights.load_model`` accepts: plain weights in torch's dtypes, weight-only quantization
(int8, int4), or int4 or int8 weights times activations quantized to int8 (w4a8, w8a8)."""
WEIGHT_DTYPES: tuple[str, ...] = get_args(WeightDtype)
QUANTIZED_DTYPES = ("int8", "int4", "w4a8", "w8a8")
"""The dtypes ``quantize`` makes: CPU kernels, bf16 activations between the products."""
INTEGER_PRODUCTS = ("w4a8", "w8a8")
"""The quantized dtypes whose products quantize their inputs too; only ``lab.intmm`` computes them."""
KERNEL_WEIGHTS = {
    "w4a8": ("weight_w4", "scales_zeros"),
    "w8a8": ("weight_int8", "scales"),
    "int4": ("weight_w4", "scales_zeros"),
    "int8": ("weight_int8", "scales"),
}
"""The buffers a layer's weights are kept in when ``lab.intmm`` computes its product, in the order its
kernel takes them (``lab.intmm.PRODUCTS`` has the kinds)."""

INT4_GROUP_SIZES = (64, 32)
"""Inputs sharing a scale and zero point, tried in this order (the kernel takes 32, 64, 128 or 256;
docs/inference.md has what each costs the builtin model)."""


def quantize_rows_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> int8 values [N, K] and scales [N] with weight ~= values * scales[:, None]."""
    weight = weight.float()
    scales = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [N]
    values = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
    return values, scales


def quantize_groups_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> codes [N, K] in 0..15 (int32) and scales_and_zeros [K / group, N, 2].

    The kernel's convention: weight ~= (code - 8) * scale + zero, per group of ``group_size`` inputs.
    The group's minimum maps to code 0 and its maximum to code 15.
    """
    n, k = weight.shape
    groups = weight.float().reshape(n, k // group_size, group_size)  # [N, G, group]
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)  # [N, G, 1]
    scales = (high - low).clamp(min=1e-12) / 15  # [N, G, 1]
    codes = torch.round((groups - low) / scales).clamp(0, 15).to(torch.int32).reshape(n, k)  # [N, K]
    zeros = low + 8 * scales  # [N, G, 1]: the value of code 8
    scales_and_zeros = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [G, N, 2]
    return codes, scales_and_zeros


def dequantize_int4(codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """The weight [N, K] that int4 codes [N, K] and scales_and_zeros [G, N, 2] stand for (fp32)."""
    n, k = codes.shape
    groups = scales_and_zeros.size(0)
    scales, zeros = scales_and_zeros.float().transpose(0, 1).unbind(-1)  # [N, G] each
    grouped = (codes.float().reshape(n, groups, k // groups) - 8) * scales[..., None] + zeros[..., None]
    return grouped.reshape(n, k)  # [N, K]


class QuantizedLinear(nn.Module):
    """y = x W + b for a weight W [in, out] given as [out, in] (``weight_out_in``), stored as ``kind``
    (one of ``QUANTIZED_DTYPES``: int8, int4, or their weights with int8 inputs, w8a8 and w4a8).

    Works on rows of bf16 activations, any number of them (the prompt's prefill too). int4 pads the
    outputs to a multiple of 16, as its packing requires, and drops the padding from the result.
    ``kernel``: the ``lab.intmm`` product that computes it (``lab.intmm.PRODUCTS``), or None where
    torch's int8 or int4 kernel does: where lab.intmm does not build or take the widths, or where
    ``kernels`` is False (int8 and int4 only: a baseline).
    """

    def __init__(
        self, weight_out_in: torch.Tensor, bias: torch.Tensor | None, kind: str, kernels: bool = True
    ):
        super().__init__()
        if kind not in QUANTIZED_DTYPES:
            raise ValueError(f"kind: one of {', '.join(QUANTIZED_DTYPES)}, got {kind!r}")
        if weight_out_in.device.type != "cpu":
            raise ValueError(f"{kind} weights use CPU kernels, not {weight_out_in.device}'s")
        if kind in INTEGER_PRODUCTS and weight_out_in.size(1) % intmm.GROUP:
            raise ValueError(f"{kind} needs input widths that are multiples of {intmm.GROUP}")
        self.kind = kind
        self.out_features, self.in_features = weight_out_in.shape
        widths = kind == "int8" or self.in_features % intmm.GROUP == 0  # int4 in w4a8's layout
        intmm_takes = kernels and widths and intmm.unavailable() is None
        self.kernel = kind if kind in INTEGER_PRODUCTS or intmm_takes else None
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16))
        weight = weight_out_in.detach()
        if kind in ("int8", "w8a8"):
            values, scales = quantize_rows_int8(weight)
            self.register_buffer("weight_int8", values)  # [Dout, Din]
            # [Dout]: torch's int8 kernel takes bf16 scales, w8a8's float32
            self.register_buffer("scales", scales.to(torch.bfloat16 if kind == "int8" else torch.float32))
        elif self.kernel is not None:  # w4a8, and int4 where lab.intmm computes it: the same weights
            self.group_size = intmm.GROUP
            packed, scales_zeros = intmm.w4a8_pack(*quantize_groups_int4(weight, self.group_size))
            self.register_buffer("weight_w4", packed)  # [Dout rounded up to 16, Din / 2]
            self.register_buffer("scales_zeros", scales_zeros)  # [Dout / 16, Din / 64, 2, 16] bf16
        else:
            self.group_size = next((g for g in INT4_GROUP_SIZES if self.in_features % g == 0), None)
            if self.group_size is None:
                raise ValueError(f"int4 needs input widths that are multiples of 32, got {self.in_features}")
            padding = -self.out_features % 16
            weight = torch.cat([weight, weight.new_zeros(padding, self.in_features)])  # [Dout + pad, Din]
            codes, scales_and_zeros = quantize_groups_int4(weight, self.group_size)
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)  # [Dout + pad, Din / 2]
            self.register_buffer("weight_int4", packed)
            scales_and_zeros = scales_and_zeros.to(torch.bfloat16)  # [G, Dout + pad, 2]
            self.register_buffer("scales_and_zeros", scales_and_zeros)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        *lead, d_in = x.shape
        # [N, Din]: the kernels need it dense. They compute each row alone, the same arithmetic
        # whatever N is, so they are batch-invariant as they are (lab.rows.rows_alone needs nothing
        # here; tests/test_serve_engine.py checks it bit for bit).
        x2d = x.reshape(-1, d_in)
        if x2d.dtype != torch.bfloat16:
            x2d = x2d.to(torch.bfloat16)
        # the buffers read from their dict: nn.Module's attribute lookup is a share of a call's Python,
        # and a decode step makes 49 of these calls
        buffers = self._buffers
        bias = buffers["bias"]
        if self.kernel is not None:  # lab.intmm reads bf16 as it is and adds the bias before rounding y
            y = intmm.PRODUCTS[self.kernel](x2d, self.kernel_weights(), bias, self.out_features)  # [N, Dout]
        else:
            y = self._weight_only(x2d.contiguous())  # [N, Dout]
        return y.view(*lead, self.out_features)

    def kernel_weights(self) -> tuple[torch.Tensor, ...]:
        """The weights as lab.intmm's product takes them (``KERNEL_WEIGHTS``), where it computes this
        layer (``kernel`` set)."""
        buffers = self._buffers
        return tuple(buffers[name] for name in KERNEL_WEIGHTS[self.kind])

    def _weight_only(self, x2d: torch.Tensor) -> torch.Tensor:
        """torch's int8 and int4 kernels: x2d [N, Din] bf16, dense -> [N, Dout] bf16."""
        if self.kind == "int8":
            y = torch.ops.aten._weight_int8pack_mm(x2d, self.weight_int8, self.scales)  # [N, Dout]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2d, self.weight_int4, self.group_size, self.scales_and_zeros
            )  # [N, Dout + pad]
            y = y[:, : self.out_features]  # [N, Dout]
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        computed_by = "lab.intmm" if self.kernel is not None else "torch"
        return f"in={self.in_features}, out={self.out_features}, {self.kind} ({computed_by})"


def require_kernels(dtype: str) -> None:
    """UserError if ``dtype``'s kernel cannot run on this machine (w4a8 and w8a8 need AVX2 and a C
    compiler)."""
    if dtype in INTEGER_PRODUCTS and (reason := intmm.unavailable()) is not None:
        weight_only = {"w4a8": "int4", "w8a8": "int8"}[dtype]
        raise UserError(f"--dtype {dtype}: {reason}; {weight_only} runs everywhere")


def quantize(model: GPT, dtype: str, kernels: bool = True) -> GPT:
    """Replace ``model``'s Linear layers and read-out with ``dtype``'s (``QUANTIZED_DTYPES``), in place;
    returns it. ``kernels=False``: int8 and int4 keep torch's kernels (``QuantizedLinear``).

    The rest of the model (tables, norms) becomes bf16, the activations' dtype.
    """
    if dtype not in QUANTIZED_DTYPES:
        raise ValueError(f"dtype: one of {', '.join(QUANTIZED_DTYPES)}, got {dtype!r}")
    require_kernels(dtype)
    if isinstance(model.read_out, QuantizedLinear):
        raise ValueError("the model is already quantized")
    model.to(torch.bfloat16)
    linears = [(name, module) for name, module in model.named_modules() if isinstance(module, Linear)]
    for name, linear in linears:
        parent_name, _, attribute = name.rpartition(".")
        weight = linear.weight.t()  # Linear's weight is [in, out]
        quantized = QuantizedLinear(weight, linear.bias, dtype, kernels)
        setattr(model.get_submodule(parent_name), attribute, quantized)
    table = model.wte.weight if model.read_rows is None else model.read_table  # [V or V_read, D]: [out, in]
    model.read_out = QuantizedLinear(table, None, dtype, kernels)  # the rows the read-out multiplies
    return model.eval().requires_grad_(False)


def parameter_count(model: GPT) -> int:
    """``model.num_params()`` as before quantization: quantized weights are buffers, not parameters.
    The read-out's quantized table is a copy of the tied token table, counted once already."""
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear) and m is not model.read_out]
    stored = sum(m.in_features * m.out_features + (0 if m.bias is None else m.out_features) for m in linears)
    return model.num_params() + stored
