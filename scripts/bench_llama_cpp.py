"""Batch-1 decoding against llama.cpp: the same GPT-2 small weights, the same CPU and threads, the
configurations interleaved round by round, ms/token with a 95% interval.

    python scripts/bench_llama_cpp.py --llama-cpp ~/src/llama.cpp --gguf-dir /tmp/gguf

``--llama-cpp`` is a llama.cpp checkout built with cmake (``build/bin/llama-bench`` and
``llama-quantize``, or ``--build DIR``; its source also ships in the ``llama-cpp-python`` sdist on
PyPI). The first run writes ``gpt2-random`` as a Hugging Face directory
(``lab.weights.save_hf_dir``), converts it with llama.cpp's own ``convert_hf_to_gguf.py`` to f32
and quantizes that to bf16, q8_0 and q4_0, all under ``--gguf-dir``; later runs reuse the files.
Pairs compared (ours each eager and through ``lab.fast``'s compiled step): llama.cpp f32 against ours
float32, bf16 against bfloat16, q8_0 against int8, q4_0 against int4 (weight-only, both: q8_0 and
q4_0 keep a scale per 32 weights, ours per output row or per group), and q8_0 and q4_0 against
w8a8 and w4a8 (int8 activations, as llama.cpp's dot products quantize them). Each round times
every configuration once: llama.cpp's ``llama-bench -r 1`` decoding ``--tokens`` after
``--prompt-tokens`` of context (``-d``), ours ``Decoder.step`` after a prompt of the same length.

``--serving`` compares serving instead (``scripts/peer_serving.py``): ``llama-server`` with 4 slots
on the q4_0 file against ``blocklab serve`` with each of ``SERVED``' dtypes and flags, 4
closed-loop streaming clients on each one's OpenAI completions route, then lone requests:
requests/s, TTFT, time per output token, inter-token latency and lone end-to-end latency.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
import sys
from contextlib import ExitStack
from json import dumps, loads
from pathlib import Path

import torch
from peer_serving import LlamaServer, compare

from lab import fast, flags
from lab.blocks import BlockSet
from lab.decode import greedy_ms_per_token
from lab.errors import UserError
from lab.machine import cpu_description
from lab.measure import interleaved, interval
from lab.threads import USER_WAIT_POLICY
from lab.weights import load_model, save_hf_dir
from serve.process import ServerProcess

PAIRS = (
    ("f32", "float32"), ("bf16", "bfloat16"), ("q8_0", "int8"), ("q8_0", "w8a8"), ("q4_0", "int4"),
    ("q4_0", "w4a8"),
)  # fmt: skip
"""llama.cpp's weight type and ours that stores as many bits per weight. q8_0 and q4_0 twice: against
int8 and int4 (weight-only, bf16 activations) and against w8a8 and w4a8, which quantize the
activations to int8 per group as llama.cpp's q8_0 and q4_0 dot products do (q8_0 blocks)."""
SERVED = ("int4", "w4a8", "w4a8 --compile")
"""How ``--serving`` serves q4_0's weights by default (``--served``): a dtype and any flags, one
``blocklab serve`` each, side by side (``--compile`` builds its step at start, ``--warm-up``'s default
lengths)."""
KINDS = tuple(dict.fromkeys(kind for kind, _ in PAIRS))
DTYPES = tuple(dict.fromkeys(dtype for _, dtype in PAIRS))


def gguf_files(llama_cpp: Path, bin_dir: Path, directory: Path) -> dict[str, Path]:
    """The GGUF file of each of ``PAIRS``' llama.cpp types, written under ``directory`` if missing."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {kind: directory / f"gpt2-random-{kind}.gguf" for kind in KINDS}
    if not files["f32"].exists():
        hf = save_hf_dir(load_model("gpt2-random"), directory / "gpt2-random-hf")
        convert = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f32"]
        subprocess.run([*convert, "--outfile", str(files["f32"])], check=True)
    for kind, path in files.items():
        if not path.exists():
            quantize = bin_dir / "llama-quantize"
            subprocess.run([str(quantize), str(files["f32"]), str(path), kind], check=True)
    return files


def llama_ms_per_token(bench: Path, gguf: Path, tokens: int, context: int, threads: int) -> float:
    """One llama-bench run (one repetition, after its warm-up): ms per generated token. It runs with
    libgomp's default waiting (ggml uses OpenMP too), whatever wait policy ours runs with."""
    command = [str(bench), "-m", str(gguf), "-p", "0", "-n", str(tokens), "-d", str(context)]
    command += ["-t", str(threads), "-r", "1", "-o", "json"]
    env = {k: v for k, v in os.environ.items() if k not in USER_WAIT_POLICY}
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
    (result,) = loads(out)
    return 1e3 / result["avg_ts"]


def main(
    llama_cpp: Path,
    gguf_dir: Path,
    build: Path | None = None,
    threads: int = 2,
    tokens: int = 32,
    prompt_tokens: int = 32,
    rounds: int = 9,
    serving: bool = False,
    clients: int = 4,
    requests: int = 8,
    served: tuple[str, ...] = SERVED,
    dtypes: tuple[str, ...] = DTYPES,
    compiled: bool = True,
    json: Path | None = None,
) -> None:
    """Measure, print the table and the JSON, and write the JSON to ``json`` if given.

    Args:
        llama_cpp: A llama.cpp checkout built with cmake (build/bin/llama-bench).
        gguf_dir: Where the GGUF files are (written on the first run).
        build: llama.cpp's cmake build directory (default: LLAMA_CPP/build).
        threads: Threads for both engines.
        tokens: Tokens decoded per measurement.
        prompt_tokens: Tokens of context before them.
        rounds: Rounds; each times every configuration once.
        serving: Compare serving (llama-server against blocklab serve, int4) instead of batch-1 decoding.
        clients: Serving: concurrent streaming clients.
        requests: Serving: requests per client per round.
        served: Serving: our servers, each a dtype and any flags of ``blocklab serve``
            (``'int4 --prefill-chunk 16'``).
        dtypes: Batch 1: our dtypes to time, each against its llama.cpp type (``PAIRS``).
        compiled: Batch 1: also each dtype through lab.fast's compiled step.
        json: Also write the results here.
    """
    torch.set_num_threads(threads)
    llama_cpp = llama_cpp.expanduser()
    bin_dir = (build.expanduser() if build else llama_cpp / "build") / "bin"
    files = gguf_files(llama_cpp, bin_dir, gguf_dir.expanduser())
    if serving:
        load = (threads, tokens, prompt_tokens, rounds, clients, requests)
        return serve_against(bin_dir, files["q4_0"], *load, served, json)
    bench = bin_dir / "llama-bench"
    prompt = torch.randint(0, 50257, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    if unknown := set(dtypes) - set(DTYPES):
        raise UserError(f"--dtypes: {sorted(unknown)} not of {list(DTYPES)}")
    pairs = [(kind, dtype) for kind, dtype in PAIRS if dtype in dtypes]
    ways = ("", " compiled") if compiled else ("",)

    def theirs(kind: str):
        return lambda: llama_ms_per_token(bench, files[kind], tokens, prompt_tokens, threads)

    configs = {f"llama.cpp {kind}": theirs(kind) for kind in dict.fromkeys(kind for kind, _ in pairs)}
    for dtype in dict.fromkeys(dtype for _, dtype in pairs):
        for way in ways:
            model = load_model("gpt2-random", dtype)
            model = fast.accelerate(model) if way else model
            configs[f"ours {dtype}{way}"] = lambda m=model: greedy_ms_per_token(m, BlockSet(), prompt, tokens)
    load_before = os.getloadavg()
    times = interleaved(configs, rounds)  # the warm-up compiles
    ms = {name: {"median": statistics.median(v), "ci": list(interval(v))} for name, v in times.items()}
    ratios, ratio_intervals = {}, {}
    for kind, dtype in pairs:
        for way in ways:
            ours_ms, theirs_ms = times[f"ours {dtype}{way}"], times[f"llama.cpp {kind}"]
            key = f"{dtype} / {kind}{way}"
            # each round times both: the median of the rounds' own ratios, with its 95% interval
            per_round = [o / t for o, t in zip(ours_ms, theirs_ms, strict=True)]
            ratios[key], ratio_intervals[key] = statistics.median(per_round), list(interval(per_round))
    results = {
        "machine": cpu_description(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": threads,
        "wait_policy": {k: os.environ.get(k) for k in USER_WAIT_POLICY},
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "rounds": rounds,
        "dtypes": list(dtypes),
        "compiled": compiled,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "ms_per_token": ms,
        "ours_over_llama_cpp": ratios,
        "ours_over_llama_cpp_ci": ratio_intervals,
    }
    for name, m in ms.items():
        print(
            f"{name:>24}  {m['median']:7.2f} ms/token  [{m['ci'][0]:.2f}, {m['ci'][1]:.2f}]", file=sys.stderr
        )
    for kind, ratio in ratios.items():
        low, high = ratio_intervals[kind]
        print(f"{'ours ' + kind:>32}  {ratio:.2f}  [{low:.2f}, {high:.2f}]", file=sys.stderr)
    text = dumps(results, indent=2)
    print(text)
    if json:
        json.write_text(text)


def over_theirs(own: dict, theirs: dict) -> dict:
    """Each of our serving figures over llama-server's: the medians, and the time to each token both
    servers' replies all reached (one that stopped a reply short has no time to its later tokens)."""
    ratios = {key: own[key] / theirs[key] for key in own if isinstance(own[key], float)}
    for k, ms in own["time_to_token_p50_ms"].items():
        if k in theirs["time_to_token_p50_ms"]:
            ratios[f"time_to_token_{k}"] = ms / theirs["time_to_token_p50_ms"][k]
    return ratios


def serve_against(
    bin_dir: Path, gguf: Path, threads: int, tokens: int, prompt_tokens: int, rounds: int, clients: int,
    requests: int, served: tuple[str, ...], json: Path | None,
) -> None:  # fmt: skip
    """``--serving``: every server up, ``peer_serving.compare``'s rounds, the figures and the ratios
    of each of ours to llama-server's."""
    with ExitStack() as servers:
        llama = servers.enter_context(LlamaServer(bin_dir / "llama-server", gguf, threads))
        urls = {"llama-server q4_0": llama.url}
        for spec in served:
            ours = ServerProcess(["--model", "gpt2-random", "--dtype", *spec.split()], startup_timeout=900)
            urls[f"blocklab {spec}"] = servers.enter_context(ours).url
        load_before = os.getloadavg()
        figures = compare(urls, rounds, clients, requests, prompt_tokens, tokens)
    theirs = figures["llama-server q4_0"]
    ours = {spec: figures[f"blocklab {spec}"] for spec in served}
    results = {
        "machine": cpu_description(), "threads": threads, "clients": clients, "requests": requests,
        "rounds": rounds, "prompt_tokens": prompt_tokens, "max_tokens": tokens,
        "load_before": load_before, "load_after": os.getloadavg(), "servers": figures,
        "ours_over_llama_server": {
            dtype: over_theirs(own, theirs) for dtype, own in ours.items()
        },
        "ours_tpot_over_itl": {dtype: own["tpot_p50_ms"] / own["itl_p50_ms"] for dtype, own in ours.items()},
        "theirs_tpot_over_itl": theirs["tpot_p50_ms"] / theirs["itl_p50_ms"],
    }  # fmt: skip
    for name, figure in figures.items():
        low, high = figure["requests_per_s_ci"]
        print(
            f"{name:>18}  {figure['requests_per_s']:.2f} req/s [{low:.2f}, {high:.2f}]  "
            f"TTFT {figure['ttft_p50_ms']:.0f} ms  TPOT {figure['tpot_p50_ms']:.1f} ms  "
            f"ITL {figure['itl_p50_ms']:.1f} ms  lone {figure['lone_e2e_p50_ms']:.0f} ms",
            file=sys.stderr,
        )
        seen = "  ".join(f"{k}: {ms:.0f}" for k, ms in figure["time_to_token_p50_ms"].items())
        print(f"{'':>18}  time to token k, p50 ms: {seen}", file=sys.stderr)
    text = dumps(results, indent=2)
    print(text)
    if json:
        json.write_text(text)


if __name__ == "__main__":
    flags.call(main)
