"""blocklab flops: 2N + 4·L·T·d by hand, and torch's FLOP counter against it (eager exact, sdpa's gap)."""

import json

import pytest

from lab.analysis import flops
from lab.analysis.designs import DESIGNS, Design
from lab.config import GPTConfig

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=40, block_size=16)


def test_formula_by_hand():
    d, L, V, T = 16, 2, 40, 12
    f = Design.from_config(TINY, "tiny").forward_flops_per_token(T)
    assert f == {"linear": 2 * L * 12 * d * d, "unembedding": 2 * V * d, "attention": 4 * L * T * d}
    assert Design.from_config(TINY, "tiny").flop_params() == L * 12 * d * d + V * d


@pytest.mark.parametrize("T", [8, 16, 24])
def test_counter_equals_formula_for_eager(T):
    """T=24 exceeds the context: the counting model's context is stretched to T."""
    expected = sum(Design.from_config(TINY, "tiny").forward_flops_per_token(T).values())
    model = flops.counting_model(TINY, T, "eager")
    assert flops.counted_flops_per_token(model, T)["total"] == expected


def test_counter_misses_fused_cpu_attention():
    """NOTES.md: FlopCounterMode has no formula for the fused CPU kernel; sdpa's attention counts 0."""
    T = 16
    f = Design.from_config(TINY, "tiny").forward_flops_per_token(T)
    counted = flops.counted_flops_per_token(flops.counting_model(TINY, T, "sdpa"), T)["total"]
    assert counted == f["linear"] + f["unembedding"]  # the whole 4·L·T·d term is missing


def test_crossover_is_where_attention_equals_linear():
    gpt2 = DESIGNS["gpt2"]
    blocks_T, all_T = gpt2.attention_crossover()
    assert blocks_T == 6 * 768  # 24·L·d^2 = 4·L·T·d
    f = gpt2.forward_flops_per_token(int(blocks_T))
    assert f["attention"] == f["linear"]
    assert all_T == pytest.approx((f["linear"] + f["unembedding"]) / (4 * 12 * 768))


def test_main_json(capsys, tmp_path):
    argv = [
        "flops",
        "--n-layer",
        "2",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--vocab-size",
        "40",
        "--T",
        "8",
        "16",
    ]
    assert flops.main([*argv, "--json", "--out", str(tmp_path / "f.png")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["T"] for r in report["rows"]] == [8, 16]
    for r in report["rows"]:
        assert r["counted_eager"] == r["total"]
        assert r["sdpa_missed"] == r["attention"]
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_main_formula_only_for_llama(capsys):
    assert flops.main(["flops", "--config", "llama3.1-8b", "--T", "8192", "--no-plot", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert "counted_eager" not in row
    assert row["attention"] == 4 * 32 * 8192 * 4096
