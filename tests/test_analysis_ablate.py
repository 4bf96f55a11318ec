"""blocklab ablate: intact loss is lab.generate.score's, ablations change it, a silent block skips free."""

import json
import math

import pytest
import torch

from lab.analysis import ablate
from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.generate import score
from lab.model import GPT

CFG = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=50257, block_size=32)
IDS = [(7 * i + 3) % 500 for i in range(32)]


def test_report_against_score():
    model = GPT(CFG).eval()
    report = ablate.ablation_report(model, IDS, ["skip", "overwrite"])
    intact = score(model, IDS).mean_loss
    assert report["intact"] == intact
    assert report["uniform"] == pytest.approx(math.log(50257))
    for r in report["rows"]:
        i = r["block"]
        assert r["skip"] == score(model, IDS, BlockSet(skip={i})).mean_loss != intact
        assert r["overwrite"] == score(model, IDS, BlockSet(overwrite={i})).mean_loss != intact
        assert r["skip_change"] == pytest.approx((r["skip"] - intact) / intact)


def test_skipping_a_block_that_writes_nothing_costs_nothing():
    model = GPT(CFG).eval()
    block = model.blocks[2]
    with torch.no_grad():
        for proj in (block.attn.c_proj, block.mlp.c_proj):
            proj.weight.zero_()
            proj.bias.zero_()
    rows = ablate.ablation_report(model, IDS, ["skip"])["rows"]
    assert rows[2]["skip"] == pytest.approx(ablate.ablation_report(model, IDS, [])["intact"], abs=1e-6)
    assert rows[0]["skip_change"] != 0


def test_main_json_one_mode(capsys, tmp_path):
    argv = [
        "ablate",
        "--n-layer",
        "2",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "32",
        "--tokens",
        "20",
    ]
    assert ablate.main([*argv, "--mode", "skip", "--json", "--out", str(tmp_path / "a.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["modes"] == ["skip"]
    assert [sorted(r) for r in report["rows"]] == [["block", "skip", "skip_change"]] * 2
    assert (tmp_path / "a.png").exists()
