"""The server's inference in-process: batched groups against ``lab.generate``, isolation, cancellation,
and the worker's loop fed resolved jobs through plain queues."""

import random
import threading
import time
from dataclasses import replace

import pytest
import torch

from lab import generate as lab_generate
from lab import intmm, tokens
from lab.blocks import BlockSet
from lab.decode import Decoder
from lab.model import GPT
from lab.sampling import SamplingParams
from serve.engine import Engine
from serve.schema import Job, ModelLimits, PredictRequest, RequestError, resolve
from serve.shared import SharedState
from serve.worker import Order, Worker
from tests.tiny import TinyModel, assert_rows_alone, random_lens, staggered_decoders

N_LAYER = 4
NO_KERNELS = pytest.mark.skipif(intmm.unavailable() is not None, reason=str(intmm.unavailable()))
INTEGER_PRODUCTS = [pytest.param("w4a8", marks=NO_KERNELS), pytest.param("w8a8", marks=NO_KERNELS)]
PROMPT = tokens.encode("The quick brown fox jumps over")


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model gains nothing from 2, and loses much on a busy machine
    yield TinyModel(n_layer=N_LAYER, fail_token=tokens.encode(" explode")[0])("cpu")
    torch.set_num_threads(threads)


def job(
    block_set="all", prompt=PROMPT, max_new_tokens=6, temperature=0.0, seed=1, score=False, **extra
) -> Job:
    sampling = {
        name: extra.pop(name)
        for name in ("top_k", "top_p", "min_tokens", "ignore_eos", "stop")
        if name in extra
    }
    return Job(
        prompt_tokens=prompt,
        block_set=BlockSet.parse(block_set, N_LAYER),
        max_new_tokens=max_new_tokens,
        sampling=SamplingParams(temperature=temperature, seed=seed, **sampling),
        score=score,
        submitted_at=time.monotonic(),
        **extra,
    )


def run(engine: Engine, jobs: list[Job]) -> tuple[dict[int, dict], dict[int, list[dict]]]:
    """Each job's last event (done or error) and every event it got."""
    last, seen = {}, {}
    for events in engine.run(list(enumerate(jobs))):
        for position, event in events:
            seen.setdefault(position, []).append(event)
            last[position] = event
    return last, seen


def alone(model, one: Job) -> list[int]:
    """The tokens ``lab.generate`` gives for the job run by itself."""
    steps = lab_generate.generate(
        model,
        one.prompt_tokens,
        one.max_new_tokens,
        one.sampling,
        block_set=one.block_set,
        eos_token=tokens.EOT,
    )
    return [step.token for step in steps]


def test_batched_generation_matches_lab_generate(model):
    jobs = [
        job("skip=1"),
        job("skip=1", temperature=1.0, seed=5),
        job("skip=1", temperature=0.7, seed=9, top_k=20, max_new_tokens=3),
    ]
    last, _ = run(Engine(model), jobs)
    for position, one in enumerate(jobs):
        response = last[position]["response"]
        assert response["tokens"] == alone(model, one)
        assert response["batch_size"] == 3  # every row shared the decode steps


MIXED = ["all", "skip=1", "keep=0,2", "exit=2", "overwrite=1", "skip=0;exit=3", "adaptive=0.9;min=2",
         "adaptive=0.5", "adaptive=0.99;check=probe", "exit=2;lens=tuned", "skip=1;exit=3;lens=tuned",
         "adaptive=0.9;min=2;lens=tuned", "lens=tuned"]  # fmt: skip


@pytest.mark.parametrize("norm", ["pre", "post"])
@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_random_mixes_of_block_sets_joining_and_leaving_compute_what_each_row_computes_alone(norm, dtype):
    """Property-style: random block sets (adaptive too), prompt lengths, sampling settings and
    arrival ticks; every row's tokens equal those of the row run alone in the engine, and those of
    ``lab.generate`` (the same decoding loop with one row; prompts here fit one prefill chunk)."""
    from lab.quantize import quantize

    torch.manual_seed(0)
    config = replace(TinyModel(n_layer=N_LAYER).config(), norm=norm)
    model = probed_tiny_model("cpu", config)
    if dtype == "int4":
        model = quantize(model.to(torch.bfloat16), "int4")
    model.tuned_lens = random_lens(model)  # in the activations' dtype: after quantizing
    rng = random.Random(f"{norm}{dtype}")
    words = tokens.decode(PROMPT).split() + ["while", "def", "class", "return", "import", "lazy", "dog"]
    for trial in range(3):
        jobs, arrivals = [], []
        for _ in range(6):
            prompt = tokens.encode(" ".join(rng.choices(words, k=rng.randint(1, 12))))
            temperature = rng.choice([0.0, 0.8, 1.0])
            jobs.append(
                job(rng.choice(MIXED), prompt=prompt, max_new_tokens=rng.randint(1, 10),
                    temperature=temperature, seed=rng.randint(0, 99), top_k=rng.choice([None, 30]))
            )  # fmt: skip
            arrivals.append(rng.randint(0, 6))
        engine = Engine(model, max_rows=4)
        last, tick = {}, 0
        waiting = sorted(range(len(jobs)), key=lambda i: arrivals[i])
        while waiting or engine.busy:
            while waiting and arrivals[waiting[0]] <= tick and engine.capacity > 0:
                position = waiting.pop(0)
                engine.add(position, jobs[position])
            for position, event in engine.tick():
                last[position] = event
            tick += 1
        for position, one in enumerate(jobs):
            got = last[position]["response"]
            by_itself, _ = run(Engine(model), [one])
            assert got["tokens"] == by_itself[0]["response"]["tokens"], (trial, position)
            assert got["blocks_per_token"] == by_itself[0]["response"]["blocks_per_token"]
            assert got["tokens"] == alone(model, one), (trial, position, str(one.block_set))


@pytest.mark.parametrize("dtype", ["float32", "int4", *INTEGER_PRODUCTS])
def test_a_rows_logits_are_bit_for_bit_its_logits_alone(dtype):
    """``decode_rows`` under ``rows_alone``: a row among others of other block sets gives exactly
    the logits it gives alone, in fp32, int4 and lab.intmm's w4a8 and w8a8; the products shared as
    one matrix product do not."""
    from lab.generate import decode_rows
    from lab.quantize import quantize

    torch.manual_seed(0)
    model = TinyModel(n_layer=N_LAYER, n_embd=64, n_head=4)("cpu")
    if dtype != "float32":
        model = quantize(model.to(torch.bfloat16), dtype)
    model.tuned_lens = random_lens(model)
    specs = ["all", "skip=1", "exit=3", "overwrite=2", "adaptive=0.5", "all", "keep=0,3", "all",
             "exit=3;lens=tuned", "exit=2;lens=tuned", "exit=3;lens=tuned",
             "adaptive=0.5;lens=tuned"]  # fmt: skip

    together, fed = assert_rows_alone(model, specs, PROMPT)
    shared, _ = decode_rows(model, staggered_decoders(model, specs, PROMPT), fed)  # equal up to rounding only
    torch.testing.assert_close(shared, together, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_a_prompts_score_and_seeded_tokens_do_not_depend_on_its_batch_mates(dtype):
    from lab.quantize import quantize

    torch.manual_seed(0)
    model = TinyModel(n_layer=N_LAYER)("cpu")
    if dtype == "int4":
        model = quantize(model.to(torch.bfloat16), "int4")
    probe = job("all", score=True, temperature=1.0, seed=7, max_new_tokens=12)
    others = [job(spec, prompt=PROMPT[:n], temperature=1.0, seed=n, max_new_tokens=12, score=True)
              for n, spec in zip(range(2, 9), ["skip=1", "exit=2", "all", "adaptive=0.8", "overwrite=3",
                                               "keep=1,2", "all"], strict=True)]  # fmt: skip
    by_itself, _ = run(Engine(model), [probe])
    together, _ = run(Engine(model), [*others[:4], probe, *others[4:]])
    assert together[4]["response"]["batch_size"] == 8
    assert together[4]["response"]["score"] == by_itself[0]["response"]["score"]  # exactly
    assert together[4]["response"]["tokens"] == by_itself[0]["response"]["tokens"]


def test_a_short_request_does_not_wait_for_a_long_generation(model):
    """Iteration-level scheduling: a request added while another generates 100 tokens is prefilled
    at the next tick and finishes within a few, while the long one goes on."""
    engine = Engine(model)
    engine.add("long", job(max_new_tokens=100, score=False))
    for _ in range(10):
        engine.tick()
    engine.add("short", job("exit=2", max_new_tokens=2))
    ticks, finished = 0, {}
    while "short" not in finished:
        ticks += 1
        for key, event in engine.tick():
            if event["event"] == "done":
                finished[key] = event
    assert ticks == 2  # prefill and first token, then one decode step
    assert "long" not in finished and engine.busy
    assert finished["short"]["response"]["tokens"] == alone(model, job("exit=2", max_new_tokens=2))


def test_a_long_prompt_is_prefilled_in_chunks_between_decode_steps(model):
    engine = Engine(model, prefill_chunk=16)
    engine.add("running", job(max_new_tokens=30, stream=True))
    engine.tick()  # its prefill and first token
    long_prompt = [7] * 70
    engine.add("long", job(prompt=long_prompt, max_new_tokens=1, score=True))
    per_tick = []
    while True:
        events = engine.tick()
        per_tick.append({key for key, _ in events})
        if any(key == "long" for key, _ in events):
            break
    assert len(per_tick) == 5  # 70 tokens in chunks of 16
    assert all("running" in keys for keys in per_tick)  # a token every tick all along
    scored = lab_generate.score(model, long_prompt)
    done = [event for key, event in events if key == "long"][0]["response"]
    assert done["score"]["token_losses"] == pytest.approx(scored.token_losses, abs=1e-5)


def test_prompts_that_arrive_together_start_together_within_the_budget(model):
    """While a row decodes, each waiting prompt advances one chunk per tick until the tick's chunks
    reach prefill_per_step tokens: three short prompts added at once all take their first token at
    the next tick with a budget of their three prompts, one tick apart with a budget of one."""
    for per_step, first_token_ticks in ((30, [1, 1, 1]), (10, [1, 2, 3])):
        engine = Engine(model, prefill_chunk=16, prefill_per_step=per_step)
        engine.add("running", job(max_new_tokens=30, stream=True))
        engine.tick()
        for name, token in (("a", 7), ("b", 8), ("c", 9)):  # three prompts: no copies (below)
            engine.add(name, job(prompt=[token] * 10, max_new_tokens=4, stream=True))
        first: dict[str, int] = {}
        for tick in range(1, 4):
            for key, event in engine.tick():
                if key != "running" and event["event"] == "token":
                    first.setdefault(key, tick)
        assert [first[name] for name in ("a", "b", "c")] == first_token_ticks


def counted_engine(model, **options) -> tuple[Engine, dict[str, int]]:
    counts: dict[str, int] = {}
    return Engine(model, lambda name, n: counts.__setitem__(name, counts.get(name, 0) + n), **options), counts


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_identical_prompts_are_prefilled_once_with_the_bits_of_their_own(dtype):
    """Rows with the same prompt under the same prefill (blocks, overwrite, scoring) copy the first
    one's keys, values, last stream and losses: each row's tokens and score are those it gets alone;
    other block sets and other prompts prefill their own."""
    from lab.quantize import quantize

    torch.manual_seed(0)
    model = GPT(TinyModel(n_layer=N_LAYER).config()).eval()
    if dtype == "int4":
        model = quantize(model.to(torch.bfloat16), "int4")
    jobs = [
        job("all", temperature=1.0, seed=1, score=True),
        job("all", temperature=1.0, seed=2, score=True),  # copies the first
        job("all", temperature=0.0, score=True),  # copies the first
        job("all", temperature=1.0, seed=3),  # no losses: copies the first all the same
        job("adaptive=0.9;min=2", temperature=1.0, seed=4),  # runs every block in its prefill: copies
        job("skip=1", temperature=1.0, seed=5),  # other blocks: its own
        job("all", prompt=PROMPT[:-1], temperature=1.0, seed=6),  # another prompt: its own
    ]
    engine, counts = counted_engine(model)
    engine.add("first", jobs[0])
    engine.add("copy", jobs[1])
    engine.tick()  # both prefilled: the second copied
    own = Decoder(model, jobs[1].block_set, max_len=len(PROMPT) + jobs[1].max_new_tokens)
    own_stream = own.extend(PROMPT)  # [T, D]
    copied = engine.rows[1]
    cache = copied.generation.decoder.cache
    assert counts == {"prefills_copied": 1, "prompt_tokens_copied": len(PROMPT), "tokens_generated": 2}
    assert torch.equal(cache.k[:, :, :, : len(PROMPT)], own.cache.k[:, :, :, : len(PROMPT)])
    assert torch.equal(cache.v[:, :, :, : len(PROMPT)], own.cache.v[:, :, :, : len(PROMPT)])
    assert torch.equal(copied.last_stream, own_stream[-1]) and cache.length == len(PROMPT)
    engine, counts = counted_engine(model)
    last, _ = run(engine, jobs)
    assert counts["prefills_copied"] == 4
    for position, one in enumerate(jobs):
        by_itself, _ = run(Engine(model), [one])
        got, expected = last[position]["response"], by_itself[0]["response"]
        assert got["tokens"] == expected["tokens"] == alone(model, one), position
        assert got["score"] == expected["score"], position  # bit for bit, losses and top tokens


def test_a_prompt_waits_for_its_twin_ahead_and_copies_it_once_prefilled(model):
    """While rows decode, prompts advance a chunk a tick; a second copy of a prompt under way takes no
    chunk of its own, and has its first token in the tick its twin has its."""
    engine, counts = counted_engine(model, prefill_chunk=4)
    engine.add("running", job(max_new_tokens=30, stream=True))
    engine.tick()
    for name in ("first", "second"):
        engine.add(name, job(prompt=[7] * 10, max_new_tokens=3, stream=True, temperature=1.0, seed=len(name)))
    first_token = {}
    for tick in range(1, 5):
        for key, event in engine.tick():
            if key != "running" and event["event"] == "token":
                first_token.setdefault(key, tick)
    assert first_token == {"first": 3, "second": 3}  # 10 tokens in chunks of 4: the third tick
    assert counts["prefills_copied"] == 1
    last, _ = run(engine, [])
    for name in ("first", "second"):
        one = job(prompt=[7] * 10, max_new_tokens=3, temperature=1.0, seed=len(name))
        assert last[name]["response"]["tokens"] == alone(model, one)


def test_a_prompt_copies_the_whole_chunks_it_shares_and_prefills_the_rest(model):
    """A prompt sharing 8 tokens with a running one copies them (two chunks of 4) and prefills the
    rest; scoring, the second chunk's losses read the 9th token, which the two do not share, so it
    copies the first chunk alone. Tokens, losses and caches are those of its own prefill."""
    shared = tokens.encode("The quick brown fox jumps over the lazy dog")[:8]
    for score, copied in ((False, 8), (True, 4)):
        engine, counts = counted_engine(model, prefill_chunk=4)
        first = job(prompt=[*shared, 11, 12], max_new_tokens=8, score=score)
        engine.add("first", first)
        engine.tick()
        second = job(prompt=[*shared, 13, 14, 15], max_new_tokens=4, score=score, temperature=1.0, seed=2)
        engine.add("second", second)
        while not engine.rows[1].prefilled:  # copies, then prefills a chunk a tick
            engine.tick()
        assert counts["prompt_tokens_copied"] == copied and "prefills_copied" not in counts
        own = Decoder(model, second.block_set, max_len=64)
        for start in range(0, len(second.prompt_tokens), 4):  # in the engine's chunks
            own.extend(second.prompt_tokens[start : start + 4])
        cache = engine.rows[1].generation.decoder.cache
        end = len(second.prompt_tokens)
        assert torch.equal(cache.k[:, :, :, :end], own.cache.k[:, :, :, :end])
        last, _ = run(engine, [])
        by_itself, _ = run(Engine(model, prefill_chunk=4), [second])
        assert last["second"]["response"]["tokens"] == by_itself[0]["response"]["tokens"]
        assert last["second"]["response"]["score"] == by_itself[0]["response"]["score"]


def test_a_copy_scores_only_what_its_own_prefill_would():
    """Losses are copied only where the targets and the read-out are the same: a score-only request
    of the prompt and one token more feeds the same tokens but reads one target more, and exit=2
    under lens=tuned reads its losses out through a translator that exit=2 lacks."""
    torch.manual_seed(0)
    model = GPT(TinyModel(n_layer=N_LAYER).config()).eval()
    model.tuned_lens = random_lens(model)
    pairs = [
        [job("all", score=True), job("all", prompt=[*PROMPT, 7], max_new_tokens=0)],
        [job("exit=2", score=True), job("exit=2;lens=tuned", score=True)],
        [job("exit=2;lens=tuned", score=True), job("exit=2", score=True)],
    ]
    for pair in pairs:
        last, _ = run(Engine(model), pair)
        for position, one in enumerate(pair):
            by_itself, _ = run(Engine(model), [one])
            assert last[position]["response"]["score"] == by_itself[0]["response"]["score"], pair


def test_twins_that_end_at_their_prefill_are_copied_in_the_same_tick(model):
    """Identical prompts of one new token each (OpenAI's n with max_tokens 1): the first ends at its
    prefill, and the others, which waited for it, copy it in the same tick, whether or not the
    prompt cache keeps it (0 bytes: it does not)."""
    for cache_bytes, copies in ((256 << 20, 3), (0, 3)):
        engine, counts = counted_engine(model, prefill_chunk=8, prompt_cache_bytes=cache_bytes)
        engine.add("running", job(max_new_tokens=30))
        engine.tick()
        for name in "abcd":
            engine.add(name, job(prompt=[7] * 33, max_new_tokens=1))
        done = {}
        for tick in range(1, 8):
            for key, event in engine.tick():
                if event["event"] == "done" and key != "running":
                    done[key] = tick
        assert done == dict.fromkeys("abcd", 5)  # 33 tokens in chunks of 8: the fifth tick, together
        assert counts.get("prefills_copied", 0) == copies


def test_identical_prompts_wait_for_their_twin_even_with_a_shorter_prefix_kept(model):
    """A kept prefill of the prompts' first chunks does not stop identical prompts waiting for the
    first of them: one prefill of the rest, and three whole copies."""
    engine, counts = counted_engine(model, prefill_chunk=4)
    run(engine, [job(prompt=[5] * 8 + [9], max_new_tokens=1)])  # leaves [5] * 8's chunks kept
    engine.add("running", job(max_new_tokens=40))
    engine.tick()
    for seed in range(4):
        engine.add(seed, job(prompt=[5] * 8 + [6] * 9, max_new_tokens=3, temperature=1.0, seed=seed))
    last, _ = run(engine, [])
    assert counts["prefills_copied"] == 3
    for seed in range(4):
        one = job(prompt=[5] * 8 + [6] * 9, max_new_tokens=3, temperature=1.0, seed=seed)
        assert last[seed]["response"]["tokens"] == alone(model, one)


def test_a_prefill_that_ended_in_the_tick_is_copied_only_under_its_own_blocks():
    """A row that ends at its prefill leaves it for rows of the same tick; one of other blocks (the
    same prompt under all after skip=1) must not copy it, and draws what it draws alone."""
    torch.manual_seed(0)
    model = GPT(TinyModel(n_layer=N_LAYER).config()).eval()
    jobs = [job("skip=1", max_new_tokens=1), job("all", max_new_tokens=4, temperature=1.0, seed=3)]
    engine, counts = counted_engine(model)
    last, _ = run(engine, jobs)
    assert "prefills_copied" not in counts
    assert last[1]["response"]["tokens"] == alone(model, jobs[1])


def test_a_prefill_outlives_its_row_within_the_prompt_caches_bytes(model):
    """A row that ended leaves its prefill: a later row of the same prompt copies it, bit for bit;
    none is kept with a budget of 0 bytes, and the least recently used goes past the budget."""
    one, other = job(max_new_tokens=2), job(prompt=PROMPT[:-1], max_new_tokens=2)
    later = job(max_new_tokens=5, temperature=1.0, seed=9)
    engine, counts = counted_engine(model)
    run(engine, [one])
    last, _ = run(engine, [later])
    assert counts["prefills_copied"] == 1 and engine.prompt_cache.nbytes > 0
    assert counts["prompt_cache_bytes"] == engine.prompt_cache.nbytes  # what /stats sums
    assert last[0]["response"]["tokens"] == alone(model, later)
    engine, counts = counted_engine(model, prompt_cache_bytes=0)
    run(engine, [one])
    run(engine, [later])
    assert "prefills_copied" not in counts and engine.prompt_cache.nbytes == 0
    size = next(iter(counted_engine(model)[0].prompt_cache.prefills.values()), None)  # none yet
    assert size is None
    probe, _ = counted_engine(model)
    run(probe, [one])
    budget = probe.prompt_cache.nbytes + 1  # one prefill of PROMPT, not two
    engine, counts = counted_engine(model, prompt_cache_bytes=budget)
    run(engine, [one])
    run(engine, [other])  # evicts the first
    run(engine, [later])
    assert "prefills_copied" not in counts
    assert counts["prompt_cache_bytes"] == engine.prompt_cache.nbytes <= budget


def test_rows_need_only_their_own_context(model):
    """Each row has its own cache: a long prompt and a long generation run side by side although
    together they would not fit the context of one shared cache."""
    context = model.config.block_size  # 128
    jobs = [job(prompt=[7] * 10, max_new_tokens=context - 10), job(prompt=[7] * 100, max_new_tokens=20)]
    last, _ = run(Engine(model), jobs)
    assert [len(last[p]["response"]["tokens"]) for p in (0, 1)] == [context - 10, 20]
    assert last[1]["response"]["batch_size"] == 2


def test_a_quantized_model_serves_the_tokens_lab_generate_gives():
    from lab.quantize import quantize

    torch.manual_seed(0)
    for norm in ("pre", "post"):
        config = replace(TinyModel(n_layer=N_LAYER).config(), norm=norm)
        model = quantize(GPT(config).eval(), "int4")  # what `blocklab serve --dtype int4` runs
        jobs = [job("all"), job("all", prompt=PROMPT[:3]), job("exit=2", max_new_tokens=4)]
        last, _ = run(Engine(model), jobs)
        for position, one in enumerate(jobs):
            assert last[position]["response"]["tokens"] == alone(model, one)
        assert [last[p]["response"]["batch_size"] for p in range(3)] == [3, 3, 3]


def test_scoring_is_exact(model):
    texts = ["a b c d e f g h i j", "hello there", "one two three four five"]
    jobs = [job("exit=3", prompt=tokens.encode(text), max_new_tokens=0) for text in texts]
    last, _ = run(Engine(model), jobs)
    for position, text in enumerate(texts):
        expected = lab_generate.score(model, tokens.encode(text), BlockSet.parse("exit=3", N_LAYER))
        score = last[position]["response"]["score"]
        assert score["mean_loss"] == pytest.approx(expected.mean_loss, abs=1e-5)
        assert score["token_losses"] == pytest.approx(expected.token_losses, abs=1e-5)
        assert last[position]["response"]["finish_reason"] == "scored"


def test_a_failing_prefill_fails_its_request_alone(model):
    failing = job(prompt=tokens.encode("Please explode now"))
    last, _ = run(Engine(model), [job(), failing, job("skip=1")])
    assert (
        last[1]["event"] == "error" and last[1]["status"] == 500 and "injected failure" in last[1]["message"]
    )
    assert last[0]["event"] == "done" and last[2]["event"] == "done"
    assert last[0]["response"]["tokens"] == alone(model, job())


def test_a_failing_step_is_run_again_row_by_row(model):
    """A step that raises for one row (here: any row at position 9) fails that row only; the row it
    shared the step with gets its tokens from a step of its own, the same as alone."""

    class FailsAtPosition9(type(model)):
        def embed_tokens(self, idx, pos=0):
            if isinstance(pos, torch.Tensor) and bool((pos == 9).any()):
                raise RuntimeError("injected failure at position 9")
            return super().embed_tokens(idx, pos)

    failing_model = FailsAtPosition9(model.config)
    failing_model.load_state_dict(model.state_dict())
    failing_model.eval()
    doomed, bystander = job(prompt=PROMPT[:6], max_new_tokens=10), job(prompt=PROMPT[:2], max_new_tokens=6)
    counts = {}
    last, _ = run(Engine(failing_model, tally=lambda name, n: counts.update({name: counts.get(name, 0) + n})),
                  [doomed, bystander])  # fmt: skip
    assert last[0]["event"] == "error" and "position 9" in last[0]["message"]
    assert last[1]["event"] == "done" and last[1]["response"]["tokens"] == alone(model, bystander)
    assert counts["batches_split"] >= 1 and counts["requests_failed"] == 1 and counts["requests_done"] == 1


def test_a_job_whose_cancellation_check_raises_fails_alone(model):
    calls = {"n": 0}

    def cancelled_then_broken() -> bool:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("broken client check")
        return False

    engine, last = Engine(model), {}
    engine.add(0, job(), cancelled=cancelled_then_broken)
    engine.add(1, job(prompt=PROMPT[:2]))
    engine.add(2, job("skip=1"))
    while engine.busy:
        last.update(engine.tick())
    assert [last[p]["event"] for p in range(3)] == ["error", "done", "done"]
    assert last[0]["status"] == 500 and "broken client check" in last[0]["message"]


def test_a_cancelled_job_stops_without_another_event(model):
    cancelled = {"now": False}
    engine, events = Engine(model), []
    engine.add(0, job(max_new_tokens=20, stream=True), cancelled=lambda: cancelled["now"])
    engine.add(1, job(max_new_tokens=20))
    while engine.busy:
        events += [event for position, event in engine.tick() if position == 0]
        if len(events) == 3:
            cancelled["now"] = True
    assert len(events) == 3 and all(event["event"] == "token" for event in events)


def always_ends(model: GPT) -> GPT:
    """``model`` whose every read-out makes end-of-text overwhelmingly likely."""

    class AlwaysEnds(type(model)):
        def unembed(self, x):
            logits = super().unembed(x)
            logits[..., tokens.EOT] = 1e4
            return logits

    return AlwaysEnds(model.config).eval()


def test_end_of_text_stops_generation(model):
    last, _ = run(Engine(always_ends(model)), [job(max_new_tokens=5)])
    response = last[0]["response"]
    assert response["finish_reason"] == "stop" and response["tokens"] == [] and response["text"] == ""


def test_min_tokens_and_ignore_eos(model):
    ending = always_ends(model)
    jobs = [job(max_new_tokens=5, min_tokens=3), job(max_new_tokens=4, ignore_eos=True)]
    last, _ = run(Engine(ending), jobs)
    held = last[0]["response"]
    assert held["finish_reason"] == "stop" and len(held["tokens"]) == 3 and tokens.EOT not in held["tokens"]
    ignored = last[1]["response"]
    assert ignored["finish_reason"] == "length" and ignored["tokens"] == [tokens.EOT] * 4


def test_a_stop_string_ends_the_job_and_the_text_before_it(model):
    free, _ = run(Engine(model), [job(max_new_tokens=12)])
    text = free[0]["response"]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    cut = text.find(stop)
    last, _ = run(Engine(model), [job(max_new_tokens=12, stop=("never there", stop))])
    response = last[0]["response"]
    assert response["finish_reason"] == "stop" and response["text"] == text[:cut]
    assert len(response["tokens"]) < 12


def test_top_p_keeps_the_smallest_set_that_reaches_it(model):
    greedy, _ = run(Engine(model), [job(max_new_tokens=8)])
    nucleus, _ = run(Engine(model), [job(max_new_tokens=8, temperature=1.0, seed=3, top_p=1e-6)])
    assert nucleus[0]["response"]["tokens"] == greedy[0]["response"]["tokens"]  # only the top token is left
    wide, _ = run(Engine(model), [job(max_new_tokens=8, temperature=1.0, seed=3, top_p=1.0)])
    assert wide[0]["response"]["tokens"] == alone(model, job(max_new_tokens=8, temperature=1.0, seed=3))


def test_streamed_pieces_add_up_to_the_text(model):
    _, seen = run(Engine(model), [job(max_new_tokens=12, temperature=1.0, seed=3, stream=True)])
    pieces = [event["text"] for event in seen[0] if event["event"] == "token"]
    text = seen[0][-1]["response"]["text"]
    assert text.startswith("".join(pieces)) and len(pieces) == 12


def probed_tiny_model(device: str, config=None) -> GPT:
    """TinyModel with an exit probe that is never sure: adaptive exit with check=probe runs every
    block. With ``config``, a random GPT of that config with a random probe (sure about some tokens)."""
    from lab.exit_probe import ExitProbe

    if config is None:
        model = TinyModel(n_layer=N_LAYER, block_size=32)(device)
        weight, bias = torch.zeros(N_LAYER, model.config.n_embd), torch.full((N_LAYER,), -20.0)
    else:
        model = GPT(config).to(device).eval()
        weight, bias = torch.randn(N_LAYER, config.n_embd), torch.zeros(N_LAYER)
    model.exit_probe = ExitProbe(weight, bias)
    return model


def test_resolve_refuses_what_does_not_fit_the_model():
    limits = ModelLimits(N_LAYER, 32)
    for request, field, words in [
        (PredictRequest(prompt="hello there", exit_at=N_LAYER + 1), "exit_at", "must be in 1..4"),
        (PredictRequest(prompt="word " * 40, max_new_tokens=1), "prompt", "context length"),
        (
            PredictRequest(prompt="hello there", blocks="adaptive=0.9;check=probe"),
            "blocks",
            "needs an exit probe",
        ),
        (
            PredictRequest(prompt="hello there", adaptive=0.9, adaptive_check="probe"),
            "adaptive_check",
            "probe",
        ),
        (PredictRequest(prompt="hello there", blocks="speculate=2", min_tokens=1), "min_tokens", "speculate"),
    ]:  # the limits say: no exit probe
        with pytest.raises(RequestError) as error:
            resolve(request, limits)
        assert error.value.field == field and words in error.value.message, error.value
    resolved = resolve(PredictRequest(prompt="hello there", blocks="skip=0", seed=5), limits)
    assert resolved.block_set == BlockSet(skip=frozenset({0})) and resolved.prompt_tokens == tokens.encode(
        "hello there"
    )
    assert resolved.sampling == SamplingParams(seed=5) and resolved.max_new_tokens == 16
    drawn = resolve(PredictRequest(prompt="hello there"), limits).sampling.seed
    assert drawn is not None and drawn != resolve(PredictRequest(prompt="hello there"), limits).sampling.seed


def test_lens_tuned_is_refused_by_a_model_without_a_lens_saying_how_to_fit_one():
    from serve import app
    from serve.http_front import Front

    class LoadedPool:  # a pool whose workers published a model without a tuned lens
        def limits(self) -> ModelLimits:
            return ModelLimits(N_LAYER, 32)

    limits = Front(LoadedPool(), model_name="builtin").limits()
    for request, field in [
        (PredictRequest(prompt="hello there", blocks="exit=2;lens=tuned"), "blocks"),
        (PredictRequest(prompt="hello there", exit_at=2, lens="tuned"), "lens"),
        (PredictRequest(prompt="hello there", blocks="speculate=2;lens=tuned"), "blocks"),
    ]:
        with pytest.raises(RequestError) as error:
            resolve(request, limits)
        assert error.value.field == field
        assert "has none: fit one with `blocklab lens fit --model builtin`" in error.value.message
    with_lens = replace(limits, tuned_lens=True)
    request = PredictRequest(prompt="hello there", exit_at=2, lens="tuned")
    assert resolve(request, with_lens).block_set == BlockSet(exit_at=2, lens="tuned")
    config = app.ServeConfig(model="builtin", default_blocks="exit=6;lens=tuned")
    with pytest.raises(RuntimeError, match="lens=tuned needs .* `blocklab lens fit --model builtin`"):
        app._check_default_blocks(config, ModelLimits(12, 64))
    app._check_default_blocks(config, ModelLimits(12, 64, tuned_lens=True))


def test_a_draft_vocabulary_is_refused_by_a_lens_without_a_ranking():
    from serve import app

    drafting = PredictRequest(prompt="hello there", blocks="speculate=2;vocab=256")
    for limits, cause in [(ModelLimits(N_LAYER, 32), "no tuned lens"),
                          (ModelLimits(N_LAYER, 32, tuned_lens=True), "a lens fitted before")]:  # fmt: skip
        with pytest.raises(RequestError) as error:
            resolve(drafting, replace(limits, model_name="builtin"))
        assert error.value.field == "blocks" and cause in error.value.message
        assert "`blocklab lens fit --model builtin`" in error.value.message
    ranked = ModelLimits(N_LAYER, 32, tuned_lens=True, ranking=True)
    assert resolve(drafting, ranked).block_set.draft_vocabulary == 256
    config = app.ServeConfig(model="builtin", default_blocks="speculate=6;vocab=256")
    with pytest.raises(RuntimeError, match="vocab=N drafts .* `blocklab lens fit --model builtin`"):
        app._check_default_blocks(config, ModelLimits(12, 64, tuned_lens=True))
    app._check_default_blocks(config, replace(ranked, n_layer=12))


def test_the_worker_runs_resolved_jobs_from_its_inbox():
    """``Worker.serve`` through plain queues, as the pool feeds it: orders in, each marked taken in
    its slot's cell, and the events out; a cancelled order ends without an event, one that waited too
    long gets 504."""
    import queue

    shared = SharedState(slots=4)
    worker = Worker(probed_tiny_model, shared, queue_timeout=60.0)
    worker.load("cpu")
    assert shared.limits() == ModelLimits(N_LAYER, 32, exit_probe=True)
    assert shared.model_info()["exit_probe"] is True
    spec = "adaptive=0.9;check=probe"
    probed = resolve(PredictRequest(prompt="hello there", blocks=spec), shared.limits())
    stale = replace(probed, submitted_at=time.monotonic() - 120)
    inbox, outbox = queue.Queue(), queue.Queue()
    shared.cancelled[2] = 3  # the third order is cancelled before it runs
    for order in (Order(1, 0, probed), Order(2, 1, stale), Order(3, 2, probed), None):
        inbox.put(order)
    worker.serve(inbox, outbox, worker_id=0)  # returns at the None
    messages = [outbox.get_nowait() for _ in range(outbox.qsize())]
    taken = [shared.was_taken(slot, ticket) for slot, ticket in ((0, 1), (1, 2), (2, 3), (3, 4))]
    assert taken == [True, True, True, False]  # no order held slot 3
    events = dict(messages)
    assert set(events) == {1, 2}  # the cancelled one sent nothing
    assert events[1]["event"] == "done" and events[1]["response"]["block_set"] == spec
    assert set(events[1]["response"]["blocks_per_token"]) == {N_LAYER}  # the probe is never sure
    assert events[2]["status"] == 504 and "in the queue" in events[2]["message"]
    assert shared.totals()["requests_done"] == 1 and shared.totals()["requests_cancelled"] == 1


def test_a_prompts_first_token_leaves_when_its_prefill_ends(model):
    """``tick_parts``: requests arriving together are prefilled one after another in a tick, and
    each one's first token is a part of its own, sent before the next prompt's prefill runs."""
    engine = Engine(model)
    for key in ("a", "b", "c"):
        engine.add(key, job(max_new_tokens=3, stream=True))
    parts = [[key for key, _ in part] for part in engine.tick_parts()]
    assert [keys for keys in parts if keys] == [["a"], ["b"], ["c"]]


def test_a_replacement_worker_counts_on_but_holds_no_cache_yet():
    shared = SharedState(4)
    tally = shared.tally(0)
    tally("tokens_generated", 5)
    tally("prompt_cache_bytes", 1000)
    shared.tally(0)  # the worker died; its replacement takes its row
    assert shared.totals()["tokens_generated"] == 5 and shared.totals()["prompt_cache_bytes"] == 0


def test_a_prefill_the_cache_cannot_keep_loses_no_request(model, monkeypatch):
    """Keeping a finished row's prefill is an optimisation: should it fail, the row's done event still
    leaves (a request whose event was lost would wait for ever), and the next row computes its own."""

    def broken(self, prefill):
        raise RuntimeError("no room")

    monkeypatch.setattr("serve.prompt_cache.PromptCache.keep", broken)
    last, _ = run(Engine(model), [job(max_new_tokens=3), job(max_new_tokens=3, seed=2)])
    assert [last[p]["event"] for p in (0, 1)] == ["done", "done"]


def test_compiled_decoders_caches_are_neither_copied_nor_kept(model):
    """lab.fast's caches hold a tensor per block (``layers_apart``): a row of one has no setting, so
    no other row copies it or is copied into it (views of an [L, ...] tensor would fail there)."""
    from lab import fast

    engine = Engine(fast.accelerate(TinyModel(n_layer=N_LAYER)("cpu")))
    engine.add(0, job())
    assert isinstance(engine.rows[0].generation.decoder.cache.k, list)
    assert engine.rows[0].setting is None


@pytest.fixture
def two_threads():
    """torch at 2 threads: the prefill lane takes one of them (it stays shut at 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


def with_kernels(model: GPT) -> GPT:
    """``model`` with lab's products (as the server loads one on a CPU where lab.intmm builds): the
    prefill lane opens only where they compute, their bits the same at any thread count."""
    from lab.block_kernel import use_block_kernels
    from lab.float_kernels import use_float_kernels

    if model.read_out is None:  # not quantized: float weights
        use_float_kernels(model)
    return use_block_kernels(model)


def held_lane(engine: Engine) -> threading.Event:
    """Hold every prefill ``engine`` hands its lane until the returned event is set."""
    release, prefill = threading.Event(), engine._prefill_in_lane

    def held(row):
        assert release.wait(30)
        return prefill(row)

    engine._prefill_in_lane = held
    return release


@pytest.fixture(scope="module")
def kernel_model():
    if intmm.unavailable() is not None:
        pytest.skip(str(intmm.unavailable()))
    return with_kernels(TinyModel(n_layer=N_LAYER, fail_token=tokens.encode(" explode")[0])("cpu"))


def test_a_prompt_arriving_while_rows_decode_is_prefilled_beside_them(kernel_model, two_threads, monkeypatch):
    """With the prefill lane, the running row takes a token every tick while the arriving prompt's
    prefill is held in the lane; the steps meanwhile run on one thread fewer; once the prefill ends,
    its first token and the rest are those it gets alone."""
    from serve import engine as engine_module

    threads_per_step = []
    decode_rows = engine_module.decode_rows

    def counting_threads(*args):
        threads_per_step.append(torch.get_num_threads())
        return decode_rows(*args)

    monkeypatch.setattr(engine_module, "decode_rows", counting_threads)
    model = kernel_model
    engine, counts = counted_engine(model, prefill_lane=True)
    release = held_lane(engine)
    engine.add("running", job(max_new_tokens=30, stream=True))
    engine.tick()
    arriving = job("skip=1", prompt=PROMPT[:5], max_new_tokens=4, temperature=1.0, seed=3)
    engine.add("arriving", arriving)
    for _ in range(4):
        assert [key for key, _ in engine.tick()] == ["running"]  # a token, and nothing waits on the lane
    assert threads_per_step[-4:] == [1, 1, 1, 1]
    release.set()
    last = {}
    while "arriving" not in last:
        last.update(engine.tick())
    assert last["arriving"]["response"]["tokens"] == alone(model, arriving)
    assert counts["prefills_in_lane"] == 1 and threads_per_step[-1] == 2  # the lane is idle again


@NO_KERNELS
@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_the_lane_prefills_what_the_line_prefills(dtype, two_threads):
    """Rows arriving while others decode, in the lane and in line: the same seeded tokens to the bit,
    whatever the block set and however many chunks; a prompt that scores stays in line."""
    from lab.quantize import quantize

    torch.manual_seed(0)
    model = TinyModel(n_layer=N_LAYER)("cpu")
    if dtype == "int4":
        model = quantize(model.to(torch.bfloat16), "int4")
    model = with_kernels(model)
    long_prompt = tokens.encode(" the lazy dog while the quick brown fox" * 4)
    settings = [("all", long_prompt), ("skip=1", PROMPT), ("exit=2", PROMPT[:3]), ("keep=0,2", PROMPT[:7]),
                ("overwrite=3", long_prompt[:20]), ("adaptive=0.8", PROMPT[:6]),
                ("speculate=2", PROMPT[:5])]  # fmt: skip
    arriving = [
        job(spec, prompt=prompt, temperature=1.0, seed=seed, max_new_tokens=5)
        for seed, (spec, prompt) in enumerate(settings)
    ] + [job("skip=2", prompt=long_prompt[:30], temperature=1.0, max_new_tokens=3, score=True)]
    answers = {}
    for lane in (False, True):
        engine, counts = counted_engine(model, max_rows=10, prefill_chunk=16, prefill_lane=lane)
        engine.add("running", job(prompt=[11] * 5, max_new_tokens=40))
        engine.tick()
        last = {}
        for position, one in enumerate(arriving):
            engine.add(position, one)
            last.update(engine.tick())
        while engine.busy:
            last.update(engine.tick())
        answers[lane] = [last[position]["response"] for position in range(len(arriving))]
        assert counts.get("prefills_in_lane", 0) == (len(settings) if lane else 0)  # not the scoring one
    for in_line, in_lane in zip(answers[False], answers[True], strict=True):
        assert in_lane["tokens"] == in_line["tokens"] and in_lane["score"] == in_line["score"]
        assert in_lane["blocks_per_token"] == in_line["blocks_per_token"]


@NO_KERNELS
def test_prompts_that_score_beside_a_busy_lane_get_the_losses_they_get_alone(two_threads):
    """A prompt's losses read out many positions at once through torch's matrix product, whose last
    bits follow the thread count (for some lengths here): scoring prompts that arrive while the lane
    is busy are prefilled in line at the worker's full count, so their scores are exactly those
    alone (in the lane, or in line at one thread fewer, some differed)."""
    torch.manual_seed(0)
    model = with_kernels(TinyModel(n_layer=N_LAYER, n_embd=128, n_head=4)("cpu"))
    rng = random.Random(0)
    prompts = [[rng.randrange(50000) for _ in range(length)] for length in range(2, 42)]
    engine, counts = counted_engine(model, max_rows=len(prompts) + 2, prefill_lane=True)
    release = held_lane(engine)
    engine.add("running", job(max_new_tokens=60))
    engine.tick()
    engine.add("held", job(prompt=PROMPT[:4], max_new_tokens=2))  # keeps the lane busy
    engine.tick()
    last = {}
    for position, prompt in enumerate(prompts):
        engine.add(position, job(prompt=prompt, max_new_tokens=0, score=True))
        last.update(engine.tick())
    release.set()
    while engine.busy:
        last.update(engine.tick())
    for position, prompt in enumerate(prompts):
        scoring = job(prompt=prompt, max_new_tokens=0, score=True)
        by_itself, _ = run(Engine(model, prefill_lane=False), [scoring])
        assert last[position]["response"]["score"] == by_itself[0]["response"]["score"], len(prompt)
    assert counts["prefills_in_lane"] == 1


def test_a_prompt_cancelled_or_failing_in_the_lane_ends_alone(kernel_model, two_threads):
    """Cancelled while the lane prefills it: no event, counted cancelled, the lane stops; a prefill
    that raises in the lane: a 500 for that request; the running row finishes as alone."""
    model = kernel_model
    gone = {"now": False}
    engine, counts = counted_engine(model, prefill_chunk=16, prefill_lane=True)
    release = held_lane(engine)
    engine.add("running", job(max_new_tokens=12))
    engine.tick()
    engine.add("cancelled", job(prompt=[7] * 100, max_new_tokens=3), cancelled=lambda: gone["now"])
    engine.add("failing", job(prompt=tokens.encode("Please explode now")))
    last, seen = {}, []
    for _ in range(2):  # both in the lane, held there; then the first one's client leaves
        seen += [key for key, _ in engine.tick()]
    gone["now"] = True
    engine.tick()
    release.set()
    while engine.busy:
        events = engine.tick()
        seen += [key for key, _ in events]
        last.update(events)
    assert "cancelled" not in seen and counts["requests_cancelled"] == 1
    assert last["failing"]["status"] == 500 and "injected failure" in last["failing"]["message"]
    assert last["running"]["response"]["tokens"] == alone(model, job(max_new_tokens=12))
    assert counts["prefills_in_lane"] == 2 and not engine.lane.pending


def test_the_lane_stays_shut_at_one_thread_under_hooks_and_without_the_kernels(
    model, kernel_model, two_threads
):
    """One thread: none to spare; a hooked model: its hooks would see two passes at once; a model
    without lab's products: torch's, whose bits follow the thread count. Prompts prefill in line."""
    for threads, hook, subject in ((1, False, kernel_model), (2, True, kernel_model), (2, False, model)):
        torch.set_num_threads(threads)
        handle = subject.blocks[0].register_forward_hook(lambda *args: None) if hook else None
        try:
            engine, counts = counted_engine(subject, prefill_lane=True)
            engine.add("running", job(max_new_tokens=8))
            engine.tick()
            engine.add("skipping", job("skip=1"))
            engine.add("short", job(prompt=PROMPT[:3]))
            last = {}
            while engine.busy:
                last.update(engine.tick())
        finally:
            if handle is not None:
                handle.remove()
        assert all(event["event"] == "done" for event in last.values())
        assert counts.get("prefills_in_lane", 0) == 0


def test_the_lane_keeps_its_one_thread_whatever_the_steps_beside_it_set(two_threads):
    """torch gives a thread its count from the process's last ``set_num_threads`` on its first
    parallel op, not at its own ``set_num_threads``: the lane's thread must take that first before it
    sets 1, or a step beside it (``_threads_beside_lane`` restoring 2) hands it 2 for good."""
    from types import SimpleNamespace

    from serve.engine import PrefillLane

    lane, go = PrefillLane(), threading.Event()
    lane.submit(SimpleNamespace(in_lane=False), lambda row: None)
    lane.pending[-1][1].result(10)  # the lane's thread started: its initializer ran

    def prefill(row):
        assert go.wait(10)
        return torch.get_num_threads()

    lane.submit(SimpleNamespace(in_lane=False), prefill)
    torch.set_num_threads(1)  # a decode step beside the lane, one thread fewer, then 2 again
    torch.set_num_threads(2)
    go.set()
    assert lane.pending[-1][1].result(10) == 1
    assert torch.get_num_threads() == 2
    lane.executor.shutdown()


def test_a_row_whose_copy_failed_is_not_handed_to_the_lane(kernel_model, two_threads):
    """A prompt's copy of what another prefill computed raises: the row ends with its 500 there, and
    goes to the lane neither (nothing to prefill for it) nor into its count."""
    engine, counts = counted_engine(kernel_model, prefill_chunk=4, prefill_lane=True)
    engine.add("running", job(max_new_tokens=8))
    engine.tick()
    engine._source = lambda row: (None, 4)  # a prefill to copy the first chunk of

    def failing_copy(row, prefill, count):
        raise RuntimeError("copy failed")

    engine._copy = failing_copy
    engine.add("copying", job(prompt=PROMPT))
    last = {}
    while engine.busy:
        last.update(engine.tick())
    assert last["copying"]["status"] == 500 and "copy failed" in last["copying"]["message"]
    assert counts.get("prefills_in_lane", 0) == 0 and not engine.lane.pending


def test_a_prefill_that_ends_during_the_step_sends_its_first_token_in_that_tick(
    kernel_model, two_threads, monkeypatch
):
    """The lane is read at the tick's end too: a prompt whose prefill ends while the step runs sends
    its first token in that tick, not a step later."""
    from serve import engine as engine_module

    engine = Engine(kernel_model, prefill_lane=True)
    release = held_lane(engine)
    decode_rows = engine_module.decode_rows

    def releasing(*args):
        if not release.is_set() and engine.lane.pending:
            release.set()
            engine.lane.pending[-1][1].result(10)  # the prefill ends during the step
        return decode_rows(*args)

    engine.add("running", job(max_new_tokens=20))
    engine.tick()
    monkeypatch.setattr(engine_module, "decode_rows", releasing)
    engine.add("arriving", job(prompt=PROMPT[:4], max_new_tokens=3, stream=True))
    events = engine.tick()
    assert [event["event"] for key, event in events if key == "arriving"] == ["token"]
