"""float32 and bf16 weights through lab.intmm's kernels (lab.float_kernels): each product is what it
claims, the loader gives them to float models on the CPU without changing their parameters, decoding
and batch invariance hold, training still takes torch's products, and a model without them is torch's."""

import pytest
import torch

from lab import fast, intmm
from lab.blocks import BlockSet
from lab.decode import Decoder
from lab.float_kernels import KernelLinear, KernelReadOut, use_float_kernels
from lab.model import GPT, Linear
from lab.quantize import QuantizedLinear, quantize
from lab.weights import load_model, save_model
from tests.tiny import TinyModel, assert_rows_alone

pytestmark = pytest.mark.skipif(intmm.unavailable() is not None, reason=str(intmm.unavailable()))

PRODUCTS = {torch.float32: intmm.f32_matmul, torch.bfloat16: intmm.bf16_matmul}
DTYPES = list(PRODUCTS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(37, 64), (37, 768), (6, 77)])
def test_float_kernel_is_its_definition_and_rows_are_alone(dtype, n, k, instruction_set):
    """Each product is x (rounded to bf16 for bf16 weights) times the weights, summed in float32
    (against float64), for any output count and any width (77: tails of a vector in both instruction
    sets); each row's result is the same alone or among others; bf16 in and out is the float32 result
    with the bias, rounded once; weights of another dtype are refused."""
    product = PRODUCTS[dtype]
    weight, bias = (torch.randn(n, k) * 0.05).to(dtype), torch.randn(n).to(dtype)
    x = torch.randn(9, k)
    y = product(x, weight, bias.float())
    assert y.shape == (9, n) and y.dtype == torch.float32
    reference = x.to(dtype).double() @ weight.double().t() + bias.double()
    torch.testing.assert_close(y.double(), reference, rtol=1e-5, atol=1e-5)
    for rows in (1, 2, 3, 4, 5):
        for start in range(0, 9 - rows + 1, 2):
            assert torch.equal(
                product(x[start : start + rows], weight, bias.float()), y[start : start + rows]
            )
    if dtype is torch.bfloat16:
        y16 = product(x.to(torch.bfloat16), weight, bias)
        assert y16.dtype == torch.bfloat16 and torch.equal(y16, y.to(torch.bfloat16))
    with pytest.raises(ValueError, match=f"weight {dtype}"):
        product(x, weight.double())


@pytest.mark.parametrize("dtype", DTYPES)
def test_float_kernels_compile_as_custom_ops(dtype, instruction_set):
    """Inside torch.compile each product is its custom op (``blocklab::f32_mm``, ``bf16_mm``)."""
    layer = Linear(64, 48)
    torch.nn.init.normal_(layer.weight), torch.nn.init.normal_(layer.bias)
    layer.to(dtype).__class__ = KernelLinear
    x = torch.randn(1, 64, dtype=dtype)
    with torch.inference_mode():
        assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


def tiny(dtype: torch.dtype = torch.float32) -> GPT:
    return TinyModel(n_layer=4, n_embd=64, n_head=4)("cpu").to(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_loader_gives_float_models_the_kernels_with_their_own_parameters(tmp_path, dtype):
    """float32 and bf16 models decode through the kernels, their parameters and state dict unchanged
    (the read-out over the table they hold, no copy); the logits are torch's up to the sums' order;
    float16 and ``kernels=False`` keep torch's products."""
    save_model(tiny(), tmp_path)
    model, plain = load_model(str(tmp_path), dtype), load_model(str(tmp_path), dtype, kernels=False)
    assert all(type(m) is KernelLinear for m in model.modules() if isinstance(m, Linear))
    assert isinstance(model.read_out, KernelReadOut) and plain.read_out is None
    assert model.state_dict().keys() == plain.state_dict().keys() and model.num_params() == plain.num_params()
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True)
    )
    assert type(load_model(str(tmp_path), "float16").blocks[0].attn.c_attn) is Linear
    prompt = list(range(40, 52))
    steps = {}
    for name, m in (("kernels", model), ("torch", plain)):
        decoder = Decoder(m, BlockSet.parse("skip=1", 4))
        first = decoder.prefill(prompt)
        steps[name] = torch.stack([first] + [decoder.step(t)[0] for t in (7, 8, 9)]).float()  # [4, V]
    tolerance = 1e-5 if dtype == "float32" else 3e-2
    torch.testing.assert_close(steps["kernels"], steps["torch"], atol=tolerance, rtol=tolerance)


def test_kernel_rows_are_alone_and_the_compiled_step_takes_them():
    """Under rows_alone the server's shared steps go through the kernels (any number of rows), each
    row bit for bit what it is alone; lab.fast's compiled step runs them as custom ops and gives the
    eager step's logits."""
    model = use_float_kernels(tiny())
    prompt = list(range(30, 38))
    assert_rows_alone(model, ["all", "exit=2", "skip=0,3", "keep=1,2"], prompt)
    compiled = fast.accelerate(use_float_kernels(tiny()), "graphs", capture=fast.eager_capture)
    eager, decoder = Decoder(model, BlockSet.parse("all", 4)), Decoder(compiled, BlockSet.parse("all", 4))
    torch.testing.assert_close(decoder.prefill(prompt), eager.prefill(prompt), atol=1e-5, rtol=1e-5)
    for token in (3, 4, 5):
        torch.testing.assert_close(decoder.step(token)[0], eager.step(token)[0], atol=1e-5, rtol=1e-5)


def test_gradients_still_flow_through_torchs_products():
    """Training a loaded model still works: where a gradient is needed the products are torch's, so the
    gradients are those of the same model without the kernels."""
    model, plain = use_float_kernels(tiny()).train(), tiny().train()
    idx = torch.randint(0, 1000, (2, 16))
    for m in (model, plain):
        torch.nn.functional.cross_entropy(m(idx).flatten(0, 1), idx.flatten()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_quantizing_a_kernel_model_replaces_its_read_out(tmp_path):
    save_model(tiny(), tmp_path)
    model = quantize(load_model(str(tmp_path)), "int8")
    assert isinstance(model.read_out, QuantizedLinear)
    assert not any(isinstance(m, Linear) for m in model.modules())
    with pytest.raises(ValueError, match="already has a read-out"):
        use_float_kernels(model)


def test_without_the_kernels_float_models_stay_torchs(tmp_path, monkeypatch):
    save_model(tiny(), tmp_path)
    monkeypatch.setattr(intmm, "unavailable", lambda: "the integer kernels need a CPU with AVX2 and FMA")
    model = load_model(str(tmp_path), "bfloat16")
    assert type(model.blocks[0].attn.c_attn) is Linear and model.read_out is None
