import json
import math

import pytest
import torch

from lab import stall
from lab.stall import PRESETS, StallPreset, report_steps, smoothed


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models step faster on one thread, and far faster when other processes share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    assert all(preset.n_layer == 6 for preset in PRESETS.values())
    gpu = PRESETS["gpu"]
    assert (gpu.n_head, gpu.n_embd, gpu.seq_len, gpu.batch_size, gpu.precision) == (
        6,
        384,
        256,
        64,
        "bf16-mixed",
    )


@pytest.mark.slow
def test_shortened_stall_writes_summary_plot_and_table(tmp_path, monkeypatch, capsys):
    tiny = StallPreset(n_layer=2, n_embd=32, n_head=2, seq_len=16, batch_size=8, lr=3e-3, steps=30, warmup=10)
    monkeypatch.setitem(PRESETS, "cpu", tiny)
    out = tmp_path / "stall"
    assert stall.main(["stall", "--seeds", "1", "2", "--out", str(out)]) == 0

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
    assert (out / "stall.png").stat().st_size > 10_000

    printed = capsys.readouterr().out
    assert "post-LN, warmup 10" in printed and "reference lines: unigram" in printed
    assert printed.count("step 100:") == 0  # progress lines come every 100 steps

    assert stall.main(["stall", "--steps", "3", "--seeds", "1", "--json", "--out", str(tmp_path / "j")]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(printed["runs"]) == 3 and "losses" not in printed["runs"][0]
