"""The tuned lens: the identity is the logit lens, fitting lowers held-out KL, the file round-trips and
refuses another model, a resumed fit ends where an uninterrupted one does, the report is the direct
computation, the CLI runs end to end, and (where the package installs) parity with ``tuned-lens``."""

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from lab import cli, weights
from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.decode import Decoder
from lab.errors import UserError
from lab.generate import generate, score
from lab.lens import cost, fit, home, report
from lab.lens.data import fingerprint
from lab.lens.translator import FILE, ReadOut, TunedLens, load_tuned_lens, save_tuned_lens
from lab.model import GPT
from lab.rows import rows_alone
from lab.weights import save_model

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=97, block_size=32)
QUICK = fit.Recipe(steps=10, windows_per_step=2, lr=1e-2)


def sharp_model(cfg: GPTConfig = CFG, seed: int = 0) -> GPT:
    """A random GPT whose blocks turn the stream far and whose read-out is peaked, so that the logit
    lens is a poor read-out of the middle blocks (at GPT-2's init both are too gentle to show it)."""
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        model.wte.weight.mul_(30)
        for name, param in model.named_parameters():
            if name.startswith("blocks.") and param.dim() == 2:
                param.mul_(6)
    return model


def compact_model(seed: int = 0) -> GPT:
    """``sharp_model`` at GPT-2's vocabulary with most of the table zero rows and a bias for them, as
    the builtin models are: the read-out multiplies only the other rows (``GPT.read_rows``)."""
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=50257, block_size=32, logit_bias=True)
    model = sharp_model(cfg, seed)
    read = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(seed))[:300]
    with torch.no_grad():
        kept = model.wte.weight[read].clone()
        model.wte.weight.zero_()
        model.wte.weight[read] = kept
        model.logit_bias.fill_(-4.0)
        model.logit_bias[read] = 0.0
    model.compact_read_out()
    assert model.read_rows is not None and len(model.read_rows) == 300
    return model


def windows(count: int, vocab: int = CFG.vocab_size, length: int = CFG.block_size, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


@pytest.fixture(scope="module")
def model():
    return sharp_model()


@pytest.fixture(scope="module")
def fitted(model):
    data = windows(12)
    return fit.fit_tuned_lens(model, data[:10], data[10:], QUICK, progress=False)


def block_streams(model: GPT, idx: torch.Tensor) -> dict[int, torch.Tensor]:
    taps = {}
    with torch.no_grad():
        model.residual_stream(idx, taps=taps)
    return taps


@pytest.mark.parametrize("rank", [None, 4])
def test_the_identity_lens_is_the_logit_lens_exactly(model, rank):
    lens = TunedLens.identity(CFG.n_layer, CFG.n_embd, rank=rank)
    idx = torch.tensor(windows(2))  # [2, T]
    taps = block_streams(model, idx)
    for block in range(CFG.n_layer):
        with torch.no_grad():
            logit_lens = model(idx, block_set=BlockSet(exit_at=block + 1))  # [2, T, V]
            assert torch.equal(lens(block, taps[block]), taps[block])
            assert torch.equal(model.unembed(lens(block, taps[block])), logit_lens)


def test_the_read_out_over_read_rows_is_the_models_distribution():
    model = compact_model()
    read_out = ReadOut(model)
    stream = torch.randn(5, 32) * 3  # [P, D]
    with torch.no_grad():
        full = F.log_softmax(model.unembed(stream[None])[0], dim=-1)  # [P, V]
        compact = F.log_softmax(read_out.logits(stream), dim=-1)  # [P, V_read + 1]
    assert compact.shape == (5, 301)
    targets = torch.tensor([int(model.read_rows[0]), int(model.read_rows[7]), 0, 1, 50256])
    close = {"rtol": 1e-5, "atol": 1e-4}  # fp32 normalisers over 50257 terms and over 301 differ so
    got = read_out.token_log_probs(compact, targets)
    torch.testing.assert_close(got, full.gather(1, targets[:, None])[:, 0], **close)
    torch.testing.assert_close(read_out.top1(read_out.logits(stream)), full.argmax(-1))
    pooled = full[:, read_out.unread].logsumexp(-1)  # the unread tokens' probability, together
    torch.testing.assert_close(compact[:, -1], pooled, **close)


def test_the_translator_is_batch_invariant_under_rows_alone(fitted):
    stream = torch.randn(6, 3, CFG.n_embd)  # [B, T, D]
    with rows_alone():
        together = fitted(1, stream)
        alone = torch.cat([fitted(1, stream[b : b + 1]) for b in range(6)])
    assert torch.equal(together, alone)
    assert torch.equal(fitted(1, stream[:1, :1]), together[:1, :1])  # one row: the matrix-vector path


@pytest.mark.parametrize(
    "recipe",
    [QUICK, fit.Recipe(steps=10, windows_per_step=2, lr=1e-2, init="identity"), fit.Recipe(steps=10, rank=4)],
    ids=["regression", "identity", "rank-4"],
)
def test_fitting_lowers_the_held_out_kl(model, recipe):
    data = windows(12)
    lens = fit.fit_tuned_lens(model, data[:10], data[10:], recipe, progress=False)
    tuned, logit = lens.metadata["held_out_kl_tuned"], lens.metadata["held_out_kl_logit"]
    assert lens.blocks == (0, 1, 2) and tuned[3] is None and logit[3] is None  # the last: the target
    for block in lens.blocks:
        assert logit[block] > 0.01  # the logit lens is a poor read-out here ...
        assert tuned[block] < 0.6 * logit[block], (block, tuned, logit)  # ... and the fit does better
    assert lens.rank == recipe.rank


def test_positions_in_chunks_fit_the_same_lens(model, fitted, monkeypatch):
    monkeypatch.setattr(fit, "CHUNK_BYTES", 4 * CFG.vocab_size * 7)  # 7 positions' logits at a time
    assert [(c.start, c.stop) for c in fit.position_chunks(16, CFG.vocab_size)] == [(0, 7), (7, 14), (14, 16)]
    data = windows(12)
    chunked = fit.fit_tuned_lens(model, data[:10], data[10:], QUICK, progress=False)
    for name, tensor in fitted.tensors().items():
        torch.testing.assert_close(chunked.tensors()[name], tensor, rtol=1e-4, atol=1e-5)


def test_only_the_chosen_blocks_are_fitted(model):
    data = windows(6)
    lens = fit.fit_tuned_lens(model, data[:5], data[5:], fit.Recipe(steps=2), blocks=[1], progress=False)
    assert lens.blocks == (1,)
    identity = TunedLens.identity(CFG.n_layer, CFG.n_embd)
    for block in (0, 2, 3):
        assert torch.equal(lens.weight[block], identity.weight[block])
        assert torch.equal(lens.bias[block], identity.bias[block])
    assert not torch.equal(lens.weight[1], identity.weight[1])
    with pytest.raises(UserError, match=r"blocks: \[3\] out of 0..2"):
        fit.check_blocks([3], CFG.n_layer)


def test_a_fit_ranks_the_final_top_tokens_and_measures_their_coverage(model, fitted):
    """The ranking puts the tokens the final read-out makes the most likely on the calibration text
    first, the most frequent first, then the others by the probability it gives them; the coverage of
    its first N is measured on the held-out windows."""
    data = windows(12)
    top, mass = fit.final_predictions(model, data[:10])  # [P], [V]
    counts = torch.bincount(top, minlength=model.config.vocab_size)
    ranking = fitted.ranking
    first = len(set(top.tolist()))
    assert set(ranking[:first].tolist()) == set(top.tolist())
    assert counts[ranking].tolist() == sorted(counts[ranking].tolist(), reverse=True)
    rest = mass[ranking[first:]].tolist()
    assert rest == sorted(rest, reverse=True) and len(ranking) == int(mass.gt(0).sum()) > first
    held_out_top = fit.final_predictions(model, data[10:])[0]
    for n, share in fitted.metadata["ranking_coverage"].items():
        expected = float(torch.isin(held_out_top, ranking[: int(n)]).float().mean())
        assert share == pytest.approx(expected, abs=1e-4)


def test_save_and_load_round_trip_with_the_fingerprint(tmp_path, model, fitted):
    assert load_tuned_lens(tmp_path, model) is None
    save_tuned_lens(fitted, tmp_path)
    loaded = load_tuned_lens(tmp_path, model)
    for name, tensor in fitted.tensors().items():
        assert torch.equal(loaded.tensors()[name], tensor)
    assert loaded.blocks == fitted.blocks == (0, 1, 2) and loaded.rank is None
    assert torch.equal(loaded.ranking, fitted.ranking) and loaded.ranking.dtype == torch.long
    assert loaded.metadata == fitted.metadata
    data = windows(12)
    assert loaded.metadata["calibration_sha256"] == fingerprint(data[:10] + data[10:])
    assert loaded.metadata["steps"] == QUICK.steps
    assert loaded.metadata["held_out_kl_tuned"][:3] == fitted.metadata["held_out_kl_tuned"][:3]
    assert fingerprint(data[:10]) != fingerprint(data[1:11])


def test_a_lens_for_another_model_is_refused(tmp_path, fitted):
    save_tuned_lens(fitted, tmp_path)
    shallower = sharp_model(GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=97, block_size=32))
    with pytest.raises(UserError, match=r"a lens for \(4, 32\) \(blocks, width\), the model is \(3, 32\)"):
        load_tuned_lens(tmp_path, shallower)
    retrained = sharp_model(seed=5)  # the same shape, other weights
    with pytest.raises(UserError, match="fitted to other weights of this shape"):
        load_tuned_lens(tmp_path, retrained)
    with torch.no_grad():
        bf16 = copy.deepcopy(sharp_model()).to(torch.bfloat16)  # the same weights in another dtype: fits
    assert load_tuned_lens(tmp_path, bf16) is not None


def test_a_resumed_fit_ends_where_an_uninterrupted_one_does(tmp_path, model, monkeypatch):
    data = windows(12)
    recipe = fit.Recipe(steps=6, windows_per_step=2, lr=1e-2, checkpoint_every=2)
    uninterrupted = fit.fit_tuned_lens(model, data[:10], data[10:], recipe, progress=False)
    checkpoint = tmp_path / fit.CHECKPOINT
    save = fit.save_checkpoint
    saved_at = []

    def save_then_die(path, step, *args):  # the process is killed right after its second checkpoint
        save(path, step, *args)
        saved_at.append(step)
        if len(saved_at) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(fit, "save_checkpoint", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        fit.fit_tuned_lens(model, data[:10], data[10:], recipe, checkpoint=checkpoint, progress=False)
    assert saved_at == [2, 4] and checkpoint.exists()
    other = fit.Recipe(steps=7, windows_per_step=2, lr=1e-2, checkpoint_every=2)
    with pytest.raises(UserError, match="a fit of another recipe"):
        fit.fit_tuned_lens(model, data[:10], data[10:], other, checkpoint=checkpoint, resume=True)
    with pytest.raises(UserError, match="a fit of another calibration_sha256"):
        fit.fit_tuned_lens(model, data[1:11], data[10:], recipe, checkpoint=checkpoint, resume=True)
    resumed = fit.fit_tuned_lens(
        model, data[:10], data[10:], recipe, checkpoint=checkpoint, resume=True, progress=False
    )
    for name, tensor in uninterrupted.tensors().items():
        assert torch.equal(resumed.tensors()[name], tensor), name
    assert resumed.metadata == uninterrupted.metadata
    assert not checkpoint.exists()  # done: nothing left to resume
    with pytest.raises(UserError, match="nothing to resume"):
        fit.fit_tuned_lens(model, data[:10], data[10:], recipe, checkpoint=checkpoint, resume=True)


def direct_rows(model: GPT, lens: TunedLens, data: list[list[int]]) -> list[dict]:
    """The report's numbers computed the plain way: the full vocabulary's logits from ``GPT.forward``
    (the logit lens is ``exit=E``) and from ``unembed(lens(block, stream))``, in float64."""
    model, lens = copy.deepcopy(model).double(), lens.to(dtype=torch.float64)  # the reference in fp64
    model.compact_read_out()
    idx = torch.tensor(data)  # [W, T]
    targets = idx[:, 1:]  # [W, T-1]
    taps = block_streams(model, idx)
    with torch.no_grad():
        final = F.log_softmax(model(idx)[:, :-1], dim=-1)  # [W, T-1, V]
        rows = []
        for block in range(model.config.n_layer):
            row = {}
            logit = model(idx, block_set=BlockSet(exit_at=block + 1))[:, :-1]  # [W, T-1, V]
            tuned = model.unembed(lens(block, taps[block]))[:, :-1]  # [W, T-1, V]
            for name, logits in (("logit", logit), ("tuned", tuned)):
                log_q = F.log_softmax(logits, dim=-1)
                row[f"loss_{name}"] = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
                row[f"kl_{name}"] = float((final.exp() * (final - log_q)).sum(-1).mean())
                row[f"top1_{name}"] = float((logits.argmax(-1) == final.argmax(-1)).float().mean())
            rows.append(row)
    return rows


@pytest.mark.parametrize("compact", [False, True], ids=["every-row", "read-rows"])
def test_the_report_is_the_direct_computation(compact, fitted):
    model = compact_model() if compact else sharp_model()
    vocab = model.config.vocab_size
    data = windows(3, vocab=vocab) if not compact else [w[:24] for w in windows(3, vocab=vocab)]
    if compact:  # mostly tokens the model reads, some it never does (their logit is the bias)
        data = [[int(model.read_rows[t % 300]) if t % 5 else t for t in w] for w in data]
        lens = fit.fit_tuned_lens(model, data[:2], data[2:], fit.Recipe(steps=3), progress=False)
    else:
        lens = fitted
    got = report.lens_report(model, lens, data)
    assert got["positions"] == sum(len(w) - 1 for w in data)
    expected = direct_rows(model, lens, data)
    for row, direct in zip(got["rows"], expected, strict=True):
        for key, value in direct.items():
            assert row[key] == pytest.approx(value, rel=1e-4, abs=1e-5), (row["block"], key)
    last = got["rows"][-1]
    assert last["kl_logit"] == pytest.approx(0, abs=1e-6) and last["top1_tuned"] == 1.0
    assert got["full_depth_loss"] == last["loss_logit"] and last["excess_logit"] == 0.0
    text = report.render({**got, "model": "tiny", "lens": "x", "text": "windows"})
    assert "| block | exit | loss logit | loss tuned |" in text


def test_where_a_lens_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path / "cache"))
    assert home.lens_home("builtin") == tmp_path / "cache" / "builtin"  # never the package's lab/assets
    assert home.lens_home(str(tmp_path)) == tmp_path
    (tmp_path / "ckpt.pt").write_bytes(b"")
    assert home.lens_home(str(tmp_path / "ckpt.pt")) == tmp_path
    assert home.lens_home("openai-community/gpt2") == tmp_path / "cache" / "hub" / "openai-community--gpt2"
    shipped = str(weights.shipped_dir("builtin"))  # the shipped model named by its path: still the cache
    assert home.lens_home(shipped) == tmp_path / "cache" / "builtin"
    assert home.lens_sources("builtin") == [tmp_path / "cache" / "builtin", weights.shipped_dir("builtin")]
    assert home.lens_sources(str(tmp_path)) == [tmp_path]


def test_find_prefers_a_lens_fitted_to_the_model(tmp_path, monkeypatch, fitted):
    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(home, "shipped_dir", lambda name: tmp_path / "shipped" / name)  # not the package's
    model, other = sharp_model(), sharp_model(seed=5)
    with pytest.raises(UserError, match=r"no tuned lens for builtin .* `blocklab lens fit --model builtin`"):
        home.find_tuned_lens("builtin", model)
    save_tuned_lens(fitted, tmp_path / "cache" / "builtin")
    lens, directory = home.find_tuned_lens("builtin", model)
    assert directory == tmp_path / "cache" / "builtin" and lens.blocks == fitted.blocks
    with pytest.raises(UserError, match="fitted to other weights"):
        home.find_tuned_lens("builtin", other)


def test_the_cli_fits_and_reports_on_a_tiny_saved_model(tmp_path, capsys):
    model = compact_model()
    save_model(model, tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("def add(a, b):\n    return a + b\n\n" * 40)
    fit_argv = ["lens", "fit", "--model", str(tmp_path / "model"), "--prompts", str(text), "--steps", "3"]
    assert cli.main([*fit_argv, "--windows", "9", "--checkpoint-every", "2"]) == 0
    out = capsys.readouterr().out
    assert "| block | exit | held-out KL logit lens | held-out KL tuned lens |" in out
    lens = load_tuned_lens(tmp_path / "model", model)
    shares = ", ".join(f"{n}: {share:.1%}" for n, share in lens.metadata["ranking_coverage"].items())
    assert f"held-out top-1 covered by the first N: {shares}" in out and lens.ranking is not None
    assert lens.metadata["steps"] == 3 and lens.metadata["model"] == str(tmp_path / "model")
    assert not (tmp_path / "model" / fit.CHECKPOINT).exists()
    png = tmp_path / "lens.png"
    report_argv = [
        "lens",
        "report",
        "--model",
        str(tmp_path / "model"),
        "--text",
        str(text),
        "--tokens",
        "200",
    ]
    assert cli.main([*report_argv, "--json", "--out", str(png)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [row["exit"] for row in result["rows"]] == [1, 2, 3] and result["positions"] == 200 - 7
    assert result["lens"] == str(tmp_path / "model" / FILE) and png.stat().st_size > 0
    assert cli.main(["lens", "fit", "--model", str(tmp_path / "model"), "--resume"]) == 2  # nothing to resume


def test_the_cost_counts_a_twelfth_of_a_blocks_weights(model, capsys):
    got = cost.translator_cost(model, repeats=3, position=5)
    D = CFG.n_embd
    assert got["block_weights"] == 12 * D * D and got["translator_weights"] == D * D
    assert got["weight_ratio"] == 1 / 12 and got["time_ratio"] == got["translator_ms"] / got["block_ms"]
    assert "translator / block: 8.3% of the weights" in cost.render({**got, "model": "tiny"})


def test_lens_without_a_subcommand_says_what_there_is(capsys):
    assert cli.main(["lens"]) == 2
    assert "usage: blocklab lens {fit,report,cost}" in capsys.readouterr().err
    assert cli.main(["lens", "--help"]) == 0
    assert "report" in capsys.readouterr().out


def test_parity_with_the_tuned_lens_package(tmp_path):
    """tuned-lens 0.2.0's own TunedLens module and its training step (its loss, and its optimiser as
    its ingredients.py builds it) on a tiny GPT2LMHeadModel, against ours fitted with the same recipe
    on the same windows in the same order. Needs the package importable (it is no dependency of
    ours: ``pip install tuned-lens==0.2.0 --no-deps --target DIR`` and DIR on PYTHONPATH)."""
    transformers = pytest.importorskip("transformers")
    tuned_lens = pytest.importorskip("tuned_lens")
    from lab.weights import load_model

    config = transformers.GPT2Config(
        n_layer=3, n_head=2, n_embd=32, vocab_size=97, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel._from_config(copy.deepcopy(config), attn_implementation="eager")
    with torch.no_grad():  # peaked read-out, blocks that turn the stream: as sharp_model
        hf.transformer.wte.weight.mul_(30)
        for name, param in hf.named_parameters():
            if ".h." in name and param.dim() == 2:
                param.mul_(6)
    hf.eval().save_pretrained(tmp_path)
    ours = load_model(str(tmp_path))
    data = windows(12)
    recipe = fit.Recipe(steps=8, windows_per_step=2, **{k: getattr(fit.BELROSE, k) for k in
                        ("init", "whiten", "optimizer", "weight_decay", "clip")})  # fmt: skip
    lens = fit.fit_tuned_lens(ours, data[:10], data[10:], recipe, progress=False)

    theirs = tuned_lens.TunedLens.from_model(hf)
    # tuned-lens's translator 0 reads the embeddings; translator i, the stream leaving block i - 1
    params = [p for p in theirs.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=1.0 * (1 - 0.9), momentum=0.9, nesterov=True, weight_decay=1e-3)
    for step in range(recipe.steps):
        for group in optimizer.param_groups:  # get_linear_schedule_with_warmup(opt, 0, steps)
            group["lr"] = 0.1 * (recipe.steps - step) / recipe.steps
        chosen = fit.step_windows(10, recipe.windows_per_step, step, recipe.seed)
        batch = torch.tensor([data[i] for i in chosen])
        with torch.no_grad():
            output = hf(batch, output_hidden_states=True)
        labels = output.logits.float().log_softmax(-1)
        for i, h in enumerate(output.hidden_states[1:-1], start=1):  # their train_loop, block by block
            logits = theirs(h, idx=i)
            loss = torch.sum(labels.exp() * (labels - logits.log_softmax(-1)), dim=-1).mean()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()

    # The same translators (theirs [out, in] as nn.Linear, ours [in, out]) and the same held-out KL, to
    # fp32 rounding: their loop computes its loss under bf16 autocast, a GPU memory measure left out here.
    held_out = torch.tensor(data[10:])
    with torch.no_grad():
        output = hf(held_out, output_hidden_states=True)
        final = output.logits.log_softmax(-1)
        for block in lens.blocks:
            translator = theirs.layer_translators[block + 1]
            torch.testing.assert_close(lens.weight[block], translator.weight.t(), rtol=1e-4, atol=1e-6)
            torch.testing.assert_close(lens.bias[block], translator.bias, rtol=1e-4, atol=1e-6)
            q = theirs(output.hidden_states[block + 1], idx=block + 1).log_softmax(-1)
            kl = float((final.exp() * (final - q)).sum(-1).mean())
            assert kl == pytest.approx(lens.metadata["held_out_kl_tuned"][block], rel=1e-5), block
            assert kl < 0.9 * lens.metadata["held_out_kl_logit"][block]  # and the fit did something


# ---------------------------------------------------------------------------------------------------
# Served: lens=tuned block sets read their exits through the model's lens


@pytest.fixture(scope="module")
def lensed(model, fitted) -> GPT:
    """``model`` with ``fitted`` as its tuned lens, as ``lab.weights.load_model`` attaches one."""
    lensed = copy.deepcopy(model)
    lensed.tuned_lens = fitted
    return lensed


def test_an_exit_through_the_lens_is_the_translated_read_out(lensed, fitted):
    """``score`` under exit=E;lens=tuned is unembed(lens(E-1, stream leaving block E-1)), computed the
    plain way; under the logit lens it is not; at full depth there is no translator."""
    ids = windows(1)[0]
    idx = torch.tensor([ids])  # [1, T]
    taps = block_streams(lensed, idx)
    for exit_at in range(1, CFG.n_layer):
        with torch.no_grad():
            logits = lensed.unembed(fitted(exit_at - 1, taps[exit_at - 1]))[0, :-1]  # [T-1, V]
        direct = F.cross_entropy(logits, idx[0, 1:], reduction="none")  # [T-1]
        tuned = score(lensed, ids, BlockSet(exit_at=exit_at, lens="tuned"))
        torch.testing.assert_close(torch.tensor(tuned.token_losses), direct, rtol=1e-5, atol=1e-5)
        assert tuned.token_losses != score(lensed, ids, BlockSet(exit_at=exit_at)).token_losses
    assert score(lensed, ids, BlockSet(lens="tuned")).token_losses == score(lensed, ids).token_losses


@pytest.mark.parametrize("spec", ["exit=2;lens=tuned", "skip=1;exit=3;lens=tuned"])
def test_decoding_through_the_lens_is_the_all_positions_pass(lensed, spec):
    """Token by token (``Decoder``: prefill, then ``decode_rows``) the logits are those of scoring the
    whole text at once, and the greedy tokens follow them; with a skip, the translator is the one of
    the last block run."""
    block_set = BlockSet.parse(spec, CFG.n_layer)
    prompt = windows(1)[0][:6]
    new = [step.token for step in generate(lensed, prompt, 10, block_set=block_set)]
    decoder = Decoder(lensed, block_set)
    cached = [decoder.prefill(prompt)] + [decoder.step(token)[0] for token in new[:-1]]
    ids = prompt + new
    idx = torch.tensor([ids[:-1]])  # [1, T]
    with torch.no_grad():
        x = lensed.residual_stream(idx, block_set=block_set)  # [1, T, D]
        last = block_set.blocks_to_run(CFG.n_layer)[-1]  # exit=3 without block 1: still block 2's
        full = lensed.unembed(lensed.tuned_lens(last, x))[0, len(prompt) - 1 :]  # [10, V]
    assert (torch.stack(cached) - full).abs().max() <= 1e-4
    assert new == full.argmax(-1).tolist()


def test_lens_tuned_without_a_lens_says_how_to_fit_one(model):
    from lab.speculate import Speculator

    ids = windows(1)[0]
    for block_set in [BlockSet(exit_at=2, lens="tuned"), BlockSet(adaptive_threshold=0.9, lens="tuned")]:
        with pytest.raises(UserError, match="lens=tuned needs the model's tuned lens .* `blocklab lens fit"):
            Decoder(model, block_set)
        with pytest.raises(UserError, match="lens=tuned needs the model's tuned lens"):
            score(model, ids, block_set)
    with pytest.raises(UserError, match="lens=tuned needs the model's tuned lens"):
        Speculator(model, BlockSet(speculate=2, lens="tuned"), max_len=32)
    assert score(model, ids, BlockSet(exit_at=2)).token_losses  # the logit lens needs nothing


def test_load_model_brings_the_lens_fitted_to_it(tmp_path, model, fitted, lensed, caplog):
    save_model(model, tmp_path / "model")
    assert weights.load_model(str(tmp_path / "model")).tuned_lens is None
    save_tuned_lens(fitted, tmp_path / "model")
    loaded = weights.load_model(str(tmp_path / "model"))
    assert torch.equal(loaded.tuned_lens.weight, fitted.weight) and loaded.tuned_lens.blocks == fitted.blocks
    bf16 = weights.load_model(str(tmp_path / "model"), "bfloat16")
    assert bf16.tuned_lens.weight.dtype == torch.bfloat16  # the activations' dtype
    ids = windows(1)[0]
    spec = BlockSet(exit_at=2, lens="tuned")
    assert score(loaded, ids, spec).token_losses == score(lensed, ids, spec).token_losses
    save_model(sharp_model(seed=5), tmp_path / "retrained")  # the same shape, other weights
    save_tuned_lens(fitted, tmp_path / "retrained")
    with caplog.at_level("WARNING", logger="lab.lens.home"):
        assert weights.load_model(str(tmp_path / "retrained")).tuned_lens is None
    assert "fitted to other weights" in caplog.text
