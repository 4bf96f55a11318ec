"""blocklab depth: batch-1 decode latency of stacks that spend the same block parameters at different depths.

    blocklab depth                          # 6x1088, 12x768, 24x544, 48x384, ratios to 12x768
    blocklab depth --stacks 12x768 24x544 --new 64 --repeats 5
    blocklab depth --device cuda --dtype bfloat16   # on a GPU (auto takes one where torch sees it)

A Block holds 12d^2 + 13d parameters, so L x d stacks with L·d^2 fixed hold (nearly) the same block
parameters: 6 x 1088^2 = 24 x 544^2 = 7,102,464 and 12 x 768^2 = 48 x 384^2 = 7,077,888 (0.35% apart);
the exact counts are printed. Heads: head size ``--head-size`` (64) where it divides d, else the head
count whose head size is nearest to it (544: 8 heads of 68).

Each stack is a GPT with GPT-2's vocabulary and random weights; ``lab.generate.generate``
prefills a ``--prompt``-token prompt and decodes ``--new`` tokens greedily with the KV cache. Every
decode step is timed, and a pre-hook on ``ln_f`` splits it into the Blocks (embedding lookup included)
and the unembedding (ln_f plus the V x d product, which grows with d, not with depth). The stacks are
run in turn within each repeat, so load hits them alike; the ratios to the baseline are what carry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from jsonargparse.typing import PositiveInt

from lab import flags
from lab.analysis import common
from lab.config import GPT2_VOCAB_SIZE, GPTConfig
from lab.errors import UserError
from lab.generate import generate
from lab.machine import Device, device_named
from lab.model import GPT

DEFAULT_STACKS = ("6x1088", "12x768", "24x544", "48x384")


def heads_for(d: int, head_size: int) -> int:
    """``d // head_size`` where it divides, else the head count whose head size is nearest ``head_size``
    (the larger head size on a tie)."""
    if d % head_size == 0:
        return d // head_size
    divisors = [n for n in range(1, d + 1) if d % n == 0]
    return min(divisors, key=lambda n: (abs(d // n - head_size), -(d // n)))


def parse_stack(text: str) -> tuple[int, int]:
    """``"12x768"`` -> (12, 768)."""
    try:
        n_layer, width = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise UserError(f"stack {text!r}: expected LAYERSxWIDTH, e.g. 12x768") from None
    return n_layer, width


@torch.inference_mode()
def decode_times(model: GPT, prompt: list[int], new_tokens: int) -> tuple[list[float], list[float]]:
    """Per decode step (the prefill excluded): seconds in the Blocks, seconds in the unembedding. On a
    GPU the mark before ``ln_f`` waits for the Blocks' kernels (the host queues them ahead), and each
    step ends with the sampled token copied to the host."""
    marks: list[float] = []
    device = model.wte.weight.device

    def mark(_module, _inputs) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        marks.append(time.perf_counter())

    hook = model.ln_f.register_forward_pre_hook(mark)
    blocks, unembed = [], []
    try:
        start = time.perf_counter()
        for n, _step in enumerate(generate(model, prompt, new_tokens)):
            end = time.perf_counter()
            if n > 0:  # the first token comes from the prefill
                blocks.append(marks[-1] - start)
                unembed.append(end - marks[-1])
            start = time.perf_counter()
    finally:
        hook.remove()
    return blocks, unembed


def build(n_layer: int, d: int, n_head: int, vocab_size: int, context: int, device: str = "cpu") -> GPT:
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=d, vocab_size=vocab_size, block_size=context)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT(cfg).eval().to(device)


def depth_report(
    stacks: list[str],
    baseline: str,
    head_size: int,
    vocab_size: int,
    prompt_len: int,
    new: int,
    repeats: int,
    dtype: str = "float32",
    device: str = "cpu",
) -> dict:
    load_before = common.load_average()
    shapes = [parse_stack(s) for s in stacks]
    models = {
        s: common.in_dtype(build(L, d, heads_for(d, head_size), vocab_size, prompt_len + new, device), dtype)
        for s, (L, d) in zip(stacks, shapes, strict=True)
    }
    prompt = torch.randint(0, vocab_size, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    blocks = {s: [] for s in stacks}
    unembed = {s: [] for s in stacks}
    for _ in range(repeats):
        for s, model in models.items():
            b, u = decode_times(model, prompt, new)
            blocks[s] += b
            unembed[s] += u
    rows = []
    for s, model in models.items():
        cfg = model.config
        block_params = common.weights(model.blocks)
        totals = [b + u for b, u in zip(blocks[s], unembed[s], strict=True)]
        rows.append(
            {
                "stack": s,
                "n_layer": cfg.n_layer,
                "d": cfg.n_embd,
                "n_head": cfg.n_head,
                "head_size": cfg.head_dim,
                "block_params": block_params,
                "total_params": common.total_weights(model),
                "ms_per_token": common.median_ms(totals),
                "blocks_ms": common.median_ms(blocks[s]),
                "unembed_ms": common.median_ms(unembed[s]),
            }
        )
    base = next(r for r in rows if r["stack"] == baseline)
    for r in rows:
        r["ratio"] = r["ms_per_token"] / base["ms_per_token"]
        r["blocks_ratio"] = r["blocks_ms"] / base["blocks_ms"]
    return {
        "baseline": baseline,
        "prompt": prompt_len,
        "new_tokens": new,
        "repeats": repeats,
        "samples_per_stack": len(blocks[baseline]),
        "threads": torch.get_num_threads(),
        "vocab_size": vocab_size,
        "dtype": dtype,
        "device": device,
        "load_average": [load_before, common.load_average()],
        "rows": rows,
    }


def render(report: dict) -> str:
    columns = ["stack", "heads x size", "block params", "ms/token", "Blocks ms", "unembed ms",
               f"/ {report['baseline']}", f"Blocks / {report['baseline']}"]  # fmt: skip
    lines = [
        [
            r["stack"],
            f"{r['n_head']} x {r['head_size']}",
            r["block_params"],
            r["ms_per_token"],
            r["blocks_ms"],
            r["unembed_ms"],
            f"{r['ratio']:.2f}x",
            f"{r['blocks_ratio']:.2f}x",
        ]  # fmt: skip
        for r in report["rows"]
    ]
    weights = "random weights" + ("" if report["dtype"] == "float32" else f" in {report['dtype']}")
    out = [
        f"depth: batch-1 decode with a KV cache, prompt {report['prompt']} tokens, "
        f"{report['new_tokens']} new; "
        f"median over {report['samples_per_stack']} decode steps ({report['repeats']} repeats), "
        f"{_where(report)}, V={report['vocab_size']}, {weights}; "
        f"load average {report['load_average'][0]} at start, {report['load_average'][1]} at end",
        "",
        common.table(columns, lines),
        "",
        "block params = L·(12d^2 + 13d), counted on the built model; Blocks ms includes the embedding "
        "lookup, unembed ms is ln_f plus the V x d product",
    ]
    return common.joined(out, report)


def _where(report: dict) -> str:
    """``2 threads`` on the CPU, else the device (a report from before ``--device`` ran on the CPU)."""
    device = report.get("device", "cpu")
    return f"{report['threads']} threads" if device == "cpu" else device


def plot(report: dict, args) -> str | None:
    plt, rows = common.pyplot(), report["rows"]
    names = [r["stack"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, [r["blocks_ms"] for r in rows], label="Blocks")
    ax.bar(names, [r["unembed_ms"] for r in rows], bottom=[r["blocks_ms"] for r in rows], label="unembedding")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['ratio']:.2f}x", (i, r["blocks_ms"] + r["unembed_ms"]), ha="center", va="bottom")
    ax.set_xlabel("L x d (same block parameters)")
    ax.set_ylabel("ms per decoded token (median)")
    ax.set_title(f"batch-1 decode, ratios to {report['baseline']}")
    ax.legend(fontsize=8)
    return common.save_figure(fig, args)


@dataclass
class DepthOptions:
    """The stacks and the decode."""

    stacks: tuple[str, ...] = DEFAULT_STACKS
    """LxD stacks."""
    baseline: str = "12x768"
    """The stack the ratios are to."""
    head_size: int = 64
    """Preferred head size."""
    vocab_size: int = GPT2_VOCAB_SIZE
    """Vocabulary (default: GPT-2's)."""
    prompt: int = 16
    """Prompt tokens."""
    new: PositiveInt = 32
    """Decoded tokens per run."""
    repeats: PositiveInt = 3
    """Decode runs per stack."""
    threads: PositiveInt = 2
    """Torch threads."""
    dtype: common.WeightDtype = "float32"
    """The weights' type: float32, bfloat16, float16, or weight-only int8 / int4 (on the CPU)."""
    device: Device = "auto"
    """auto (a CUDA device where torch sees one, else the CPU) | cpu | cuda."""


def parser() -> flags.Parser:
    p = common.parser("depth", "Batch-1 decode latency of equal-parameter stacks of different depth.")
    p.add_options(DepthOptions)
    common.add_output_args(p, plot="depth.png")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse(argv[1:])
    if args.baseline not in args.stacks:
        raise UserError(f"--baseline {args.baseline} is not among --stacks {list(args.stacks)}")
    if args.new < 2:
        raise UserError("--new: need at least 2 tokens (the first comes from the prefill)")

    device = device_named(args.device, args.dtype)
    torch.set_num_threads(args.threads)
    report = depth_report(
        list(args.stacks),
        args.baseline,
        args.head_size,
        args.vocab_size,
        args.prompt,
        args.new,
        args.repeats,
        args.dtype,
        device,
    )
    report["png"] = plot(report, args)
    common.emit(args, report, render(report))
    return 0
