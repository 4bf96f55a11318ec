"""Every benchmark of the project in one run, written to BENCHMARKS.md (a few minutes on 2 cores).

    python scripts/bench_all.py                       # writes BENCHMARKS.md
    python scripts/bench_all.py --out /tmp/bench.md --json /tmp/bench.json

Runs, one after another, each benchmark with settings shortened to fit a few minutes:

- decode: ``scripts/bench_decode.py`` (ours in fp32/bf16/int8/w8a8/int4/w4a8 vs transformers vs the bound,
  blocks skipped, each dtype through lab.fast's compiled step);
- serve: ``scripts/bench_serve.py`` (HTTP overhead, batching throughput, latency with skips, the
  scheduler on GPT-2 small shapes in int4 and on the builtin model, batch-invariant and not);
- train: ``scripts/bench_train.py`` (LitGPT under Lightning vs a plain torch loop);
- depth: ``blocklab depth`` (equal-parameter stacks, ratios to 12x768);
- speculate: ``scripts/bench_speculate.py`` (self-speculative decoding against full depth, batch 1) on
  each builtin model that exists (``blocklab builtin``, ``blocklab builtin --recipe early-exit``);
- peers, with ``--llama-cpp DIR`` (a llama.cpp checkout built with cmake; skipped without it):
  ``scripts/bench_llama_cpp.py``, batch-1 decoding against llama-bench (2 threads, then 1) and
  serving against llama-server, on the same weights and cores.

Each benchmark reports ratios against a baseline measured in its own run, so the machine's speed
cancels; the load average before and after is recorded, because on a shared CPU it moves the numbers.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from json import dumps, loads
from pathlib import Path

from lab import flags
from lab.machine import cpu_description
from lab.measure import shown

ROOT = Path(__file__).resolve().parents[1]


def run_json(name: str, command: list[str], json_path: Path | None = None) -> dict:
    """Run one benchmark; its JSON comes from ``json_path`` if given, else from its stdout."""
    print(f"[{name}] {' '.join(command)}", file=sys.stderr, flush=True)
    started = time.monotonic()
    completed = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if completed.returncode != 0:
        raise SystemExit(f"[{name}] failed with {completed.returncode}:\n{completed.stderr[-4000:]}")
    text = json_path.read_text() if json_path else completed.stdout
    # libraries may print lines of their own before the JSON: it starts at the first line opening "{"
    text = text[text.index("{") if text.startswith("{") else text.index("\n{") + 1 :]
    print(f"[{name}] done in {elapsed:.0f} s", file=sys.stderr, flush=True)
    shown = ["python" if part == sys.executable else part for part in command]  # rerunnable anywhere
    return {"command": " ".join(shown), "seconds": round(elapsed, 1), "results": loads(text)}


def decode_rows(decode: dict) -> list[tuple[str, str, str]]:
    ms = decode["ms_per_token"]
    rows = []
    for dtype in ("float32", "bfloat16", "int8", "w8a8", "int4", "w4a8"):
        rows += [
            (
                f"decode, GPT-2 small shapes: ours {dtype} / transformers fp32",
                f"{decode['ratio_to_hf_fp32'][dtype]:.2f} ({ms[f'ours {dtype}']:.1f} ms/token)",
                "<= 0.5",
            ),
            (f"decode: ours {dtype} / bandwidth bound", f"{decode['ratio_to_bound'][dtype]:.2f}", "<= 1.5"),
        ]
        if dtype in (against_torch := decode.get("lab_kernels_over_torch_kernels", {})):
            torch_ms = ms[f"ours {dtype}, torch's kernels"]
            text = f"{against_torch[dtype]:.2f} (torch's: {torch_ms:.1f} ms/token)"
            rows.append((f"decode: ours {dtype}, lab.intmm's kernels / torch's", text, ""))
        if dtype in (against_modules := decode.get("block_calls_over_modules", {})):
            modules_ms = ms[f"ours {dtype}, blocks through modules"]
            text = f"{against_modules[dtype]:.2f} (modules: {modules_ms:.1f} ms/token)"
            rows.append((f"decode: ours {dtype}, each block in one call / through its modules", text, ""))
        compiled = decode.get("compiled_over_eager", {})
        if dtype in compiled:
            text = f"{compiled[dtype]:.2f} ({ms[f'ours {dtype} compiled']:.1f} ms/token)"
            rows.append((f"decode: ours {dtype} compiled (lab.fast) / eager", text, ""))
    rows += [
        ("decode: transformers fp32 ms/token", f"{ms['transformers fp32']:.1f}", ""),
        ("decode: blocks' share of a step (fit)", f"{decode['fit']['block_share']:.2f}", ""),
    ]
    for name, row in decode.get("builtin_rows", {}).items():
        rows.append((
            f"decode: builtin, a step of {name}, the rows in one call / block by block",
            f"{row['one_call_over_block_by_block']:.2f} ({shown(row['one_call_ms'], row['one_call_ci'])} ms)",
            "",
        ))  # fmt: skip
    for model, row in decode.get("sampling", {}).items():
        for setting in ("temperature 1", "top_p 0.9"):
            ours, step, ratio = (
                row[f"{setting} ours"],
                row["decode step"]["ms"],
                row[f"{setting}: ours / textbook"],
            )
            text = f"{ratio:.2f} ({shown(ours['ms'], ours['ci'], 3)} ms; a decode step {step:.2f})"
            name = f"sampling, {model}: a draw at {setting}, ours / torch.multinomial (top_p: full sort)"
            rows.append((name, text, ""))
    return rows


def scheduler_rows(r: dict) -> list[tuple[str, str, str]]:
    """The rows of one scheduler measurement of scripts/bench_serve.py (a model, a dtype, a mode): the
    medians over its rounds, each with its 95% interval."""
    name = f"scheduler, {r['model']} {r['dtype']}, {'invariant' if r['batch_invariant'] else 'shared'}"
    same = "same" if r["batched_tokens_equal"] else "DIFFERENT"

    def value(key: str, digits: int = 2) -> str:
        return shown(r[key], r.get(f"{key}_interval"), digits)

    return [
        (
            f"{name}: 1-token request during a 200-token generation, ms",
            f"{value('one_token_during_200_token_generation_ms', 0)} (alone {r['one_token_alone_ms']:.0f})",
            f"<= {r['head_of_line_bound_ms']:.0f}",
        ),
        (
            f"{name}: TTFT p50 of 4 streaming clients, ms",
            f"{value('ttft_4_clients_p50_ms', 0)} (alone {r['ttft_alone_ms']:.0f})",
            f"<= {r['ttft_bound_ms']:.0f}",
        ),
        (
            f"{name}: TTFT p50 of 4 streaming clients of one prompt (prefilled once), ms",
            value("ttft_4_clients_one_prompt_p50_ms", 0),
            f"<= {r['ttft_bound_ms']:.0f}",
        ),
        (
            f"{name}: TTFT p50 of 8 streaming clients / of 4",
            f"{value('ttft_8_over_4_clients')} ({r['ttft_8_clients_p50_ms']:.0f} ms)",
            "<= 1.5",
        ),
        (f"{name}: 4 block sets at once / in turn", value("four_block_sets_speedup"), ">= 1.6"),
        (f"{name}: 8 adaptive clients / 1", value("eight_adaptive_speedup"), ">= 2"),
        (f"{name}: TPOT of skip half / all, 4 clients", value("tpot_skip_half_over_all"), "<= 0.7"),
        (
            f"{name}: alone vs among 8 mixed, max loss difference; seeded tokens",
            f"{r['batched_loss_max_abs_diff']:.1e}; {same}",
            "<= 1e-6 fp32, 1e-4 int4; same",
        ),
        (f"{name}: 8 clients / 1, requests/s", value("throughput_8_clients_over_1"), ">= 2.1"),
    ]


def speculate_row(result: dict) -> tuple[str, str, str]:
    best = max(result["rows"], key=lambda row: row["speedup"])
    identical = all(row["greedy_identical"] for row in result["rows"])
    return (
        f"speculate, {result['model']}: best tokens/s over full depth ({best['block_set']}; "
        f"{best['acceptance_rate']:.0%} accepted); greedy tokens identical at every setting",
        f"{best['speedup']:.2f}x {best['speedup_interval']}; {'yes' if identical else 'NO'}",
        ">= 1.25x (builtin), 1.3x (builtin-early-exit); yes",
    )


def headline(runs: dict) -> list[tuple[str, str, str]]:
    """(measure, value, target) rows for the summary table."""
    serve = runs["serve"]["results"]
    overhead = serve["overhead"]
    depth = runs["depth"]["results"]
    rows = decode_rows(runs["decode"]["results"])
    rows += [
        (
            "serve: HTTP overhead over in-process / bare FastAPI+uvicorn, p50",
            f"{shown(overhead['overhead_over_bare'], overhead.get('overhead_over_bare_interval'))} "
            f"({overhead['overhead_p50_ms']:.2f} ms)",
            "<= 1.5",
        ),
        ("serve: 8 clients / sequential throughput", f"{serve['batching']['throughput_ratio']:.2f}", ">= 2"),
        (
            "serve: the same, prompts of 8 lengths",
            f"{serve['batching']['mixed_throughput_ratio']:.2f}",
            ">= 2",
        ),
        (
            "serve: a 256 + 16-token prompt whose first 256 an ended request had, first token: "
            "prompt cache / none (gpt2-random int4)",
            f"{serve['prompt_cache']['copied_over_computed']:.3f} "
            f"({serve['prompt_cache']['copied_ms']:.1f} vs {serve['prompt_cache']['computed_ms']:.1f} ms)",
            "",
        ),
        ("train: Lightning / plain torch step time", f"{runs['train']['results']['ratio']:.3f}", "<= 1.05"),
    ]
    for r in serve["scheduling"]:
        rows += scheduler_rows(r)
    for row in depth["rows"]:
        rows.append((f"depth: {row['stack']} / {depth['baseline']} ms per token", f"{row['ratio']:.2f}", ""))
    rows += [speculate_row(run["results"]) for name, run in runs.items() if name.startswith("speculate")]
    return rows + peer_rows(runs)


def builtin_models() -> list[str]:
    """The builtin models made on this machine (the speculation benchmark runs on each)."""
    from lab.weights import BUILTIN_MODELS, FORMAT_FILE, builtin_source

    return [name for name in BUILTIN_MODELS if (builtin_source(name) / FORMAT_FILE).exists()]


def render(runs: dict, meta: dict) -> str:
    lines = [
        "# Benchmarks",
        "",
        f"Written by `{meta['command']}` on {meta['date']} ({meta['seconds']:.0f} s).",
        "",
        f"Machine: {meta['machine']}, {meta['cores']} cores; Python {meta['python']}; "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f". Load average before/after: {meta['load_before']:.2f} / {meta['load_after']:.2f}.",
        "",
        "| measure | value | target |",
        "|---|---|---|",
    ]
    lines += [f"| {measure} | {value} | {target} |" for measure, value, target in headline(runs)]
    lines += ["", "Every ratio is against a baseline measured in the same run. The raw results:", ""]
    for name, run in runs.items():
        lines += [
            f"## {name}",
            "",
            f"`{run['command']}` ({run['seconds']:.0f} s)",
            "",
            "```json",
            dumps(run["results"], indent=1),
            "```",
            "",
        ]
    return "\n".join(lines)


def peer_runs(python: str, llama_cpp: Path, build: Path | None, gguf_dir: Path) -> dict:
    """``scripts/bench_llama_cpp.py``'s comparisons, shortened: batch 1 at 2 threads and at 1, serving."""
    where = ["--llama-cpp", str(llama_cpp), "--gguf-dir", str(gguf_dir)]
    where += ["--build", str(build)] if build else []
    bench = [python, "scripts/bench_llama_cpp.py", *where]
    return {
        "peers decode": run_json("peers decode", [*bench, "--rounds", "5"]),
        "peers decode, 1 thread": run_json(
            "peers decode, 1 thread", [*bench, "--rounds", "3", "--threads", "1"]
        ),
        "peers serving": run_json(
            "peers serving", [*bench, "--serving", "--rounds", "2", "--tokens", "32", "--prompt-tokens", "64"]
        ),
    }


def peer_rows(runs: dict) -> list[tuple[str, str, str]]:
    """The llama.cpp comparisons' rows, where they ran."""
    if "peers decode" not in runs:
        return []
    from bench_llama_cpp import PAIRS, SERVED  # a sibling script: scripts/ is on the path when this one runs

    serving = runs["peers serving"]["results"]
    rows = []
    for run in ("peers decode", "peers decode, 1 thread"):  # every pair, eager and compiled: peer_runs'
        decode = runs[run]["results"]
        ms, ratio = decode["ms_per_token"], decode["ours_over_llama_cpp"]
        for kind, dtype in PAIRS:
            pair = f"{ms[f'ours {dtype}']['median']:.1f} vs {ms[f'llama.cpp {kind}']['median']:.1f}"
            key = f"{dtype} / {kind}"
            threads = f"{decode['threads']} thread" + ("s" if decode["threads"] > 1 else "")
            rows.append((
                f"peers, batch 1, {threads}: ours {key}; compiled",
                f"{ratio[key]:.2f} ({pair}); {ratio[key + ' compiled']:.2f}",
                "<= 1.0",
            ))  # fmt: skip
    theirs = serving["servers"]["llama-server q4_0"]
    for dtype in SERVED:
        ours, over = serving["servers"][f"blocklab {dtype}"], serving["ours_over_llama_server"][dtype]
        name = f"peers, serve {dtype} vs llama-server q4_0, {serving['clients']} clients"
        rate = f"{ours['requests_per_s']:.2f} vs {theirs['requests_per_s']:.2f}"
        lone = f"{ours['lone_e2e_p50_ms']:.0f} vs {theirs['lone_e2e_p50_ms']:.0f}"
        rows += [
            (f"{name}: requests/s, ours / theirs", f"{over['requests_per_s']:.2f} ({rate})", ">= 1"),
            (
                f"{name}: TPOT / inter-token latency, ours",
                f"{serving['ours_tpot_over_itl'][dtype]:.2f}",
                "<= 1.2",
            ),
            (
                f"{name}: lone end-to-end ms, ours / theirs",
                f"{over['lone_e2e_p50_ms']:.2f} ({lone})",
                "<= 1.2",
            ),
        ]
    return rows


def run_all(peers: tuple[Path, Path | None, Path] | None = None) -> dict:
    """Every benchmark, one after another, with settings shortened to fit a few minutes; ``peers``:
    llama.cpp's checkout, build directory and GGUF directory, for the comparisons against it."""
    python = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        decode_json = Path(tmp) / "decode.json"
        decode = [
            python,
            "scripts/bench_decode.py",
            "--rounds",
            "3",
            "--tokens",
            "16",
            "--compile",
            "true",
            "--json",
            str(decode_json),
        ]
        runs = {
            "decode": run_json("decode", decode, decode_json),
            "serve": run_json(
                "serve",
                [python, "scripts/bench_serve.py", "--overhead-requests", "150", "--requests", "6", "--json"],
            ),
            "train": run_json("train", [python, "scripts/bench_train.py", "--steps", "25", "--json"]),
            "depth": run_json(
                "depth",
                [python, "-m", "lab.cli", "depth", "--new", "16", "--repeats", "3", "--no-plot", "--json"],
            ),
        }
        for model in builtin_models():
            runs[f"speculate {model}"] = run_json(
                f"speculate {model}",
                [
                    python, "scripts/bench_speculate.py", "--model", model, "--exits", "3", "4", "6",
                    "--drafts", "2", "3", "--vocabs", "1024", "--rounds", "3", "--prompts", "6",
                    "--new-tokens", "48", "--json",
                ],
            )  # fmt: skip
        if peers is not None:
            runs |= peer_runs(python, *peers)
    return runs


def main(
    out: Path = ROOT / "BENCHMARKS.md",
    json: Path | None = None,
    llama_cpp: Path | None = None,
    llama_build: Path | None = None,
    gguf_dir: Path = Path("/tmp/gguf"),
) -> None:
    """Run every benchmark and write the results.

    Args:
        out: The Markdown file to write.
        json: Also write every result here, as JSON.
        llama_cpp: A llama.cpp checkout built with cmake (llama-bench, llama-quantize, llama-server):
            compare against it too (skipped without).
        llama_build: Its cmake build directory (default: LLAMA_CPP/build).
        gguf_dir: Where the GGUF files of the comparison are (written on the first run).
    """
    started, load_before = time.monotonic(), os.getloadavg()[0]
    runs = run_all(None if llama_cpp is None else (llama_cpp, llama_build, gguf_dir))
    meta = {
        "command": "python scripts/bench_all.py" + ("" if llama_cpp is None else " --llama-cpp DIR"),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": time.monotonic() - started,
        "machine": cpu_description(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {name: version(name) for name in ("torch", "lightning", "litserve", "transformers")},
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
    }
    out.write_text(render(runs, meta))
    if json:
        json.write_text(dumps({"meta": meta, "runs": runs}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    flags.call(main)
