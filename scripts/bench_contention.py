"""A training step and a decode step, idle and with a CPU-bound process on one core: spinning vs yielding.

    flock /work/bench.lock python scripts/bench_contention.py --rounds 3 --json contention.json

Each measurement runs in a fresh process (the OpenMP wait policy is read when torch loads), in two ways:

- ``spin``: as before ``lab.threads``: libgomp's default wait (threads spin), torch's default threads
  (every core);
- ``yield``: ``OMP_WAIT_POLICY=PASSIVE`` (a waiting thread sleeps at once) and ``lab.threads``'
  ``ThreadTuner`` ticked between steps (threads for the cores other processes leave free);
- ``bounded``: a bounded spin, ``GOMP_SPINCOUNT=--spin`` (a waiting thread spins that many turns of
  libgomp's wait loop before it sleeps; default: ``lab.threads.WAIT_POLICY``'s, what the lab's
  commands set), and the tuner.

and each idle and with a competitor, ``python -c "while True: pass"`` pinned to the last allowed core
(as ``taskset -c 1`` would on 2 cores), started before the process and stopped after it. The jobs: one
optimiser step of the builtin model's recipe (``lab.builtin.training_step``: 12 blocks, width 128,
its compact vocabulary, batch 8 of 256 tokens, Muon, fp32) and one greedy decode step of ``--model``
(``gpt2-random``: GPT-2 small shapes) at ``--dtype`` (fp32), eager or ``--compile``d (``lab.fast``; the
compiled step's first call, which compiles or loads it, is among the warm-up steps). Rounds
interleave every configuration; the median of a measurement's steps, then the median over rounds, is
reported, with the ratio contended / idle (the target: at most 2.5) and the threads the tuner chose.
"""

from __future__ import annotations

import json as json_lib
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal, get_args

from lab import flags, threads
from lab.machine import cpu_description

Way = Literal["spin", "yield", "bounded"]
WAYS = get_args(Way)
Job = Literal["train", "decode"]
JOBS = get_args(Job)


def measure_train(steps: int, tuner) -> list[float]:
    """Seconds of each of ``steps`` builtin-recipe optimiser steps (after one warm-up step)."""
    import torch

    from lab.builtin import Recipe, training_step
    from lab.config import GPTConfig
    from lab.train import LitGPT
    from lab.weights import read_metadata, shipped_dir

    recipe = Recipe()
    vocab = read_metadata(shipped_dir("builtin"))["distinct_tokens"]  # the compact vocabulary it trains in
    cfg = GPTConfig(
        n_layer=recipe.n_layer, n_head=recipe.n_head, n_embd=recipe.n_embd, vocab_size=vocab,
        block_size=recipe.block_size,
    )  # fmt: skip
    lit = LitGPT(cfg, optimizer="muon", muon_lr=recipe.muon_lr, lr=recipe.lr, max_steps=steps + 1)
    optimizer = lit.configure_optimizers()["optimizer"]
    x = torch.randint(0, vocab, (recipe.batch_size, recipe.block_size))  # [B, T]
    y = torch.randint(0, vocab, (recipe.batch_size, recipe.block_size))  # [B, T]
    times = []
    for _ in range(steps + 1):
        if tuner is not None:
            tuner.tick()
        start = time.perf_counter()
        training_step(lit, optimizer, x, y, recipe.precision)
        times.append(time.perf_counter() - start)
    return times[1:]


def measure_decode(model_spec: str, dtype: str, compile: bool, tokens: int, tuner) -> list[float]:
    """Seconds of each of ``tokens`` greedy decode steps after a 32-token prompt (after 8 warm-up steps)."""
    import torch

    from lab.decode import Decoder
    from lab.fast import accelerate
    from lab.weights import load_model

    model = load_model(model_spec, dtype)
    if compile:
        accelerate(model)
    prompt = torch.randint(0, model.config.vocab_size, (32,), generator=torch.Generator().manual_seed(0))
    decoder = Decoder(model, max_len=len(prompt) + tokens + 9)
    token = int(decoder.prefill(prompt.tolist()).argmax())
    times = []
    for _ in range(tokens + 8):
        if tuner is not None:
            tuner.tick()
        start = time.perf_counter()
        logits, _ = decoder.fast_step(token) if compile else decoder.step(token)
        token = int(logits.argmax())
        times.append(time.perf_counter() - start)
    return times[8:]


def run_job(job: str, way: str, spin: int, train_steps: int, decode_tokens: int, model: str, dtype: str,
            compile: bool) -> dict:  # fmt: skip
    """This process's measurement (``--job``): the median step in ms and the threads it ran with."""
    if way == "yield":  # before torch loads
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    elif way == "bounded":
        os.environ["GOMP_SPINCOUNT"] = str(spin)
    tuner = threads.ThreadTuner() if way != "spin" else None
    if job == "train":
        times = measure_train(train_steps, tuner)
    else:
        times = measure_decode(model, dtype, compile, decode_tokens, tuner)
    import torch

    return {"step_ms": statistics.median(times) * 1e3, "threads": torch.get_num_threads()}


def competitor(core: int) -> subprocess.Popen:
    """A CPU-bound Python loop pinned to ``core``."""
    loop = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", loop])


def measured(job: str, way: str, contended: bool, options: dict, timeout: float) -> dict:
    """One measurement in a fresh process: ``way``'s environment, a competitor while it runs if
    ``contended``. A measurement past ``timeout`` seconds reports the time it had taken as a lower bound."""
    env = {k: v for k, v in os.environ.items() if k not in threads.USER_WAIT_POLICY}
    command = [sys.executable, __file__, "--job", job, "--way", way]
    command += [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    rival = competitor(max(threads.allowed_cores())) if contended else None
    started = time.monotonic()
    try:
        out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=True)
        return json_lib.loads(out.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return {"step_ms": None, "timed_out_after_s": time.monotonic() - started, "threads": None}
    except subprocess.CalledProcessError as failed:  # the measurement's own error, not this traceback
        raise RuntimeError(f"{' '.join(command)} failed:\n{failed.stderr[-2000:]}") from None
    finally:
        if rival is not None:
            rival.kill()
            rival.wait()


def summary(runs: dict[tuple[str, str, bool], list[dict]]) -> dict:
    """Per job and way: the median idle and contended step (ms), their ratio, the threads chosen."""
    out: dict = {}
    for (job, way, contended), results in runs.items():
        done = [r["step_ms"] for r in results if r["step_ms"] is not None]
        entry = out.setdefault(job, {}).setdefault(way, {})
        key = "contended" if contended else "idle"
        entry[f"{key}_ms"] = statistics.median(done) if done else None
        entry[f"{key}_threads"] = sorted({r["threads"] for r in results if r["threads"] is not None})
        entry[f"{key}_timed_out"] = len(results) - len(done)
    for ways in out.values():
        for entry in ways.values():
            if entry.get("idle_ms") and entry.get("contended_ms"):
                entry["ratio"] = entry["contended_ms"] / entry["idle_ms"]
    return out


def main(
    rounds: int = 3,
    train_steps: int = 4,
    decode_tokens: int = 32,
    model: str = "gpt2-random",
    dtype: str = "float32",
    compile: bool = False,
    spin: int = int(threads.WAIT_POLICY["GOMP_SPINCOUNT"]),
    jobs: tuple[Job, ...] = JOBS,
    ways: tuple[Way, ...] = WAYS,
    timeout: float = 300.0,
    json: str | None = None,
    job: Job | None = None,
    way: Way = "yield",
) -> None:
    """Measure every configuration ``rounds`` times, interleaved; print the summary as JSON.

    Args:
        rounds: Rounds; each measures every job, way and load once.
        train_steps: Training steps timed per measurement.
        decode_tokens: Decode steps timed per measurement.
        model: The decoded model (lab.weights).
        dtype: The decoded model's dtype (lab.quantize.WEIGHT_DTYPES).
        compile: Decode through the compiled step (lab.fast).
        spin: The ``bounded`` way's ``GOMP_SPINCOUNT``.
        jobs: The jobs measured.
        ways: The ways measured.
        timeout: Seconds one measurement may take; past it, it counts as timed out.
        json: Also write the results here.
        job: Internal: measure this job in this process and print it (the parent starts these).
        way: Internal, with --job: the way it runs.
    """
    options = {"spin": spin, "train_steps": train_steps, "decode_tokens": decode_tokens, "model": model,
               "dtype": dtype, "compile": compile}  # fmt: skip
    if job is not None:
        print(json_lib.dumps(run_job(job, way, **options)))
        return
    load_before = os.getloadavg()
    runs: dict[tuple[str, str, bool], list[dict]] = {}
    for _ in range(rounds):
        for job_name in jobs:
            for way_name in ways:
                for contended in (False, True):
                    result = measured(job_name, way_name, contended, options, timeout)
                    runs.setdefault((job_name, way_name, contended), []).append(result)
                    print(job_name, way_name, "contended" if contended else "idle", result, file=sys.stderr)
    results = {
        "machine": cpu_description(),
        "python": platform.python_version(),
        "allowed_cores": len(threads.allowed_cores()),
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "rounds": rounds,
        "options": options,
        "jobs": summary(runs),
    }
    print(json_lib.dumps(results, indent=2))
    if json:
        Path(json).write_text(json_lib.dumps(results, indent=2))


if __name__ == "__main__":
    flags.call(main)
