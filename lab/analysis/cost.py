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

from lab.analysis import common
from lab.analysis.designs import DESIGNS, Design
from lab.config import PRESETS
from lab.errors import UserError

PEAK_TFLOPS: dict[str, float] = {
    "A100": 312.0,
    "H100-SXM": 989.0,
    "H100-PCIe": 756.0,
    "H200": 989.0,
    "RTX4090": 165.2,
}
"""Dense bf16 tensor-core peaks, TFLOP/s, from NVIDIA's datasheets (no sparsity; the RTX 4090's is with
fp32 accumulation). Override with --peak."""


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


def main(argv: list[str]) -> int:
    p = common.parser(argv[0], "Training cost 6ND (+ attention) in FLOPs, hours and MFU.")
    p.add_argument("--model", default=None, help="use the shapes of a model blocklab loads")
    common.add_config_args(p, default="gpt2", choices=DESIGNS)
    p.add_argument(
        "--batch-size", type=int, default=12, help="sequences per micro-batch (default: %(default)s)"
    )
    p.add_argument(
        "--seq-len", type=int, default=1024, help="training sequence length T (default: %(default)s)"
    )
    p.add_argument(
        "--grad-accum", type=int, default=40, help="micro-batches per iteration, all GPUs (default: 40)"
    )
    p.add_argument("--tokens-per-iter", type=int, default=None, help="override batch x seq-len x grad-accum")
    p.add_argument("--iters", type=int, default=600_000, help="iterations (default: %(default)s)")
    p.add_argument(
        "--gpu", choices=PEAK_TFLOPS, default="A100", help="accelerator of --step-time (default: A100)"
    )
    p.add_argument("--gpus", type=int, default=8, help="accelerators (default: %(default)s)")
    p.add_argument("--peak", type=float, default=None, help="override --gpu's peak, TFLOP/s")
    p.add_argument("--mfu", type=float, default=0.4, help="assumed utilisation for the hours (default: 0.4)")
    p.add_argument("--step-time", type=float, default=None, help="measured seconds per iteration -> MFU")
    common.add_output_args(p)
    args = p.parse_args(argv[1:])

    if args.model is not None:
        from lab.weights import load_model

        design = Design.from_config(load_model(args.model).config, args.model)
    elif args.config in PRESETS:
        design = Design.from_config(common.config_from_args(args), common.config_name(args))
    else:
        if common.config_overrides(args):
            raise UserError(f"{args.config}: GPTConfig overrides apply to the GPT-2 presets only")
        design = DESIGNS[args.config]
    tokens_per_iter = args.tokens_per_iter or args.batch_size * args.seq_len * args.grad_accum
    tokens = tokens_per_iter * args.iters
    flops = training_flops(design, args.seq_len, tokens)
    peaks = dict(PEAK_TFLOPS)
    if args.peak is not None:
        peaks[args.gpu] = args.peak
    accelerators = [
        {
            "name": name,
            "peak_tflops": peak,
            "gpus": args.gpus,
            # GPU-hours (what a run costs, whatever the GPU count) and wall hours on --gpus of them
            "gpu_hours_peak_6ND": hours(flops["C_6ND"], peak, 1),
            "gpu_hours_peak_total": hours(flops["C_total"], peak, 1),
            "gpu_hours_mfu": hours(flops["C_total"], peak, 1, args.mfu),
            "hours_peak_6ND": hours(flops["C_6ND"], peak, args.gpus),
            "hours_peak_total": hours(flops["C_total"], peak, args.gpus),
            "hours_mfu": hours(flops["C_total"], peak, args.gpus, args.mfu),
        }
        for name, peak in peaks.items()
    ]
    report = {
        "design": design.name,
        "L": design.n_layer,
        "d": design.d_model,
        "seq_len": args.seq_len,
        "tokens_per_iter": tokens_per_iter,
        "iters": args.iters,
        "tokens": tokens,
        "flops": flops,
        "mfu": args.mfu,
        "accelerators": accelerators,
    }
    if args.step_time is not None:
        per_iter = (flops["per_token_6N"] + flops["per_token_attention"]) * tokens_per_iter
        report["measured_mfu"] = {
            "name": args.gpu,
            "gpus": args.gpus,
            "peak_tflops": peaks[args.gpu],
            "step_seconds": args.step_time,
            "flops_per_iter": per_iter,
            "mfu": mfu_from_step(per_iter, args.step_time, peaks[args.gpu], args.gpus),
            "mfu_6N": mfu_from_step(
                flops["per_token_6N"] * tokens_per_iter, args.step_time, peaks[args.gpu], args.gpus
            ),
        }
    common.emit(args, report, render(report))
    return 0
