"""shapes, timing, depth: structure only (never timings), plus the shared model resolution."""

import json

from lab.analysis import common, depth, shapes, timing
from lab.config import GPTConfig
from lab.model import GPT

TINY_ARGS = ["--n-layer", "2", "--n-embd", "16", "--n-head", "2", "--block-size", "32"]


def test_shapes_json(capsys):
    assert shapes.main(["shapes", *TINY_ARGS, "--T", "12", "--batch", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = {r["hook"]: (r["shape"], r["mixes_positions"]) for r in report["rows"]}
    B, T, D, H = 2, 12, 16, 2
    assert got == {
        "resid_pre": ([B, T, D], False),
        "attn.qkv": ([B, T, 3 * D], False),
        "attn.scores": ([B, H, T, T], True),
        "attn_out": ([B, T, D], True),
        "mlp.hidden": ([B, T, 4 * D], False),
        "mlp_out": ([B, T, D], False),
    }
    d = D
    params = {r["hook"]: r["params"] for r in report["rows"]}
    assert params["attn.qkv"] == 2 * d + 3 * d * d + 3 * d  # ln_1 + c_attn
    assert sum(params.values()) == report["block_params"] == 12 * d * d + 13 * d
    assert sum(r["flops_per_token"] for r in report["rows"]) == 24 * d * d + 4 * T * d


def test_timing_json_structure(capsys):
    assert timing.main(["timing", *TINY_ARGS, "--T", "8", "16", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(r["T"], r["attention"]) for r in report["rows"]] == [
        (8, "eager"), (8, "sdpa"), (16, "eager"), (16, "sdpa")
    ]  # fmt: skip
    d = 16
    for r in report["rows"]:
        assert r["share"] == r["attention_ms"] / r["block_ms"]
        assert r["flop_share"] == (8 * d * d + 4 * r["T"] * d) / (24 * d * d + 4 * r["T"] * d)


def test_depth_heads_and_structure(capsys, tmp_path):
    assert [depth.heads_for(d, 64) for d in (1088, 768, 544, 384)] == [17, 12, 8, 6]
    argv = [
        "depth",
        "--stacks",
        "1x32",
        "4x16",
        "--baseline",
        "1x32",
        "--head-size",
        "8",
        "--vocab-size",
        "64",
    ]
    argv += ["--prompt", "4", "--new", "3", "--repeats", "1", "--json", "--out", str(tmp_path / "d.png")]
    assert depth.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    base, deep = report["rows"]
    assert base["ratio"] == 1.0 and base["blocks_ratio"] == 1.0
    assert (base["n_head"], deep["n_head"]) == (4, 2)
    assert base["block_params"] == 1 * (12 * 32**2 + 13 * 32)
    assert deep["block_params"] == 4 * (12 * 16**2 + 13 * 16)
    assert report["samples_per_stack"] == 2  # 3 new tokens: the first comes from the prefill
    assert (tmp_path / "d.png").exists()


def test_default_model_is_builtin_once_created(tmp_path, monkeypatch):
    from lab import weights
    from lab.weights import save_model

    monkeypatch.setenv("BLOCKLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(weights, "SHIPPED_DIR", tmp_path / "not_shipped")  # an install that lost them
    assert common.default_model_spec() == "gpt2-random"
    save_model(GPT(GPTConfig()), tmp_path / "builtin")
    assert common.default_model_spec() == "builtin"


def test_table_is_markdown():
    lines = common.table(["name", "n"], [["a", 1234], ["bb", 0.5]]).splitlines()
    assert lines[0] == "| name |     n |"
    assert lines[1] == "|------|------:|"
    assert lines[2] == "| a    | 1,234 |"


def test_default_text_is_held_out_standard_library_source():
    """GPT-2-token commands read standard-library source the builtin model never trained on."""
    import argparse

    from lab import tokens
    from lab.corpora import held_out_stdlib_files, stdlib_files

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=tokens.VOCAB_SIZE, block_size=64))
    ids, source = common.text_tokens(argparse.Namespace(text=None, tokens=1000), model)
    first = held_out_stdlib_files()[0]
    assert len(ids) == 64 and source.startswith(f"held-out standard-library source ({first.name}")
    assert ids == tokens.encode(first.read_text(encoding="utf-8"))[:64]
    held_out = set(held_out_stdlib_files())
    assert first == stdlib_files()[0] and len(held_out) == len(stdlib_files()[::20])


def test_depth_in_int4_counts_the_same_block_parameters(capsys):
    argv = ["depth", "--stacks", "1x32", "2x32", "--baseline", "1x32", "--vocab-size", "64", "--prompt", "4"]
    argv += ["--new", "3", "--repeats", "1", "--no-plot", "--json"]
    counts = {}
    for dtype in ("float32", "int4"):
        assert depth.main([*argv, "--dtype", dtype]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["dtype"] == dtype
        counts[dtype] = [(r["block_params"], r["total_params"]) for r in report["rows"]]
    assert counts["int4"] == counts["float32"]
    assert counts["float32"][1][0] == 2 * (12 * 32**2 + 13 * 32)
