"""LayerSkip's training recipe in ``LitGPT``: layer dropout rising with depth, an early-exit loss on
every block's read-out with a rotational curriculum, and what it buys: cheaper early exits."""

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.data import CharDataModule
from lab.model import GPT
from lab.train import LitGPT, make_trainer

CONFIG = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=64)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_layer_dropout_rises_with_depth_and_with_the_curriculum():
    module = LitGPT(CONFIG, layer_dropout=0.4, max_steps=100)
    rates = module.layer_dropout_rates(step=0)
    assert rates[0] == 0.0 and rates[-1] == pytest.approx(0.4) and bool((rates.diff() > 0).all())
    growing = LitGPT(CONFIG, layer_dropout=0.4, layer_dropout_curriculum="exponential", max_steps=100)
    assert float(growing.layer_dropout_rates(0).max()) == 0.0
    assert torch.allclose(growing.layer_dropout_rates(100), rates)
    assert float(growing.layer_dropout_rates(50)[-1]) == pytest.approx(0.4 * (2**0.5 - 1))


def test_a_dropped_block_passes_the_stream_through_and_taps_are_the_exits():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    idx = torch.randint(0, 64, (3, 10))
    keep = torch.ones(4, 3, dtype=torch.bool)
    keep[2, 1] = False  # row 1 skips block 2
    taps = {}
    with torch.no_grad():
        stream = model.residual_stream(idx, layer_keep=keep, taps=taps)
        skipped = model.residual_stream(idx[1:2], block_set=BlockSet(skip=frozenset({2})))
        full = model.residual_stream(idx)
        early = model.residual_stream(idx, block_set=BlockSet(exit_at=2))
    torch.testing.assert_close(stream[1:2], skipped)
    torch.testing.assert_close(stream[[0, 2]], full[[0, 2]])
    assert sorted(taps) == [0, 1, 2, 3]
    torch.testing.assert_close(taps[1], early)


def test_the_objective_mixes_exit_losses_on_the_chosen_positions():
    """The training objective by hand: the last block's loss weighted L, each exit of this step's
    rotation weighted e (l + 1), normalised; exits on a random subset of positions, drawn from the
    global RNG (here replayed). Validation reports the model's own loss and every exit's."""
    torch.manual_seed(0)
    module = LitGPT(CONFIG, early_exit_loss=0.5, early_exit_every=2, early_exit_tokens=0.25)
    x, y = torch.randint(0, 64, (2, 3, 16))  # [B, T] each
    with torch.no_grad():
        torch.manual_seed(7)
        loss, exits = module.objective(x, y, training=True)  # step 0: blocks 0 and 2 (every 2nd)
        torch.manual_seed(7)
        chosen = torch.randperm(48)[:12]  # a quarter of the 3 x 16 positions
        taps = {}
        logits = module.model.unembed(module.model.residual_stream(x, taps=taps))  # [B, T, V]
        last = F.cross_entropy(logits.flatten(0, 1), y.flatten())

        def exit_at(i):
            return F.cross_entropy(module.model.unembed(taps[i].flatten(0, 1)[chosen]), y.flatten()[chosen])

        expected = (4 * last + 0.5 * exit_at(0) + 1.5 * exit_at(2)) / (4 + 0.5 + 1.5)
        torch.testing.assert_close(loss, expected)
        assert sorted(exits) == [0, 2, 3]
        torch.testing.assert_close(exits[2], exit_at(2))
        val_loss, val_exits = module.objective(x, y, training=False)
    torch.testing.assert_close(val_loss, last)
    assert sorted(val_exits) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="early_exit_tokens"):
        LitGPT(CONFIG, early_exit_tokens=0.0)


def test_muon_steps_the_blocks_matrices_and_adamw_the_rest():
    module = LitGPT(CONFIG, optimizer="muon", muon_lr=0.02, lr=1e-3, max_steps=10)
    optimizer = module.configure_optimizers()["optimizer"]
    muon_params = {id(p) for group in optimizer.muon.param_groups for p in group["params"]}
    for name, param in module.model.named_parameters():
        in_muon = id(param) in muon_params
        assert in_muon == (name.startswith("blocks.") and param.dim() == 2), name
    assert [group["lr"] for group in optimizer.param_groups][:1] == [0.02]


def fit(tmp_path, steps: int, **recipe) -> LitGPT:
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. a bird sang in the tree. " * 80)
    L.seed_everything(1)
    data = CharDataModule(paths=[str(text)], seq_len=32, batch_size=8, val_batches=2)
    data.setup("fit")
    config = GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=32, vocab_size=data.vocab_size)
    module = LitGPT(config, lr=3e-3, **recipe)
    # make_trainer clips gradients at 1.0 by default; this test's recipe trains without clipping
    trainer = make_trainer(steps, gradient_clip_val=None)
    trainer.fit(module, data)
    module.logged = dict(trainer.callback_metrics)
    module.data = data
    return module.eval()


def exit_loss(module: LitGPT, exit_at: int) -> float:
    losses = []
    with torch.no_grad():
        for x, y in module.data.val_dataloader():
            logits = module.model(x, block_set=BlockSet(exit_at=exit_at))
            losses.append(float(F.cross_entropy(logits.flatten(0, 1), y.flatten())))
    return sum(losses) / len(losses)


@pytest.mark.slow
def test_the_recipe_trains_early_exits_and_logs_each_blocks_exit_loss(tmp_path):
    plain = fit(tmp_path, 120)
    recipe = fit(tmp_path, 120, layer_dropout=0.2, early_exit_loss=1.0, early_exit_every=2)
    assert {f"val/exit_loss/blocks.{i}" for i in range(4)} <= set(recipe.logged)
    assert any(name.startswith("train/exit_loss/blocks.") for name in recipe.logged)
    assert float(recipe.logged["val/exit_loss/blocks.3"]) == pytest.approx(float(recipe.logged["val/loss"]))
    # what the recipe is for: reading out after 2 of 4 blocks costs far less than in a plain model
    assert exit_loss(recipe, 2) < exit_loss(plain, 2) - 0.2
