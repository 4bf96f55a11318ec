"""Decoding and scoring: cache == no cache, sampling, stopping, context bound, adaptive exit, the CLI."""

import copy
import json
import math
import random
import time

import pytest
import torch
import torch.nn.functional as F

from lab.blocks import BlockSet
from lab.config import GPTConfig
from lab.decode import Decoder, propagate_kv
from lab.errors import UserError
from lab.generate import adaptive_forward, generate, main, mean_blocks, score
from lab.hooks import capture
from lab.model import GPT
from lab.sampling import SamplingError, SamplingParams, draw, inverse_cdf, token_probabilities

CFG = GPTConfig(n_layer=6, n_head=2, n_embd=32, vocab_size=71, block_size=48)
FIXED_SETS = ["all", "skip=1,4", "keep=0,5", "overwrite=2", "exit=3", "skip=0;overwrite=3;exit=5"]
MIXED = "adaptive=0.995;min=2"  # on the random model below, some tokens exit early and some do not


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(CFG).eval()


def prompt_tokens(n=6, seed=1):
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def decode_all(model, block_set, prompt, new_tokens):
    """Teacher-forced incremental decoding: logits after the prompt and after each of ``new_tokens``."""
    decoder = Decoder(model, block_set)
    logits, depths = [decoder.prefill(prompt)], [decoder.blocks]
    for token in new_tokens:
        step_logits, blocks_run = decoder.step(token)
        logits.append(step_logits)
        depths.append(blocks_run)
    return torch.stack(logits), depths, decoder


@pytest.mark.parametrize("spec", FIXED_SETS)
def test_cache_equals_no_cache(model, spec):
    block_set = BlockSet.parse(spec, CFG.n_layer)
    prompt = prompt_tokens()
    steps = list(generate(model, prompt, 10, block_set=block_set))
    new = [s.token for s in steps]
    assert all(s.blocks_run == block_set.blocks_to_run(CFG.n_layer) for s in steps)
    cached, _, _ = decode_all(model, block_set, prompt, new[:-1])
    with torch.no_grad():
        full = model(torch.tensor([prompt + new[:-1]]), block_set=block_set)[0, len(prompt) - 1 :]
    assert (cached - full).abs().max() <= 1e-4
    assert new == full.argmax(-1).tolist()  # greedy picks what a full forward pass would


@pytest.mark.parametrize("lens", ["logit", "tuned"])
def test_adaptive_cache_equals_parallel_forward(model, lens):
    """Decoding token by token with state propagation == the all-positions adaptive pass, depth by
    depth; through the tuned lens too, where a token that exited early is read out through the
    translator of its exit block and one that ran every block as it is."""
    from tests.tiny import random_lens

    lensed = copy.copy(model)  # the same modules, a lens of its own
    lensed.tuned_lens = random_lens(model)
    block_set = BlockSet.parse(f"{MIXED};lens={lens}", CFG.n_layer)
    prompt, new = prompt_tokens(), prompt_tokens(n=25, seed=2)
    cached, depths, _ = decode_all(lensed, block_set, prompt, new)
    full, full_depths = adaptive_forward(lensed, torch.tensor([prompt + new]), block_set, n_full=len(prompt))
    assert depths == full_depths[len(prompt) - 1 :]
    assert (cached - full[0, len(prompt) - 1 :]).abs().max() <= 1e-4
    lengths = {len(d) for d in depths[1:]}
    assert min(lengths) < CFG.n_layer and max(lengths) == CFG.n_layer, "the test wants a mix of depths"
    logit_lens, _, _ = decode_all(lensed, BlockSet.parse(MIXED, CFG.n_layer), prompt, new)
    for step, blocks_run in enumerate(depths):  # the same depths: the check reads ln_f either way
        same = lens == "logit" or len(blocks_run) == CFG.n_layer
        assert torch.equal(cached[step], logit_lens[step]) == same, (step, blocks_run)


def test_adaptive_threshold_controls_depth(model):
    prompt = prompt_tokens()
    everything = list(generate(model, prompt, 12, block_set=BlockSet.parse("adaptive=1.0", CFG.n_layer)))
    shallow = list(generate(model, prompt, 12, block_set=BlockSet.parse("adaptive=0.5;min=2", CFG.n_layer)))
    assert mean_blocks(everything) == CFG.n_layer
    assert all(s.blocks_run == [0, 1] for s in shallow[1:])  # exits at the minimum depth
    assert shallow[0].blocks_run == list(range(CFG.n_layer))  # read out after the full prefill
    assert mean_blocks(shallow) < mean_blocks(everything)


def test_adaptive_respects_skip(model):
    block_set = BlockSet.parse("skip=0,1;adaptive=0.5;min=2", CFG.n_layer)
    steps = list(generate(model, prompt_tokens(), 6, block_set=block_set))
    assert steps[0].blocks_run == [2, 3, 4, 5]
    assert all(s.blocks_run == [2, 3] for s in steps[1:])


@torch.inference_mode()
def test_propagated_kv_is_ln1_c_attn_of_the_exit_state(model):
    block_set = BlockSet.parse("adaptive=0.5;min=2", CFG.n_layer)
    decoder = Decoder(model, block_set)
    decoder.prefill(prompt_tokens())
    pos = decoder.position
    with capture(model, "blocks.1.resid_post") as seen:
        _, blocks_run = decoder.step(5)
    assert blocks_run == [0, 1]
    exit_state = seen["blocks.1.resid_post"]  # [1, 1, D]
    D = CFG.n_embd
    for i in range(2, CFG.n_layer):
        block = model.blocks[i]
        qkv = block.attn.c_attn(block.ln_1(exit_state))[0, 0]  # [3D]
        k = decoder.cache.k[i, 0, :, pos].reshape(D)  # [H, Dh] -> [D]
        v = decoder.cache.v[i, 0, :, pos].reshape(D)
        torch.testing.assert_close(k, qkv[D : 2 * D])
        torch.testing.assert_close(v, qkv[2 * D :])
    # and a direct call writes the same
    k_before = decoder.cache.k[3, :, :, pos].clone()
    decoder.cache.k[3, :, :, pos] = 0
    propagate_kv(model.blocks[3], exit_state, decoder.cache.layer(3), pos)
    torch.testing.assert_close(decoder.cache.k[3, :, :, pos], k_before)


def test_greedy_is_deterministic(model):
    a = [s.token for s in generate(model, prompt_tokens(), 8)]
    b = [s.token for s in generate(model, prompt_tokens(), 8)]
    assert a == b


def test_seeded_sampling_is_reproducible(model):
    def sample(seed, top_k=None):
        steps = generate(model, prompt_tokens(), 8, SamplingParams(temperature=5.0, top_k=top_k, seed=seed))
        return [s.token for s in steps]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    greedy_first = next(generate(model, prompt_tokens(), 1)).token
    assert set(sample(3, top_k=1)[:1]) == {greedy_first}  # top-1 sampling is greedy


def test_draws_follow_the_distribution_and_never_take_a_token_of_probability_zero():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])  # [V]
    generator = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(4000)]), minlength=5)
    assert counts[1] == counts[4] == 0
    # each share within 4 standard deviations of its probability (4000 draws: at most 0.032)
    assert torch.allclose(counts / 4000, probs, atol=0.032)
    assert draw(probs * 7.0, torch.Generator().manual_seed(3)) == draw(
        probs, torch.Generator().manual_seed(3)
    )


def test_inverse_cdf_places_u_by_the_cumulative_sums_and_rounding_lands_on_a_token_of_some_probability():
    probs = torch.tensor([0.25, 0.0, 0.25, 0.5, 0.0, 0.0])
    assert [inverse_cdf(probs, u) for u in (0.0, 0.2499, 0.25, 0.4999, 0.5, 0.99)] == [0, 0, 2, 2, 3, 3]
    assert inverse_cdf(probs, 1.0) == 3  # u * total at the total itself: the last token drawn can be
    broken_ones = [[0.0, 0.0], [0.5, float("nan")], [1.0, float("inf")], [0.3, -0.5, 0.3]]
    for broken in map(torch.tensor, broken_ones):
        with pytest.raises(ValueError, match="at least 0 with a finite positive total"):
            inverse_cdf(broken, 0.5)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 3.0])
@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("spread", [4.0, 0.3, 0.0])  # peaked (a trained model's), flat, uniform
@pytest.mark.parametrize("top_k", [None, 700])
def test_nucleus_keeps_the_tokens_a_full_sort_keeps(temperature, top_p, spread, top_k):
    """The nucleus from its probabilities' buckets equals the textbook one over the whole sorted
    vocabulary (all tied: as many tokens, which of them aside)."""
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * spread
    sampling = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    scaled = logits / temperature
    if top_k is not None:
        scaled = scaled.masked_fill(scaled < torch.topk(scaled, top_k).values[-1], -math.inf)
    probs = F.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.double().cumsum(-1) - sorted_probs.double()  # exact enough to place the cut
    expected = torch.zeros_like(probs).scatter(-1, order, sorted_probs.masked_fill(before >= top_p, 0.0))
    got = token_probabilities(logits, sampling)
    if spread == 0.0:
        assert int((got > 0).sum()) == int((expected > 0).sum())
    else:
        torch.testing.assert_close(got, expected / expected.sum())


def test_nucleus_keeps_as_many_of_tied_tokens_and_every_token_at_a_top_p_the_total_reaches():
    """Tied at the cut, the nucleus keeps as many tokens as the full sort (which of them may differ);
    a top_p at or above the probabilities' rounded total keeps every token, as the full sort does."""
    tied = F.softmax(torch.tensor([0.0] * 17 + [-30.0] * 20), dim=-1)  # [37]
    kept = token_probabilities(torch.log(tied), SamplingParams(temperature=1.0, top_p=0.05))
    assert int((kept > 0).sum()) == 1 and float(kept.max()) == 1.0
    logits = torch.tensor([13.0, -52.0, -40.0, 27.0, 23.0])  # softmax total just below 1 in float32
    kept = token_probabilities(logits, SamplingParams(temperature=1.0, top_p=0.99999999))
    assert bool((kept > 0).all())


def test_logprob_is_of_the_chosen_token(model):
    prompt = prompt_tokens()
    step = next(generate(model, prompt, 1))
    with torch.no_grad():
        expected = F.log_softmax(model(torch.tensor([prompt]))[0, -1], dim=-1)[step.token]
    assert step.logprob == pytest.approx(float(expected), abs=1e-5)


def test_end_of_text_ends_generation_and_is_not_output(model):
    free = [s.token for s in generate(model, prompt_tokens(), 10)]
    stop = free[3]
    generation = generate(model, prompt_tokens(), 10, eos_token=stop)
    steps = list(generation)
    assert [s.token for s in steps] == free[: free.index(stop)] == generation.tokens
    assert generation.finish_reason == "stop"
    assert all(s.finish_reason is None for s in steps)


def test_min_tokens_and_ignore_eos(model):
    free = [s.token for s in generate(model, prompt_tokens(), 10)]
    eos = free[0]  # the greedy first token: without min_tokens nothing would be generated
    assert list(generate(model, prompt_tokens(), 10, eos_token=eos)) == []
    held = generate(model, prompt_tokens(), 10, SamplingParams(min_tokens=3), eos_token=eos)
    tokens = [s.token for s in held]
    assert len(tokens) >= 3 and eos not in tokens[:3]
    ignored = generate(model, prompt_tokens(), 10, SamplingParams(ignore_eos=True), eos_token=eos)
    assert [s.token for s in ignored] == free and ignored.finish_reason == "length"


def test_a_stop_string_ends_generation_and_the_text_before_it():
    from lab import tokens

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=tokens.VOCAB_SIZE, block_size=48)).eval()
    prompt = tokens.encode("The quick brown fox")
    free = generate(model, prompt, 12)
    list(free)
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 2]
    stopped = generate(model, prompt, 12, SamplingParams(stop=("never there", stop)))
    steps = list(stopped)
    assert stopped.finish_reason == "stop" and steps[-1].finish_reason == "stop"
    assert stopped.text == free.text[: free.text.find(stop)] and len(steps) < 12
    assert "".join(step.text for step in steps) == stopped.text  # the stream holds no stop string


def test_min_tokens_holds_stop_strings_back_as_vllm_does():
    """A stop string completed by one of the first ``min_tokens`` tokens does not end the generation
    (it stays in the text); the first one completed by a later token does, and is the stop reason."""
    from lab import tokens

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=tokens.VOCAB_SIZE, block_size=48)).eval()
    prompt = tokens.encode("The quick brown fox")
    pieces = [step.text for step in generate(model, prompt, 16, SamplingParams(stop=("\x00",)))]
    whole = "".join(pieces)
    pairs = [whole[i : i + 2] for i in range(len(whole) - 1)]
    stop = max(pairs, key=pairs.count)  # a string the text holds more than once
    assert pairs.count(stop) > 1

    def expected(min_tokens: int) -> str:
        text = ""
        for count, piece in enumerate(pieces, 1):
            before, text = len(text), text + piece
            ends = [i for i in range(len(text)) if text.startswith(stop, i) and before < i + len(stop)]
            if ends and count >= min_tokens:
                return text[: min(ends)]
        return text

    texts = set()
    for min_tokens in range(len(pieces) + 1):
        run = generate(model, prompt, 16, SamplingParams(stop=(stop,), min_tokens=min_tokens))
        list(run)
        assert run.text == expected(min_tokens), min_tokens
        assert run.stop_reason == (stop if run.finish_reason == "stop" else None)
        texts.add(run.text)
    assert len(texts) > 2  # min_tokens moved the end, more than once


def test_stop_strings_are_found_and_held_as_a_search_of_the_whole_text_finds_them():
    """StopStrings, fed random pieces of random text over a small alphabet (so strings overlap and
    repeat), against str.find and str.endswith over the whole text at every piece."""
    from lab.generate import StopStrings

    rng = random.Random(0)
    for _ in range(2000):
        stops = tuple("".join(rng.choices("ab", k=rng.randint(1, 5))) for _ in range(rng.randint(1, 3)))
        matcher, text = StopStrings(stops), ""
        while True:
            piece = "".join(rng.choices("abc", k=rng.randint(0, 4)))
            found, text = matcher.feed(piece), text + piece
            starts = [text.find(stop) for stop in stops if stop in text]
            assert (found and found[0]) == (min(starts) if starts else None), (stops, text)
            assert found is None or text[found[0] :].startswith(found[1])
            if found is not None or len(text) > 30:
                break
            held = [k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])]
            assert matcher.held == max(held, default=0), (stops, text)


def test_text_that_may_begin_a_stop_string_is_held_until_it_does_not():
    """A stop string across two tokens: the first token's step holds back the character it would
    begin, and the stream ends before the stop string; the same character before a stop string that
    never comes is released by the next step, and the stream joins to the whole text."""
    from lab import tokens

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=tokens.VOCAB_SIZE, block_size=48)).eval()
    prompt = tokens.encode("The quick brown fox")
    pieces = [step.text for step in generate(model, prompt, 12, SamplingParams(stop=("\x00",)))]
    whole = "".join(pieces)

    def boundary(i: int) -> bool:  # a stop string across pieces i and i + 1 would first appear there
        across, before = pieces[i][-1:] + pieces[i + 1][:1], "".join(pieces[: i + 1])
        first_there = whole.find(across) == len(before) - 1
        return len(across) == 2 and first_there and not before[:-1].endswith(across[0])

    i = next(i for i in range(len(pieces) - 1) if boundary(i))
    across = pieces[i][-1] + pieces[i + 1][0]
    stopped = generate(model, prompt, 12, SamplingParams(stop=(across,)))
    steps = list(stopped)
    assert steps[i].text == pieces[i][:-1] and stopped.finish_reason == "stop"
    assert "".join(step.text for step in steps) == stopped.text == whole[: whole.find(across)]
    never = generate(model, prompt, 12, SamplingParams(stop=(pieces[i][-1] + "\x00",)))
    steps = list(never)
    assert steps[i].text == pieces[i][:-1] and steps[i + 1].text.startswith(pieces[i][-1])  # released
    assert "".join(step.text for step in steps) == never.text == whole
    assert never.finish_reason == "length"


def test_a_deadline_stops_generation(model):
    with pytest.raises(TimeoutError, match="deadline passed after 0 new tokens"):
        list(generate(model, prompt_tokens(), 10, deadline=time.monotonic() - 1))


@pytest.mark.parametrize(
    "settings, field",
    [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"),
     ({"min_tokens": -1}, "min_tokens")],
)  # fmt: skip
def test_sampling_settings_are_checked_naming_the_field(settings, field):
    with pytest.raises(SamplingError) as error:
        SamplingParams(**settings)
    assert error.value.field == field and str(error.value).startswith(f"{field}: ")
    assert isinstance(error.value, UserError)


def test_context_length_bounds_generation(model):
    steps = list(generate(model, prompt_tokens(CFG.block_size - 3), 10))
    assert len(steps) == 3 and steps[-1].finish_reason == "length"
    at_the_end = generate(model, prompt_tokens(CFG.block_size), 10)
    assert list(at_the_end) == [] and at_the_end.finish_reason == "length"
    steps = list(generate(model, prompt_tokens(), 4))
    assert len(steps) == 4 and steps[-1].finish_reason == "length"
    with pytest.raises(ValueError, match="exceed the context length"):
        list(generate(model, prompt_tokens(CFG.block_size + 1), 1))


@pytest.mark.parametrize("spec", ["all", "skip=2", "exit=4"])
def test_score_is_the_mean_cross_entropy(model, spec):
    tokens = prompt_tokens(20)
    block_set = BlockSet.parse(spec, CFG.n_layer)
    result = score(model, tokens, block_set)
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]]), block_set=block_set)[0]
    expected = F.cross_entropy(logits, torch.tensor(tokens[1:]), reduction="none")
    torch.testing.assert_close(torch.tensor(result.token_losses), expected)
    assert result.mean_loss == pytest.approx(float(expected.mean()), abs=1e-6)
    assert result.blocks_per_token == [len(block_set.blocks_to_run(CFG.n_layer))] * 19


def test_adaptive_score(model):
    tokens = prompt_tokens(30)
    full = score(model, tokens)
    everything = score(model, tokens, BlockSet.parse("adaptive=1.0", CFG.n_layer))
    assert everything.mean_loss == pytest.approx(full.mean_loss, abs=1e-5)
    mixed = score(model, tokens, BlockSet.parse(MIXED, CFG.n_layer))
    assert everything.mean_blocks == CFG.n_layer > mixed.mean_blocks
    assert mixed.mean_loss != pytest.approx(full.mean_loss, abs=1e-5)


def test_cli_generate_and_score(tmp_path, capsys):
    from lab import tokens
    from lab.config import GPT2_VOCAB_SIZE
    from lab.weights import save_model

    torch.manual_seed(0)
    save_model(GPT(GPTConfig(n_layer=2, n_embd=16, vocab_size=GPT2_VOCAB_SIZE, block_size=32)), tmp_path)
    common = ["--model", str(tmp_path), "--json"]
    args = ["--prompt", "def f(x):", "--max-new-tokens", "5", "--blocks", "skip=1"]
    assert main(["generate", *common, *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["tokens"]) <= 5 and out["blocks_per_token"] == [1] * len(out["tokens"])
    assert out["finish_reason"] == "length" if len(out["tokens"]) == 5 else "stop"
    assert out["mean_blocks"] == 1.0 and out["text"] == tokens.decode(out["tokens"])
    text_file = tmp_path / "text.txt"
    text_file.write_text("import os\nprint(os.getcwd())\n")
    assert main(["score", *common, "--file", str(text_file), "--blocks", "adaptive=1.0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mean_blocks"] == 2.0 and len(out["token_losses"]) == len(out["blocks_per_token"]) > 5


def test_cli_generate_compile_decodes_through_the_fast_step(tmp_path, capsys, monkeypatch):
    """--compile gives the model lab.fast's steps (here captured, not compiled: the same dispatch, in
    seconds) and the greedy tokens are the eager ones."""
    from lab import fast
    from lab.config import GPT2_VOCAB_SIZE
    from lab.weights import save_model

    torch.manual_seed(0)
    save_model(GPT(GPTConfig(n_layer=2, n_embd=16, vocab_size=GPT2_VOCAB_SIZE, block_size=32)), tmp_path)
    accelerated, accelerate = [], fast.accelerate

    def capture_instead(model):
        accelerated.append(accelerate(model, "graphs", capture=fast.eager_capture))
        return model

    monkeypatch.setattr(fast, "accelerate", capture_instead)
    args = ["generate", "--model", str(tmp_path), "--json", "--prompt", "def f(x):", "--max-new-tokens", "6"]
    assert main(args) == 0
    eager = json.loads(capsys.readouterr().out)["tokens"]
    assert not accelerated
    assert main([*args, "--compile"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == eager
    (model,) = accelerated
    assert model.fast.steps and not model.fast.fallbacks


def test_serve_compile_gives_each_worker_the_fast_step(tmp_path):
    from lab.config import GPT2_VOCAB_SIZE
    from lab.weights import save_model
    from serve.worker import WeightsLoader

    save_model(GPT(GPTConfig(n_layer=2, n_embd=16, vocab_size=GPT2_VOCAB_SIZE, block_size=32)), tmp_path)
    assert WeightsLoader(str(tmp_path))("cpu").fast is None
    assert WeightsLoader(str(tmp_path), compile=True)("cpu").fast.mode == "compile"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_matrix_vector_path_equals_matrix_path(dtype):
    """Decoding multiplies one row with addmv / mv (lab.model.Linear, GPT.unembed): same numbers."""
    torch.manual_seed(0)
    model = GPT(CFG).eval().to(dtype)
    assert model.blocks[0].mlp.c_fc.weight.t().is_contiguous()  # laid out [out, in] for mv
    idx = torch.tensor([prompt_tokens(8)])
    with torch.no_grad():
        batched = model(idx)[0, -1]  # every Linear sees 8 rows: addmm
        decoder = Decoder(model, max_len=8)
        decoder.prefill(idx[0, :-1].tolist())
        one_row, _ = decoder.step(int(idx[0, -1]))  # every Linear sees 1 row: addmv
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(one_row, batched, atol=tolerance, rtol=tolerance)


def test_loaded_models_keep_the_decoding_layout(tmp_path):
    from lab.weights import load_model, save_model

    save_model(GPT(CFG), tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        weight = load_model(str(tmp_path), dtype=dtype).blocks[1].attn.c_attn.weight
        assert weight.shape == (CFG.n_embd, 3 * CFG.n_embd) and weight.t().is_contiguous()
