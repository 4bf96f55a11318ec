"""Weight import: Hugging Face GPT-2 (logit parity with transformers), nanoGPT, our own format, errors."""

import copy
import json

import pytest
import torch

from lab import weights
from lab.config import GPTConfig
from lab.errors import UserError
from lab.model import GPT, KVCache
from lab.weights import load_model, save_model

transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(n_layer=3, n_head=2, n_embd=32, vocab_size=97, n_positions=40)


def hf_model(attention: str):
    """A tiny random GPT2LMHeadModel. _from_config mutates the config in transformers 5.x: copy it."""
    config = transformers.GPT2Config(**HF_CONFIG, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel._from_config(copy.deepcopy(config), attn_implementation=attention)
    # random LayerNorm and bias values too, so a mix-up of any two tensors shows in the logits
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias") or ".ln_" in name:
                param.normal_(0.0, 0.1).add_(1.0 if name.endswith(".weight") else 0.0)
    return model.eval()


@pytest.fixture(scope="module")
def idx():
    return torch.randint(0, HF_CONFIG["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("serialization", ["safetensors", "bin"])
def test_hf_logits_match(tmp_path, idx, attention, serialization):
    reference = hf_model(attention)
    if serialization == "safetensors":
        reference.save_pretrained(tmp_path)
    else:  # transformers 5.x only writes safetensors; older checkpoints are this pickled state dict
        reference.config.save_pretrained(tmp_path)
        torch.save(reference.state_dict(), tmp_path / "pytorch_model.bin")
    ours = load_model(str(tmp_path), attention=attention)
    assert ours.config.attention == attention
    with torch.no_grad():
        expected = reference(idx).logits
        got = ours(idx)
    assert (got - expected).abs().max() <= 1e-4


def test_save_hf_dir_is_what_transformers_and_load_model_read(tmp_path, idx):
    """Our GPT-2 written as a Hugging Face directory (for other engines' converters): transformers
    gives its logits, load_model reads it back exactly, and the tokenizer files are beside it."""
    ours = load_model(str(_saved_reference(tmp_path / "reference")))
    written = weights.save_hf_dir(ours, tmp_path / "written")
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt"} <= {
        p.name for p in written.iterdir()
    }
    assert json.loads((written / "config.json").read_text())["n_ctx"] == HF_CONFIG["n_positions"]
    with torch.no_grad():
        expected = ours(idx)
        assert torch.equal(load_model(str(written))(idx), expected)
        theirs = transformers.GPT2LMHeadModel.from_pretrained(written).eval()
        assert (theirs(idx).logits - expected).abs().max() <= 1e-4
    with pytest.raises(UserError, match="plain GPT-2"):
        weights.save_hf_dir(GPT(GPTConfig(norm="post")), tmp_path / "post")


def _saved_reference(directory):
    hf_model("sdpa").save_pretrained(directory)
    return directory


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_hf_kv_cache_decode_matches(tmp_path, idx, attention):
    """A prefill then one decode step: HF's own cache vs ours."""
    reference = hf_model(attention)
    reference.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), attention=attention)
    prompt, nxt = idx[:, :-1], idx[:, -1:]
    with torch.no_grad():
        out = reference(prompt, use_cache=True)
        if "cache" in out:  # transformers >= 5.x renamed past_key_values to cache
            expected = reference(nxt, cache=out.cache, use_cache=True).logits
        else:
            expected = reference(nxt, past_key_values=out.past_key_values, use_cache=True).logits
        cache = KVCache(ours.config, max_len=idx.size(1))
        ours(prompt, cache=cache)
        got = ours(nxt, cache=cache)
    assert (got - expected).abs().max() <= 1e-4
    assert (got - ours(idx)[:, -1:]).abs().max() <= 1e-4


def test_hf_dir_without_transformer_prefix(tmp_path, idx):
    """The hub's original gpt2 checkpoint was saved from GPT2Model: keys have no 'transformer.' prefix."""
    reference = hf_model("eager")
    reference.transformer.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["n_layer"] == HF_CONFIG["n_layer"]
    ours = load_model(str(tmp_path))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), reference(idx).logits, atol=1e-4, rtol=0)


def test_hf_unsupported_config_is_named(tmp_path):
    hf_model("eager").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["activation_function"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="activation_function 'relu'"):
        load_model(str(tmp_path))


def nanogpt_checkpoint(model: GPT, compiled: bool) -> dict:
    """Our weights in nanoGPT's ckpt.pt layout: transformer.h.*, nn.Linear [out, in], a tied lm_head."""
    prefix = "_orig_mod." if compiled else ""
    state = {}
    for name, tensor in model.state_dict().items():
        if name.startswith("blocks."):
            name = "h." + name.removeprefix("blocks.")
            if name.endswith("weight") and ("attn.c_" in name or "mlp.c_" in name):
                tensor = tensor.t().contiguous()  # [out, in]
        state[prefix + "transformer." + name] = tensor.clone()
    state[prefix + "lm_head.weight"] = model.wte.weight.clone()
    for i in range(model.config.n_layer):  # the causal mask buffer nanoGPT keeps without flash attention
        T = model.config.block_size
        state[f"{prefix}transformer.h.{i}.attn.bias"] = torch.ones(T, T).tril().view(1, 1, T, T)
    cfg = model.config
    model_args = dict(
        n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd, block_size=cfg.block_size,
        bias=cfg.bias, vocab_size=cfg.vocab_size, dropout=0.0,
    )  # fmt: skip
    return {"model": state, "model_args": model_args, "iter_num": 10, "best_val_loss": 3.0, "config": {}}


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_round_trip(tmp_path, compiled, bias):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=24, bias=bias)
    original = GPT(cfg).eval()
    torch.save(nanogpt_checkpoint(original, compiled), tmp_path / "ckpt.pt")
    loaded = load_model(str(tmp_path / "ckpt.pt"))
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), original(idx), atol=0, rtol=0)


def test_nanogpt_wrong_shape_names_the_key(tmp_path):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=24)
    checkpoint = nanogpt_checkpoint(GPT(cfg), compiled=False)
    checkpoint["model"]["transformer.h.1.mlp.c_fc.weight"] = torch.zeros(16, 64)  # not transposed
    del checkpoint["model"]["transformer.ln_f.bias"]
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    with pytest.raises(ValueError) as error:
        load_model(str(tmp_path / "ckpt.pt"))
    assert "blocks.1.mlp.c_fc.weight: (64, 16)" in str(error.value)
    assert "missing keys ['ln_f.bias']" in str(error.value)


def test_save_and_load_our_format(tmp_path):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=24, norm="post")
    original = GPT(cfg).eval()
    save_model(original, tmp_path / "m", metadata={"val_loss": 1.5})
    assert weights.read_metadata(tmp_path / "m") == {"val_loss": 1.5}
    loaded = load_model(str(tmp_path / "m"))
    assert loaded.config == cfg and not loaded.training
    idx = torch.randint(0, 50, (1, 7))
    with torch.no_grad():  # the same weights: torch's products give the same bits, lab.intmm's nearly
        exact = load_model(str(tmp_path / "m"), kernels=False)
        torch.testing.assert_close(exact(idx), original(idx), atol=0, rtol=0)
        torch.testing.assert_close(loaded(idx), original(idx), atol=1e-6, rtol=1e-4)
    half = load_model(str(tmp_path / "m"), dtype=torch.bfloat16)
    assert half.wte.weight.dtype == torch.bfloat16


def test_builtin_missing_says_how_to_create(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(weights, "SHIPPED_DIR", tmp_path / "not_shipped")  # an install that lost them
    assert weights.builtin_dir() == tmp_path / "builtin"
    with pytest.raises(FileNotFoundError, match="run `blocklab builtin`"):
        load_model("builtin")


def test_random_models_are_seeded():
    a = weights.random_model("gpt2", n_layer=1, vocab_size=64)
    b = weights.random_model("gpt2", n_layer=1, vocab_size=64)
    c = weights.random_model("gpt2", n_layer=1, vocab_size=64, seed=2)
    torch.testing.assert_close(a.blocks[0].mlp.c_fc.weight, b.blocks[0].mlp.c_fc.weight, atol=0, rtol=0)
    assert not torch.equal(a.blocks[0].mlp.c_fc.weight, c.blocks[0].mlp.c_fc.weight)


@pytest.mark.slow
def test_gpt2_random_has_gpt2_small_shapes():
    model = load_model("gpt2-random")
    assert model.config == GPTConfig.from_name("gpt2") and not model.training
    assert model.num_params() == 124_439_808  # GPT-2 small, the tied table counted once


def test_unreachable_hub_id_says_so(monkeypatch):
    huggingface_hub = pytest.importorskip("huggingface_hub")

    def offline(*args, **kwargs):
        raise huggingface_hub.errors.LocalEntryNotFoundError("no connection")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    unreachable = "not in the Hugging Face cache, and the hub could not be reached"
    with pytest.raises(UserError, match=unreachable) as error:
        load_model("openai-community/gpt2-nonexistent")
    assert "\n" not in str(error.value) and "no connection" in str(error.value)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_model("./no/such/dir")


def test_lightning_checkpoint(tmp_path):
    """A checkpoint of the training lab (lab.train.LitGPT) loads as the GPT it trained."""
    import lightning as L
    from torch.utils.data import DataLoader

    from lab.train import LitGPT

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=50, block_size=16)
    lit = LitGPT(cfg)
    x = torch.randint(0, 50, (4, 16))
    batches = DataLoader([(x, torch.roll(x, -1, dims=1))], batch_size=None)
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", devices=1,
    )  # fmt: skip
    trainer.fit(lit, train_dataloaders=batches)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    loaded = load_model(str(tmp_path / "last.ckpt"))
    assert loaded.config == cfg
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), lit.model.eval()(x), atol=0, rtol=0)
