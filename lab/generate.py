"""Generation and scoring under a block set: one sequence's rules, and the loop that runs it alone.

    for step in generate(model, tokens.encode("def main("), 40, SamplingParams(temperature=0.8, seed=1),
                         block_set=BlockSet.parse("skip=5", 12), eos_token=tokens.EOT):
        print(step.text, step.blocks_run)
    score(model, tokens.encode(text)).mean_loss  # nats per token

A ``Generation`` is one sequence being generated: its decoder (``lab.decode``; under ``speculate=E``
a ``lab.speculate.Speculator``), its sampler (``lab.sampling``) and its stopping rules: end-of-text
(unless ``ignore_eos``) and stop strings (neither before ``min_tokens``, as in vLLM),
``max_new_tokens``, the context, a deadline. ``generate`` runs one alone: the prompt in one pass,
then a step (``decode_rows`` with one row) or a speculation round at a time. The server's engine
(``serve.engine``) runs many: it prefills them in chunks and takes the decode steps of all its rows
in one ``decode_rows`` call, then hands each row's logits to its ``Generation.pick``; the rules are
the same code.

``score`` under adaptive exit decides for every position, with the same arithmetic as decoding:
block by block over all positions, an exited position's stream frozen at its exit state (so the
deeper blocks' keys and values come from that state, as in propagation).
"""

from __future__ import annotations

import codecs
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from jsonargparse.typing import PositiveInt

from lab import fast, tokens
from lab.blocks import BlockSet
from lab.decode import Decoder, decode_rows, exit_score, require_exit_probe
from lab.errors import UserError
from lab.lens.translator import exit_translator, require_tuned_lens, translate_exits
from lab.machine import Device, device_named
from lab.model import GPT
from lab.quantize import WeightDtype
from lab.sampling import (
    GREEDY,
    FinishReason,
    SamplingError,
    SamplingParams,
    pick_token,
    seeded_generator,
    token_logprob,
)
from lab.speculate import SpeculationStats, Speculator
from lab.threads import ThreadTuner
from lab.weights import load_model


@dataclass
class Step:
    """One generated token, the blocks that ran to produce it, and why generation stopped (last step)."""

    token: int
    blocks_run: list[int]
    logprob: float
    """Log-probability (nats) of ``token`` under the model's (unscaled, full-vocabulary) distribution."""
    text: str = ""
    """The text this token releases, when the generation detokenizes: what it completes (empty
    mid-character), less any end that may begin a stop string (released by a later step, or never if
    the stop string comes); the steps' texts join to the generation's ``text`` (less a character, or
    a held end, still open when end-of-text comes, which has no step)."""
    finish_reason: FinishReason | None = None
    """On the last step only. A generation that ends on end-of-text has no step for it."""


@dataclass
class Score:
    """Next-token loss of a text under a block set."""

    mean_loss: float
    token_losses: list[float]  # nats, for tokens 1..n-1 given the ones before
    blocks_run: list[int]
    """The blocks a token may run: all of them for fixed sets, the deepest possible for adaptive exit."""
    blocks_per_token: list[int]
    """How many blocks ran for each predicted position (differs per position under adaptive exit)."""

    @property
    def mean_blocks(self) -> float:
        return sum(self.blocks_per_token) / len(self.blocks_per_token)


def mean_blocks(steps: list[Step]) -> float:
    """Mean number of blocks run per generated token."""
    return sum(len(step.blocks_run) for step in steps) / len(steps) if steps else 0.0


def check_sampling(sampling: SamplingParams, block_set: BlockSet) -> None:
    """SamplingError unless ``sampling`` can be used under ``block_set``."""
    refused = block_set.cannot_serve("min_tokens") if sampling.min_tokens > 0 else None
    if refused is not None:
        raise SamplingError("min_tokens", refused)


class StopStrings:
    """Where stop strings appear in a text fed a piece at a time: one Knuth-Morris-Pratt automaton
    per string, so each character costs the same whatever the strings' lengths (comparing every
    prefix of every string at each token grew with their squares: docs/serving.md)."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.failure = [self._failure(stop) for stop in stops]
        self.matched = [0] * len(stops)  # per string: the longest prefix of it the text ends with
        self.length = 0  # characters fed

    @staticmethod
    def _failure(stop: str) -> list[int]:
        """Per prefix stop[: i + 1], the length of its longest proper prefix that is also its suffix."""
        failure, k = [0] * len(stop), 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = failure[k - 1]
            k += stop[i] == stop[k]
            failure[i] = k
        return failure

    def feed(self, piece: str) -> tuple[int, str] | None:
        """Take the next piece of text; where the first stop string to appear in it begins (an index
        into the whole text) and that string, or None."""
        starts = []
        for j, (stop, failure) in enumerate(zip(self.stops, self.failure, strict=True)):
            k = self.matched[j]
            for i, char in enumerate(piece):
                while k and char != stop[k]:
                    k = failure[k - 1]
                k += char == stop[k]
                if k == len(stop):
                    starts.append((self.length + i + 1 - k, stop))
                    k = failure[k - 1]
            self.matched[j] = k
        self.length += len(piece)
        return min(starts, default=None)

    @property
    def held(self) -> int:
        """Characters at the end of the text that begin a stop string (and may yet complete it)."""
        return max(self.matched, default=0)


class Generation:
    """One sequence being generated after ``prompt``: see the module docstring.

    ``eos_token``: the vocabulary's end-of-text token (None: it has none; generation then ends only at
    its length). ``deadline``: ``time.monotonic()`` past which it must not go on. ``detokenize``: decode
    each token's text as it comes (``Step.text``; stop strings need it). Iterating it runs it alone
    (what ``generate`` returns); the engine instead calls ``extend``, ``pick`` and ``speculate``.
    """

    def __init__(
        self,
        model: GPT,
        prompt: list[int],
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
        block_set: BlockSet | None = None,
        *,
        eos_token: int | None = None,
        deadline: float = math.inf,
        detokenize: bool = False,
        speculation: SpeculationStats | None = None,
    ):
        cfg = model.config
        if not prompt:
            raise UserError("prompt: needs at least one token")
        if len(prompt) > cfg.block_size:
            raise UserError(f"prompt: {len(prompt)} tokens exceed the context length {cfg.block_size}")
        block_set = (block_set or BlockSet()).validate(cfg.n_layer)
        check_sampling(sampling, block_set)
        self.model, self.prompt, self.sampling, self.deadline = model, prompt, sampling, deadline
        self.eos_token = None if sampling.ignore_eos else eos_token
        self.budget = max(0, min(max_new_tokens, cfg.block_size - len(prompt)))
        if block_set.is_speculative:
            self.speculator: Speculator | None = Speculator(model, block_set, len(prompt) + self.budget)
            self.speculator.stats = speculation if speculation is not None else self.speculator.stats
            self.decoder = self.speculator.decoder
        else:
            self.speculator = None
            self.decoder = Decoder(model, block_set, max_len=len(prompt) + self.budget)
        self.generator = seeded_generator(sampling, model.wte.weight.device)
        self.tokens: list[int] = []
        self.last_token: int | None = None
        """The token to feed at the next step, once the prompt is in."""
        self.finish_reason: FinishReason | None = None
        if self.budget == 0:
            self.finish_reason = "scored" if max_new_tokens == 0 else "length"
        self.detokenize = detokenize or bool(sampling.stop)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._released = 0  # characters of _text the steps have released
        self._stopped_at: int | None = None  # where a stop string begins in _text, once one appears
        self.stop_reason: str | None = None
        """The stop string that ended it (None: it ended otherwise, or runs on), vLLM's field."""
        self._stops = StopStrings(sampling.stop) if sampling.stop else None
        self._run: Iterator[Step] | None = None  # running alone (iterated)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def speculation(self) -> SpeculationStats | None:
        return None if self.speculator is None else self.speculator.stats

    @property
    def text(self) -> str:
        """What was generated, ending before a stop string if one appeared."""
        return tokens.decode(self.tokens) if self._stopped_at is None else self._text[: self._stopped_at]

    def overdue(self, now: float) -> bool:
        return now > self.deadline

    def extend(self, chunk: list[int]) -> torch.Tensor:
        """Feed the prompt, or its next chunk; the stream [t, D] leaving the set's blocks."""
        return self.decoder.extend(chunk)

    def pick(self, logits: torch.Tensor, blocks_run: list[int]) -> Step | None:
        """Draw the next token from logits [V] (the read-out after the last token fed) and record it;
        its step (None: end-of-text ended the generation)."""
        logits = logits.float()
        allowed = logits
        if self.eos_token is not None and len(self.tokens) < self.sampling.min_tokens:
            allowed = logits.clone()
            allowed[self.eos_token] = float("-inf")
        token = pick_token(allowed, self.sampling, self.generator)
        return self.record(token, token_logprob(logits, token), blocks_run)

    def record(self, token: int, logprob: float, blocks_run: list[int]) -> Step | None:
        """Take ``token`` as the next one and apply the stopping rules; its step (None: end-of-text)."""
        if token == self.eos_token:
            self.finish_reason = "stop"
            return None
        self.tokens.append(token)
        self.last_token = token
        if len(self.tokens) == self.budget:
            self.finish_reason = "length"
        text = self._release(token) if self.detokenize else ""  # a stop string: finish_reason "stop"
        return Step(token, blocks_run, logprob, text, self.finish_reason)

    def _release(self, token: int) -> str:
        """Add the text ``token`` completes (noting where a stop string appears first); what it
        releases: up to the stop string once one appears, everything at the last step, else all but
        the longest end that begins a stop string (the next tokens may complete it)."""
        piece = self._utf8.decode(tokens.decode_token_bytes(token))
        self._text += piece
        end = len(self._text)
        if self._stops is not None:
            found = self._stops.feed(piece)
            if found is not None and len(self.tokens) >= self.sampling.min_tokens:  # vLLM's rule
                (self._stopped_at, self.stop_reason), end = found, found[0]
                self.finish_reason = "stop"
            elif self.finish_reason is None:
                end -= self._stops.held
        released, self._released = self._text[self._released : end], max(self._released, end)
        return released

    def step(self) -> list[Step]:
        """One decode step alone (``decode_rows`` with one row), or a speculation round."""
        if self.speculator is not None:
            return self.speculate()
        logits, blocks_run = decode_rows(self.model, [self.decoder], [self.last_token])
        step = self.pick(logits[0], blocks_run[0])
        return [] if step is None else [step]

    def speculate(self) -> list[Step]:
        """One round of self-speculative decoding: 1 to k + 1 tokens, up to the generation's end."""
        wanted = self.budget - len(self.tokens)
        steps = []
        for token, logprob in self.speculator.round(self.last_token, wanted, self.sampling, self.generator):
            step = self.record(token, logprob, self.decoder.blocks)
            steps += [] if step is None else [step]
            if self.finished:
                break
        return steps

    def __iter__(self) -> Generation:
        return self

    def __next__(self) -> Step:
        """Run alone: the prompt in one pass, then a step at a time; the next step."""
        if self._run is None:
            self._run = self._alone()
        return next(self._run)

    def _alone(self) -> Iterator[Step]:
        if self.finished:
            return
        self._check_deadline()
        step = self.pick(self.decoder.prefill(self.prompt), self.decoder.blocks)
        steps = [] if step is None else [step]
        while True:
            yield from steps
            if self.finished:
                return
            self._check_deadline()
            steps = self.step()

    def _check_deadline(self) -> None:
        if self.overdue(time.monotonic()):
            raise TimeoutError(f"deadline passed after {len(self.tokens)} new tokens")


generate = Generation
"""``generate(model, prompt, max_new_tokens, sampling, block_set=..., eos_token=...)``: tokens one at a
time after ``prompt``, a ``Generation`` to iterate for its ``Step``s (afterwards it holds ``tokens``,
``text``, ``finish_reason``). It stops at ``eos_token``, ``max_new_tokens``, the context or a stop
string of ``sampling``; under a speculating block set tokens come a round at a time, counted in
``speculation`` when given."""


@torch.inference_mode()
def adaptive_forward(
    model: GPT, idx: torch.Tensor, block_set: BlockSet, n_full: int = 0
) -> tuple[torch.Tensor, list[list[int]]]:
    """Logits [B, T, V] under adaptive exit for all positions at once, and the blocks each position ran.

    The same arithmetic as decoding token by token (``Decoder``), block by block over all positions:
    an exited position's stream stays at its exit state, so deeper blocks compute its keys and values
    from that state. Positions before ``n_full`` (a prompt) run every block. Batch size 1.
    """
    B, T = idx.shape
    if B != 1:
        raise ValueError(f"adaptive_forward: batch size 1 only, got {B}")
    block_set = block_set.validate(model.config.n_layer)
    require_exit_probe(model, block_set)
    lens = require_tuned_lens(model, block_set)
    blocks = block_set.blocks_to_run(model.config.n_layer)
    x = model.embed_tokens(idx)  # [1, T, D]
    active = torch.ones(T, dtype=torch.bool, device=idx.device)  # [T] still going deeper
    may_exit = torch.arange(T, device=idx.device) >= n_full  # [T]
    depth = torch.zeros(T, dtype=torch.long)  # [T] blocks run so far
    first = max(block_set.adaptive_min_blocks, 1)  # the first check comes after this many blocks
    cosine = block_set.adaptive_check == "cosine"  # only the cosine compares consecutive reads
    read_before = model.ln_f(x) if cosine and first == 1 else None  # [1, T, D]
    ran = 0

    def check(i: int, x: torch.Tensor) -> None:
        nonlocal ran, read_before
        ran += 1
        depth.add_(active.cpu())
        if first <= ran < len(blocks):
            read_now = model.ln_f(x)  # [1, T, D]
            stable = exit_score(model, block_set, i, read_now, read_before)[0] >= block_set.adaptive_threshold
            active.logical_and_(~(stable & may_exit))  # exited positions keep their exit state
            read_before = read_now
        elif cosine and ran == first - 1:
            read_before = model.ln_f(x)  # [1, T, D]: the read entering the first checked block

    keep = lambda i: active[None, :, None]  # [1, T, 1]
    x = model.run_blocks(x, blocks, overwrite=block_set.overwrite, keep=keep, after=check)  # [1, T, D]
    per_position = [blocks[:d] for d in depth.tolist()]
    exits = [exit_translator(lens, blocks_ran) for blocks_ran in per_position]  # lens=tuned: each its own
    return model.unembed(translate_exits(lens, x[0], exits)[None]), per_position


@torch.inference_mode()
def score(model: GPT, ids: list[int], block_set: BlockSet | None = None) -> Score:
    """Mean next-token loss (nats) of token ids ``ids`` under ``block_set``, with the loss of each token."""
    cfg = model.config
    block_set = (block_set or BlockSet()).validate(cfg.n_layer)
    if not 2 <= len(ids) <= cfg.block_size + 1:
        raise UserError(f"tokens: need 2..{cfg.block_size + 1} tokens to score, got {len(ids)}")
    idx = torch.tensor([ids], device=model.wte.weight.device)  # [1, T+1]
    blocks = block_set.blocks_to_run(cfg.n_layer)
    if block_set.is_adaptive:
        logits, per_token = adaptive_forward(model, idx[:, :-1], block_set)
    else:
        lens = require_tuned_lens(model, block_set)
        x = model.residual_stream(idx[:, :-1], block_set=block_set)  # [1, T, D]
        logits = model.unembed(translate_exits(lens, x, [exit_translator(lens, blocks)]))  # [1, T, V]
        per_token = [blocks] * (len(ids) - 1)
    blocks_per_token = [len(ran) for ran in per_token]
    losses = F.cross_entropy(logits[0].float(), idx[0, 1:], reduction="none")  # [T]
    return Score(
        mean_loss=float(losses.mean()),
        token_losses=losses.tolist(),
        blocks_run=blocks,
        blocks_per_token=blocks_per_token,
    )


# ---------------------------------------------------------------------------------------------------
# blocklab generate / blocklab score


@dataclass
class ScoreCommand:
    """``blocklab score``: mean next-token loss of a text, under a block set."""

    model: str = "builtin"
    """builtin | gpt2-random | Hugging Face id or dir | checkpoint file (lab.weights)."""
    prompt: str | None = None
    """The text (for generate: the prompt); or --file."""
    file: str | None = None
    """Read the text from this UTF-8 file ('-': stdin)."""
    blocks: str = "all"
    """Block set spec, e.g. skip=3,4 | exit=6 | adaptive=0.9;min=4 (lab.blocks)."""
    dtype: WeightDtype = "float32"
    """Weights: float32 | bfloat16 | float16; int8 | int4 weight-only quantized; or w4a8 | w8a8, int4 or
    int8 weights times int8 activations (lab.quantize; CPU only)."""
    device: Device = "auto"
    """auto (a CUDA device where torch sees one, else the CPU) | cpu | cuda. int8, int4, w4a8 and w8a8
    run on the CPU: with them auto is the CPU."""
    threads: PositiveInt | None = None
    """torch CPU threads, fixed (default: one per core other processes leave free, chosen again every
    few seconds; lab.threads)."""
    json: bool = False
    """Print one JSON object instead of text."""


@dataclass
class GenerateCommand(ScoreCommand):
    """``blocklab generate``: text after a prompt, under a block set."""

    max_new_tokens: PositiveInt = 64
    """Tokens to generate at most (fewer at end-of-text or the context's end)."""
    temperature: float = 0.0
    """0: greedy."""
    top_k: int | None = None
    """Draw from the k most likely tokens only."""
    seed: int | None = None
    """Seed of the draws (default: a fresh random one)."""
    compile: bool = False
    """Decode through lab.fast's static-shape step: inductor's code on the CPU, CUDA graphs on a GPU.
    A block set's first run compiles it (slow; kept on disk, so later runs load it)."""


def _read_text(args: ScoreCommand) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.file == "-":
        return sys.stdin.read()
    with open(args.file, encoding="utf-8") as f:
        return f.read()


def _run_generate(
    model: GPT, block_set: BlockSet, args: GenerateCommand, text: str, tuner: ThreadTuner | None
) -> dict:
    prompt = tokens.encode(text, allow_endoftext=True)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    generation = generate(
        model, prompt, args.max_new_tokens, sampling, block_set=block_set, eos_token=tokens.EOT
    )
    steps: list[Step] = []
    times: list[float] = [time.perf_counter()]  # start, then the moment each token was ready

    def generated_tokens() -> Iterator[int]:
        for step in generation:
            times.append(time.perf_counter())
            steps.append(step)
            yield step.token
            if tuner is not None:
                tuner.tick()

    for piece in tokens.text_pieces(generated_tokens()):
        if not args.json:
            print(piece, end="", flush=True)
    decode_ms = (times[-1] - times[1]) * 1e3 / (len(steps) - 1) if len(steps) > 1 else float("nan")
    speculation = generation.speculation
    return {
        "model": args.model,
        "device": str(model.wte.weight.device),
        "blocks": str(block_set),
        "prompt_tokens": len(prompt),
        "text": generation.text,
        "tokens": generation.tokens,
        "blocks_per_token": [len(s.blocks_run) for s in steps],
        "mean_blocks": mean_blocks(steps),
        "finish_reason": generation.finish_reason,
        "first_token_ms": (times[1] - times[0]) * 1e3 if steps else float("nan"),
        "decode_ms_per_token": decode_ms,
        "speculation": None
        if speculation is None
        else {**asdict(speculation), "acceptance_rate": speculation.acceptance_rate},
    }


def _run_score(
    model: GPT, block_set: BlockSet, args: ScoreCommand, text: str, tuner: ThreadTuner | None
) -> dict:
    if tuner is not None:
        tuner.tick()
    ids = tokens.encode(text, allow_endoftext=True)
    limit = model.config.block_size + 1
    if len(ids) > limit:
        print(f"note: scoring the first {limit} of {len(ids)} tokens (the context length)", file=sys.stderr)
        ids = ids[:limit]
    result = score(model, ids, block_set)
    return {
        "model": args.model,
        "blocks": str(block_set),
        **asdict(result),
        "mean_blocks": result.mean_blocks,
    }


def _summary(command: str, result: dict, n_layer: int) -> str:
    """The line printed after the text (generate) or instead of it (score)."""
    if command == "score":
        return (
            f"{result['mean_loss']:.4f} nats/token over {len(result['token_losses'])} tokens, "
            f"blocks {result['blocks']}, {result['mean_blocks']:.2f} of {n_layer} blocks/token"
        )
    speculation = result["speculation"]
    accepted = f", drafts accepted {speculation['acceptance_rate']:.0%}" if speculation else ""
    return (
        f"\n[{len(result['tokens'])} tokens, {result['mean_blocks']:.2f} of {n_layer} "
        f"blocks/token, {result['decode_ms_per_token']:.1f} ms/token, "
        f"stopped: {result['finish_reason']}{accepted}]"
    )


def main(argv: list[str]) -> int:
    """``blocklab generate ...`` / ``blocklab score ...``: argv[0] is the subcommand."""
    from lab import flags

    command, rest = argv[0], argv[1:]
    options = GenerateCommand if command == "generate" else ScoreCommand
    args = flags.parse(options, rest, f"blocklab {command}", options.__doc__)
    if (args.prompt is None) == (args.file is None):
        raise UserError("give the text as --prompt TEXT or --file PATH, one of them")
    if args.threads:
        torch.set_num_threads(args.threads)
    tuner = None if args.threads else ThreadTuner()  # its first window: the model's loading
    text = _read_text(args)  # before the model loads: a wrong path fails at once
    model = load_model(args.model, args.dtype, device=device_named(args.device, args.dtype))
    if command == "generate" and args.compile:
        fast.accelerate(model)
    try:
        block_set = BlockSet.parse(args.blocks, model.config.n_layer)
    except ValueError as error:
        raise UserError(f"--blocks: {error}") from None
    run = _run_generate if command == "generate" else _run_score
    result = run(model, block_set, args, text, tuner)
    if args.json:
        print(json.dumps(result))
    else:
        summary = _summary(command, result, model.config.n_layer)
        print(summary, file=sys.stderr if command == "generate" else sys.stdout)
    return 0
