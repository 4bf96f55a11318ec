"""W4A8 against torch's int4 kernel (``lab.w4a8``, ``lab.quantize``): one product, and a prompt's prefill.

    python scripts/bench_w4a8.py                      # 1 and 2 threads, 7 interleaved rounds
    python scripts/bench_w4a8.py --threads 2 --rounds 9 --json w4a8.json

- one product of GPT-2 small's c_attn shape (2304 x 768) at 1, 4, 20 and 80 rows: the same int4
  codes through ``torch.ops.aten._weight_int4pack_mm_for_cpu`` (bf16 activations) and through the W4A8
  kernel (activations quantized to int8 per group of 64), ms per call, best of 20 calls a round;
- the prefill of a 20- and an 80-token prompt on ``gpt2-random`` with ``--dtype int4`` and ``w4a8``.

Configurations are interleaved round by round (``lab.measure.interleaved``); the median over rounds
and the int4 / w4a8 ratio are reported, with the machine.
"""

from __future__ import annotations

import os
import statistics
import time
from json import dumps
from pathlib import Path

import torch

from lab import flags, w4a8
from lab.decode import Decoder
from lab.machine import cpu_description
from lab.measure import interleaved
from lab.quantize import quantize_groups_int4
from lab.weights import load_model

ROWS = (1, 4, 20, 80)
PROMPTS = (20, 80)


def best_ms(call, repeats: int = 20) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def product_measures() -> dict:
    torch.manual_seed(0)
    codes, scales_and_zeros = quantize_groups_int4(torch.randn(2304, 768) * 0.05, 64)
    torch_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    torch_scales = scales_and_zeros.to(torch.bfloat16)
    ours = w4a8.pack(codes, scales_and_zeros)
    measures = {}
    for rows in ROWS:
        x = torch.randn(rows, 768)
        bf16 = x.to(torch.bfloat16)
        measures[f"product {rows} rows int4"] = lambda x=bf16: best_ms(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, torch_packed, 64, torch_scales)
        )
        measures[f"product {rows} rows w4a8"] = lambda x=x: best_ms(lambda: w4a8.matmul(x, *ours))
    return measures


def prefill_measures() -> dict:
    models = {dtype: load_model("gpt2-random", dtype) for dtype in ("int4", "w4a8")}
    measures = {}
    for length in PROMPTS:
        prompt = list(range(100, 100 + length))
        for dtype, model in models.items():
            measures[f"prefill {length} tokens {dtype}"] = lambda m=model, p=prompt: best_ms(
                lambda: Decoder(m, max_len=128).prefill(p), repeats=3
            )
    return measures


def main(threads: tuple[int, ...] = (1, 2), rounds: int = 7, json: Path | None = None) -> None:
    """Measure and print; write the JSON to ``json`` if given.

    Args:
        threads: Torch thread counts, each a run of its own.
        rounds: Rounds; each times every configuration once.
        json: Also write the results here.
    """
    unavailable = w4a8.unavailable()
    if unavailable is not None:
        raise SystemExit(unavailable)
    results = {"machine": cpu_description(), "torch": torch.__version__, "rounds": rounds, "runs": []}
    for count in threads:
        torch.set_num_threads(count)
        load_before = os.getloadavg()
        times = interleaved({**product_measures(), **prefill_measures()}, rounds)
        ms = {name: statistics.median(values) for name, values in times.items()}
        pairs = [name.removesuffix(" int4") for name in ms if name.endswith(" int4")]
        speedup = {name: ms[f"{name} int4"] / ms[f"{name} w4a8"] for name in pairs}
        run = {"threads": count, "load_before": load_before, "load_after": os.getloadavg(), "ms": ms}
        results["runs"].append(run | {"int4_over_w4a8": speedup})
        for name in pairs:
            print(
                f"{count} thread(s), {name:>18}: int4 {ms[f'{name} int4']:8.3f} ms, "
                f"w4a8 {ms[f'{name} w4a8']:8.3f} ms, {speedup[name]:.2f}x"
            )
    text = dumps(results, indent=2)
    print(text)
    if json:
        json.write_text(text)


if __name__ == "__main__":
    flags.call(main)
