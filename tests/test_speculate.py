"""Self-speculative decoding (``speculate=E``): exact tokens when greedy, the full set's distribution
when sampling, in ``lab.generate``, the engine and the block-set grammar."""

import copy
import itertools
import re
import time

import pytest
import torch

from lab import intmm, tokens
from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.generate import generate, score
from lab.lens.translator import TunedLens
from lab.model import GPT
from lab.sampling import SamplingParams
from lab.speculate import SpeculationStats
from serve.engine import Engine
from serve.schema import Job
from tests.tiny import random_lens

PROMPTS = ["The quick brown fox", "def main(", "import os\nimport sys", "Once upon a time there"]


def bold(config: GPTConfig, seed: int = 0) -> GPT:
    """A random GPT whose blocks move the stream a lot (projections scaled up), so that a read-out
    after the first blocks often disagrees with the full stack's: drafts are rejected too."""
    torch.manual_seed(seed)
    model = GPT(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("c_proj.weight"):
                param.mul_(40.0)
    return model


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.set_num_threads(1)
    model = bold(GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=tokens.VOCAB_SIZE, block_size=128))
    model.tuned_lens = random_lens(model, scale=0.05)  # lens=tuned drafts: other guesses, some right
    return model


def tokens_of(model: GPT, prompt: str, spec: str, n: int = 24) -> list[int]:
    block_set = BlockSet.parse(spec, model.config.n_layer)
    return [step.token for step in generate(model, tokens.encode(prompt), n, block_set=block_set)]


@pytest.mark.parametrize(
    "spec",
    ["speculate=1", "speculate=2;k=2", "speculate=3;k=6", "skip=1;speculate=2;k=3",
     "speculate=2;k=3;lens=tuned", "skip=1;speculate=3;k=4;lens=tuned"],
)  # fmt: skip
def test_greedy_speculation_gives_exactly_the_full_sets_tokens(model, spec):
    full_spec = "skip=1" if spec.startswith("skip") else "all"
    stats = SpeculationStats()
    for prompt in PROMPTS:
        block_set = BlockSet.parse(spec, 4)
        got = [step.token for step in generate(model, tokens.encode(prompt), 24, block_set=block_set,
                                               speculation=stats)]  # fmt: skip
        assert got == tokens_of(model, prompt, full_spec), (spec, prompt)
    assert 0 < stats.accepted < stats.drafted  # drafts were accepted and rejected both
    assert stats.rounds < 4 * 23  # fewer verification passes than tokens after the first


def test_greedy_speculations_logprobs_are_the_full_sets(model):
    """Each token's log-probability, accepted draft or the verification's own, is the one a plain
    full-depth step gives it (the verification's logits of that position)."""
    prompt = tokens.encode(PROMPTS[1])
    plain = list(generate(model, prompt, 24))
    stats = SpeculationStats()
    block_set = BlockSet.parse("speculate=2;k=3", 4)
    spec = list(generate(model, prompt, 24, block_set=block_set, speculation=stats))
    assert [step.token for step in spec] == [step.token for step in plain] and stats.accepted > 0
    for got, want in zip(spec, plain, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)


def test_quantized_greedy_speculation_gives_the_full_sets_tokens():
    from lab.quantize import quantize

    config = GPTConfig(n_layer=4, n_head=4, n_embd=64, vocab_size=tokens.VOCAB_SIZE, block_size=128)
    model = quantize(bold(config, seed=1).to(torch.bfloat16), "int4")
    for prompt in PROMPTS[:2]:
        assert tokens_of(model, prompt, "speculate=2;k=3") == tokens_of(model, prompt, "all")


def test_a_tuned_draft_is_the_exit_through_the_lens(model):
    """Under speculate=E;lens=tuned a round's greedy drafts are the tokens exit=E;lens=tuned decodes
    from the same place (the drafting blocks' keys and values are the exit's), and not those of the
    logit lens's draft."""
    from lab.decode import Decoder
    from lab.sampling import GREEDY
    from lab.speculate import Speculator

    model = copy.copy(model)  # the same modules, a lens of its own: far from the identity
    model.tuned_lens = random_lens(model, scale=0.5)
    prompt, fed = tokens.encode(PROMPTS[1]), tokens.encode(" x")[0]
    drafts = {}
    for lens in ("tuned", "logit"):
        speculator = Speculator(model, BlockSet.parse(f"speculate=2;k=6;lens={lens}", 4), max_len=64)
        speculator.decoder.prefill(prompt)
        _, drafts[lens], _ = speculator._draft(
            fed, len(prompt), 6, GREEDY, torch.Generator(), speculator.fast
        )
    exit_decoder, exit_tokens, token = Decoder(model, BlockSet.parse("exit=2;lens=tuned", 4)), [], fed
    exit_decoder.prefill(prompt)
    for _ in range(6):
        token = int(exit_decoder.step(token)[0].argmax())
        exit_tokens.append(token)
    assert drafts["tuned"] == exit_tokens and drafts["logit"] != exit_tokens


def ranked(model: GPT) -> GPT:
    """``model`` (the same modules) whose lens ranks the tokens its full stack predicts on the prompts
    (``lab.lens.fit.top1_ranking``, as a fit ranks them on its calibration text)."""
    from lab.lens.fit import top1_ranking

    model = copy.copy(model)
    windows = [tokens.encode(prompt) + tokens_of(model, prompt, "all") for prompt in PROMPTS]
    model.tuned_lens = copy.copy(model.tuned_lens)
    model.tuned_lens.ranking, _ = top1_ranking(model, windows, windows)
    return model


@pytest.mark.parametrize("spec", ["speculate=2;k=3;vocab=16", "speculate=1;k=4;vocab=3;lens=tuned"])
def test_drafts_over_a_draft_vocabulary_give_the_full_sets_tokens(model, spec):
    """Under vocab=N every draft is one of the ranking's first N tokens, and the verification keeps
    the full set's tokens exactly, whether or not the full set's token is among them."""
    from lab.sampling import GREEDY
    from lab.speculate import Speculator

    model = ranked(model)
    block_set, stats = BlockSet.parse(spec, 4), SpeculationStats()
    allowed = set(model.tuned_lens.ranking[: block_set.draft_vocabulary].tolist())
    for prompt in map(tokens.encode, PROMPTS):
        got = [s.token for s in generate(model, prompt, 24, block_set=block_set, speculation=stats)]
        assert got == tokens_of(model, tokens.decode(prompt), "all"), (spec, prompt)
        speculator = Speculator(model, block_set, max_len=64)
        speculator.decoder.prefill(prompt)
        _, drafts, _ = speculator._draft(got[0], len(prompt), 4, GREEDY, torch.Generator(), None)
        assert set(drafts) <= allowed
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.skipif(intmm.unavailable() is not None, reason=str(intmm.unavailable()))
@pytest.mark.parametrize("spec", ["speculate=2;k=4;vocab=64;lens=tuned", "speculate=1;k=3;vocab=16"])
def test_a_draft_over_a_vocabulary_is_one_call_where_the_blocks_are(model, monkeypatch, spec):
    """On a model with lab.intmm's blocks (the loader's, on this CPU), each vocab=N draft step and
    each round's last fed token is one call (``lab.intmm.draft_row``): it drafts the tokens the eager
    draft drafts, and the output stays the full set's. A hooked final norm takes the eager draft."""
    from lab.block_kernel import use_block_kernels
    from lab.float_kernels import use_float_kernels
    from lab.sampling import GREEDY
    from lab.speculate import Speculator

    fast = use_block_kernels(use_float_kernels(copy.deepcopy(ranked(model))))
    calls = []
    draft_row = intmm.draft_row
    monkeypatch.setattr(intmm, "draft_row", lambda *args: calls.append(args[-1]) or draft_row(*args))
    block_set = BlockSet.parse(spec, 4)
    prompt = tokens.encode(PROMPTS[2])
    drafted = {}
    for kernel in (True, False):
        speculator = Speculator(fast, block_set, max_len=64)
        assert speculator.draft_kernel is not None
        if not kernel:
            speculator.draft_kernel = None
        speculator.decoder.prefill(prompt)
        with torch.inference_mode():  # as a round drafts: the kernels carry no gradient
            _, drafted[kernel], _ = speculator._draft(7, len(prompt), 4, GREEDY, torch.Generator(), None)
    assert drafted[True] == drafted[False]
    assert calls == [True] * 4 + [False]  # four drafts read out, then the last fed
    got = [step.token for step in generate(fast, prompt, 24, block_set=block_set)]
    assert got == [step.token for step in generate(fast, prompt, 24)]
    calls.clear()
    handle = fast.ln_f.register_forward_hook(lambda *args: None)
    speculator = Speculator(fast, block_set, max_len=64)
    speculator.decoder.prefill(prompt)
    with torch.inference_mode():
        _, hooked, _ = speculator._draft(7, len(prompt), 4, GREEDY, torch.Generator(), None)
    handle.remove()
    assert calls == [] and hooked == drafted[False]


def test_a_draft_vocabulary_needs_a_lens_with_a_ranking(model):
    from lab.errors import UserError

    unranked = copy.copy(model)
    unranked.tuned_lens = copy.copy(model.tuned_lens)
    unranked.tuned_lens.ranking = None
    block_set = BlockSet.parse("speculate=2;vocab=8", 4)
    with pytest.raises(UserError, match="blocklab lens fit"):
        list(generate(unranked, tokens.encode(PROMPTS[0]), 4, block_set=block_set))


def test_scoring_under_speculation_is_the_full_sets_loss(model):
    ids = tokens.encode(PROMPTS[2])
    assert score(model, ids, BlockSet.parse("speculate=2", 4)).token_losses == score(model, ids).token_losses


@pytest.mark.slow
def test_sampled_speculation_draws_from_the_full_sets_distribution():
    """Speculative sampling's rule makes (t1, t2, t3) distributed as under the full set: the joint
    distribution of 3 tokens of a 4-token vocabulary, exact by enumeration, against 3,000 seeded
    draws. The same test tells the draft's own distribution apart, so it can fail."""
    config = GPTConfig(n_layer=4, n_head=2, n_embd=16, vocab_size=4, block_size=16)
    model = bold(config, seed=4)
    with torch.no_grad():
        model.wte.weight.mul_(10.0)  # sharper read-outs: the draft's distribution is far from the full
    prompt, temperature = [1, 2], 1.0

    def probs(context: list[int], block_set: BlockSet) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([context]), block_set=block_set)[0, -1]
        return torch.softmax(logits / temperature, dim=-1)

    def joint(block_set: BlockSet) -> dict[tuple[int, ...], float]:
        table = {}
        for seq in itertools.product(range(4), repeat=3):
            p = 1.0
            for i in range(3):
                p *= float(probs(prompt + list(seq[:i]), block_set)[seq[i]])
            table[seq] = p
        return table

    exact, draft_only = joint(BlockSet()), joint(BlockSet(exit_at=2))
    spec = BlockSet.parse("speculate=2;k=2", 4)
    counts: dict[tuple[int, ...], int] = {}
    n = 3000
    for seed in range(n):
        steps = generate(model, prompt, 3, SamplingParams(temperature=temperature, seed=seed), block_set=spec)
        seq = tuple(step.token for step in steps)
        counts[seq] = counts.get(seq, 0) + 1
    empirical = {seq: counts.get(seq, 0) / n for seq in exact}

    def distance(a: dict, b: dict) -> float:
        return 0.5 * sum(abs(a[seq] - b[seq]) for seq in exact)

    assert distance(exact, draft_only) > 0.3  # the draft alone samples something else
    assert distance(empirical, exact) < 0.06  # sampling noise of 3,000 draws over 64 outcomes

    # drafts over 2 of the 4 tokens (a ranking of the lens): the same distribution still
    model.tuned_lens = TunedLens.identity(4, 16)
    model.tuned_lens.ranking = torch.tensor([2, 0, 3, 1])
    spec, counts = BlockSet.parse("speculate=2;k=2;vocab=2", 4), {}
    for seed in range(n):
        steps = generate(model, prompt, 3, SamplingParams(temperature=temperature, seed=seed), block_set=spec)
        seq = tuple(step.token for step in steps)
        counts[seq] = counts.get(seq, 0) + 1
    assert distance({seq: counts.get(seq, 0) / n for seq in exact}, exact) < 0.06


def job(spec: str, prompt: str, stream: bool = False, min_tokens: int = 0) -> Job:
    return Job(
        prompt_tokens=tokens.encode(prompt),
        block_set=BlockSet.parse(spec, 4),
        max_new_tokens=20,
        sampling=SamplingParams(seed=1, min_tokens=min_tokens),
        stream=stream,
        submitted_at=time.monotonic(),
    )


def test_the_engine_serves_speculation_beside_other_rows(model):
    speculating = job("speculate=2;k=3", PROMPTS[0], stream=True)
    jobs = [speculating, job("all", PROMPTS[1]), job("exit=2", PROMPTS[2])]
    last, seen = {}, {}
    for events in Engine(model).run(list(enumerate(jobs))):
        for key, event in events:
            last[key] = event
            seen.setdefault(key, []).append(event)
    speculated = last[0]["response"]
    assert speculated["tokens"] == tokens_of(model, PROMPTS[0], "all", n=20)
    assert [event["token"] for event in seen[0][:-1]] == speculated["tokens"]  # a token event each
    assert speculated["blocks_per_token"] == [4] * 20 and speculated["block_set"] == "speculate=2;k=3"
    stats = speculated["speculation"]
    assert stats["drafted"] > 0 and stats["acceptance_rate"] == stats["accepted"] / stats["drafted"]
    assert last[1]["response"]["speculation"] is None
    assert last[1]["response"]["tokens"] == tokens_of(model, PROMPTS[1], "all", n=20)
    refused = next(iter(Engine(model).run([(0, job("speculate=2", PROMPTS[0], min_tokens=2))])))
    assert refused[0][1]["status"] == 422 and "min_tokens" in refused[0][1]["message"]


def test_the_grammar_of_speculation():
    assert str(BlockSet.parse(" speculate = 6 ; k = 3 ", 12)) == "speculate=6;k=3"
    assert BlockSet.parse("speculate=6;k=4", 12) == BlockSet(speculate=6)
    assert str(BlockSet.parse("vocab = 2048 ; speculate=6", 12)) == "speculate=6;vocab=2048"
    assert BlockSet.parse("speculate=6;vocab=64", 12).without_speculation() == BlockSet()
    for bad, part in [("k=3", "'k=3'"), ("speculate=0", "speculate=0"), ("speculate=12", "speculate=12"),
                      ("speculate=6;exit=9", "speculate=6"), ("speculate=6;k=17", "k=17"),
                      ("speculate=+6", "speculate=+6"), ("skip=0;speculate=1", "speculate=1"),
                      ("vocab=64", "'vocab=64'"), ("speculate=6;vocab=0", "vocab=0")]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(part)):
            BlockSet.parse(bad, 12)
