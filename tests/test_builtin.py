"""The builtin model's pipeline (tiny): corpus, compact vocabulary, training, widening, saving, loading."""

import copy
import dataclasses
import json

import pytest
import torch

from lab import tokens
from lab.builtin import Recipe, create_builtin, format_report, main
from lab.config import GPTConfig
from lab.corpora import stdlib_files
from lab.errors import UserError
from lab.model import GPT
from lab.quantize import quantize
from lab.token_data import TokenDataModule, widen_vocabulary
from lab.weights import load_model, read_metadata

TINY = Recipe(
    n_layer=2, n_head=2, n_embd=16, block_size=32, batch_size=4, steps=4, max_files=6, val_every=3,
    eval_batches=2,
)  # fmt: skip


def test_stdlib_corpus_is_sorted_source_without_tests():
    files = stdlib_files()
    assert len(files) > 100
    names = [f.as_posix() for f in files]
    assert all(name.endswith(".py") for name in names)
    assert not any("/test/" in name or "site-packages" in name for name in names)
    assert stdlib_files(5) == files[:5]


def test_token_data_compact_vocabulary_and_split():
    dm = TokenDataModule(stdlib_files(6), seq_len=16, batch_size=2, val_every=3)
    assert dm.n_files == 6 and dm.n_val_files == 2  # files 0 and 3
    assert dm.vocab_size == len(dm.gpt2_ids) < tokens.VOCAB_SIZE
    assert tokens.EOT in dm.gpt2_ids.tolist()  # every file ends with <|endoftext|>
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (2, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    text = tokens.decode(dm.gpt2_ids[dm.train_ids[:200]].tolist())  # compact ids map back to source
    assert "import" in text or "def " in text or '"""' in text


def test_widened_vocabulary_keeps_seen_logits_and_pins_the_rest():
    torch.manual_seed(0)
    compact = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=40, block_size=16)).eval()
    with torch.no_grad():  # a trained-looking final norm
        compact.ln_f.weight.uniform_(0.5, 1.5)
        compact.ln_f.bias.normal_(0.0, 0.01)  # sum(beta / gamma) near 0: no table row alone pins a logit
    gpt2_ids = torch.randperm(tokens.VOCAB_SIZE)[:40].sort().values
    wide = widen_vocabulary(compact, gpt2_ids, unseen_logit=-25.0)
    assert wide.config.vocab_size == tokens.VOCAB_SIZE
    idx = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        narrow_logits = compact(idx)  # [B, T, 40]
        wide_logits = wide(gpt2_ids[idx])  # [B, T, 50257]
    torch.testing.assert_close(wide_logits[..., gpt2_ids], narrow_logits)
    unseen = torch.ones(tokens.VOCAB_SIZE, dtype=torch.bool)
    unseen[gpt2_ids] = False
    torch.testing.assert_close(wide_logits[..., unseen], torch.full_like(wide_logits[..., unseen], -25.0))
    lows = {"bf16": copy.deepcopy(wide).to(torch.bfloat16), "int4": quantize(copy.deepcopy(wide), "int4")}
    for name, low in lows.items():  # low-precision weights keep never-seen tokens where they were
        with torch.no_grad():
            logits = low(gpt2_ids[idx]).float()  # [B, T, 50257]
        assert bool((logits[..., unseen] == -25.0).all()), name
        assert float((logits[..., gpt2_ids] - narrow_logits).abs().max()) < 0.5, name


def test_tiny_builtin_pipeline(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path))
    report = create_builtin(TINY)
    assert report["steps"] == 4 and len(report["val_loss_skip"]) == 2
    assert report["unseen_token_mass"] < 1e-4
    model = load_model("builtin")
    assert model.config.vocab_size == tokens.VOCAB_SIZE and model.config.n_layer == 2
    assert read_metadata(tmp_path / "builtin")["val_loss"] == pytest.approx(report["val_loss"])
    assert (tmp_path / "builtin" / "logs").is_dir()
    assert 0 < report["val_loss"] < 11  # below a uniform guess over 50257 tokens (10.8 nats)
    assert model.exit_probe is not None and model.exit_probe.weight.shape == (2, model.config.n_embd)
    # a second `blocklab builtin` does not train again
    assert main(["builtin"]) == 0
    out = capsys.readouterr().out
    assert "(retrained) (train again with --force)" in out
    assert "short of the bigram count model" in out  # 4 steps do not beat counting pairs
    trained = {**report, "val_loss": report["baselines"]["bigram"] - 0.5}
    assert "short of the bigram" not in format_report(trained)


def test_the_early_exit_recipe_saves_builtin_early_exit(tmp_path, monkeypatch):
    from lab.builtin import RECIPES

    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path))
    recipe = dataclasses.replace(TINY, **RECIPES["early-exit"])
    report = create_builtin(recipe, tmp_path / "builtin-early-exit")
    layerskip = RECIPES["early-exit"]["layerskip"]
    assert report["recipe"]["layerskip"]["early_exit_loss"] == layerskip["early_exit_loss"] > 0
    assert len(report["val_loss_exit"]) == 1
    model = load_model("builtin-early-exit")
    assert model.config.n_layer == 2 and model.exit_probe is not None
    assert load_model("builtin").config.n_layer == 12  # the plain one is a model of its own: the shipped one


def test_muon_orthogonalises_in_fp32_as_torch_does_in_bf16():
    """lab.optim.Muon is torch.optim.Muon's update with the Newton-Schulz iteration in fp32 (torch
    casts to bf16, slow on CPUs without bf16 units): the same steps up to bf16's rounding."""
    from lab.optim import Muon

    ours = torch.nn.Parameter(torch.randn(384, 128))
    theirs = torch.nn.Parameter(ours.detach().clone())
    start = ours.detach().clone()
    mine = Muon([ours], lr=0.02, weight_decay=0.1)
    reference = torch.optim.Muon([theirs], lr=0.02, weight_decay=0.1)
    for _ in range(5):
        grad = torch.randn(384, 128)
        ours.grad, theirs.grad = grad.clone(), grad.clone()
        mine.step()
        reference.step()
    assert float((ours.detach() - start).norm()) > 0.05  # it moved, as torch's did
    assert torch.allclose(ours.detach(), theirs.detach(), atol=1e-3)


def test_the_same_seed_and_threads_make_the_same_weights(tmp_path):
    """A run is its steps, seed and data order: the machine changes only how long it takes."""
    recipe = dataclasses.replace(TINY, threads=1)
    reports = [create_builtin(recipe, tmp_path / name) for name in ("first", "second")]
    assert (tmp_path / "first" / "model.safetensors").read_bytes() == (
        tmp_path / "second" / "model.safetensors"
    ).read_bytes()
    assert reports[0]["val_loss"] == reports[1]["val_loss"]
    other = create_builtin(dataclasses.replace(recipe, seed=2), tmp_path / "other")
    assert other["val_loss"] != reports[0]["val_loss"]


def test_damaged_or_missing_files_are_refused_by_name(tmp_path):
    create_builtin(TINY, tmp_path / "m")
    assert load_model(str(tmp_path / "m")).exit_probe is not None
    weights = tmp_path / "m" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(UserError, match="model.safetensors: damaged"):
        load_model(str(tmp_path / "m"))
    data[-1] ^= 1
    weights.write_bytes(bytes(data))  # whole again
    (tmp_path / "m" / "exit_probe.safetensors").unlink()
    with pytest.raises(UserError, match="exit_probe.safetensors: missing"):
        load_model(str(tmp_path / "m"))


SHIPPED_BYTES = 12 * 2**20
"""What a shipped model's weights may take (fp16 rows of the tokens it trained)."""


@pytest.mark.parametrize("name", ["builtin", "builtin-early-exit"])
def test_the_shipped_models_load_offline_and_checked(tmp_path, monkeypatch, name):
    from lab import weights

    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path))  # nothing retrained here
    directory = weights.locate(name)
    assert directory == weights.shipped_dir(name)
    assert (directory / "model.safetensors").stat().st_size <= SHIPPED_BYTES
    description = json.loads((directory / "blocklab.json").read_text())
    assert set(description["sha256"]) == {"model.safetensors", "exit_probe.safetensors"}
    report = description["metadata"]
    assert report["command"].startswith("blocklab builtin") and report["steps"] == report["planned_steps"]
    assert report["val_loss"] < report["baselines"]["bigram"]
    model = load_model(name)
    assert model.config.vocab_size == tokens.VOCAB_SIZE and model.config.n_layer == 12
    assert len(model.read_rows) == report["distinct_tokens"]  # the read-out multiplies the trained rows
    assert model.exit_probe is not None
    assert model.tuned_lens is not None  # fitted to these weights and shipped beside them: lens=tuned works


def test_a_retrained_builtin_takes_precedence_until_reset(tmp_path, monkeypatch, caplog, capsys):
    from lab import weights

    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path))
    create_builtin(TINY)  # into the cache, as `blocklab builtin` does
    with caplog.at_level("WARNING", logger="lab.weights"):
        assert load_model("builtin").config.n_layer == 2
    assert "retrained" in caplog.text and "--reset" in caplog.text
    assert main(["builtin", "--show"]) == 0
    assert "(retrained)" in capsys.readouterr().out
    assert main(["builtin", "--reset"]) == 0
    assert weights.locate("builtin") == weights.shipped_dir()
    assert main(["builtin", "--show"]) == 0
    assert "(shipped)" in capsys.readouterr().out


@pytest.mark.slow
def test_the_shipped_report_is_the_shipped_weights(monkeypatch, tmp_path):
    """The report's validation loss and block costs, measured again on the weights as loaded here."""
    from lab import weights
    from lab.builtin import data_module, evaluate

    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path))
    report = read_metadata(weights.shipped_dir())
    recipe = Recipe(**report["recipe"])
    dm = data_module(recipe)
    model = load_model("builtin")
    compact = GPT(dataclasses.replace(model.config, vocab_size=dm.vocab_size, logit_bias=False)).eval()
    state = {k: v for k, v in model.state_dict().items() if k != "logit_bias"}
    state["wte.weight"] = state["wte.weight"][dm.gpt2_ids]
    compact.load_state_dict(state)
    measured = evaluate(model, compact, dm)
    assert measured["val_loss"] == pytest.approx(report["val_loss"], abs=2e-3)
    costs = torch.tensor(measured["val_loss_skip"]) - measured["val_loss"]
    torch.testing.assert_close(
        costs, torch.tensor(report["val_loss_skip"]) - report["val_loss"], atol=2e-3, rtol=0
    )
