"""A decode step's attention and greedy pick through lab.intmm's kernels (lab.block_kernel,
lab.intmm.argmax): the attention kernel is its definition and writes the caches as torch's path does,
each row is computed as if alone, the loader gives it to every model on the CPU without changing its
parameters, decoding matches torch's attention, and hooks, prompts and gradients keep torch's; the
argmax is torch's."""

import math

import pytest
import torch

from lab import intmm
from lab.block_kernel import KernelAttention, use_block_kernels
from lab.decode import Decoder
from lab.hooks import capture
from lab.model import CausalSelfAttention
from lab.weights import load_model, save_model
from tests.tiny import TinyModel, assert_rows_alone

pytestmark = pytest.mark.skipif(intmm.unavailable() is not None, reason=str(intmm.unavailable()))

H, DH = 3, 12  # a head width that is no multiple of 8: the dot products' tails run too


def reference(qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, position: int) -> torch.Tensor:
    """One row's attention in float64 over positions 0..position of its cache ([H, T_max, Dh]), the
    row's own key and value in place at ``position``: [D]."""
    q, k, v = qkv.double().view(3, H, DH)  # [H, Dh] each
    keys, values = k_cache[:, : position + 1].double().clone(), v_cache[:, : position + 1].double().clone()
    keys[:, position], values[:, position] = k, v
    weights = torch.softmax(torch.einsum("hd,hsd->hs", q, keys) / math.sqrt(DH), dim=-1)  # [H, S]
    return torch.einsum("hs,hsd->hd", weights, values).reshape(H * DH)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attend_rows_is_its_definition_writes_the_caches_and_rows_are_alone(dtype):
    """Each row attends over its own cache (their lengths differ) up to its own position, as the
    float64 definition does, after writing its key and value there; a row's result is the same alone
    as among others; a position outside its cache, caches of another dtype and values whose length
    is not their keys' are refused."""
    lengths, positions = [5, 9, 9, 16], [0, 8, 3, 11]
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(4, 3 * H * DH, generator=generator).to(dtype)
    k_caches = [torch.randn(1, H, t, DH, generator=generator).to(dtype) for t in lengths]
    v_caches = [torch.randn(1, H, t, DH, generator=generator).to(dtype) for t in lengths]
    before = [(k.clone(), v.clone()) for k, v in zip(k_caches, v_caches, strict=True)]
    y = intmm.attend_rows(qkv, k_caches, v_caches, positions, H)
    assert y.shape == (4, H * DH) and y.dtype == dtype
    tolerance = 1e-5 if dtype is torch.float32 else 1e-2
    for b, position in enumerate(positions):
        expected = reference(qkv[b], before[b][0][0], before[b][1][0], position)
        torch.testing.assert_close(y[b].double(), expected, rtol=tolerance, atol=tolerance)
        k_new, v_new = qkv[b].view(3, H, DH)[1:]
        assert torch.equal(k_caches[b][0, :, position], k_new)
        assert torch.equal(v_caches[b][0, :, position], v_new)
        untouched = [s for s in range(lengths[b]) if s != position]
        assert torch.equal(k_caches[b][0, :, untouched], before[b][0][0, :, untouched])
    for rows in ([0], [1, 3], [2, 0, 1]):
        alone = intmm.attend_rows(
            qkv[rows].contiguous(), [k_caches[b] for b in rows], [v_caches[b] for b in rows],
            [positions[b] for b in rows], H,
        )  # fmt: skip
        assert torch.equal(alone, y[rows])
    with pytest.raises(ValueError, match="position 5 outside a cache of 5"):
        intmm.attend_rows(qkv[:1], k_caches[:1], v_caches[:1], [5], H)
    with pytest.raises(ValueError, match="caches dense"):
        intmm.attend_rows(qkv[:1], [k_caches[0].double()], v_caches[:1], [0], H)
    with pytest.raises(ValueError, match="caches dense"):  # values read with the keys' length
        intmm.attend_rows(qkv[:1], k_caches[:1], v_caches[1:2], [0], H)


def tiny(dtype: torch.dtype = torch.float32):
    return TinyModel(n_layer=4, n_embd=48, n_head=4)("cpu").to(dtype)


def decode(model, prompts: list[list[int]], fed: list[int]) -> torch.Tensor:
    """Decoders prefilled with ``prompts``, stepped once together with ``fed``: the logits [B, V]."""
    from lab.decode import decode_rows
    from lab.rows import rows_alone

    decoders = [Decoder(model, None, max_len=32) for _ in prompts]
    for decoder, prompt in zip(decoders, prompts, strict=True):
        decoder.prefill(prompt)
    with rows_alone():
        return decode_rows(model, decoders, fed)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attention_decodes_as_torch_does_and_rows_are_alone(dtype):
    """A model whose attention is the kernel's decodes rows at different positions to torch's
    logits up to the sums' order, with its parameters unchanged; under rows_alone every row, under
    any block set, gets bit for bit the logits it gets alone."""
    plain = tiny(dtype)
    model = use_block_kernels(tiny(dtype))
    assert all(type(block.attn) is KernelAttention for block in model.blocks)
    pairs = zip(model.state_dict().values(), plain.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    prompts, fed = [[5, 6, 7], list(range(10, 21)), [3]], [8, 9, 10]
    tolerance = 1e-5 if dtype is torch.float32 else 5e-2
    together, plainly = decode(model, prompts, fed), decode(plain, prompts, fed)
    torch.testing.assert_close(together, plainly, rtol=tolerance, atol=tolerance)
    assert_rows_alone(model, ["all", "exit=2", "skip=0,3", "adaptive=0.5", "keep=1,2"], list(range(30, 40)))


def test_hooks_prompts_and_gradients_keep_torchs_attention(monkeypatch):
    """While a block's attention pattern is hooked that block's attention is torch's explicit one
    (the hook sees its pattern; the other blocks keep the kernel), and so are a prompt's positions
    and anything that needs gradients: the kernel is not called for them."""
    model = use_block_kernels(tiny())
    calls = []
    kernel = intmm.attend_rows
    monkeypatch.setattr(intmm, "attend_rows", lambda *args: calls.append(1) or kernel(*args))
    decoder = Decoder(model, None, max_len=32)
    decoder.prefill([1, 2, 3, 4])
    assert calls == []  # the prompt: several positions at once
    decoder.step(5)
    assert len(calls) == model.config.n_layer
    with capture(model, ["blocks.1.attn.pattern"]) as seen:
        decoder.step(6)
    assert seen["blocks.1.attn.pattern"].shape[-1] == 6 and len(calls) == 2 * model.config.n_layer - 1
    attention = model.blocks[0].attn
    x = torch.randn(1, 1, 48, requires_grad=True)
    cache = (torch.zeros(1, 4, 8, 12), torch.zeros(1, 4, 8, 12))
    attention(x, [cache], [0]).sum().backward()
    assert x.grad is not None and len(calls) == 2 * model.config.n_layer - 1


@pytest.mark.parametrize("dtype", ["float32", "w4a8"])
def test_the_loader_gives_every_model_the_kernel(tmp_path, dtype):
    """Float and quantized models alike get the kernel from the loader; ``kernels=False`` keeps
    torch's attention."""
    save_model(TinyModel(n_layer=2, n_embd=64, n_head=4)("cpu"), tmp_path)  # w4a8: widths of 64
    assert type(load_model(str(tmp_path), dtype).blocks[0].attn) is KernelAttention
    assert type(load_model(str(tmp_path), dtype, kernels=False).blocks[0].attn) is CausalSelfAttention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_answers_as_torch_does(dtype):
    """Greedy decoding's pick (``lab.intmm.argmax``, ``lab.sampling.greedy_token``) is torch's
    argmax: the first of equal largest values, the first NaN where there is one, at any length
    (vector tails too); other layouts keep torch's."""
    from lab.sampling import greedy_token

    generator = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 50257):
        for trial in range(40):
            x = torch.randn(n, generator=generator).to(dtype)
            at = torch.randint(n, (2,), generator=generator)
            if trial % 3 == 0:
                x[at[0]] = x.max()  # a tie with the largest, before or after it
            if trial % 7 == 0:
                x[at[1]] = float("nan")
            if trial % 11 == 0:
                x[:] = float("-inf")
            assert intmm.argmax(x) == int(x.argmax()) == greedy_token(x), (n, trial)
    columns = torch.randn(4, 9).to(dtype).t()[0]  # not dense: torch's argmax
    assert greedy_token(columns) == int(columns.argmax())
    with pytest.raises(ValueError, match="argmax: x dense"):
        intmm.argmax(columns)


def test_logsumexp_answers_as_torch_does():
    """A token's log-probability (``lab.intmm.logsumexp``, ``lab.sampling.token_logprob``) is
    torch's to float32's last bits, at any length and scale; -inf, +inf and NaN as torch answers
    them; other dtypes keep torch's."""
    from lab.sampling import token_logprob

    generator = torch.Generator().manual_seed(0)
    for n in (1, 7, 8, 9, 50257):
        for scale in (1e-3, 1.0, 30.0):
            x = torch.randn(n, generator=generator) * scale - 5.0
            if n > 1:
                x[n // 2] = float("-inf")  # a masked token (min_tokens' end-of-text) costs nothing
            want = float(torch.logsumexp(x, 0))
            assert intmm.logsumexp(x) == pytest.approx(want, rel=1e-6, abs=1e-6), (n, scale)
            token = n - 1
            assert token_logprob(x, token) == pytest.approx(float(x[token] - torch.logsumexp(x, 0)), abs=1e-5)
    for special in ([float("-inf")] * 9, [0.0, float("inf")] * 5, [0.0, float("nan"), float("inf")]):
        x = torch.tensor(special)
        want = float(torch.logsumexp(x, 0))
        assert intmm.logsumexp(x) == want or math.isnan(want) and math.isnan(intmm.logsumexp(x))
    half = torch.randn(9, generator=generator).to(torch.bfloat16)
    assert token_logprob(half, 3) == pytest.approx(float(half[3].float() - torch.logsumexp(half.float(), 0)))
    with pytest.raises(ValueError, match="logsumexp: x dense float32"):
        intmm.logsumexp(half)
