"""The model: shapes, causality, eager == sdpa, pre vs post, the stream's bookkeeping, block sets."""

import math
from dataclasses import replace

import pytest
import torch

from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.hooks import capture, hook_names
from lab.model import GPT, KVCache

TINY = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=23, block_size=32)


def tokens(B=2, T=12, V=TINY.vocab_size):
    return torch.randint(0, V, (B, T))


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_logits_shape(norm):
    model = GPT(replace(TINY, norm=norm))
    assert model(tokens()).shape == (2, 12, TINY.vocab_size)


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_causal(norm, attention):
    model = GPT(replace(TINY, norm=norm, attention=attention)).eval()
    idx = tokens()
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % TINY.vocab_size
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7])
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("norm", ["pre", "post"])
def test_eager_equals_sdpa(norm):
    eager = GPT(replace(TINY, norm=norm, attention="eager")).eval()
    sdpa = GPT(replace(TINY, norm=norm, attention="sdpa")).eval()
    sdpa.load_state_dict(eager.state_dict())
    idx = tokens()
    torch.testing.assert_close(eager(idx), sdpa(idx), atol=1e-5, rtol=1e-5)


def test_pre_and_post_differ_as_defined():
    """Same weights, different wiring: post-LN normalises each sum, pre-LN normalises each input."""
    pre = GPT(replace(TINY, norm="pre")).eval()
    post = GPT(replace(TINY, norm="post")).eval()
    post.load_state_dict(pre.state_dict(), strict=False)  # post has no ln_f
    assert isinstance(post.ln_f, torch.nn.Identity)
    idx = tokens()
    assert not torch.allclose(pre(idx), post(idx))
    # post-LN: every block's output is LayerNorm'd: mean 0, unit variance per position
    with capture(post, "blocks.*.resid_post") as seen:
        post(idx)
    for name, x in seen.items():
        torch.testing.assert_close(x.mean(-1), torch.zeros(x.shape[:-1]), atol=1e-5, rtol=0, msg=name)
        torch.testing.assert_close(
            x.var(-1, unbiased=False), torch.ones(x.shape[:-1]), atol=1e-3, rtol=0, msg=name
        )


def test_stream_adds_up():
    model = GPT(TINY).eval()
    with capture(model) as seen:
        model(tokens())
    torch.testing.assert_close(seen["blocks.0.resid_pre"], seen["embed"])
    for i in range(TINY.n_layer):
        pre, post = seen[f"blocks.{i}.resid_pre"], seen[f"blocks.{i}.resid_post"]
        attn_out, mlp_out = seen[f"blocks.{i}.attn_out"], seen[f"blocks.{i}.mlp_out"]
        torch.testing.assert_close(seen[f"blocks.{i}.resid_mid"], pre + attn_out)
        torch.testing.assert_close(post, pre + attn_out + mlp_out)
        if i + 1 < TINY.n_layer:
            torch.testing.assert_close(seen[f"blocks.{i + 1}.resid_pre"], post)


def test_block_tensors_have_their_shapes():
    model = GPT(replace(TINY, attention="sdpa")).eval()
    B, T, D, H = 2, 12, TINY.n_embd, TINY.n_head
    with capture(model, "blocks.1.*") as seen:
        logits = model(tokens(B, T))
    expected = {
        "blocks.1.attn.qkv": (B, T, 3 * D),
        "blocks.1.attn.scores": (B, H, T, T),
        "blocks.1.attn.pattern": (B, H, T, T),
        "blocks.1.attn.z": (B, T, D),
        "blocks.1.attn_out": (B, T, D),
        "blocks.1.mlp.hidden": (B, T, 4 * D),
        "blocks.1.mlp_out": (B, T, D),
    }
    for name, shape in expected.items():
        assert seen[name].shape == shape, name
    # scores were formed by the eager path even though the model is sdpa; the pattern is causal
    pattern = seen["blocks.1.attn.pattern"]
    assert torch.all(pattern.triu(diagonal=1) == 0)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(B, H, T))
    uncaptured = model(tokens(B, T).copy_(tokens(B, T)))  # a different call, to make sure hooks are gone
    assert uncaptured.shape == logits.shape
    assert not any(m._forward_hooks for m in model.modules())


def test_capture_unknown_name_fails():
    with pytest.raises(KeyError, match="no hook point"), capture(GPT(TINY), "blocks.9.nope"):
        pass
    assert "blocks.2.resid_post" in hook_names(GPT(TINY))


def test_capture_leaves_arithmetic_unchanged():
    model = GPT(TINY).eval()
    idx = tokens()
    plain = model(idx)
    with capture(model):
        hooked = model(idx)
    torch.testing.assert_close(plain, hooked, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_cache_equals_full_forward(attention):
    model = GPT(replace(TINY, attention=attention)).eval()
    idx = tokens(B=1, T=10)
    full = model(idx)
    cache = KVCache(model.config, max_len=10)
    steps = [model(idx[:, :4], cache=cache)]  # prefill
    steps += [model(idx[:, t : t + 1], cache=cache) for t in range(4, 7)]  # one at a time
    steps.append(model(idx[:, 7:], cache=cache))  # a chunk after a prefix
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert cache.length == 10
    with pytest.raises(ValueError, match="exceed"):
        model(idx[:, :1], cache=cache)


def test_skip_passes_stream_through():
    model = GPT(TINY).eval()
    with capture(model, ["blocks.*.resid_pre", "blocks.*.resid_post"]) as seen:
        model(tokens(), block_set=BlockSet(skip={1}))
    assert "blocks.1.resid_pre" not in seen
    torch.testing.assert_close(seen["blocks.2.resid_pre"], seen["blocks.0.resid_post"])


def test_skip_all_is_embedding_readout():
    model = GPT(TINY).eval()
    idx = tokens()
    logits = model(idx, block_set=BlockSet(skip={0, 1, 2}))
    torch.testing.assert_close(logits, model.unembed(model.embed_tokens(idx)))


def test_exit_at_is_logit_lens():
    model = GPT(TINY).eval()
    idx = tokens()
    with capture(model, "blocks.1.resid_post") as seen:
        logits = model(idx, block_set=BlockSet(exit_at=2))
    torch.testing.assert_close(logits, model.unembed(seen["blocks.1.resid_post"]))
    torch.testing.assert_close(model(idx, block_set=BlockSet(exit_at=3)), model(idx))


def test_overwrite_hands_on_the_writes_alone():
    model = GPT(TINY).eval()
    with capture(model, ["blocks.1.*", "blocks.2.resid_pre"]) as seen:
        model(tokens(), block_set=BlockSet(overwrite={1}))
    torch.testing.assert_close(
        seen["blocks.2.resid_pre"], seen["blocks.1.attn_out"] + seen["blocks.1.mlp_out"]
    )
    # the writes themselves were computed as usual: the MLP still read resid_pre + attn_out
    torch.testing.assert_close(
        seen["blocks.1.resid_mid"], seen["blocks.1.resid_pre"] + seen["blocks.1.attn_out"]
    )


def test_residual_projections_scaled_at_init():
    model = GPT(GPTConfig(n_layer=8, n_embd=64, n_head=4, vocab_size=64, block_size=16))
    std = model.blocks[0].attn.c_proj.weight.std().item()
    assert std == pytest.approx(0.02 / 4, rel=0.2)  # 0.02 / sqrt(2 * 8)
    assert model.blocks[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_token_table_is_tied():
    model = GPT(TINY)
    x = torch.randn(1, 1, TINY.n_embd)
    torch.testing.assert_close(model.unembed(x), model.ln_f(x) @ model.wte.weight.T)
    assert model.num_params() == sum(p.numel() for p in model.parameters())


def test_config_validation_names_the_values():
    with pytest.raises(ValueError, match=r"n_embd \(30\).*n_head \(4\)"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="norm"):
        GPTConfig(norm="middle")
    assert GPTConfig.from_name("gpt2").n_embd == 768
    with pytest.raises(KeyError, match="unknown model preset"):
        GPTConfig.from_name("gpt5")


@pytest.mark.parametrize("norm", ["pre", "post", "deepnorm", "peri"])
@pytest.mark.parametrize("norm_type", ["layer", "rms"])
def test_every_norm_variant_runs_forward_and_backward(norm, norm_type):
    model = GPT(replace(TINY, norm=norm, norm_type=norm_type))
    logits = model(tokens(2, 8))  # [B, T, V]
    logits.logsumexp(-1).mean().backward()
    assert logits.shape == (2, 8, TINY.vocab_size) and torch.isfinite(logits).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.blocks.parameters())
    norm_class = torch.nn.RMSNorm if norm_type == "rms" else torch.nn.LayerNorm
    assert isinstance(model.blocks[0].ln_1, norm_class) and isinstance(model.blocks[0].ln_2, norm_class)
    assert isinstance(model.ln_f, norm_class if norm in ("pre", "peri") else torch.nn.Identity)


def test_deepnorm_scales_the_residual_by_alpha_and_the_init_by_beta():
    cfg = replace(TINY, norm="deepnorm", n_layer=4, n_embd=64, n_head=2)
    model = GPT(cfg)
    L, D = cfg.n_layer, cfg.n_embd
    alpha, beta = (2 * L) ** 0.25, (8 * L) ** -0.25
    block = model.blocks[0]
    assert block.alpha == pytest.approx(alpha)
    # Xavier normal: std = gain * sqrt(2 / (fan_in + fan_out))
    q, k, v = block.attn.c_attn.weight.detach().split(D, dim=1)
    assert float(q.std()) == pytest.approx(math.sqrt(2 / (2 * D)), rel=0.1)
    assert float(v.std()) == pytest.approx(beta * math.sqrt(2 / (2 * D)), rel=0.1)
    c_proj = block.mlp.c_proj.weight.detach()
    assert float(c_proj.std()) == pytest.approx(beta * math.sqrt(2 / (5 * D)), rel=0.1)
    # The residual: with the attention's write zeroed, resid_mid = ln_1(alpha * resid_pre).
    x = torch.randn(1, 3, D)
    torch.nn.init.zeros_(block.attn.c_proj.weight)
    torch.nn.init.zeros_(block.attn.c_proj.bias)
    with capture(block, ["resid_mid"]) as seen:
        block(x)
    torch.testing.assert_close(seen["resid_mid"], block.ln_1(alpha * x))
    assert GPT(replace(cfg, norm="post")).blocks[0].alpha == 1.0


def test_peri_normalises_what_each_stage_writes():
    # eps far below the writes' variance at init (tiny: GPT-2's init scales c_proj down), so they norm to 1
    model = GPT(replace(TINY, norm="peri", layer_norm_eps=1e-12)).eval()
    with torch.no_grad(), capture(model, ["blocks.0.attn_out", "blocks.0.mlp_out", "blocks.0.resid_pre",
                                          "blocks.0.resid_post"]) as seen:  # fmt: skip
        model(tokens(1, 8))
    for name in ("blocks.0.attn_out", "blocks.0.mlp_out"):
        write = seen[name]  # [1, T, D], after the output LayerNorm (weight 1, bias 0 at init)
        torch.testing.assert_close(write.mean(-1), torch.zeros(1, 8), atol=1e-5, rtol=0)
        torch.testing.assert_close(write.var(-1, unbiased=False), torch.ones(1, 8), atol=1e-3, rtol=0)
    # the stream stays the plain sum of the writes, as in pre-LN
    total = seen["blocks.0.resid_pre"] + seen["blocks.0.attn_out"] + seen["blocks.0.mlp_out"]
    torch.testing.assert_close(seen["blocks.0.resid_post"], total)
