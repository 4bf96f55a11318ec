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
    adaptive  with the model's exit probe, a few thresholds (adaptive=T;check=probe), where k is the
              mean number of blocks a token did not run

The methods choose on a calibration split of the text; every reported loss is measured on the
evaluation split, so a plan does not grade its own homework. Losses are mean next-token losses
over the evaluation windows (token-weighted; per window what ``lab.generate.score`` gives). Latency
is batch-1 decoding, ms per new token, measured in-process (``lab.generate.generate``) or through a
running server's ``/predict`` (``--url``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn.functional as F

from lab.blocks import BlockSet
from lab.errors import UserError
from lab.generate import generate, score
from lab.hooks import capture
from lab.model import GPT

PRUNING = ("single", "bi", "angular", "greedy")
"""The methods that choose which blocks to skip (the others are depth rules)."""
ADAPTIVE_THRESHOLDS = (0.7, 0.8, 0.9, 0.95)
BATCH_TOKENS = 512
"""Positions per batched forward pass. Small, so that one batch's logits (positions x V floats) come
back from the allocator's free memory instead of being mapped afresh from the OS every batch, which
spent as much system time as the work itself."""
CACHE_BYTES = 2**30
"""Most memory ``LossMeter`` keeps the full stack's stream in (the input of every block, every token)."""


# ---------------------------------------------------------------------------------------------------
# Text: windows of tokens, split into calibration and evaluation


def windows_of(ids: list[int], window: int) -> list[list[int]]:
    """Cut ``ids`` into windows of ``window`` + 1 tokens overlapping by one, so each token after the
    first is predicted exactly once; the last window may be shorter (at least 2 tokens)."""
    return [ids[start : start + window + 1] for start in range(0, max(len(ids) - 1, 0), window)]


def read_windows(
    model: GPT, prompts: Path | None, max_tokens: int, window: int
) -> tuple[list[list[int]], str]:
    """Windows of at most ``max_tokens`` GPT-2 tokens in all, and where the text came from.

    ``prompts``: a ``.jsonl`` file (a ``prompt`` field or a string per line, each prompt windowed on its
    own) or any other UTF-8 text file, windowed whole. None: the standard-library source the builtin
    model never trained on (``lab.corpora.held_out_stdlib_files``), as ``ablate`` and ``bus`` read.
    """
    from lab import tokens
    from lab.analysis.common import held_out_source

    if model.config.vocab_size < tokens.VOCAB_SIZE:
        raise UserError(
            f"the text is GPT-2 tokens and this model's vocabulary has {model.config.vocab_size} rows"
        )
    window = min(window, model.config.block_size)
    if prompts is None:
        text, names = held_out_source(8 * max_tokens + 1024)  # ~4 characters a token: enough text
        names = names.split(", ")
        texts, source = [text], f"held-out standard-library source ({names[0]} .. {names[-1]})"
    elif prompts.suffix == ".jsonl":
        texts, source = [], str(prompts)
        for number, line in enumerate(prompts.read_text(encoding="utf-8").splitlines(), start=1):
            record = json.loads(line) if line.strip() else ""
            text = record.get("prompt") if isinstance(record, dict) else record
            if not isinstance(text, str):
                raise UserError(f"{prompts}:{number}: expected a string or an object with a prompt field")
            texts.append(text)
    else:
        texts, source = [prompts.read_text(encoding="utf-8")], str(prompts)
    windows, total = [], 0
    for text in texts:
        for piece in windows_of(tokens.encode(text, allow_endoftext=True), window):
            piece = piece[: max_tokens - total + 1]  # the +1: a window's first token is not predicted
            if len(piece) >= 2:
                windows.append(piece)
                total += len(piece) - 1
        if total >= max_tokens:
            break
    if total == 0:
        raise UserError(f"{source}: no text in it")
    if len(windows) < 2:
        raise UserError(
            f"{source}: {total} tokens to predict in {len(windows)} window(s); a plan needs at least two "
            "windows (one to choose on, one to measure on)"
        )
    return windows, f"{source}, {total} tokens"


def split(
    windows: list[list[int]], calibration_share: float = 0.5
) -> tuple[list[list[int]], list[list[int]]]:
    """The first ``calibration_share`` of the windows to choose on, the rest to measure on: contiguous
    parts, so the two share at most the file (or prompt) that the cut falls in."""
    cut = min(max(1, round(len(windows) * calibration_share)), len(windows) - 1)
    return windows[:cut], windows[cut:]


def batches(windows: list[list[int]], device: torch.device) -> Iterator[torch.Tensor]:
    """Windows of equal length stacked, at most ``BATCH_TOKENS`` positions a batch. [B, T+1] each."""
    by_length: dict[int, list[list[int]]] = defaultdict(list)
    for w in windows:
        by_length[len(w)].append(w)
    for length, group in by_length.items():
        rows = max(1, BATCH_TOKENS // length)
        for start in range(0, len(group), rows):
            yield torch.tensor(group[start : start + rows], device=device)  # [B, T+1]


# ---------------------------------------------------------------------------------------------------
# Loss under a block set


class LossMeter:
    """Mean next-token loss of a set of windows under any block set, each set measured once.

    Fixed sets run batched. The stream entering every block under all blocks is kept (within
    ``CACHE_BYTES``), so a set starts at its first skipped block or its exit: the blocks before it
    would compute the same stream again. Adaptive sets decide per token, so they run window by window
    through ``lab.generate.score``. The read-out uses the token table's distinct rows, each counted as
    often as it repeats: exact, and for a model whose never-seen tokens share one row (the builtin
    model: ~31k of 50257) it skips most of the unembedding, the bulk of a narrow model's work.
    """

    def __init__(self, model: GPT, windows: list[list[int]]):
        self.model, self.windows = model, windows
        self.tokens = sum(len(w) - 1 for w in windows)
        self.batches = list(batches(windows, model.wte.weight.device))  # [B, T+1] each
        self.measured: dict[str, float] = {}
        self.mean_blocks: dict[str, float] = {}
        """Blocks run per predicted token, per measured set (varies only under adaptive exit)."""
        self.table = None
        if model.read_out is None:  # a quantized read-out (lab.quantize) has no rows to compare
            weight = model.wte.weight.detach()  # [V, D]
            bias = model.logit_bias if model.logit_bias is not None else weight.new_zeros(len(weight))  # [V]
            rows, self.row_of, counts = torch.unique(
                torch.cat([weight, bias[:, None]], dim=1), dim=0, return_inverse=True, return_counts=True
            )  # [U, D + 1]: a row and its bias, [V] token -> its row, [U]
            self.table, self.table_bias = rows[:, :-1], rows[:, -1]  # [U, D], [U]
            self.repeated = (counts > 1).nonzero()[:, 0]  # [R] rows that stand for several tokens
            self.log_repeats = counts[self.repeated].float().log()  # [R]
        cfg, weight = model.config, model.wte.weight
        size = self.tokens * cfg.n_embd * (cfg.n_layer + 1) * weight.element_size()
        self.cached = None
        if size <= CACHE_BYTES:
            self.cached = list(self.streams())

    def streams(self) -> Iterator[list[torch.Tensor]]:
        """Per batch, the stream entering each block under all blocks, then leaving the last.
        L+1 x [B, T, D]"""
        if self.cached is not None:
            yield from self.cached
            return
        L = self.model.config.n_layer
        names = [f"blocks.{i}.resid_pre" for i in range(L)] + [f"blocks.{L - 1}.resid_post"]
        for idx in self.batches:
            with torch.inference_mode(), capture(self.model, names) as seen:
                self.model.residual_stream(idx[:, :-1])
            yield [seen[name] for name in names]

    def __call__(self, block_set: BlockSet) -> float:
        spec = str(block_set)
        if spec not in self.measured:
            if block_set.is_adaptive:
                scores = [score(self.model, w, block_set) for w in self.windows]
                total = sum(s.mean_loss * len(s.token_losses) for s in scores)
                ran = sum(sum(s.blocks_per_token) for s in scores)
            else:
                total = self._fixed_total(block_set)
                ran = len(block_set.blocks_to_run(self.model.config.n_layer)) * self.tokens
            self.measured[spec] = total / self.tokens
            self.mean_blocks[spec] = ran / self.tokens
        return self.measured[spec]

    @torch.inference_mode()
    def _fixed_total(self, block_set: BlockSet) -> float:
        model, L = self.model, self.model.config.n_layer
        top = L if block_set.exit_at is None else block_set.exit_at
        first = min([*block_set.skip, *block_set.overwrite, top])  # the first block that differs
        total = 0.0
        for b, idx in enumerate(self.batches):
            if self.cached is None:
                x = model.residual_stream(idx[:, :-1], block_set=block_set)  # [B, T, D]
            else:
                x = self.cached[b][first]  # [B, T, D]
                for i in [i for i in block_set.blocks_to_run(L) if i >= first]:
                    x = model.blocks[i](x, overwrite=i in block_set.overwrite)
            total += float(self.token_losses(x, idx[:, 1:]).double().sum())
        return total

    def token_losses(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Cross-entropy of ``targets`` [B, T] under the read-out of stream ``x`` [B, T, D]. [B, T]"""
        if self.table is None:
            logits = self.model.unembed(x).float()  # [B, T, V]
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
        logits = F.linear(self.model.ln_f(x), self.table, self.table_bias).float()  # [B, T, U]
        target = logits.gather(-1, self.row_of[targets][..., None])[..., 0]  # [B, T]
        logits[..., self.repeated] += self.log_repeats  # a row counts once per token it stands for
        return torch.logsumexp(logits, dim=-1) - target


# ---------------------------------------------------------------------------------------------------
# Proxies: how far each block (or run of blocks) turns the stream


def stream_angles(meter: LossMeter, max_span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over tokens of cos(x_l, x_l+k) and of arccos(cos(x_l, x_l+k)) / pi, for every start l and
    span k <= ``max_span`` (x_l: the stream entering block l; x_L: leaving the last), on ``meter``'s
    windows. [L, K+1] each, NaN where l + k > L; column 0 unused."""
    L = meter.model.config.n_layer
    cos_sum = torch.zeros(L, max_span + 1, dtype=torch.float64)
    angle_sum = torch.zeros_like(cos_sum)
    for streams in meter.streams():
        stream = [x.flatten(0, 1).double() for x in streams]  # L+1 x [N, D]
        for start in range(L):
            for k in range(1, min(max_span, L - start) + 1):
                cos = F.cosine_similarity(stream[start], stream[start + k], dim=-1).clamp(-1.0, 1.0)  # [N]
                cos_sum[start, k] += cos.sum()
                angle_sum[start, k] += (torch.arccos(cos) / math.pi).sum()
    valid = torch.tensor([[1 <= k <= L - start for k in range(max_span + 1)] for start in range(L)])
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    count = meter.tokens
    return torch.where(valid, cos_sum / count, nan), torch.where(valid, angle_sum / count, nan)


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


def check_loopback(url: str) -> None:
    """``--url`` is a load generator's target: loopback only."""
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise UserError(f"--url: {host or url!r} is not a loopback address")


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


def frontier(points: list[Point]) -> list[Point]:
    """The points nothing faster beats on loss, fastest first (one per block set)."""
    best, kept = math.inf, []
    for point in sorted(unique(points), key=lambda p: (p.ms_per_token, p.loss)):
        if point.loss < best:
            kept.append(point)
            best = point.loss
    return kept


def unique(points: list[Point]) -> list[Point]:
    """The first point of each block set (methods often agree on one)."""
    first: dict[str, Point] = {}
    for point in points:
        first.setdefault(point.block_set, point)
    return list(first.values())


def recommend(points: list[Point], max_loss_increase: float | None, budget_ms: float | None) -> Point:
    """The fastest set whose loss increase is at most ``max_loss_increase``, or the lowest-loss set
    that decodes within ``budget_ms`` per token."""
    if budget_ms is not None:
        within = [p for p in points if p.ms_per_token <= budget_ms]
        if not within:
            fastest = min(points, key=lambda p: p.ms_per_token)
            raise UserError(
                f"no block set decodes within {budget_ms:g} ms/token; the fastest, {fastest.block_set}, "
                f"takes {fastest.ms_per_token:.2f} ms/token (loss {fastest.loss_increase:+.4f})"
            )
        return min(within, key=lambda p: (p.loss, p.ms_per_token))
    within = [p for p in points if p.loss_increase <= max_loss_increase]
    if not within:
        lowest = min(points, key=lambda p: p.loss_increase)
        raise UserError(
            f"no block set stays within a loss increase of {max_loss_increase:g}; the least is "
            f"{lowest.block_set} at {lowest.loss_increase:+.4f}"
        )
    return min(within, key=lambda p: (p.ms_per_token, p.loss))


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
    ms = latency(list(sets.values()))
    base = meter(BlockSet())
    all_point = Point("all", 0, "all", base, 0.0, ms.get("all"))
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
        "frontier": [{**asdict(p), "methods": proposed_by[p.block_set]} for p in frontier(timed)],
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
    markers = dict(zip(["single", "bi", "angular", "greedy", "exit", "adaptive"], "osD^vP", strict=True))
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


def _parser() -> argparse.ArgumentParser:
    from lab.quantize import WEIGHT_DTYPES

    p = argparse.ArgumentParser(prog="blocklab plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin", help="builtin | gpt2 | gpt2-random | HF id or dir | ckpt.pt")
    p.add_argument(
        "--dtype", choices=WEIGHT_DTYPES, default="float32", help="weights as served (lab.quantize)"
    )
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="text file (windowed whole) or .jsonl with a prompt field (default: held-out stdlib source)",
    )
    p.add_argument(
        "--tokens", type=int, default=20_000, help="tokens of text to use, both splits (default: %(default)s)"
    )
    p.add_argument(
        "--window",
        type=int,
        default=256,
        help="tokens per window, at most the context (default: %(default)s)",
    )
    p.add_argument(
        "--max-drop", type=int, default=4, help="K: plan for 1..K blocks dropped (default: %(default)s)"
    )
    bound = p.add_mutually_exclusive_group()
    bound.add_argument(
        "--max-loss-increase",
        type=float,
        default=None,
        help="recommend the fastest set within this loss increase, nats (default: 0.1)",
    )
    bound.add_argument(
        "--budget-ms-per-token",
        type=float,
        default=None,
        help="recommend the lowest-loss set within this batch-1 ms per token",
    )
    p.add_argument("--url", default=None, help="time through this running server's /predict (loopback)")
    p.add_argument("--out", type=Path, default=Path("runs") / "plan", help="for plan.json and plan.png")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of tables")
    return p


def main(argv: list[str]) -> int:
    """``blocklab plan ...``; a user error (``UserError``, a missing file) is one line and status 2,
    printed by ``lab.cli``."""
    args = _parser().parse_args(argv[1:])
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def run(args: argparse.Namespace) -> dict:
    from lab import tokens
    from lab.weights import load_model

    started = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tokens < 2 or args.window < 1:
        raise UserError(f"--tokens must be >= 2 and --window >= 1, got {args.tokens} and {args.window}")
    if args.url is not None:
        check_loopback(args.url)
    model = load_model(args.model, args.dtype).eval()
    windows, text = read_windows(model, args.prompts, args.tokens, args.window)
    latency = None
    if args.url is not None:
        prompt = tokens.decode(split(windows)[1][0][:16])
        latency = lambda block_sets: served_ms(args.url, model, prompt, block_sets)  # noqa: E731
    report = make_plan(
        model,
        windows,
        args.max_drop,
        max_loss_increase=args.max_loss_increase,
        budget_ms=args.budget_ms_per_token,
        latency=latency,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    files = {"json": str(args.out / "plan.json"), "png": str(args.out / "plan.png")}
    threads = torch.get_num_threads()
    where = f"served by {args.url}" if args.url else f"in-process, torch threads: {threads}"
    report = {"model": args.model, "text": text, "latency": where, **report, "files": files}
    report["seconds"] = round(time.perf_counter() - started, 1)
    Path(files["json"]).write_text(json.dumps(report, indent=2) + "\n")
    plot(report, Path(files["png"]))
    return report
