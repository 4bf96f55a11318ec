import json
import math
from dataclasses import asdict, replace

import pytest
import yaml

from lab.errors import UserError
from lab.stall import cli, experiment
from lab.stall.cli import load_preset
from lab.stall.experiment import run_stall
from lab.stall.report import aggregate, grad_norms_by_variant, report_steps, smoothed, table
from lab.stall.settings import PRESET_NAMES, StallPreset, Variant, default_variants

pytestmark = pytest.mark.usefixtures("one_thread")


def preset_file(tmp_path, preset: StallPreset) -> str:
    """``preset`` as a YAML file for ``--config``: the keys of configs/stall/*.yaml."""
    path = tmp_path / "preset.yaml"
    path.write_text(
        yaml.safe_dump({**asdict(preset), "betas": list(preset.betas), "seeds": list(preset.seeds)})
    )
    return str(path)


CPU = load_preset("cpu")
TINY = replace(CPU, n_layer=2, n_embd=16, n_head=2, seq_len=8, batch_size=4, lr=3e-3, steps=3, warmup=2)


def test_smoothed_is_a_trailing_mean_that_ignores_skipped_steps():
    curve = smoothed([4.0, 2.0, None, float("nan"), 6.0, 0.0], window=2)
    assert curve == [4.0, 3.0, 3.0, 3.0, 4.0, 3.0]
    assert math.isnan(smoothed([None])[0])


def test_report_steps():
    assert report_steps(300) == [100, 200, 300]
    assert report_steps(450) == [100, 200, 300, 400, 450]
    assert report_steps(30) == [10, 20, 30]
    assert report_steps(3) == [1, 2, 3]


def test_presets_are_six_blocks_and_the_gpu_one_is_shakespeare_char_sized():
    assert set(PRESET_NAMES) >= {"cpu", "gpu"}
    assert all(load_preset(name).n_layer == 6 for name in PRESET_NAMES)
    gpu = load_preset("gpu")
    assert (gpu.n_head, gpu.n_embd, gpu.seq_len, gpu.batch_size, gpu.precision) == (
        6,
        384,
        256,
        64,
        "bf16-mixed",
    )


def test_the_cpu_preset_is_the_searched_one():
    assert StallPreset(
        n_embd=384, n_head=6, seq_len=64, batch_size=16, lr=1e-3, steps=400, warmup=100, n_layer=6,
        betas=(0.9, 0.99), weight_decay=0.1, grad_clip=1.0, precision="32-true", val_batches=8, seeds=(1,),
    ) == CPU  # fmt: skip


def test_flags_override_the_preset_and_a_config_file_overrides_it_too(tmp_path):
    preset, options = cli.parse(
        ["--preset", "gpu", "--seeds", "1", "7", "--n-embd", "32", "--at-init", "6", "12"]
    )
    assert (preset.seeds, preset.n_embd, preset.seq_len, options.at_init) == ((1, 7), 32, 256, (6, 12))
    config = tmp_path / "mine.yaml"
    config.write_text("lr: 0.002\nsteps: 50\nvariants: [post]\n")
    preset, options = cli.parse(["--config", str(config), "--steps", "60"])
    assert (preset.lr, preset.steps, preset.n_embd, options.variants) == (0.002, 60, 384, ("post",))
    with pytest.raises(UserError, match="--steps >= 3"):
        cli.parse(["--steps", "2"])
    with pytest.raises(UserError, match="preset"):
        cli.parse(["--preset", "tpu"])


@pytest.mark.slow
def test_shortened_stall_writes_summary_plot_and_table(tmp_path, capsys):
    tiny = replace(
        CPU, n_layer=2, n_embd=32, n_head=2, seq_len=16, batch_size=8, lr=3e-3, steps=30, warmup=10
    )
    out = tmp_path / "stall"
    assert (
        cli.main(["stall", "--config", preset_file(tmp_path, tiny), "--seeds", "1", "2", "--out", str(out)])
        == 0
    )

    summary = json.loads((out / "summary.json").read_text())
    assert summary["unigram"] == pytest.approx(3.25, abs=0.02) and summary["bigram"] < summary["unigram"]
    runs = summary["runs"]
    assert [(r["norm"], r["warmup"], r["seed"]) for r in runs] == [
        ("pre", 0, 1),
        ("post", 0, 1),
        ("post", 10, 1),
        ("pre", 0, 2),
        ("post", 0, 2),
        ("post", 10, 2),
    ]
    for run in runs:
        assert list(run["loss_at"]) == ["10", "20", "30"]
        assert len(run["losses"]) == 30
        assert run["loss_at"]["30"] == pytest.approx(sum(run["losses"][20:30]) / 10, abs=1e-4)
        assert math.isfinite(run["val_loss"]) and isinstance(run["stalled"], bool)
        below = run["below_bigram_at"]
        assert below is None or 1 <= below <= 30
        assert (out / f"{run['norm']}ln_warmup{run['warmup']}_seed{run['seed']}").is_dir()  # TensorBoard run
        assert len(run["grad_norms_at_init"]["blocks"]) == 2
    assert (out / "stall.png").stat().st_size > 10_000
    assert set(summary["grad_norms_at_init"]) == {"pre", "post", "post+warmup=10"}
    assert [row["stalled_seeds"] <= 2 for row in summary["variants"]] == [True] * 3

    printed = capsys.readouterr().out
    assert "post-LN, warmup 10" in printed and "reference lines: unigram" in printed
    assert "final min-max" in printed  # two seeds: a row per variant with the spread
    assert printed.count("step 100:") == 0  # progress lines come every 100 steps

    argv = ["stall", "--config", preset_file(tmp_path, tiny), "--steps", "3", "--seeds", "1", "--json"]
    assert cli.main([*argv, "--out", str(tmp_path / "j")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["runs"]) == 3 and "losses" not in printed["runs"][0]


def test_variant_specs_parse_and_label():
    assert Variant.parse("post+warmup=100") == Variant("post", 100)
    assert Variant.parse("peri+rms").norm_type == "rms"
    assert Variant.parse("deepnorm+warmup=5+rms").spec == "deepnorm+warmup=5+rms"
    assert Variant.parse("peri+rms").label == "Peri-LN, RMSNorm, no warmup"
    for bad in ("middle", "post+warmup=x", "post+cosine"):
        with pytest.raises(ValueError, match="variant"):
            Variant.parse(bad)


def test_every_variant_trains_and_reports_grad_norms_at_init(tmp_path):
    variants = [Variant.parse(spec) for spec in ("deepnorm", "peri+rms")]
    summary = run_stall(TINY, tmp_path, lambda line: None, variants)
    assert [run["variant"] for run in summary["runs"]] == ["deepnorm", "peri+rms"]
    for spec, norms in summary["grad_norms_at_init"].items():
        assert len(norms) == TINY.n_layer and all(n > 0 for n in norms), spec
    assert len(summary["grad_norms_at_init_mlp_c_proj"]["deepnorm"]) == TINY.n_layer
    assert (tmp_path / "grad_norms.png").exists() and (tmp_path / "stall.png").exists()
    assert (tmp_path / "deepnormln_warmup0_seed1").is_dir() and (
        tmp_path / "periln_warmup0_rms_seed1"
    ).is_dir()


def fake_run(preset, variant, seed, data, out, report):
    """What train_variant returns, made up from the settings: a stall when lr is large and no warmup."""
    stalled = preset.lr >= 2e-3 and variant.warmup == 0
    final = (3.3 if stalled else 2.0) + seed / 100
    return {
        "variant": variant.spec, "norm": variant.norm, "norm_type": variant.norm_type,
        "warmup": variant.warmup, "seed": seed, "loss_at": {"3": final}, "val_loss": final,
        "below_bigram_at": None if stalled else 2,
        "stalled": stalled, "grad_norms_at_init": {"blocks": [1.0, 2.0 * seed], "mlp.c_proj": [0.5, 0.5]},
        "losses": [final] * 3,
    }  # fmt: skip


def test_seeds_are_aggregated_per_variant():
    preset = replace(TINY, lr=2e-3)
    runs = [fake_run(preset, v, seed, None, None, None) for seed in (1, 7) for v in default_variants(preset)]
    rows = aggregate(runs)
    assert [row["variant"] for row in rows] == ["pre", "post", "post+warmup=2"]
    assert [row["stalled_seeds"] for row in rows] == [2, 2, 0]
    assert rows[2]["final_loss"] == {"mean": pytest.approx(2.04), "min": 2.01, "max": 2.07}
    assert grad_norms_by_variant(runs)["pre"] == [1.0, 8.0]  # block 1: (2 + 14) / 2
    printed = table(runs, 3.25, 2.48)
    assert "2/2" in printed and "2.010-2.070" in printed


def test_grid_runs_every_cell_and_a_rerun_skips_the_done_ones(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(experiment, "train_variant", lambda *a: calls.append(a) or fake_run(*a))
    config = preset_file(tmp_path, TINY)
    args = [
        "stall",
        "--config",
        config,
        "--grid",
        "lr=1e-3,2e-3",
        "warmup=0,5",
        "--seeds",
        "1",
        "--out",
        str(tmp_path),
    ]
    assert cli.main(args) == 0
    assert len(calls) == 4
    assert {(a[0].lr, a[1].warmup) for a in calls} == {(1e-3, 0), (1e-3, 5), (2e-3, 0), (2e-3, 5)}
    grid = json.loads((tmp_path / "grid.json").read_text())
    assert [c["stalled_seeds"] for c in grid["cells"]] == [0, 0, 1, 0]
    assert (tmp_path / "grid.png").exists()

    (tmp_path / "cells" / "lr=0.002_warmup=5_seed1.json").unlink()  # as if killed during that cell
    calls.clear()
    assert cli.main(args) == 0
    assert [(a[0].lr, a[1].warmup) for a in calls] == [(2e-3, 5)]
    assert "done before, skipped" in capsys.readouterr().out
    with pytest.raises(UserError, match="grid axis 'betas=1,2'"):
        cli.main(["stall", "--grid", "betas=1,2"])


def test_at_init_measures_what_training_measures_at_every_depth(tmp_path, capsys):
    """--at-init: no training, the gradient norms at init per variant and depth; at the preset's depth
    they are the very numbers a training run records before its first step."""
    args = ["stall", "--config", preset_file(tmp_path, TINY), "--at-init", "2", "3"]
    args += ["--variants", "pre", "post", "post+warmup=2", "--seeds", "1"]
    assert cli.main([*args, "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "at_init.json").read_text())
    rows = summary["rows"]
    assert [(r["variant"], r["n_layer"]) for r in rows] == [("pre", 2), ("post", 2), ("pre", 3), ("post", 3)]
    for row in rows:
        assert len(row["mlp.c_proj"]) == len(row["blocks"]) == row["n_layer"]
        last_over_first = row["mlp.c_proj"][-1] / row["mlp.c_proj"][0]
        assert row["ratio_mlp_c_proj"] == pytest.approx(last_over_first, rel=1e-3)
    assert (tmp_path / "at_init.png").exists() and "vs pre-LN" in printed and "1.00x" in printed

    trained = run_stall(TINY, tmp_path / "trained", lambda line: None, [Variant("post")])
    assert trained["grad_norms_at_init"]["post"] == pytest.approx(rows[1]["blocks"], rel=1e-4)
    with pytest.raises(UserError, match="--at-init takes depths of at least 2 blocks"):
        cli.main(["stall", "--at-init", "1"])


@pytest.mark.slow
def test_the_gpu_preset_starts_and_trains_on_the_cpu(tmp_path, capsys):
    """No GPU here: the preset's structure (6 blocks, bf16-mixed, its optimiser) runs 3 steps, smaller."""
    small = ["--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--batch-size", "4"]
    args = ["stall", "--preset", "gpu", "--steps", "3", "--seeds", "1", "--variants", "post", *small]
    assert cli.main([*args, "--json", "--out", str(tmp_path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["preset"]["precision"] == "bf16-mixed" and summary["preset"]["n_layer"] == 6
    (run,) = summary["runs"]
    assert all(math.isfinite(loss) for loss in run["loss_at"].values())
    assert len(summary["grad_norms_at_init"]["post"]) == 6
