"""The exit probe: fitted on the model's own agreement with itself, saved beside the weights, and the
check that adaptive exit applies when a block set says check=probe."""

import pytest
import torch
import torch.nn.functional as F
from test_generate import decode_all  # teacher-forced decoding, token by token

from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.exit_probe import ExitProbe, exit_features, fit_exit_probe, load_exit_probe, save_exit_probe
from lab.generate import Decoder, adaptive_forward, generate, score
from lab.model import GPT

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=97, block_size=48)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


def windows(count=6, length=CFG.block_size, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (count, length), generator=generator).tolist()


def constant_probe(bias: float) -> ExitProbe:
    return ExitProbe(weight=torch.zeros(CFG.n_layer, CFG.n_embd), bias=torch.full((CFG.n_layer,), bias))


def test_labels_say_where_the_top_1_is_already_final(model):
    reads, labels = exit_features(model, windows(1)[0])
    assert reads.shape == (CFG.n_layer, CFG.block_size, CFG.n_embd) and labels.shape == reads.shape[:2]
    assert labels[-1].eq(1).all()  # the last block agrees with itself
    idx = torch.tensor([windows(1)[0]])  # [1, T]
    final, after_two = model(idx)[0], model(idx, block_set=BlockSet(exit_at=2))[0]  # [T, V] each
    torch.testing.assert_close(labels[1], (after_two.argmax(-1) == final.argmax(-1)).float())


def test_the_fitted_probe_beats_the_base_rate_on_its_text(model):
    data = windows()
    probe = fit_exit_probe(model, data)
    reads, labels = zip(*(exit_features(model, w) for w in data), strict=True)
    reads, labels = torch.cat(reads, dim=1), torch.cat(labels, dim=1)  # [L, N, D], [L, N]
    for block in range(CFG.n_layer - 1):
        rate = labels[block].mean().clamp(1e-3, 1 - 1e-3)
        if not 0.05 < rate < 0.95:
            continue  # nothing to learn beyond the rate
        fitted = F.binary_cross_entropy(probe(reads[block], block).clamp(1e-6, 1 - 1e-6), labels[block])
        constant = F.binary_cross_entropy(rate.expand_as(labels[block]), labels[block])
        assert fitted < constant, (block, float(fitted), float(constant))


def test_save_and_load(tmp_path, model):
    assert load_exit_probe(tmp_path) is None
    probe = fit_exit_probe(model, windows(2), max_iter=5)
    save_exit_probe(probe, tmp_path)
    loaded = load_exit_probe(tmp_path)
    torch.testing.assert_close(loaded.weight, probe.weight)
    torch.testing.assert_close(loaded.bias, probe.bias)


def test_load_model_brings_the_probe_of_its_directory(tmp_path, model):
    from lab.weights import load_model, save_model

    save_model(model, tmp_path)
    assert load_model(str(tmp_path)).exit_probe is None
    save_exit_probe(constant_probe(1.0), tmp_path)
    assert load_model(str(tmp_path)).exit_probe.bias.tolist() == [1.0] * CFG.n_layer
    save_exit_probe(ExitProbe(torch.zeros(3, CFG.n_embd), torch.zeros(3)), tmp_path)  # another depth
    with pytest.raises(ValueError, match=r"a probe for \(3, 32\) \(blocks, width\), the model is \(4, 32\)"):
        load_model(str(tmp_path))


def test_check_probe_applies_the_threshold_to_the_probe(model):
    prompt, spec = windows(1, 8)[0], "adaptive=0.5;min=2;check=probe"
    block_set = BlockSet.parse(spec, CFG.n_layer)
    assert str(block_set) == spec
    try:
        model.exit_probe = constant_probe(20.0)  # always sure: every token exits at the minimum
        steps = generate(model, prompt, 5, block_set=block_set)
        assert [len(step.blocks_run) for step in steps] == [4, 2, 2, 2, 2]  # the first: the prefill's
        model.exit_probe = constant_probe(-20.0)  # never sure: every token runs every block
        assert score(model, prompt, block_set).mean_blocks == CFG.n_layer
    finally:
        model.exit_probe = None


def test_with_a_probe_decoding_equals_the_parallel_pass(model):
    """Token by token with state propagation == the all-positions adaptive pass, under a fitted probe."""
    block_set = BlockSet.parse("adaptive=0.6;min=1;check=probe", CFG.n_layer)
    prompt, new = windows(1, 6)[0], windows(1, 20, seed=3)[0]
    try:
        model.exit_probe = fit_exit_probe(model, windows())
        logits, depths, _ = decode_all(model, block_set, prompt, new)
        idx = torch.tensor([prompt + new])  # [1, T]
        full, full_depths = adaptive_forward(model, idx, block_set, n_full=len(prompt))
    finally:
        model.exit_probe = None
    assert depths == full_depths[len(prompt) - 1 :]
    assert (logits - full[0, len(prompt) - 1 :]).abs().max() <= 1e-4
    assert len({len(d) for d in depths[1:]}) > 1, "the test wants a mix of depths"


def test_check_probe_without_a_probe_is_refused(model):
    block_set = BlockSet.parse("adaptive=0.9;check=probe", CFG.n_layer)
    with pytest.raises(ValueError, match="check=probe needs the model's exit probe"):
        Decoder(model, block_set)
    with pytest.raises(ValueError, match="check=probe needs the model's exit probe"):
        score(model, windows(1, 8)[0], block_set)


@pytest.mark.parametrize(
    ("spec", "message"),
    [("check=probe", "only with adaptive"), ("adaptive=0.9;check=maybe", "'cosine' or 'probe'")],
)
def test_block_set_check_is_validated(spec, message):
    with pytest.raises(ValueError, match=message):
        BlockSet.parse(spec, CFG.n_layer)


def test_save_model_writes_the_probe_and_never_leaves_a_stale_one(tmp_path, model):
    from lab.weights import load_model, save_model

    try:
        model.exit_probe = constant_probe(2.0)
        save_model(model, tmp_path)
        assert load_model(str(tmp_path)).exit_probe.bias.tolist() == [2.0] * CFG.n_layer
    finally:
        model.exit_probe = None
    save_model(model, tmp_path)  # the same directory, now for a model without a probe
    assert load_exit_probe(tmp_path) is None and load_model(str(tmp_path)).exit_probe is None


def test_probe_windows_come_from_training_files_only(tmp_path):
    from lab import tokens
    from lab.exit_probe import probe_windows

    files = []
    for i in range(6):  # with val_every=3, files 0 and 3 are held out
        files.append(tmp_path / f"f{i}.py")
        files[-1].write_text(f"word{i} " * 200)
    windows = probe_windows(files, length=16, val_every=3, count=10)
    texts = {tokens.decode(window).split()[1] for window in windows}
    assert texts == {"word1", "word2", "word4", "word5"}
