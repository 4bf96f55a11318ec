"""blocklab plan: which blocks to drop, chosen by every method on your text, then measured.

    blocklab plan --model builtin --max-drop 4 --max-loss-increase 0.1       # held-out stdlib source
    blocklab plan --model gpt2 --prompts notes.txt --budget-ms-per-token 20 --out runs/plan
    blocklab serve --model builtin --default-blocks "$(jq -r .recommended.block_set runs/plan/plan.json)"

For k = 1..K blocks dropped, each method proposes a block set:

    single    the k blocks whose lone skip costs least (measured)
    bi        ShortGPT (Men et al. 2024): the k lowest Block Influence, 1 - cos(block input, output)
    angular   Gromov et al. 2024: the run of k consecutive blocks whose input and output are the
              closest in angle, arccos(cos(x_l, x_l+k)) / pi (averaged over tokens, not the last only)
    greedy    SLEB (Song et al. 2024): skip the block whose removal costs least, re-measure, repeat
    exit      run blocks 0..L-k-1 and read out there (exit=L-k)
    tuned     with the model's tuned lens (lab.lens), the same exits read out through the translator
              of block L-k-1 (exit=L-k;lens=tuned)
    adaptive  with the model's exit probe, a few thresholds (adaptive=T;check=probe), where k is the
              mean number of blocks a token did not run

The methods choose on a calibration split of the text; every reported loss is measured on the
evaluation split, so a plan does not grade its own homework. Losses are mean next-token losses
over the evaluation windows (token-weighted; per window what ``lab.generate.score`` gives). Latency
is batch-1 decoding, ms per new token, measured in-process (``lab.generate.generate``) or through a
running server's ``/predict`` (``--url``).
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from jsonargparse.typing import PositiveInt

from lab.blocks import BlockSet
from lab.errors import UserError
from lab.flags import parse
from lab.generate import generate
from lab.loss_meter import LossMeter, read_windows, split, stream_angles
from lab.measure import check_loopback, frontier
from lab.model import GPT

PRUNING = ("single", "bi", "angular", "greedy")
"""The methods that choose which blocks to skip (the others are depth rules)."""
ADAPTIVE_THRESHOLDS = (0.7, 0.8, 0.9, 0.95)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""

    def ranks(values: list[float]) -> torch.Tensor:
        v = torch.tensor(values, dtype=torch.float64)
        return torch.stack([((v < x).sum() + ((v == x).sum() - 1) / 2) for x in v]).double()

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


# ---------------------------------------------------------------------------------------------------
# Candidates


def skip(blocks) -> BlockSet:
    return BlockSet(skip=frozenset(blocks))


def choose(model: GPT, meter: LossMeter, max_drop: int) -> tuple[dict[str, list[BlockSet]], dict]:
    """Each method's block set for k = 1..max_drop, chosen with ``meter`` (the calibration split), and
    the per-block proxies beside the measured single-skip increase."""
    L = model.config.n_layer
    base = meter(BlockSet())
    single = [meter(skip([i])) - base for i in range(L)]
    cos, angle = stream_angles(meter, max_drop)
    influence = (1 - cos[:, 1]).tolist()
    by_single = sorted(range(L), key=lambda i: single[i])  # stable: ties go to the lower index
    by_influence = sorted(range(L), key=lambda i: influence[i])
    chosen: dict[str, list[BlockSet]] = {method: [] for method in (*PRUNING, "exit")}
    dropped: list[int] = []
    for k in range(1, max_drop + 1):
        chosen["single"].append(skip(by_single[:k]))
        chosen["bi"].append(skip(by_influence[:k]))
        start = int(torch.nan_to_num(angle[:, k], nan=math.inf).argmin())
        chosen["angular"].append(skip(range(start, start + k)))
        rest = [i for i in range(L) if i not in dropped]
        dropped.append(min(rest, key=lambda i: meter(skip([*dropped, i]))))
        chosen["greedy"].append(skip(dropped))
        chosen["exit"].append(BlockSet(exit_at=L - k))
    if model.tuned_lens is not None:
        chosen["tuned"] = [BlockSet(exit_at=L - k, lens="tuned") for k in range(1, max_drop + 1)]
    if model.exit_probe is not None:
        chosen["adaptive"] = [
            BlockSet(adaptive_threshold=t, adaptive_check="probe") for t in ADAPTIVE_THRESHOLDS
        ]
    proxies = {
        "spearman": {"bi": spearman(influence, single), "angular": spearman(angle[:, 1].tolist(), single)},
        "per_block": [
            {"block": i, "single_loss_increase": single[i], "bi": influence[i], "angular": float(angle[i, 1])}
            for i in range(L)
        ],
    }
    return chosen, proxies


# ---------------------------------------------------------------------------------------------------
# Latency


def schedule(block_sets: list[BlockSet], rounds: int) -> list[tuple[bool, BlockSet]]:
    """One unmeasured run first (a first call pays one-time costs), then ``rounds`` rounds of every set,
    interleaved so that a change in the machine's load falls on all of them alike."""
    return [(False, block_sets[0])] + [(True, s) for _ in range(rounds) for s in block_sets]


def decode_ms(
    model: GPT, prompt: list[int], block_sets: list[BlockSet], new_tokens: int = 16, rounds: int = 7
):
    """Batch-1 ms per new token for each set (spec -> ms): the fastest of ``rounds`` greedy decodes of
    ``new_tokens`` after ``prompt`` (``schedule``). The fastest, not the median: other processes only
    ever add time, so the least disturbed run is the number that repeats on a shared machine."""
    times: dict[str, list[float]] = defaultdict(list)
    for measured, block_set in schedule(block_sets, rounds):
        stamps = [time.perf_counter() for _ in generate(model, prompt, new_tokens, block_set=block_set)]
        if measured and len(stamps) > 1:
            times[str(block_set)].append((stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1))
    return {spec: min(values) for spec, values in times.items()}


def served_ms(
    url: str, model: GPT, prompt: str, block_sets: list[BlockSet], new_tokens: int = 16, rounds: int = 7
):
    """As ``decode_ms``, through a running server: its ``/predict`` (with ``score``) and the per-token
    time the server reports, so the number is what a request sees apart from the network."""
    import httpx

    check_loopback(url)
    times: dict[str, list[float]] = defaultdict(list)
    try:
        with httpx.Client(base_url=url, timeout=httpx.Timeout(300.0, connect=10.0)) as client:
            depth = client.get("/info").raise_for_status().json()["model"]["depth"]
            if depth != model.config.n_layer:
                raise UserError(
                    f"--url: the server's model has {depth} blocks, --model's {model.config.n_layer}"
                )
            for measured, block_set in schedule(block_sets, rounds):
                body = {"prompt": prompt, "max_new_tokens": new_tokens, "blocks": str(block_set),
                        "score": True, "seed": 0}  # fmt: skip
                response = client.post("/predict", json=body)
                if response.status_code != 200:
                    raise UserError(f"--url: {response.status_code} for {block_set}: {response.text[:200]}")
                per_token = response.json()["timings"]["per_token_ms"]
                if measured and per_token is not None:
                    times[str(block_set)].append(per_token)
    except httpx.HTTPError as error:
        raise UserError(f"--url: {url}: {error}") from None
    return {spec: min(values) for spec, values in times.items()}


# ---------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Point:
    """One candidate measured on the evaluation split."""

    method: str
    k: float
    """Blocks dropped; for adaptive exit, the mean per token on the evaluation split."""
    block_set: str
    loss: float
    loss_increase: float
    ms_per_token: float | None


def cheapest(points: list[Point]) -> list[Point]:
    """The frontier: the points nothing faster beats on loss, fastest first (one per block set)."""
    return frontier(unique(points), x=lambda p: p.ms_per_token, y=lambda p: p.loss)


def unique(points: list[Point]) -> list[Point]:
    """The first point of each block set (methods often agree on one)."""
    first: dict[str, Point] = {}
    for point in points:
        first.setdefault(point.block_set, point)
    return list(first.values())


def recommend(points: list[Point], max_loss_increase: float | None, budget_ms: float | None) -> Point:
    """The fastest set whose loss increase is at most ``max_loss_increase``, or the lowest-loss set
    that decodes within ``budget_ms`` per token."""
    if budget_ms is not None:  # the lowest loss within the budget
        within, order = [p for p in points if p.ms_per_token <= budget_ms], lambda p: (p.loss, p.ms_per_token)
        nearest = min(points, key=lambda p: p.ms_per_token)
        miss = (
            f"no block set decodes within {budget_ms:g} ms/token; the fastest, {nearest.block_set}, "
            f"takes {nearest.ms_per_token:.2f} ms/token (loss {nearest.loss_increase:+.4f})"
        )
    else:  # the fastest within the loss bound
        within = [p for p in points if p.loss_increase <= max_loss_increase]
        order, nearest = lambda p: (p.ms_per_token, p.loss), min(points, key=lambda p: p.loss_increase)
        miss = (
            f"no block set stays within a loss increase of {max_loss_increase:g}; the least is "
            f"{nearest.block_set} at {nearest.loss_increase:+.4f}"
        )
    if not within:
        raise UserError(miss)
    return min(within, key=order)


def measure_points(
    meter: LossMeter, chosen: dict[str, list[BlockSet]], ms: dict[str, float]
) -> tuple[Point, dict[str, list[Point]]]:
    """``all`` and each method's choices as points: loss on ``meter``'s windows, ``ms`` per token."""
    L, base = meter.model.config.n_layer, meter(BlockSet())
    methods: dict[str, list[Point]] = {}
    for method, group in chosen.items():
        methods[method] = []
        for k, block_set in enumerate(group, start=1):
            loss = meter(block_set)
            if block_set.is_adaptive:
                k = round(L - meter.mean_blocks[str(block_set)], 3)
            methods[method].append(
                Point(method, k, str(block_set), loss, loss - base, ms.get(str(block_set)))
            )
    return Point("all", 0, "all", base, 0.0, ms.get("all")), methods


def make_plan(
    model: GPT,
    windows: list[list[int]],
    max_drop: int,
    *,
    max_loss_increase: float | None = None,
    budget_ms: float | None = None,
    latency: Callable[[list[BlockSet]], dict[str, float]] | None = None,
) -> dict:
    """Choose on the first half of ``windows``, measure on the second, time every distinct set with
    ``latency`` (default: ``decode_ms`` after the first 16 evaluation tokens); the report as a dict."""
    L = model.config.n_layer
    if not 1 <= max_drop < L:
        raise UserError(f"--max-drop {max_drop}: the model has {L} blocks, so drop 1..{L - 1}")
    if max_loss_increase is not None and budget_ms is not None:
        raise UserError("give --max-loss-increase or --budget-ms-per-token, not both")
    calibration, evaluation = split(windows)
    chosen, proxies = choose(model, LossMeter(model, calibration), max_drop)
    meter = LossMeter(model, evaluation)
    sets = {str(s): s for s in [BlockSet(), *(s for group in chosen.values() for s in group)]}
    if latency is None:
        prompt = evaluation[0][:16]
        latency = lambda block_sets: decode_ms(model, prompt, block_sets)  # noqa: E731
    all_point, methods = measure_points(meter, chosen, latency(list(sets.values())))
    points = [all_point, *(p for group in methods.values() for p in group)]
    timed = [p for p in points if p.ms_per_token is not None]
    if budget_ms is None and max_loss_increase is None:
        max_loss_increase = 0.1
    best = recommend(timed, max_loss_increase, budget_ms)
    proposed_by = defaultdict(list)
    for point in points:
        proposed_by[point.block_set].append(point.method)
    pruned = [p for m in PRUNING for p in methods[m]]
    excess = {
        m: [p.loss - min(q.loss for q in pruned if q.k == p.k) for p in methods[m]] for m in PRUNING
    }  # how much each method loses against the best any pruning method found at the same k
    return {
        "model_depth": L,
        "max_drop": max_drop,
        "calibration": {"windows": len(calibration), "tokens": sum(len(w) - 1 for w in calibration)},
        "evaluation": {"windows": len(evaluation), "tokens": meter.tokens},
        "all": asdict(all_point),
        "methods": {m: [asdict(p) for p in group] for m, group in methods.items()},
        "agreement": {**proxies, "excess_over_best": excess},
        "frontier": [{**asdict(p), "methods": proposed_by[p.block_set]} for p in cheapest(timed)],
        "recommended": {
            **asdict(best),
            "rule": f"fastest with loss increase <= {max_loss_increase:g}"
            if budget_ms is None
            else f"lowest loss within {budget_ms:g} ms/token",
        },
    }


# ---------------------------------------------------------------------------------------------------
# Output


def render(report: dict) -> str:
    from lab.analysis.common import table

    on_frontier = {p["block_set"] for p in report["frontier"]}
    rows = []
    for method, group in [("all", [report["all"]]), *report["methods"].items()]:
        for p in group:
            mark = "*" if p["block_set"] in on_frontier else ""
            rows.append(
                [
                    method,
                    p["k"],
                    p["block_set"],
                    p["loss"],
                    f"{p['loss_increase']:+.4f}",
                    p["ms_per_token"],
                    mark,
                ]
            )
    agreement, best = report["agreement"], report["recommended"]
    excess = ", ".join(f"{m} {max(v):+.4f}" for m, v in agreement["excess_over_best"].items())
    return "\n".join(
        [
            f"plan: {report['model']} ({report['model_depth']} blocks), {report['text']}",
            f"chosen on {report['calibration']['tokens']} tokens, measured on "
            f"{report['evaluation']['tokens']}; latency: {report['latency']}",
            "",
            table(["method", "k", "block set", "loss", "+loss", "ms/token", "frontier"], rows),
            "",
            "agreement with the measured single-skip cost (Spearman, calibration split): "
            + ", ".join(f"{m} {r:+.2f}" for m, r in agreement["spearman"].items()),
            f"worst excess over the best pruning at the same k (evaluation split): {excess}",
            f"recommended ({best['rule']}): {best['block_set']}, loss {best['loss']:.4f} "
            f"({best['loss_increase']:+.4f}), {best['ms_per_token']:.2f} ms/token",
            f"{report['seconds']:.0f} s; wrote {report['files']['json']}, {report['files']['png']}",
        ]
    )


def plot(report: dict, path: Path) -> None:
    from lab.analysis.common import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    methods = ["single", "bi", "angular", "greedy", "exit", "tuned", "adaptive"]
    markers = dict(zip(methods, "osD^v<P", strict=True))
    ax.scatter([report["all"]["ms_per_token"]], [0.0], marker="*", s=120, color="k", label="all", zorder=3)
    for method, group in report["methods"].items():
        timed = [p for p in group if p["ms_per_token"] is not None]
        ax.scatter([p["ms_per_token"] for p in timed], [p["loss_increase"] for p in timed],
                   marker=markers[method], label=method, alpha=0.8, zorder=3)  # fmt: skip
    front = report["frontier"]
    ax.step([p["ms_per_token"] for p in front], [p["loss_increase"] for p in front], where="post",
            color="tab:gray", lw=1, label="frontier (nothing faster is better)")  # fmt: skip
    best = report["recommended"]
    ax.annotate(f"recommended: {best['block_set']}", (best["ms_per_token"], best["loss_increase"]),
                textcoords="offset points", xytext=(6, 8), fontsize=8)  # fmt: skip
    ax.set_xlabel(f"batch-1 ms per token ({report['latency']})")
    ax.set_ylabel("loss increase over all blocks (nats/token, evaluation split)")
    ax.set_title(f"plan: {report['model']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass
class PlanOptions:
    """``blocklab plan``'s flags."""

    model: str = "builtin"
    """builtin | gpt2 | gpt2-random | HF id or dir | ckpt.pt"""
    dtype: str = "float32"
    """Weights as served (lab.quantize): float32, bfloat16, float16, int8, int4, w8a8, w4a8."""
    prompts: Path | None = None
    """A text file (windowed whole) or .jsonl with a prompt field (default: held-out stdlib source)."""
    tokens: PositiveInt = 20_000
    """Tokens of text to use, both splits."""
    window: PositiveInt = 256
    """Tokens per window, at most the context."""
    max_drop: int = 4
    """K: plan for 1..K blocks dropped."""
    max_loss_increase: float | None = None
    """Recommend the fastest set within this loss increase, nats (default: 0.1)."""
    budget_ms_per_token: float | None = None
    """Recommend the lowest-loss set within this batch-1 ms per token."""
    url: str | None = None
    """Time through this running server's /predict (loopback) instead of in-process."""
    out: Path = field(default_factory=lambda: Path("runs") / "plan")
    """Directory for plan.json and plan.png."""
    threads: PositiveInt | None = None
    """Torch CPU threads (default: torch's)."""
    json: bool = False
    """Print the plan as JSON instead of tables."""

    def __post_init__(self) -> None:
        from lab.quantize import WEIGHT_DTYPES

        if self.dtype not in WEIGHT_DTYPES:
            raise UserError(f"--dtype: one of {', '.join(WEIGHT_DTYPES)}, got {self.dtype!r}")
        if self.tokens < 2 or self.window < 1:
            raise UserError(f"--tokens must be >= 2 and --window >= 1, got {self.tokens} and {self.window}")
        if self.url is not None:
            check_loopback(self.url)


def main(argv: list[str]) -> int:
    """``blocklab plan ...``; a user error (``UserError``, a missing file) is one line and status 2,
    printed by ``lab.cli``."""
    options = parse(PlanOptions, argv[1:], prog="blocklab plan", description=__doc__.split("\n\n")[0])
    report = run(options)
    print(json.dumps(report, indent=2) if options.json else render(report))
    return 0


def run(options: PlanOptions) -> dict:
    from lab import tokens
    from lab.weights import load_model

    started = time.perf_counter()
    if options.threads:
        torch.set_num_threads(options.threads)
    model = load_model(options.model, options.dtype).eval()
    windows, text = read_windows(model, options.prompts, options.tokens, options.window)
    latency = None
    if options.url is not None:
        prompt = tokens.decode(split(windows)[1][0][:16])
        latency = lambda block_sets: served_ms(options.url, model, prompt, block_sets)  # noqa: E731
    report = make_plan(
        model,
        windows,
        options.max_drop,
        max_loss_increase=options.max_loss_increase,
        budget_ms=options.budget_ms_per_token,
        latency=latency,
    )
    options.out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(options.out / "plan.json"), "png": str(options.out / "plan.png")}
    where = (
        f"served by {options.url}" if options.url else f"in-process, torch threads: {torch.get_num_threads()}"
    )
    report = {"model": options.model, "text": text, "latency": where, **report, "files": files}
    report["seconds"] = round(time.perf_counter() - started, 1)
    Path(files["json"]).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(files["png"]))
    return report
