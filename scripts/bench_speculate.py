"""Self-speculative decoding at batch 1: tokens per second against full-depth decoding, per draft
exit E, draft length K and draft read-out (the logit lens, or the model's tuned lens: ``lens=tuned``),
with the acceptance rate, and whether the greedy tokens are the same.

    python scripts/bench_speculate.py --model builtin        # both read-outs where a lens is fitted
    python scripts/bench_speculate.py --model builtin --exits 2 4 6 --drafts 2 4 --prompts 10 --json
    python scripts/bench_speculate.py --model builtin --lenses tuned --exits 3 4 --drafts 3 4

Prompts are held-out standard library source (``lab.corpora``), the text the builtin model was not
trained on. Each setting decodes the same prompts greedily; the baseline (``all``) is timed in the
same run, in interleaved rounds (``--rounds``), so the ratio holds under the machine's load of the
moment; the speedup is the median of the rounds' ratios, with its 95% bootstrap interval.

The cost model beside each row: a round drafts ``drafted / rounds`` tokens at ``draft_cost`` (a token
decoded under ``exit=E``, the draft's own pass, timed in the same run, over a full-depth token) and
verifies once at ``verify_cost`` (the round's remaining time, in full-depth tokens); it yields
``tokens_per_verify`` tokens, so the speedup is tokens_per_verify / (drafts * draft_cost +
verify_cost), and speculation pays once enough drafts are accepted to lift tokens_per_verify above
the denominator (docs/inference.md works it out for GPT-2 small's shapes).
"""

import itertools
import os
import statistics
import sys
import time
from json import dumps
from pathlib import Path
from typing import Literal

import torch

import lab.fast
from lab import flags, tokens
from lab.blocks import BlockSet
from lab.corpora import held_out_stdlib_files
from lab.generate import generate
from lab.lens.home import how_to_fit
from lab.measure import interleaved, interval
from lab.quantize import WEIGHT_DTYPES
from lab.speculate import SpeculationStats
from lab.weights import load_model


def prompts_from_stdlib(count: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of ``count`` held-out standard library files."""
    files = held_out_stdlib_files()
    chosen = [files[i * len(files) // count] for i in range(count)]
    return [tokens.encode(path.read_text(encoding="utf-8", errors="replace"))[:length] for path in chosen]


def decode(model, prompts: list[list[int]], new: int, block_set: BlockSet) -> tuple[float, list, object]:
    """Seconds for every prompt's greedy decode, the tokens, and what speculation did. A compiled
    model (``--compile``) first decodes one prompt untimed, so each graph compiles outside the clock."""
    if model.fast is not None:
        list(generate(model, prompts[0], new, block_set=block_set))
    stats, outputs = SpeculationStats(), []
    start = time.perf_counter()
    for prompt in prompts:
        steps = generate(model, prompt, new, block_set=block_set, speculation=stats)
        outputs.append([step.token for step in steps])
    return time.perf_counter() - start, outputs, stats


def speculation_row(
    model, prompts: list[list[int]], exit_block: int, k: int, lens: str, vocab: int | None, new_tokens: int,
    draft_cost, rounds: int,
):  # fmt: skip
    """One setting ``speculate=E;k=K;lens=LENS[;vocab=N]`` against full depth, in ``rounds``
    interleaved rounds (the speedup: the median of the rounds' ratios, with its interval);
    ``draft_cost`` (None: measure it here, beside this baseline) is a draft token's time over a
    full-depth token's, read out over the whole table. Returns the row and the draft cost."""
    spec = BlockSet(speculate=exit_block, draft_tokens=k, lens=lens, draft_vocabulary=vocab)
    spec = spec.validate(model.config.n_layer)
    runs: dict[str, list] = {"full": [], "speculate": []}

    def timed(name: str, block_set: BlockSet):
        def measure() -> float:
            runs[name].append(decode(model, prompts, new_tokens, block_set))
            return runs[name][-1][0]

        return measure

    seconds = interleaved({"full": timed("full", BlockSet()), "speculate": timed("speculate", spec)}, rounds)
    ratios = [full / spec for full, spec in zip(seconds["full"], seconds["speculate"], strict=True)]
    full_s, spec_s = statistics.median(seconds["full"]), statistics.median(seconds["speculate"])
    _, full_tokens, _ = runs["full"][-1]
    _, spec_tokens, stats = runs["speculate"][-1]
    full_token_s = full_s / sum(map(len, full_tokens))
    if draft_cost is None:  # the draft's own pass (exit=E through the same read-out), beside this baseline
        exit_s, exit_tokens, _ = decode(model, prompts, new_tokens, BlockSet(exit_at=exit_block, lens=lens))
        draft_cost = (exit_s / sum(map(len, exit_tokens))) / full_token_s
    round_s = spec_s / max(1, stats.rounds)
    drafts_per_round = stats.drafted / max(1, stats.rounds)
    low_high = interval(ratios)
    row = {
        "block_set": str(spec),
        "exit": exit_block,
        "k": k,
        "lens": lens,
        "vocab": vocab,
        "speedup": round(statistics.median(ratios), 3),
        "speedup_interval": None if low_high is None else [round(end, 3) for end in low_high],
        "rounds": rounds,
        "acceptance_rate": round(stats.acceptance_rate or 0.0, 3),
        "tokens_per_verify": round(sum(map(len, spec_tokens)) / max(1, stats.rounds), 2),
        "drafts_per_round": round(drafts_per_round, 2),
        "draft_cost": round(draft_cost, 3),
        "verify_cost": round(round_s / full_token_s - drafts_per_round * draft_cost, 3),
        "full_tokens_per_s": round(sum(map(len, full_tokens)) / full_s, 1),
        "tokens_per_s": round(sum(map(len, spec_tokens)) / spec_s, 1),
        "greedy_identical": all(tokens == full_tokens for _, tokens, _ in runs["speculate"] + runs["full"]),
    }
    return row, draft_cost


def print_row(r: dict) -> None:
    print(
        f"{r['block_set']:>29}  speedup {r['speedup']:.2f}x {r['speedup_interval']}  "
        f"accepted {r['acceptance_rate']:.0%}  "
        f"{r['tokens_per_s']:.1f} vs {r['full_tokens_per_s']:.1f} tok/s  "
        f"draft {r['draft_cost']:.2f} verify {r['verify_cost']:.2f} (full tokens)  "
        f"identical {r['greedy_identical']}",
        flush=True,
    )


def main(
    model: str = "builtin",
    dtype: Literal[WEIGHT_DTYPES] = "float32",
    exits: tuple[int, ...] = (2, 4, 6, 8),
    drafts: tuple[int, ...] = (2, 4, 6),
    lenses: tuple[Literal["logit", "tuned"], ...] | None = None,
    vocabs: tuple[int, ...] = (),
    rounds: int = 3,
    prompts: int = 8,
    prompt_tokens: int = 32,
    new_tokens: int = 64,
    threads: int = 1,
    compile: bool = False,
    out: Path | None = None,
    json: bool = False,
) -> int:
    """Decode under every speculate=E;k=K and at full depth; print a row per setting, or the JSON.

    Args:
        model: The model to load (builtin, builtin-early-exit, a directory, ...).
        dtype: Its weights' type.
        exits: Draft exits E: the blocks that draft.
        drafts: Draft lengths K: the tokens drafted per round.
        lenses: The drafts' read-outs: logit (as is), tuned (through the model's tuned lens, fitted by
            `blocklab lens fit`); default both where the model has a tuned lens, else logit.
        vocabs: Draft vocabularies N (vocab=N: the drafts read out over the first N tokens of the
            tuned lens's ranking) to time besides the whole table.
        rounds: Interleaved rounds of full depth and each setting (the speedup's interval needs 2).
        prompts: Held-out standard-library files to take a prompt from.
        prompt_tokens: Tokens of each prompt.
        new_tokens: Tokens decoded after each prompt.
        threads: Torch threads.
        compile: Decode through lab.fast's compiled steps (drafts and verifications too), baseline as well.
        out: Write speculate.json and speculate.png here.
        json: Print the results as one JSON object instead of a line per setting.
    """
    torch.set_num_threads(threads)
    loaded = load_model(model, dtype)
    if compile:
        lab.fast.accelerate(loaded)
    if lenses is None:
        lenses = ("logit", "tuned") if loaded.tuned_lens is not None else ("logit",)
    if "tuned" in lenses and loaded.tuned_lens is None:
        sys.exit(f"--lenses tuned: {model} has no tuned lens; {how_to_fit(model)}")
    texts = prompts_from_stdlib(prompts, prompt_tokens)
    decode(loaded, texts[:1], 8, BlockSet())  # warm-up
    rows = []
    for exit_block, lens in itertools.product(exits, lenses):
        draft_cost = None  # measured once per draft exit and read-out
        for k, vocab in itertools.product(drafts, (None, *vocabs)):
            setting = (exit_block, k, lens, vocab)
            row, draft_cost = speculation_row(loaded, texts, *setting, new_tokens, draft_cost, rounds)
            rows.append(row)
            if not json:
                print_row(row)
    result = {
        "model": model,
        "dtype": dtype,
        "load_average": os.getloadavg(), "prompts": prompts, "new_tokens": new_tokens, "threads": threads,
        "compiled": compile,
        "rows": rows,
    }  # fmt: skip
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "speculate.json").write_text(dumps(result, indent=2) + "\n")
        plot(rows, out / "speculate.png", f"{model}: self-speculative decoding, batch 1")
    if json:
        print(dumps(result, indent=2))
    return 0


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, accept) = plt.subplots(1, 2, figsize=(10, 4))
    settings = sorted({(row["k"], row["lens"], row.get("vocab") or 0) for row in rows})
    for (k, lens, vocab), style in zip(settings, itertools.cycle(["o-", "s--", "^:"]), strict=False):
        mine = [row for row in rows if (row["k"], row["lens"], row.get("vocab") or 0) == (k, lens, vocab)]
        label = f"k={k}, {lens} lens" + (f", vocab={vocab}" if vocab else "")
        exits = [row["exit"] for row in mine]
        speed.plot(exits, [row["speedup"] for row in mine], style, label=label)
        accept.plot(exits, [row["acceptance_rate"] for row in mine], style, label=label)
    speed.axhline(1.0, color="grey", lw=0.8)
    speed.set_ylabel("tokens/s over full-depth decoding")
    accept.set_ylabel("drafts accepted")
    for ax in (speed, accept):
        ax.set_xlabel("draft exit E (blocks that draft)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(flags.call(main))
