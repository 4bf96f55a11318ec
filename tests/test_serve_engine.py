"""The server's inference in-process: batched groups against ``lab.generate``, isolation, cancellation."""

import time
from dataclasses import replace

import pytest
import torch

from lab import generate as lab_generate
from lab import tokens
from lab.blocks import BlockSet
from lab.model import GPT
from serve.api import BlockLabAPI, Rejection, SharedState
from serve.engine import Engine, Job
from serve.schema import PredictRequest
from serve.testing import TinyModel

N_LAYER = 4
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
    return Job(
        request_id=None,
        prompt_tokens=prompt,
        block_set=BlockSet.parse(block_set, N_LAYER),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=extra.pop("top_k", None),
        seed=seed,
        score=score,
        stream=extra.pop("stream", False),
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
        temperature=one.temperature,
        top_k=one.top_k,
        seed=one.seed,
        stop_token=tokens.EOT,
        block_set=one.block_set,
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
        assert response["batch_size"] == 3  # one group: same block set


def test_prompts_of_different_lengths_share_one_batch(model):
    prompts = [PROMPT, PROMPT[:2], tokens.encode("A much longer prompt than the others, with more tokens")]
    settings = [(0.0, 1), (1.0, 2), (0.7, 3)]  # (temperature, seed)
    jobs = [
        job("skip=2", prompt=p, temperature=t, seed=s) for p, (t, s) in zip(prompts, settings, strict=True)
    ]
    last, _ = run(Engine(model), jobs)
    for position, one in enumerate(jobs):
        response = last[position]["response"]
        assert response["tokens"] == alone(model, one)
        assert response["batch_size"] == 3


def test_groups_are_packed_to_fit_the_context(model):
    context = model.config.block_size  # 128
    short, long = [7] * 10, [7] * 100
    engine = Engine(model)
    fits = [job(prompt=short, max_new_tokens=20), job(prompt=long, max_new_tokens=20)]
    assert [len(g.members) for g in engine.groups(list(enumerate(fits)), time.monotonic())] == [2]
    # 100 prompt tokens + the short one's 100 new tokens would not fit 128: two groups
    apart = [job(prompt=short, max_new_tokens=context - 10), job(prompt=long, max_new_tokens=20)]
    assert [len(g.members) for g in engine.groups(list(enumerate(apart)), time.monotonic())] == [1, 1]
    last, _ = run(engine, apart)
    assert all(event["event"] == "done" for event in last.values())


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
        assert [last[p]["response"]["batch_size"] for p in range(3)] == [2, 2, 1]


def test_right_padded_scoring_is_exact(model):
    texts = ["a b c d e f g h i j", "hello there", "one two three four five"]
    jobs = [job("exit=3", prompt=tokens.encode(text), max_new_tokens=0) for text in texts]
    last, _ = run(Engine(model), jobs)
    for position, text in enumerate(texts):
        expected = lab_generate.score(model, tokens.encode(text), BlockSet.parse("exit=3", N_LAYER))
        score = last[position]["response"]["score"]
        assert score["mean_loss"] == pytest.approx(expected.mean_loss, abs=1e-5)
        assert score["token_losses"] == pytest.approx(expected.token_losses, abs=1e-5)
        assert last[position]["response"]["batch_size"] == 3


def test_block_sets_are_never_mixed(model):
    specs = ["all", "skip=2", "exit=2", "overwrite=1", "all", "skip=2"]
    together, _ = run(Engine(model), [job(spec, score=True) for spec in specs])
    for position, spec in enumerate(specs):
        alone, _ = run(Engine(model), [job(spec, score=True)])
        assert together[position]["response"]["tokens"] == alone[0]["response"]["tokens"]
        assert together[position]["response"]["score"]["mean_loss"] == pytest.approx(
            alone[0]["response"]["score"]["mean_loss"], abs=1e-5
        )
        assert together[position]["response"]["block_set"] == spec


def test_a_failing_request_does_not_take_the_others_down(model):
    """The failing request is batched with job 0 (same block set): the batch fails at its prefill,
    then each of its jobs runs again alone; only the failing one gets the error."""
    failing = job(prompt=tokens.encode("Please explode now"))
    last, _ = run(Engine(model), [job(), failing, job("skip=1")])
    assert (
        last[1]["event"] == "error" and last[1]["status"] == 500 and "injected failure" in last[1]["message"]
    )
    assert last[0]["event"] == "done" and last[2]["event"] == "done"
    assert last[0]["response"]["batch_size"] == 1  # it ran again alone
    assert last[0]["response"]["tokens"] == alone(model, job())


def test_a_failure_after_the_first_step_ends_every_job_of_the_group(model):
    """Once tokens went out a batch cannot start again: each of its jobs gets the error (500)."""
    calls = {"n": 0}

    def cancelled_then_broken() -> bool:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("broken client check")
        return False

    jobs = [job(cancelled=cancelled_then_broken), job(prompt=PROMPT[:2]), job("skip=1")]
    last, _ = run(Engine(model), jobs)
    assert [last[p]["event"] for p in range(3)] == ["error", "error", "done"]
    assert last[0]["status"] == last[1]["status"] == 500 and "broken client check" in last[0]["message"]


def test_a_cancelled_job_stops_without_another_event(model):
    cancelled = {"now": False}
    streaming = job(max_new_tokens=20, stream=True, cancelled=lambda: cancelled["now"])
    events = []
    for tick in Engine(model).run([(0, streaming), (1, job(max_new_tokens=20))]):
        events += [event for position, event in tick if position == 0]
        if len(events) == 3:
            cancelled["now"] = True
    assert len(events) == 3 and all(event["event"] == "token" for event in events)


def test_end_of_text_stops_generation(model):
    class AlwaysEnds(type(model)):
        def unembed(self, x):
            logits = super().unembed(x)
            logits[..., tokens.EOT] = 1e4
            return logits

    ending = AlwaysEnds(model.config)
    last, _ = run(Engine(ending.eval()), [job(max_new_tokens=5)])
    response = last[0]["response"]
    assert response["finish_reason"] == "stop" and response["tokens"] == [] and response["text"] == ""


def test_streamed_pieces_add_up_to_the_text(model):
    _, seen = run(Engine(model), [job(max_new_tokens=12, temperature=1.0, seed=3, stream=True)])
    pieces = [event["text"] for event in seen[0] if event["event"] == "token"]
    text = seen[0][-1]["response"]["text"]
    assert text.startswith("".join(pieces)) and len(pieces) == 12


def probed_tiny_model(device: str) -> GPT:
    """TinyModel with an exit probe that is never sure: adaptive exit with check=probe runs every block."""
    from lab.exit_probe import ExitProbe

    model = TinyModel(n_layer=N_LAYER, block_size=32)(device)
    model.exit_probe = ExitProbe(torch.zeros(N_LAYER, model.config.n_embd), torch.full((N_LAYER,), -20.0))
    return model


def test_decode_request_rejects_what_does_not_fit_the_model():
    api = BlockLabAPI(TinyModel(n_layer=N_LAYER, block_size=32), SharedState(max_in_flight=4))
    api.load("cpu")
    assert api.shared.limits().n_layer == N_LAYER
    rejected = api.decode_request(PredictRequest(prompt="hello there", exit_at=N_LAYER + 1))
    assert isinstance(rejected, Rejection) and rejected.status == 422 and "exit_at" in rejected.message
    too_long = api.decode_request(PredictRequest(prompt="word " * 40, max_new_tokens=1))
    assert isinstance(too_long, Rejection) and "context length" in too_long.message
    for request, field in [
        (PredictRequest(prompt="hello there", blocks="adaptive=0.9;check=probe"), "blocks"),
        (PredictRequest(prompt="hello there", adaptive=0.9, adaptive_check="probe"), "adaptive_check"),
    ]:  # TinyModel has no exit probe
        no_probe = api.decode_request(request)
        assert isinstance(no_probe, Rejection) and no_probe.status == 422
        assert no_probe.message.startswith(f"{field}: check=probe needs an exit probe")
    assert api.shared.model_info()["exit_probe"] is False
    with_probe = BlockLabAPI(probed_tiny_model, SharedState(max_in_flight=4))
    with_probe.load("cpu")
    spec = "adaptive=0.9;check=probe"
    probed = with_probe.decode_request(PredictRequest(prompt="hello there", blocks=spec))
    assert isinstance(probed, Job) and with_probe.shared.model_info()["exit_probe"] is True
    events = [event for tick in with_probe.predict([probed]) for _, event in tick]
    assert events[-1]["event"] == "done" and events[-1]["response"]["block_set"] == spec
    assert set(events[-1]["response"]["blocks_per_token"]) == {N_LAYER}  # the probe is never sure
    accepted = api.decode_request(PredictRequest(prompt="hello there", blocks="skip=0"))
    assert isinstance(accepted, Job) and accepted.block_set == BlockSet(skip=frozenset({0}))
    events = [event for tick in api.predict([rejected, accepted]) for event in tick]
    assert {position for position, _ in events} == {0, 1}
