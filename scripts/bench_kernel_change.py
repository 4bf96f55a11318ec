"""A change to lab/kernels/intmm.c against another version of the file, in one process, call by call.

    git show HEAD~1:lab/kernels/intmm.c > /tmp/before.c
    python scripts/bench_kernel_change.py --before /tmp/before.c
    python scripts/bench_kernel_change.py --before /tmp/before.c --kinds '[int4, bf16]' --threads 1
    python scripts/bench_kernel_change.py --before /tmp/before.c --rows '[1]' --decode-rounds 9
    python scripts/bench_kernel_change.py --before OLD.c --rows '[4]' --rows-per-step 4 --decode-rounds 5
    python scripts/bench_kernel_change.py --before /tmp/before.c --model builtin --kinds '[f32]' --threads 1

Both versions are built (``lab.intmm``'s flags, cached by their digest) and loaded side by side. For
each weight kind (int4, int8 weight-only; bf16, f32; the integer products w4a8, w8a8) and row count,
one block's four products at ``--model``'s width D (c_attn 3D x D, c_proj D x D, c_fc 4D x D, its
c_proj D x 4D; GPT-2 small: D = 768), bf16 rows in (float32 for f32, as the models feed them), are
timed under each version in turn, ``--calls`` times each: load and drift fall on both alike.
Reported: the medians (ms for the four products), after / before with the 95% bootstrap interval of
the per-call ratio, and whether the two versions' outputs are bit for bit equal (a change meant to
keep the sums, or one meant to change their order; bf16 outputs can round two orders' sums to the
same value). With ``--decode-rounds N``, also greedy decoding of ``--model`` in each kind's dtype
(32 tokens after a 32-token prompt, ms per step, as ``bench_llama_cpp`` times ours), ``--rows-per-step``
sequences stepping together (1: batch 1; more: a server's shared step, ``lab.decode.decode_rows``),
the versions in turn for N rounds: the whole step, not the products alone.
"""

from __future__ import annotations

import statistics
import time
from json import dumps
from pathlib import Path

import torch

from lab import flags, intmm
from lab.blocks import BlockSet
from lab.decode import Decoder, decode_rows, greedy_ms_per_token
from lab.machine import cpu_description
from lab.measure import interval
from lab.quantize import quantize_groups_int4, quantize_rows_int8
from lab.sampling import greedy_token
from lab.weights import load_model

KINDS = ("int4", "int8", "bf16", "f32", "w4a8", "w8a8")
ROWS = (1, 4, 19, 64)
DTYPES = {"bf16": "bfloat16", "f32": "float32"} | {kind: kind for kind in ("int4", "int8", "w4a8", "w8a8")}
"""The model dtype whose products each kind is."""


def block_shapes(d: int) -> tuple[tuple[int, int], ...]:
    """A block of width ``d``: (outputs, inputs) of each weight."""
    return (3 * d, d), (d, d), (4 * d, d), (d, 4 * d)


def product(kind: str, n: int, k: int):
    """lab.intmm's product of ``kind`` on random weights [n, k] as lab.quantize stores them."""
    weight = torch.randn(n, k) * 0.05
    if kind in ("int4", "w4a8"):
        packed = intmm.w4a8_pack(*quantize_groups_int4(weight, 64))
        matmul = intmm.int4_matmul if kind == "int4" else intmm.w4a8_matmul
        return lambda x: matmul(x, *packed, None, n)
    if kind == "int8":
        values, scales = quantize_rows_int8(weight)
        scales = scales.to(torch.bfloat16)
        return lambda x: intmm.int8_matmul(x, values, scales)
    if kind == "w8a8":
        values, scales = quantize_rows_int8(weight)
        return lambda x: intmm.w8a8_matmul(x, values, scales)
    if kind == "bf16":
        weight = weight.to(torch.bfloat16)
        return lambda x: intmm.bf16_matmul(x, weight)
    return lambda x: intmm.f32_matmul(x, weight)


def ms_per_step(model, rows: int, prompt: list[int], n_steps: int) -> float:
    """ms per step of ``rows`` sequences decoding greedily together after ``prompt`` (shifted per row,
    so the rows differ), their prefills not counted; one row: ``greedy_ms_per_token``."""
    if rows == 1:
        return greedy_ms_per_token(model, BlockSet(), prompt, n_steps)
    decoders = [Decoder(model, BlockSet(), max_len=len(prompt) + n_steps + 1) for _ in range(rows)]
    tokens = [greedy_token(d.prefill([t + row for t in prompt])) for row, d in enumerate(decoders)]
    start = time.perf_counter()
    for _ in range(n_steps):
        logits, _ = decode_rows(model, decoders, tokens)
        tokens = [greedy_token(row_logits) for row_logits in logits]
    return (time.perf_counter() - start) * 1e3 / n_steps


def compared(times: dict[str, list[float]], unit: str, scale: float = 1.0) -> dict:
    """Medians of each version's ``times`` (times ``scale``, in ``unit``) and after / before: the median
    of the paired ratios with its 95% bootstrap interval."""
    ratios = [a / b for a, b in zip(times["after"], times["before"], strict=True)]
    low, high = interval(ratios)
    return {
        f"before_{unit}": round(statistics.median(times["before"]) * scale, 3),
        f"after_{unit}": round(statistics.median(times["after"]) * scale, 3),
        "after_over_before": round(statistics.median(ratios), 3),
        "ci": [round(low, 3), round(high, 3)],
    }


def main(
    before: Path,
    model: str = "gpt2-random",
    kinds: tuple[str, ...] = KINDS,
    rows: tuple[int, ...] = ROWS,
    threads: int = 2,
    calls: int = 40,
    decode_rounds: int = 0,
    rows_per_step: int = 1,
    json: Path | None = None,
) -> None:
    """Time both versions and print the table and the JSON (written to ``json`` if given).

    Args:
        before: The other version of lab/kernels/intmm.c (this checkout's is "after").
        model: The model whose block shapes are timed and which decodes (gpt2-random, builtin, ...).
        kinds: Weight kinds, of int4, int8, bf16, f32, w4a8, w8a8.
        rows: Input rows per product.
        threads: torch's threads, which the kernels' OpenMP loops run in.
        calls: Calls of each version per kind and row count (more rows: a third as many, at least 5).
        decode_rounds: Rounds of decoding per kind (0: none).
        rows_per_step: Sequences each decode step takes together.
        json: Also write the results here.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    libraries = {"after": intmm._library(), "before": intmm._library(before.expanduser())}
    # lab.intmm looks each C function up through _function: pointing it at one library or the other
    # switches every product without touching their hot path.
    chosen = ["after"]
    intmm._function = lambda name: getattr(libraries[chosen[0]], name)
    results = {"machine": cpu_description(), "model": model, "threads": threads, "before": str(before)}
    results["measures"] = {}
    shapes = block_shapes(load_model(model, "float32").config.n_embd)
    for kind in kinds:
        products = [(k, product(kind, n, k)) for n, k in shapes]
        dtype = torch.float32 if kind == "f32" else torch.bfloat16
        for m in rows:
            inputs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in shapes}}
            times: dict[str, list[float]] = {"before": [], "after": []}
            outputs = {}
            for _ in range(calls if m <= 4 else max(5, calls // 3)):
                for version in ("before", "after"):
                    chosen[0] = version
                    start = time.perf_counter()
                    outputs[version] = [call(inputs[k]) for k, call in products]
                    times[version].append(time.perf_counter() - start)
            equal = all(torch.equal(a, b) for a, b in zip(outputs["before"], outputs["after"], strict=True))
            measure = compared(times, "ms", 1e3) | {"bit_equal": equal}
            results["measures"][f"{kind} rows={m}"] = measure
            print(
                f"{kind:5s} {m:3d} rows: before {measure['before_ms']:7.3f} ms, "
                f"after {measure['after_ms']:7.3f} ms, after / before {measure['after_over_before']:.2f} "
                f"{measure['ci']}, bit-equal {equal}",
                flush=True,
            )
    for kind in kinds if decode_rounds else ():
        decoding = load_model(model, DTYPES[kind])
        ms: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(decode_rounds):
            for version in ("before", "after"):
                chosen[0] = version
                ms[version].append(ms_per_step(decoding, rows_per_step, list(range(100, 132)), 32))
        measure = compared(ms, "ms_per_step")
        results["measures"][f"{kind} decode rows={rows_per_step}"] = measure
        print(
            f"{kind:5s} decode, {rows_per_step} rows: before {measure['before_ms_per_step']} ms/step, "
            f"after {measure['after_ms_per_step']}, after / before {measure['after_over_before']:.2f} "
            f"{measure['ci']}",
            flush=True,
        )
    text = dumps(results, indent=2)
    print(text)
    if json:
        json.write_text(text)


if __name__ == "__main__":
    flags.call(main)
