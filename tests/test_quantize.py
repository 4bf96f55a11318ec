"""Quantized int8/int4/w4a8: each layer computes with the weights it claims to hold, and decoding works."""

from dataclasses import replace

import pytest
import torch

from lab import w4a8
from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.decode import Decoder
from lab.generate import generate, score
from lab.model import GPT, Linear
from lab.quantize import (
    QuantizedLinear,
    dequantize_int4,
    parameter_count,
    quantize,
    quantize_groups_int4,
    quantize_rows_int8,
)

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=64, vocab_size=100, block_size=32)  # 100 rows: int4 pads to 112

W4A8 = pytest.param(
    "w4a8", marks=pytest.mark.skipif(w4a8.unavailable() is not None, reason=str(w4a8.unavailable()))
)
QUANTIZED = ["int8", "int4", W4A8]


def tiny_model(norm: str = "pre") -> GPT:
    torch.manual_seed(0)
    return GPT(replace(CFG, norm=norm)).eval()


def test_int8_rows_round_trip_within_half_a_step():
    weight = torch.randn(48, 64)
    values, scales = quantize_rows_int8(weight)
    assert values.dtype == torch.int8 and values.abs().max() == 127
    error = (values.float() * scales[:, None] - weight).abs()
    assert (error <= scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_groups_round_trip_within_half_a_step(group_size):
    weight = torch.randn(48, 128)
    codes, scales_and_zeros = quantize_groups_int4(weight, group_size)
    assert codes.min() == 0 and codes.max() == 15 and scales_and_zeros.shape == (128 // group_size, 48, 2)
    step = scales_and_zeros[..., 0].t().repeat_interleave(group_size, dim=1)  # [N, K]
    assert ((dequantize_int4(codes, scales_and_zeros) - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 5])
def test_quantized_linear_is_the_product_with_its_dequantized_weight(bits, rows):
    """The fused kernel computes x @ W_q + b for the W_q the quantizer produced (with bf16 rounding),
    for one row (decoding) and several (prefill), with outputs not a multiple of 16 (int4 pads)."""
    torch.manual_seed(0)
    linear = Linear(64, 100)
    torch.nn.init.normal_(linear.weight, std=0.02)
    torch.nn.init.normal_(linear.bias, std=0.02)
    layer = QuantizedLinear(linear.weight.t(), linear.bias, f"int{bits}")
    x = torch.randn(2, rows, 64)
    weight = linear.weight.t().detach()  # [out, in]
    if bits == 8:
        values, scales = quantize_rows_int8(weight)
        dequantized = values.float() * scales.to(torch.bfloat16).float()[:, None]
    else:
        codes, scales_and_zeros = quantize_groups_int4(weight, layer.group_size)
        dequantized = dequantize_int4(codes, scales_and_zeros.to(torch.bfloat16))
    expected = x.to(torch.bfloat16).float() @ dequantized.t() + linear.bias.detach()  # [2, rows, 100]
    got = layer(x)
    assert got.shape == (2, rows, 100) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)
    # and the quantized weights are close to the originals: the error is the quantizer's, bounded
    relative = (dequantized - weight).norm() / weight.norm()
    assert relative < (0.01 if bits == 8 else 0.12)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_model_predicts_like_the_original(dtype, norm):
    model = tiny_model(norm)
    idx = torch.randint(0, CFG.vocab_size, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(idx)  # [2, 20, V] fp32
        quantized = quantize(tiny_model(norm), dtype)
        logits = quantized(idx).float()
        # a strided view, as the server's prefill reads out its last positions: the kernels need dense rows
        last = quantized.unembed(quantized.residual_stream(idx)[:, -1:]).float()  # [2, 1, V]
    torch.testing.assert_close(last, logits[:, -1:], atol=1e-2, rtol=1e-2)
    assert parameter_count(quantized) == model.num_params()
    assert quantized.read_out is not None
    assert not any(isinstance(m, Linear) for m in quantized.modules())
    error = (logits - reference).norm() / reference.norm()
    assert error < (0.02 if dtype == "int8" else 0.15)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree > (0.9 if dtype == "int8" else 0.6)


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_quantized_decoding_cache_and_block_sets(dtype):
    model = quantize(tiny_model(), dtype)
    prompt = torch.randint(0, CFG.vocab_size, (8,), generator=torch.Generator().manual_seed(2)).tolist()
    for spec in ["all", "skip=1", "exit=2"]:
        block_set = BlockSet.parse(spec, CFG.n_layer)
        decoder = Decoder(model, block_set)
        with torch.no_grad():
            step_logits = [decoder.prefill(prompt[:4])] + [decoder.step(t)[0] for t in prompt[4:]]
            full = model(torch.tensor([prompt]), block_set=block_set)[0, 3:]  # [5, V]
        torch.testing.assert_close(torch.stack(step_logits).float(), full.float(), atol=5e-2, rtol=5e-2)
    steps = list(generate(model, prompt, 6, block_set=BlockSet.parse("adaptive=0.9;min=1", CFG.n_layer)))
    assert len(steps) == 6 and all(1 <= len(s.blocks_run) <= CFG.n_layer for s in steps)
    result = score(model, prompt, BlockSet.parse("skip=2", CFG.n_layer))
    assert len(result.token_losses) == len(prompt) - 1 and result.mean_loss > 0


def test_the_loader_takes_every_dtype_by_name(tmp_path):
    from lab.weights import load_model, save_model

    save_model(tiny_model(), tmp_path)
    assert load_model(str(tmp_path), "bfloat16").wte.weight.dtype == torch.bfloat16
    assert load_model(str(tmp_path), torch.float16).wte.weight.dtype == torch.float16  # or a torch dtype
    assert isinstance(load_model(str(tmp_path), "int4").blocks[0].mlp.c_fc, QuantizedLinear)
    with pytest.raises(ValueError, match="dtype: one of float32, bfloat16, float16, int8, int4"):
        load_model(str(tmp_path), "int3")
    with pytest.raises(ValueError, match="already quantized"):
        quantize(load_model(str(tmp_path), "int8"), "int8")
    with pytest.raises(ValueError, match="multiples of 32"):
        QuantizedLinear(torch.randn(32, 48), None, "int4")
    with pytest.raises(ValueError, match="runs on the CPU, not meta"):
        load_model(str(tmp_path), "int4", device="meta")


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_propagated_keys_and_values_are_those_the_block_writes(dtype):
    """Adaptive exit fills deeper blocks' K/V from the exit state; with quantized c_attn too."""
    from lab.decode import propagate_kv
    from lab.model import KVCache

    model = quantize(tiny_model(), dtype)
    x = torch.randn(1, 1, CFG.n_embd, dtype=torch.bfloat16)  # [1, 1, D] an exit state
    ran, propagated = KVCache(CFG, dtype=torch.bfloat16), KVCache(CFG, dtype=torch.bfloat16)
    with torch.no_grad():
        model.blocks[2](x, ran.layer(2), pos=0)  # the block run: its attention stores K/V at 0
        propagate_kv(model.blocks[2], x, propagated.layer(2), pos=0)
    assert propagated.k[2].abs().sum() > 0
    torch.testing.assert_close(propagated.k[2], ran.k[2])
    torch.testing.assert_close(propagated.v[2], ran.v[2])


def w4a8_reference(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """What lab/kernels/w4a8.c defines, in float64: each row's groups of 64 inputs rounded to int8
    steps of max |a| / 127, times the weights (code - 8) * scale + zero. x [M, K] -> [M, N]."""
    m, k = x.shape
    groups = x.double().reshape(m, k // 64, 64)  # [M, G, 64]
    steps = groups.abs().amax(-1, keepdim=True) / 127  # [M, G, 1]
    q = torch.where(steps > 0, torch.round(groups / steps), 0.0) * steps  # the int8 activations
    scales, zeros = scales_and_zeros.double().transpose(0, 1).unbind(-1)  # [N, G] each
    c = codes.double().reshape(codes.size(0), k // 64, 64) - 8  # [N, G, 64]
    products = torch.einsum("mgi,ngi->mng", q, c) * scales  # [M, N, G]
    return (products + groups.sum(-1)[:, None, :] * zeros).sum(-1)  # [M, N]


@pytest.mark.skipif(w4a8.unavailable() is not None, reason=str(w4a8.unavailable()))
@pytest.mark.parametrize("k", [64, 768])
def test_w4a8_kernel_is_its_definition_and_rows_are_alone(k):
    """The C kernel computes what its header says (against float64), with outputs of any count,
    and each row's result is bit for bit the same alone or among 1 to 8 others (batch invariance)."""
    torch.manual_seed(0)
    weight = torch.randn(37, k) * 0.05
    codes, scales_and_zeros = quantize_groups_int4(weight, 64)
    packed, scales, zeros = w4a8.pack(codes, scales_and_zeros)
    x = torch.randn(9, k)
    x[2] = 0.0  # a row of zeros: its activation scale is 0
    y = w4a8.matmul(x, packed, scales, zeros)
    assert y.shape == (9, 37) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), w4a8_reference(x, codes, scales_and_zeros), rtol=1e-5, atol=1e-5)
    assert not y[2].any()
    for rows in (1, 3, 4, 5):
        for start in range(0, 9 - rows + 1, 2):
            assert torch.equal(
                w4a8.matmul(x[start : start + rows], packed, scales, zeros), y[start : start + rows]
            )


@pytest.mark.skipif(w4a8.unavailable() is not None, reason=str(w4a8.unavailable()))
def test_w4a8_compiles_as_a_custom_op():
    """Inside torch.compile the product is ``blocklab::w4a8_mm``: eager's numbers, but for the bias
    added before the bf16 rounding (inductor fuses the two)."""
    torch.manual_seed(0)
    layer = QuantizedLinear(torch.randn(48, 64), torch.randn(48), "w4a8")
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x), layer(x), atol=4e-3, rtol=1e-2)


def test_w4a8_without_its_kernel_is_refused_saying_why(monkeypatch):
    """Where the kernel cannot run (no AVX2, no compiler), quantizing and the server's settings say why."""
    from serve.app import ServeConfig

    monkeypatch.setattr(w4a8, "unavailable", lambda: "the W4A8 kernel needs a CPU with AVX2 and FMA")
    with pytest.raises(ValueError, match="--dtype w4a8: the W4A8 kernel needs a CPU with AVX2.*int4 runs"):
        quantize(tiny_model(), "w4a8")
    with pytest.raises(ValueError, match="--dtype w4a8: the W4A8 kernel needs"):
        ServeConfig(model="builtin", dtype="w4a8").check()
    quantize(tiny_model(), "int4")  # the others need nothing of it
