"""lab.intmm's quantized products against torch's weight-only kernels: int4 and w4a8 against torch's
int4, int8 and w8a8 against torch's int8.

    python scripts/bench_intmm.py                     # 1 and 2 threads, 7 interleaved rounds
    python scripts/bench_intmm.py --threads 2 --rounds 9 --json intmm.json
    python scripts/bench_intmm.py --only products decode
    python scripts/bench_intmm.py --instruction-sets avx2 avx512-vnni   # both kernels, on one CPU

Each group holds the same quantized weights (``lab.quantize``): int4 and int8 multiply bf16
activations by weights widened to floating point, in torch's kernels (``int4 torch``, ``int8 torch``:
``torch.ops.aten._weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``, what ``kernels=False``
keeps) and in lab.intmm's (``int4_mm``, ``int8_mm``); w4a8 and w8a8 quantize the activations to int8
per group of 64 and multiply integers. Sections (``--only``):

- ``fixed``: a tiny product (16 outputs x 64 inputs) at 1 row, as the model calls it (a
  ``QuantizedLinear`` with a bias, bf16 rows in and out): what a call costs besides its arithmetic,
  us, best of 2000 calls a round (a GPT-2 decode step makes 49 products);
- ``products``: one product of GPT-2 small's c_attn shape (2304 x 768, with its bias) at 1, 4, 20 and
  80 rows, the same way, ms per call, best of 20 calls a round; and at 80 rows the weight-only
  products' multiply-adds a second against this CPU's float multiply-add peak on the same threads
  (``lab.intmm.multiply_add_rate``): a prompt's products are bound by their arithmetic;
- ``prefill``: the prefill of a 20- and an 80-token prompt on ``gpt2-random``, best of 3 a round;
- ``decode``: batch-1 greedy decoding on ``gpt2-random``, eager, ms/token over 32 tokens after a
  32-token prompt (``lab.decode.greedy_ms_per_token``).

With ``--instruction-sets``, each of lab.intmm's products runs in each of them (``lab.intmm.instruction_set``;
each must be one this CPU has), each its own configuration, with the ratios of each to the first.

Configurations are interleaved round by round (``lab.measure.interleaved``); the median over rounds
and torch's time over each of lab.intmm's on the same weights are reported, with the machine, the load
and the wait policy.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from json import dumps
from pathlib import Path

import torch

from lab import flags, intmm
from lab.blocks import BlockSet
from lab.decode import Decoder, greedy_ms_per_token
from lab.machine import cpu_description
from lab.measure import interleaved
from lab.quantize import QuantizedLinear
from lab.threads import USER_WAIT_POLICY
from lab.weights import load_model

GROUPS = {"int4 torch": ("int4", "w4a8"), "int8 torch": ("int8", "w8a8")}
"""Torch's weight-only kernel, and lab.intmm's products on the same weights: weight-only and integer."""
CONFIGURATIONS = tuple(name for baseline, ours in GROUPS.items() for name in (baseline, *ours))
OURS = tuple(name for ours in GROUPS.values() for name in ours)
ROWS = (1, 4, 20, 80)
PROMPTS = (20, 80)
SECTIONS = ("fixed", "products", "prefill", "decode")


def best_ms(call, repeats: int = 20) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def layer_measures(name: str, n: int, k: int, rows: tuple[int, ...], repeats: int, unit: float) -> dict:
    """One product of [n, k] weights with a bias in each dtype, at each count of ``rows``: best of
    ``repeats`` calls, in ms times ``unit``."""
    torch.manual_seed(0)
    weight, bias = torch.randn(n, k) * 0.05, torch.randn(n) * 0.01
    layers = {name: QuantizedLinear(weight, bias, *dtype_and_kernels(name)) for name in CONFIGURATIONS}
    measures = {}
    for count in rows:
        x = torch.randn(count, k).to(torch.bfloat16)  # [rows, K]: the model's activations
        for dtype, layer in layers.items():
            measures[f"{name} {count} rows {dtype}"] = lambda layer=layer, x=x: (
                unit * timed(layer, x, repeats)
            )
    return measures


@torch.inference_mode()
def timed(layer: QuantizedLinear, x: torch.Tensor, repeats: int) -> float:
    return best_ms(lambda: layer(x), repeats)


def product_rates(ms: dict[str, float], peak: float) -> dict[str, dict[str, float]]:
    """The c_attn products of the weight-only kinds (float multiply-adds) at the most rows: their
    multiply-adds a second, and that over this CPU's float multiply-add ``peak`` (``lab.intmm.
    multiply_add_rate``, GMAC/s): how close a prompt's products, bound by arithmetic, run to the roof."""
    rows = max(ROWS)
    rates = {}
    for kind in ("int4", "int8", "int4 torch", "int8 torch"):
        name = f"c_attn (2304 x 768) {rows} rows {kind}"
        gmac_s = rows * 2304 * 768 / ms[name] / 1e6
        rates[name] = {"gmac_s": gmac_s, "of_peak": gmac_s / peak}
    return rates


def dtype_and_kernels(name: str) -> tuple[str, bool]:
    """A configuration's dtype, and whether lab.intmm computes it (``int4 torch``: int4, False)."""
    dtype, _, torch_kernels = name.partition(" ")
    return dtype, not torch_kernels


def model_measures(sections: tuple[str, ...]) -> dict:
    models = {}
    for name in CONFIGURATIONS:
        dtype, kernels = dtype_and_kernels(name)
        models[name] = load_model("gpt2-random", dtype, kernels=kernels)
    measures = {}
    if "prefill" in sections:
        for length in PROMPTS:
            prompt = list(range(100, 100 + length))
            for dtype, model in models.items():
                measures[f"prefill {length} tokens {dtype}"] = lambda m=model, p=prompt: best_ms(
                    lambda: Decoder(m, max_len=128).prefill(p), repeats=3
                )
    if "decode" in sections:
        prompt = torch.randint(0, 50257, (32,), generator=torch.Generator().manual_seed(0)).tolist()
        for dtype, model in models.items():
            measures[f"decode ms/token {dtype}"] = lambda m=model: greedy_ms_per_token(
                m, BlockSet(), prompt, 32
            )
    return measures


def in_each(measures: dict, instruction_sets: tuple[str, ...]) -> dict:
    """``measures`` with each of lab.intmm's products' measure once per instruction set (named ``NAME
    SET``)."""
    ours = tuple(f" {name}" for name in OURS)
    out = {}
    for name, measure in measures.items():
        if not name.endswith(ours) or not instruction_sets:
            out[name] = measure
            continue
        for chosen in instruction_sets:
            out[f"{name} {chosen}"] = functools.partial(in_set, chosen, measure)
    return out


def in_set(chosen: str, measure) -> float:
    intmm.instruction_set(chosen)
    return measure()


def main(
    threads: tuple[int, ...] = (1, 2),
    rounds: int = 7,
    only: tuple[str, ...] = SECTIONS,
    instruction_sets: tuple[str, ...] = (),
    json: Path | None = None,
) -> None:
    """Measure and print; write the JSON to ``json`` if given.

    Args:
        threads: Torch thread counts, each a run of its own.
        rounds: Rounds; each times every configuration once.
        only: Sections to run, of fixed, products, prefill, decode.
        instruction_sets: Run the integer products in each of these (of lab.intmm.INSTRUCTION_SETS);
            default: the one the library chose.
        json: Also write the results here.
    """
    unavailable = intmm.unavailable()
    if unavailable is not None:
        raise SystemExit(unavailable)
    if unknown := set(only) - set(SECTIONS):
        raise SystemExit(f"--only: of {', '.join(SECTIONS)}, not {', '.join(sorted(unknown))}")
    default_set = intmm.instruction_set()
    for chosen in instruction_sets:  # a set this CPU lacks would run as AVX2 under its name
        if chosen not in intmm.INSTRUCTION_SETS or intmm.instruction_set(chosen) != chosen:
            raise SystemExit(f"--instruction-sets: {chosen} is not one this CPU runs")
    intmm.instruction_set(default_set)
    results = {
        "machine": cpu_description(),
        "torch": torch.__version__,
        "rounds": rounds,
        "instruction_set": default_set,
        "wait_policy": {name: os.environ.get(name) for name in USER_WAIT_POLICY},
        "runs": [],
    }
    for count in threads:
        torch.set_num_threads(count)
        load_before = os.getloadavg()
        measures = {}
        if "fixed" in only:
            measures |= layer_measures("fixed cost (us), 16 x 64,", 16, 64, (1,), 2000, 1e3)
        if "products" in only:
            measures |= layer_measures("c_attn (2304 x 768)", 2304, 768, ROWS, 20, 1.0)
        measures |= model_measures(only)
        ms = {
            name: statistics.median(values)
            for name, values in interleaved(in_each(measures, instruction_sets), rounds).items()
        }
        intmm.instruction_set(default_set)
        ratios = {}
        suffixes = [f" {chosen}" for chosen in instruction_sets] or [""]
        for baseline, ours in GROUPS.items():
            names = [name.removesuffix(f" {baseline}") for name in measures if name.endswith(f" {baseline}")]
            for name, product in ((name, product) for name in names for product in ours):
                slow = ms[f"{name} {baseline}"]
                for suffix in suffixes:
                    fast = ms[f"{name} {product}{suffix}"]
                    ratios[f"{name} {baseline} / {product}{suffix}"] = slow / fast
                    print(
                        f"{count} thread(s), {name:>36}: {baseline} {slow:8.3f}, "
                        f"{product}{suffix} {fast:8.3f}, {slow / fast:.2f}x"
                    )
                for suffix in suffixes[1:]:
                    first, other = ms[f"{name} {product}{suffixes[0]}"], ms[f"{name} {product}{suffix}"]
                    ratios[f"{name} {product}{suffixes[0]} / {product}{suffix}"] = first / other
        peak = statistics.median(intmm.multiply_add_rate() for _ in range(5)) / 1e9
        rates = product_rates(ms, peak) if "products" in only else {}
        for name, rate in rates.items():
            print(f"{count} thread(s), {name}: {rate['gmac_s']:.1f} GMAC/s, {rate['of_peak']:.2f} of peak")
        run = {"threads": count, "load_before": load_before, "load_after": os.getloadavg(), "ms": ms}
        run |= {"multiply_add_peak_gmac_s": peak, "product_rates": rates}
        results["runs"].append(run | {"torch_over_ours": ratios})
    text = dumps(results, indent=2)
    print(text)
    if json:
        json.write_text(text)


if __name__ == "__main__":
    flags.call(main)
