"""A change to lab/kernels/intmm.c against another version of the file, in one process, call by call.

    git show HEAD~1:lab/kernels/intmm.c > /tmp/before.c
    python scripts/bench_kernel_change.py --before /tmp/before.c
    python scripts/bench_kernel_change.py --before /tmp/before.c --kinds '[int4, bf16]' --threads 1
    python scripts/bench_kernel_change.py --before /tmp/before.c --rows '[1]' --decode-rounds 9

Both versions are built (``lab.intmm``'s flags, cached by their digest) and loaded side by side. For
each weight kind (int4, int8 weight-only; bf16, f32; the integer products w4a8, w8a8) and row count, one
GPT-2 small block's four products (c_attn 2304 x 768, c_proj 768 x 768, c_fc 3072 x 768, its c_proj 768
x 3072), bf16 rows in (float32 for f32, as the models feed them), are timed under each version in turn,
``--calls`` times each: load and drift fall on both alike. Reported: the medians (ms for the four
products), after / before with the 95% bootstrap interval of the per-call ratio, and whether the two
versions' outputs are bit for bit equal (a change meant to keep the sums, or one meant to change their
order; bf16 outputs can round two orders' sums to the same value). With ``--decode-rounds N``, also
batch-1 greedy decoding of ``gpt2-random`` in each kind's dtype (32 tokens after a 32-token prompt,
ms/token, as ``bench_llama_cpp`` times ours), the versions in turn for N rounds: the whole step, not the
products alone.
"""

from __future__ import annotations

import statistics
import time
from json import dumps
from pathlib import Path

import torch

from lab import flags, intmm
from lab.blocks import BlockSet
from lab.decode import greedy_ms_per_token
from lab.machine import cpu_description
from lab.measure import interval
from lab.quantize import quantize_groups_int4, quantize_rows_int8
from lab.weights import load_model

SHAPES = ((2304, 768), (768, 768), (3072, 768), (768, 3072))
"""GPT-2 small's block: (outputs, inputs) of each weight."""
KINDS = ("int4", "int8", "bf16", "f32", "w4a8", "w8a8")
ROWS = (1, 4, 19, 64)
DTYPES = {"bf16": "bfloat16", "f32": "float32"} | {kind: kind for kind in ("int4", "int8", "w4a8", "w8a8")}
"""The model dtype whose products each kind is."""


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
    kinds: tuple[str, ...] = KINDS,
    rows: tuple[int, ...] = ROWS,
    threads: int = 2,
    calls: int = 40,
    decode_rounds: int = 0,
    json: Path | None = None,
) -> None:
    """Time both versions and print the table and the JSON (written to ``json`` if given).

    Args:
        before: The other version of lab/kernels/intmm.c (this checkout's is "after").
        kinds: Weight kinds, of int4, int8, bf16, f32, w4a8, w8a8.
        rows: Input rows per product.
        threads: torch's threads, which the kernels' OpenMP loops run in.
        calls: Calls of each version per kind and row count (more rows: a third as many, at least 5).
        decode_rounds: Rounds of batch-1 decoding per kind (0: none).
        json: Also write the results here.
    """
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    libraries = {"after": intmm._library(), "before": intmm._library(before.expanduser())}
    # lab.intmm looks each C function up through _function: pointing it at one library or the other
    # switches every product without touching their hot path.
    chosen = ["after"]
    intmm._function = lambda name: getattr(libraries[chosen[0]], name)
    results = {"machine": cpu_description(), "threads": threads, "before": str(before), "measures": {}}
    for kind in kinds:
        products = [(k, product(kind, n, k)) for n, k in SHAPES]
        dtype = torch.float32 if kind == "f32" else torch.bfloat16
        for m in rows:
            inputs = {k: torch.randn(m, k).to(dtype) for k in {k for _, k in SHAPES}}
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
        model = load_model("gpt2-random", DTYPES[kind])
        everything = BlockSet.parse("all", model.config.n_layer)
        ms: dict[str, list[float]] = {"before": [], "after": []}
        for _ in range(decode_rounds):
            for version in ("before", "after"):
                chosen[0] = version
                ms[version].append(greedy_ms_per_token(model, everything, list(range(100, 132)), 32))
        measure = compared(ms, "ms_per_token")
        results["measures"][f"{kind} decode"] = measure
        print(
            f"{kind:5s} decode: before {measure['before_ms_per_token']} ms/token, "
            f"after {measure['after_ms_per_token']}, after / before {measure['after_over_before']:.2f} "
            f"{measure['ci']}",
            flush=True,
        )
    text = dumps(results, indent=2)
    print(text)
    if json:
        json.write_text(text)


if __name__ == "__main__":
    flags.call(main)
