"""blocklab cost: training compute as 6·N·D, with and without attention's term, in FLOPs, GPU-hours,
wall hours on N GPUs, and MFU.

    blocklab cost                                   # nanoGPT's GPT-2 124M run (config/train_gpt2.py)
    blocklab cost --config gpt2-xl --iters 100000 --mfu 0.5
    blocklab cost --step-time 0.9 --gpu A100 --gpus 8  # MFU from a measured iteration time

Per trained token, the forward pass costs 2N + 4·L·T·d (see ``blocklab flops``: N the Blocks' matrices
plus the unembedding, T the training sequence length, the causal mask's zero half counted). The
backward pass costs twice the forward (a gradient for the activations and one for the weights), so a
training token costs 3x: 6N + 12·L·T·d, and D tokens cost

    C = 6·N·D + 12·L·T·d·D

(nanoGPT's estimate_mfu uses the same 6N + 12·L·T·d, with N all parameters but the position table;
Kaplan et al. write 6N with N the non-embedding parameters and drop the attention term). The default run
is nanoGPT's config/train_gpt2.py: batch 12 x sequence 1024 x 40 gradient-accumulation steps (5 per GPU
on 8 GPUs) = 491,520 tokens per iteration, 600,000 iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from jsonargparse.typing import PositiveInt

from lab import flags
from lab.analysis import common
from lab.analysis.designs import Design

PEAK_TFLOPS: dict[str, float] = {
    "A100": 312.0,
    "H100-SXM": 989.0,
    "H100-PCIe": 756.0,
    "H200": 989.0,
    "RTX4090": 165.2,
}
"""Dense bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets (no sparsity; the RTX 4090's is with
fp32 accumulation). Override with --peak."""
Accelerator = Literal[tuple(PEAK_TFLOPS)]


def training_flops(design: Design, seq_len: int, tokens: int) -> dict[str, float]:
    """6·N·D and attention's 12·L·T·d·D for D = ``tokens`` trained at sequence length T = ``seq_len``."""
    N = design.flop_params()
    attention_per_token = 12 * design.n_layer * seq_len * design.d_model
    return {
        "N": N,
        "per_token_6N": 6 * N,
        "per_token_attention": attention_per_token,
        "C_6ND": 6 * N * tokens,
        "C_attention": attention_per_token * tokens,
        "C_total": (6 * N + attention_per_token) * tokens,
    }


def hours(flops: float, peak_tflops: float, n_gpus: int, mfu: float = 1.0) -> float:
    """Wall-clock hours for ``flops`` on ``n_gpus`` accelerators at ``mfu`` of their peak."""
    return flops / (n_gpus * peak_tflops * 1e12 * mfu) / 3600


def mfu_from_step(flops_per_iter: float, step_seconds: float, peak_tflops: float, n_gpus: int) -> float:
    """Model FLOPs utilisation: the FLOPs an iteration needs over what the accelerators could do meanwhile."""
    return flops_per_iter / (step_seconds * n_gpus * peak_tflops * 1e12)


def render(report: dict) -> str:
    f = report["flops"]
    terms = [
        ["6N (weights)", f["per_token_6N"], float(f["C_6ND"])],
        ["12·L·T·d (attention)", f["per_token_attention"], float(f["C_attention"])],
        ["total", f["per_token_6N"] + f["per_token_attention"], float(f["C_total"])],
    ]
    mfu = f"{report['mfu']:g}"
    columns = ["accelerator", "TFLOP/s", "GPU-h at peak, 6ND", "GPU-h at peak, total", f"GPU-h at MFU {mfu}",
               "GPUs", f"wall h at MFU {mfu}", f"wall days at MFU {mfu}"]  # fmt: skip
    lines = [
        [
            a["name"],
            a["peak_tflops"],
            a["gpu_hours_peak_6ND"],
            a["gpu_hours_peak_total"],
            a["gpu_hours_mfu"],
            a["gpus"],
            a["hours_mfu"],
            a["hours_mfu"] / 24,
        ]  # fmt: skip
        for a in report["accelerators"]
    ]
    out = [
        f"cost: {report['design']}; N = {f['N']:,} (Blocks' matrices + unembedding), L={report['L']} "
        f"d={report['d']}, T={report['seq_len']} (training sequence length)",
        f"D = {report['tokens_per_iter']:,} tokens/iter x {report['iters']:,} iters "
        f"= {report['tokens']:,} tokens",
        "",
        common.table(["term", "FLOPs per token", "FLOPs for D tokens"], terms),
        "",
        f"attention's term adds {100 * f['C_attention'] / f['C_6ND']:.1f}% to 6ND",
        "",
        common.table(columns, lines),
    ]
    if "measured_mfu" in report:
        m = report["measured_mfu"]
        out += [
            "",
            f"MFU from a measured step of {m['step_seconds']:g} s on {m['gpus']} x {m['name']} "
            f"({m['peak_tflops']:g} TFLOP/s): {100 * m['mfu']:.1f}% "
            f"({m['flops_per_iter']:.4g} FLOPs per iteration; {100 * m['mfu_6N']:.1f}% counting 6N only)",
        ]
    return "\n".join(out)


@dataclass
class TrainingRun:
    """The run."""

    batch_size: int = 12
    """Sequences per micro-batch."""
    seq_len: int = 1024
    """Training sequence length T."""
    grad_accum: int = 40
    """Micro-batches per iteration, all GPUs."""
    tokens_per_iter: int | None = None
    """Override batch x seq-len x grad-accum."""
    iters: int = 600_000
    """Iterations."""
    gpu: Accelerator = "A100"
    """Accelerator of --step-time."""
    gpus: PositiveInt = 8
    """Accelerators."""
    peak: float | None = None
    """Override --gpu's peak, TFLOP/s."""
    mfu: float = 0.4
    """Assumed utilisation for the hours."""
    step_time: float | None = None
    """Measured seconds per iteration -> MFU."""


def accelerator_hours(flops: dict[str, float], peak: float, run: TrainingRun) -> dict[str, float]:
    """GPU-hours (what a run costs, whatever the GPU count) and wall hours on ``run.gpus`` of them."""
    return {
        "gpu_hours_peak_6ND": hours(flops["C_6ND"], peak, 1),
        "gpu_hours_peak_total": hours(flops["C_total"], peak, 1),
        "gpu_hours_mfu": hours(flops["C_total"], peak, 1, run.mfu),
        "hours_peak_6ND": hours(flops["C_6ND"], peak, run.gpus),
        "hours_peak_total": hours(flops["C_total"], peak, run.gpus),
        "hours_mfu": hours(flops["C_total"], peak, run.gpus, run.mfu),
    }


def measured_mfu(flops: dict[str, float], tokens_per_iter: int, peak: float, run: TrainingRun) -> dict:
    """MFU of ``run.step_time`` seconds per iteration on ``run.gpus`` x ``run.gpu``, with and without
    attention's term."""
    per_iter = (flops["per_token_6N"] + flops["per_token_attention"]) * tokens_per_iter
    return {
        "name": run.gpu,
        "gpus": run.gpus,
        "peak_tflops": peak,
        "step_seconds": run.step_time,
        "flops_per_iter": per_iter,
        "mfu": mfu_from_step(per_iter, run.step_time, peak, run.gpus),
        "mfu_6N": mfu_from_step(flops["per_token_6N"] * tokens_per_iter, run.step_time, peak, run.gpus),
    }


def cost_report(design: Design, run: TrainingRun) -> dict:
    """The FLOPs of ``run`` on ``design``, the hours on every accelerator, and the MFU of a measured step."""
    tokens_per_iter = run.tokens_per_iter or run.batch_size * run.seq_len * run.grad_accum
    tokens = tokens_per_iter * run.iters
    flops = training_flops(design, run.seq_len, tokens)
    peaks = dict(PEAK_TFLOPS)
    if run.peak is not None:
        peaks[run.gpu] = run.peak
    accelerators = [
        {"name": name, "peak_tflops": peak, "gpus": run.gpus, **accelerator_hours(flops, peak, run)}
        for name, peak in peaks.items()
    ]
    report = {
        "design": design.name,
        "L": design.n_layer,
        "d": design.d_model,
        "seq_len": run.seq_len,
        "tokens_per_iter": tokens_per_iter,
        "iters": run.iters,
        "tokens": tokens,
        "flops": flops,
        "mfu": run.mfu,
        "accelerators": accelerators,
    }
    if run.step_time is not None:
        report["measured_mfu"] = measured_mfu(flops, tokens_per_iter, peaks[run.gpu], run)
    return report


def parser() -> flags.Parser:
    p = common.parser("cost", "Training cost 6ND (+ attention) in FLOPs, hours and MFU.")
    common.add_design_args(p)
    p.add_options(TrainingRun)
    common.add_output_args(p)
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])

    design, _ = common.design_from_args(args)
    report = cost_report(design, flags.options(TrainingRun, args))
    common.emit(args, report, render(report))
    return 0
