"""blocklab bus: the bookkeeping in the reported numbers, cosines, and a stage that writes nothing."""

import json

import pytest
import torch

from lab.analysis import bus
from lab.config import GPTConfig
from lab.errors import UserError
from lab.model import GPT

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=50257, block_size=32)
IDS = list(range(100, 132))


def test_reported_stream_adds_up():
    report = bus.stream_report(GPT(CFG).eval(), IDS)
    rows = report["rows"]
    assert len(rows) == CFG.n_layer
    assert report["embed"] == pytest.approx(rows[0]["resid_pre"])  # the embedding is the first stream
    for before, after in zip(rows, rows[1:], strict=False):
        assert after["resid_pre"] == pytest.approx(
            before["resid_post"]
        )  # one block's output is the next's input
    for r in rows:
        assert r["bookkeeping"] < 1e-6  # resid_post == resid_pre + attn_out + mlp_out


def test_cosine_of_identical_streams_is_one():
    x = torch.randn(5, 16)
    torch.testing.assert_close(bus.cosine(x, x), torch.ones(5, dtype=torch.float64))
    torch.testing.assert_close(bus.cosine(x, -x), -torch.ones(5, dtype=torch.float64))


def test_a_block_that_writes_nothing():
    model = GPT(CFG).eval()
    block = model.blocks[1]
    with torch.no_grad():
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            proj.weight.zero_()
            proj.bias.zero_()
    row = bus.stream_report(model, IDS)["rows"][1]
    assert row["attn_share"] == 0 and row["mlp_share"] == 0
    assert row["cosine_in_out"] == pytest.approx(1.0)
    assert row["resid_post"] == pytest.approx(row["resid_pre"])


def test_post_ln_has_no_sum_identity():
    from dataclasses import replace

    report = bus.stream_report(GPT(replace(CFG, norm="post")).eval(), IDS)
    assert all(r["bookkeeping"] is None for r in report["rows"])


def test_main_json_and_png(capsys, tmp_path):
    argv = [
        "bus",
        "--n-layer",
        "2",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "32",
        "--tokens",
        "24",
    ]
    assert bus.main([*argv, "--json", "--out", str(tmp_path / "bus.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens"] == 24 and len(report["rows"]) == 2
    assert "random weights" in report["model"]
    assert (tmp_path / "bus.png").read_bytes()[:4] == b"\x89PNG"


def test_text_needs_gpt2_vocabulary():
    with pytest.raises(UserError, match="vocabulary"):
        bus.main(
            ["bus", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--vocab-size", "64", "--no-plot"]
        )


def test_random_weights_in_another_dtype(capsys):
    argv = [
        "bus",
        "--n-layer",
        "2",
        "--n-embd",
        "32",
        "--n-head",
        "2",
        "--block-size",
        "32",
        "--tokens",
        "32",
    ]
    assert bus.main([*argv, "--dtype", "bfloat16", "--no-plot", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["model"].endswith("random weights (seed 0, bfloat16)") and len(report["rows"]) == 2
