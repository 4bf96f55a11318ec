"""Quantized weights (lab.quantize, lab.intmm): each layer computes with the weights it claims to hold,
and decoding works."""

from dataclasses import replace

import pytest
import torch

from lab import intmm
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

NO_KERNELS = pytest.mark.skipif(intmm.unavailable() is not None, reason=str(intmm.unavailable()))
INTEGER = [pytest.param("w4a8", marks=NO_KERNELS), pytest.param("w8a8", marks=NO_KERNELS)]
QUANTIZED = ["int8", "int4", *INTEGER]
KERNELS = [*INTEGER, pytest.param("int4", marks=NO_KERNELS), pytest.param("int8", marks=NO_KERNELS)]
"""lab.intmm's products: w4a8 and w8a8, and weight-only int4 and int8 where it computes them."""


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


@pytest.mark.parametrize("kind", QUANTIZED)
@pytest.mark.parametrize("rows", [1, 5])
def test_quantized_linear_is_the_product_with_its_dequantized_weight(kind, rows):
    """The fused kernel computes x @ W_q + b for the W_q the quantizer produced (with bf16 rounding,
    and w4a8's and w8a8's int8 inputs), for one row (decoding) and several (prefill), with outputs
    not a multiple of 16 (int4 pads)."""
    torch.manual_seed(0)
    linear = Linear(64, 100)
    torch.nn.init.normal_(linear.weight, std=0.02)
    torch.nn.init.normal_(linear.bias, std=0.02)
    layer = QuantizedLinear(linear.weight.t(), linear.bias, kind)
    x = torch.randn(2, rows, 64)
    weight = linear.weight.t().detach()  # [out, in]
    bits = 8 if kind in ("int8", "w8a8") else 4
    if bits == 8:
        values, scales = quantize_rows_int8(weight)
        dequantized = values.float() * layer.scales.float()[:, None]  # int8's bf16, w8a8's float32
    else:
        codes, scales_and_zeros = quantize_groups_int4(weight, layer.group_size)
        scales_and_zeros = scales_and_zeros.to(torch.bfloat16)  # both kernels keep bf16 scales and zeros
        dequantized = dequantize_int4(codes, scales_and_zeros)
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
    eight_bits = dtype in ("int8", "w8a8")
    error = (logits - reference).norm() / reference.norm()
    assert error < (0.02 if eight_bits else 0.15)
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean()
    assert agree > (0.9 if eight_bits else 0.6)


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


def quantized_inputs(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as lab/kernels/intmm.c quantizes it, in float64: each row's groups of 64 inputs rounded
    to int8 steps of max |a| / 127. -> [M, K / 64, 64]."""
    m, k = x.shape
    groups = x.double().reshape(m, k // 64, 64)  # [M, G, 64]
    steps = groups.abs().amax(-1, keepdim=True) / 127  # [M, G, 1]
    return torch.where(steps > 0, torch.round(groups / steps), 0.0) * steps


def w4a8_reference(x: torch.Tensor, codes: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """What w4a8_mm defines: the int8 inputs times the weights (code - 8) * scale + zero, scale and
    zero rounded to bf16 as int4's, with each group's sum of x exact (the zeros multiply it).
    x [M, K] -> [M, N]."""
    m, k = x.shape
    q = quantized_inputs(x)  # [M, G, 64]
    scales, zeros = scales_and_zeros.to(torch.bfloat16).double().transpose(0, 1).unbind(-1)  # [N, G] each
    c = codes.double().reshape(codes.size(0), k // 64, 64) - 8  # [N, G, 64]
    products = torch.einsum("mgi,ngi->mng", q, c) * scales  # [M, N, G]
    return (products + x.double().reshape(m, k // 64, 64).sum(-1)[:, None, :] * zeros).sum(-1)  # [M, N]


def w8a8_reference(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What w8a8_mm defines: the int8 inputs times the weights value * scale. x [M, K] -> [M, N]."""
    q = quantized_inputs(x).flatten(1)  # [M, K]
    return q @ (values.double() * scales.double()[:, None]).t()  # [M, N]


def integer_product(kind: str, weight: torch.Tensor):
    """lab.intmm's product of ``kind`` on ``weight`` [N, K] as lab.quantize quantizes it, and its
    float64 definition: two functions of x [M, K] (and a bias [N])."""
    if kind in ("w4a8", "int4"):
        codes, scales_and_zeros = quantize_groups_int4(weight, 64)
        packed = intmm.w4a8_pack(codes, scales_and_zeros)
        if kind == "int4":  # weight-only: x as it is times the weights the bf16 scales and zeros make
            dequantized = dequantize_int4(codes, scales_and_zeros.to(torch.bfloat16)).double()
            return (
                lambda x, bias=None: intmm.int4_matmul(x, *packed, bias, weight.size(0)),
                lambda x: x.double() @ dequantized.t(),
            )
        return (
            lambda x, bias=None: intmm.w4a8_matmul(x, *packed, bias, weight.size(0)),
            lambda x: w4a8_reference(x, codes, scales_and_zeros),
        )
    values, scales = quantize_rows_int8(weight)
    if kind == "int8":  # weight-only, with the bf16 scales torch's int8 kernel takes
        scales = scales.to(torch.bfloat16)
        return (
            lambda x, bias=None: intmm.int8_matmul(x, values, scales, bias),
            lambda x: x.double() @ (values.double() * scales.double()[:, None]).t(),
        )
    return (
        lambda x, bias=None: intmm.w8a8_matmul(x, values, scales, bias),
        lambda x: w8a8_reference(x, values, scales),
    )


@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize(("n", "k"), [(37, 64), (37, 768), (6, 1088)])
def test_integer_kernel_is_its_definition_and_rows_are_alone(kind, n, k, instruction_set):
    """The C kernel computes what its header says (against float64), with outputs of any count
    (w8a8's tiles of 4 and what is left; w4a8's and int4's blocks of 16, the last one padded) and
    groups of any count (1088: 17, one past a vector of 16), and each row's result is bit for bit the
    same alone or among 1 to 28 others (batch invariance: a decode step's rows, a short prompt's, and a
    long prompt's, whose int4 products on AVX2 widen each block's codes once)."""
    torch.manual_seed(0)
    product, reference = integer_product(kind, torch.randn(n, k) * 0.05)
    x = torch.randn(29, k)
    x[2] = 0.0  # a row of zeros: its activation scale is 0
    y = product(x)
    assert y.shape == (29, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), reference(x), rtol=1e-5, atol=1e-5)
    assert not y[2].any()
    for rows in (1, 2, 3, 4, 5, 9, 25):
        for start in range(0, 29 - rows + 1, 3):
            assert torch.equal(product(x[start : start + rows]), y[start : start + rows])


@pytest.mark.parametrize(("n", "k"), [(37, 64), (37, 768)])
def test_int4_of_bf16_inputs_is_its_definition_and_rows_are_alone(n, k, instruction_set):
    """bf16 inputs (an int4 model's activations) take the tile that adds the products in pairs where
    the CPU has AVX-512 BF16: still the definition (the products are exact, the sums float32), and each
    row's result the same alone or among others."""
    torch.manual_seed(1)
    product, reference = integer_product("int4", torch.randn(n, k) * 0.05)
    x = torch.randn(9, k).to(torch.bfloat16)
    y = product(x)
    assert y.shape == (9, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), reference(x).to(torch.bfloat16).double(), rtol=1e-2, atol=1e-2)
    for rows in (1, 2, 3, 4, 5):
        for start in range(0, 9 - rows + 1, 2):
            assert torch.equal(product(x[start : start + rows]), y[start : start + rows])


def test_w8a8_takes_every_int8_value_and_refuses_weights_it_would_misread(instruction_set):
    """-128, which lab.quantize never makes, still multiplies as itself (AVX-512's offset trick
    negates in int32); scales of another dtype, which C would read past their end, are refused."""
    torch.manual_seed(0)
    values = torch.randint(-128, 128, (11, 128), dtype=torch.int8)
    values[:, :7] = -128
    scales = torch.rand(11) / 100
    x = torch.randn(3, 128)
    torch.testing.assert_close(
        intmm.w8a8_matmul(x, values, scales).double(), w8a8_reference(x, values, scales), rtol=1e-5, atol=1e-5
    )
    with pytest.raises(ValueError, match="scales torch.float32"):
        intmm.w8a8_matmul(x, values, scales.to(torch.bfloat16))


@pytest.mark.parametrize("kind", KERNELS)
def test_integer_kernel_reads_and_writes_bf16(kind, instruction_set):
    """bf16 x is read as it is (its values exactly), the bias added in float32 and y rounded once to
    bf16 as torch rounds; a strided x is made dense first; other dtypes are taken as float32."""
    torch.manual_seed(0)
    product, _ = integer_product(kind, torch.randn(40, 128) * 0.05)
    x, bias = torch.randn(6, 256)[:, ::2], torch.randn(40)  # [6, 128], strided
    x16 = x.to(torch.bfloat16)
    y = product(x16, bias.to(torch.bfloat16))
    assert y.dtype == torch.bfloat16
    expected = product(x16.float(), bias.to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(y, expected)
    assert torch.equal(product(x.double()), product(x))


@pytest.mark.parametrize("kind", KERNELS)
def test_integer_products_compile_as_custom_ops(kind, instruction_set):
    """Inside torch.compile each product is its custom op (``blocklab::w4a8_mm``, ``int4_mm``, ...),
    bias included: eager's numbers bit for bit."""
    torch.manual_seed(0)
    layer = QuantizedLinear(torch.randn(48, 64), torch.randn(48), kind)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))


@NO_KERNELS
def test_the_instruction_set_is_chosen_by_name():
    """The default is the best this CPU has; a name not among INSTRUCTION_SETS is refused."""
    default = intmm.instruction_set()
    assert default in intmm.INSTRUCTION_SETS
    try:
        assert intmm.instruction_set("avx2") == "avx2"
        assert intmm.instruction_set("avx512-vnni") == default
    finally:
        intmm.instruction_set(default)
    with pytest.raises(ValueError, match="one of avx2, avx512-vnni, not 'sse4'"):
        intmm.instruction_set("sse4")


@NO_KERNELS
def test_another_version_of_the_source_builds_into_its_own_library(tmp_path, monkeypatch):
    """scripts/bench_kernel_change.py loads two versions side by side: each library is built from
    the file it names (it once built the shipped file under the other's digest, so both were one)."""
    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "intmm.c"
    other.write_text(intmm.SOURCE.read_text() + "\nint version_marker(void) { return 7; }\n")
    assert intmm._library(other).version_marker() == 7
    assert not hasattr(intmm._library(), "version_marker")


@pytest.mark.parametrize(("kind", "weight_only"), [("w4a8", "int4"), ("w8a8", "int8")])
def test_integer_products_without_their_kernels_are_refused_saying_why(monkeypatch, kind, weight_only):
    """Where the kernels cannot run (no AVX2, no compiler), quantizing and the server's settings say why."""
    from serve.app import ServeConfig

    monkeypatch.setattr(intmm, "unavailable", lambda: "the integer kernels need a CPU with AVX2 and FMA")
    with pytest.raises(
        ValueError, match=f"--dtype {kind}: the integer kernels need a CPU.*{weight_only} runs"
    ):
        quantize(tiny_model(), kind)
    with pytest.raises(ValueError, match=f"--dtype {kind}: the integer kernels need"):
        ServeConfig(model="builtin", dtype=kind).check()
    model = quantize(tiny_model(), weight_only)  # the others need nothing of it: torch's kernels
    assert model.blocks[0].mlp.c_fc.kernel is None


@NO_KERNELS
def test_weight_only_products_are_lab_intmms_where_it_takes_their_widths():
    """int8 of any width and int4 of widths that are multiples of 64 take lab.intmm's products; int4 of
    other widths (groups of 32), and both with ``kernels=False``, keep torch's kernels: the product
    of the same weights either way."""
    torch.manual_seed(0)
    weight, bias = torch.randn(40, 96) * 0.05, torch.randn(40)
    x = torch.randn(3, 96, dtype=torch.bfloat16)
    assert QuantizedLinear(weight, bias, "int8").kernel == "int8"
    assert QuantizedLinear(weight[:, :64], bias, "int4").kernel == "int4"
    torch_int4 = QuantizedLinear(weight, bias, "int4")
    assert torch_int4.kernel is None and torch_int4.group_size == 32 and "(torch)" in repr(torch_int4)
    codes, scales_and_zeros = quantize_groups_int4(weight, 32)
    expected = x.float() @ dequantize_int4(codes, scales_and_zeros.to(torch.bfloat16)).t() + bias
    torch.testing.assert_close(torch_int4(x).float(), expected, atol=2e-2, rtol=2e-2)
    for dtype in ("int8", "int4"):  # kernels=False: torch's, the baseline; the same predictions
        ours, theirs = quantize(tiny_model(), dtype), quantize(tiny_model(), dtype, kernels=False)
        assert ours.blocks[0].mlp.c_fc.kernel == dtype and theirs.blocks[0].mlp.c_fc.kernel is None
        assert theirs.read_out.kernel is None
        tokens = torch.randint(0, CFG.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(ours(tokens).float(), theirs(tokens).float(), atol=5e-2, rtol=5e-2)
