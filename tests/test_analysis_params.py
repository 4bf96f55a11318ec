"""blocklab params: the formulas against hand-computed values, instantiated models and published totals."""

import json
from dataclasses import replace

import pytest
import torch

from lab.analysis import params
from lab.analysis.designs import DESIGNS, Design, Poly
from lab.config import PRESETS, GPTConfig
from lab.model import GPT

TINY = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=23, block_size=32)

# Totals of the Hugging Face checkpoints (model.num_parameters(), tied table counted once).
PUBLISHED = {
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
    "gpt2-large": 774_030_080,
    "gpt2-xl": 1_557_611_200,
}


def test_tiny_counts_by_hand():
    d, L, V, T = 16, 3, 23, 32
    design = Design.from_config(TINY, "tiny")
    attention, ff, norms, block = design.block_counts()
    assert (attention.formula, attention.params) == ("4d^2 + 4d", 4 * d * d + 4 * d)
    assert (ff.formula, ff.params) == ("8d^2 + 5d", 8 * d * d + 5 * d)
    assert (norms.formula, norms.params) == ("4d", 4 * d)
    assert (block.formula, block.params) == ("12d^2 + 13d", 12 * d * d + 13 * d)
    assert design.total_params() == L * (12 * d * d + 13 * d) + V * d + T * d + 2 * d


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("bias", [True, False])
def test_formulas_equal_the_instantiated_model(norm, bias):
    cfg = replace(TINY, norm=norm, bias=bias)
    model = GPT(cfg)
    report = params.describe(Design.from_config(cfg, "tiny"), model)
    for row in report["block"] + report["model"]:
        assert row["params"] == row["counted"], row
    assert report["total"] == report["total_counted"] == model.num_params()


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_gpt2_sizes_equal_published_totals(name):
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    assert DESIGNS[name].total_params() == model.num_params() == PUBLISHED[name]


def test_llama_31_8b():
    llama = DESIGNS["llama3.1-8b"]
    d, d_ff, d_kv, V, L = 4096, 14336, 8 * 128, 128256, 32
    attention, ff, norms, block = llama.block_counts()
    assert attention.params == 2 * d * d + 2 * d * d_kv
    assert ff.params == 3 * d * d_ff
    assert norms.params == 2 * d  # two RMSNorms, scale only
    assert llama.total_params() == L * block.params + 2 * V * d + d  # untied head, final norm
    assert llama.total_params() == 8_030_261_248  # Meta's "8.03B" (the checkpoint's count)
    gpt2 = params.describe(DESIGNS["gpt2"])
    assert (
        params.describe(llama)["feed_forward_share_of_block"]
        > 0.8
        > 0.67
        > gpt2["feed_forward_share_of_block"]
    )


def test_poly_adds_and_prints():
    assert str(Poly.of(d2=4, d=4) + Poly.of(d2=8, d=5) + Poly.of(d=4)) == "12d^2 + 13d"
    assert str(Poly.of(d2=2, d_dkv=2) + Poly.of(d_dff=3)) == "2d^2 + 2d·d_kv + 3d·d_ff"


def test_main_json_counts_match(capsys):
    assert params.main(["params", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["total"] == report["total_counted"]
    assert report["tied_head"] is True


def test_main_all_and_llama(capsys):
    params.main(["params", "--all", "--json"])
    names = [r["design"] for r in json.loads(capsys.readouterr().out)["designs"]]
    assert names == list(DESIGNS)
    params.main(["params", "--config", "llama3.1-8b"])
    assert "untied" in capsys.readouterr().out


def test_a_quantized_model_counts_as_the_weights_it_stands_for(tmp_path, capsys):
    """--dtype int4 stores the linear layers in buffers: the count is still the float model's."""
    from lab.weights import save_model

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    save_model(GPT(cfg).eval(), tmp_path / "tiny")
    counts = {}
    for dtype in ("float32", "int4"):
        assert params.main(["params", "--model", str(tmp_path / "tiny"), "--dtype", dtype, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        counts[dtype] = [row["counted"] for row in report["block"] + report["model"]], report["total_counted"]
    assert counts["int4"] == counts["float32"] and counts["float32"][1] == GPT(cfg).num_params()
