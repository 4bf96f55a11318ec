"""blocklab cost: 6ND and the attention term by hand, hours, and MFU from a step time."""

import json

import pytest

from lab.analysis import cost
from lab.analysis.designs import Design
from lab.config import GPTConfig

TINY = Design.from_config(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=40, block_size=16), "tiny")


def test_training_flops_by_hand():
    L, d, V, T, D = 2, 16, 40, 8, 1000
    N = L * 12 * d * d + V * d
    f = cost.training_flops(TINY, seq_len=T, tokens=D)
    assert f["N"] == N
    assert f["C_6ND"] == 6 * N * D
    assert f["C_attention"] == 12 * L * T * d * D  # 3 x the forward's 4·L·T·d
    assert f["C_total"] == f["C_6ND"] + f["C_attention"]


def test_hours_and_mfu_round_trip():
    assert cost.hours(312e12 * 3600, 312, 1) == pytest.approx(1.0)
    assert cost.hours(312e12 * 3600, 312, 8, mfu=0.5) == pytest.approx(0.25)
    per_iter = 1e15
    step = per_iter / (4 * 989e12 * 0.4)  # the step time at 40% MFU on 4 GPUs
    assert cost.mfu_from_step(per_iter, step, 989, 4) == pytest.approx(0.4)


def test_main_defaults_are_nanogpts_run(capsys):
    assert cost.main(["cost", "--json", "--step-time", "1.0"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tokens_per_iter"] == 12 * 1024 * 40 == 491_520
    assert report["tokens"] == 491_520 * 600_000
    a100 = next(a for a in report["accelerators"] if a["name"] == "A100")
    assert a100["hours_mfu"] == pytest.approx(report["flops"]["C_total"] / (8 * 312e12 * 0.4) / 3600)
    per_iter = report["measured_mfu"]["flops_per_iter"]
    assert report["measured_mfu"]["mfu"] == pytest.approx(per_iter / (8 * 312e12))


def test_peak_override(capsys):
    cost.main(["cost", "--json", "--gpu", "H200", "--peak", "500", "--gpus", "1", "--iters", "10"])
    h200 = next(a for a in json.loads(capsys.readouterr().out)["accelerators"] if a["name"] == "H200")
    assert h200["peak_tflops"] == 500


def test_gpu_hours_beside_wall_hours(capsys):
    """nanoGPT's GPT-2 run at peak is about 195 A100 GPU-hours: 24.3 wall hours on its 8 GPUs."""
    assert cost.main(["cost", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    a100 = next(a for a in report["accelerators"] if a["name"] == "A100")
    assert a100["gpu_hours_peak_6ND"] == pytest.approx(report["flops"]["C_6ND"] / (312e12 * 3600))
    assert a100["gpu_hours_peak_6ND"] == pytest.approx(195, abs=1)
    for key in ("peak_6ND", "peak_total", "mfu"):
        assert a100[f"gpu_hours_{key}"] == pytest.approx(8 * a100[f"hours_{key}"])
    assert cost.main(["cost"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if "GPU-h at peak, 6ND" in line)
    a100_row = next(line for line in lines if line.startswith("| A100"))
    columns = [cell.strip() for cell in header.split("|")]
    cells = [cell.strip() for cell in a100_row.split("|")]
    assert cells[columns.index("GPU-h at peak, 6ND")] == "194.6"
    assert cells[columns.index("GPUs")] == "8"
    assert cells[columns.index("wall h at MFU 0.4")] == "70.11"
