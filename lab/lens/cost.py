"""``blocklab lens cost``: what a translator adds to an early exit, against one block, at batch 1.

    blocklab lens cost --model gpt2-random      # GPT-2 small's shapes: D = 768
    blocklab lens cost --model builtin --json

A row that exits through the tuned lens pays one D x D product and a bias (``TunedLens.__call__``)
before the read-out; a block multiplies 12 D^2 weights (the fused query/key/value projection 3 D^2,
attention's output 1 D^2, the feed-forward 8 D^2) and attends over its cache. The weight ratio is
(D^2 + D) / (12 D^2 + 13 D), about 1/12 whatever D. Decoding streams weights once per token, so the
timed ratio follows the weight ratio where the matrix-vector products dominate, and lies above it for
narrow models, whose steps are mostly per-call overhead. Times are medians of repeated calls, and mean
little on a loaded machine (the load average is reported beside them).
"""

from __future__ import annotations

import time

import torch

from lab.analysis import common
from lab.lens.translator import TunedLens
from lab.model import GPT, KVCache


def median_seconds(call, repeats: int) -> float:
    """The median wall time of ``call()`` over ``repeats`` calls, after five to warm up."""
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def translator_cost(model: GPT, repeats: int = 200, position: int = 128) -> dict:
    """One decoding step (batch 1, one token at ``position`` of the cache) of block 0, against one
    translator applied to the stream it leaves: weights multiplied, and median times."""
    cfg = model.config
    D, device, dtype = cfg.n_embd, model.wte.weight.device, model.wte.weight.dtype
    position = min(position, cfg.block_size - 1)
    generator = torch.Generator().manual_seed(0)
    lens = TunedLens(
        bias=torch.randn(1, D, generator=generator), weight=torch.randn(1, D, D, generator=generator)
    )
    lens = lens.to(device, dtype)
    cache = KVCache(cfg, 1, position + 1, device, dtype)
    stream = torch.randn(1, 1, D, generator=generator).to(device, dtype)  # [1, 1, D]
    block = model.blocks[0]
    block_seconds = median_seconds(lambda: block(stream, cache.layer(0), position), repeats)
    translator_seconds = median_seconds(lambda: lens(0, stream), repeats)
    block_weights = sum(
        p.numel() for name, p in block.named_parameters() if name.endswith("weight") and p.dim() == 2
    )
    return {
        "width": D,
        "position": position,
        "block_weights": block_weights,
        "translator_weights": D * D,
        "weight_ratio": D * D / block_weights,
        "block_ms": 1e3 * block_seconds,
        "translator_ms": 1e3 * translator_seconds,
        "time_ratio": translator_seconds / block_seconds,
        "threads": torch.get_num_threads(),
        "load_average": common.load_average(),
    }


def render(report: dict) -> str:
    rows = [
        ["block (batch 1, one token)", report["block_weights"], report["block_ms"]],
        ["translator (D x D + bias)", report["translator_weights"], report["translator_ms"]],
    ]
    return "\n".join(
        [
            f"lens cost: {report['model']} (D = {report['width']}, cache position {report['position']}, "
            f"{report['threads']} threads, load average {report['load_average']})",
            "",
            common.table(["step", "weights multiplied", "median ms"], rows),
            f"translator / block: {report['weight_ratio']:.1%} of the weights, {report['time_ratio']:.1%} "
            "of the time",
        ]
    )
