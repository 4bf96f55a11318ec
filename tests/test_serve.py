"""The server over real HTTP: one tiny-model server for the module, on a free loopback port."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from lab import tokens
from serve.process import ServerProcess
from tests.tiny import TinyModel

KEY = "test-key"
HEADERS = {"X-API-Key": KEY}
FAIL_WORD, SLOW_WORD = " explode", " sleepy"  # one token each; see TinyModel
N_LAYER, CONTEXT = 4, 128
PROMPT = "The quick brown fox jumps over the lazy dog because"


SERVED = TinyModel(
    n_layer=N_LAYER,
    block_size=CONTEXT,
    fail_token=tokens.encode(FAIL_WORD)[0],
    slow_token=tokens.encode(SLOW_WORD)[0],
    slow_s=0.5,
    tuned_lens=True,
)


@pytest.fixture(scope="module")
def server():
    model = SERVED
    args = [
        "--model",
        "tiny-test",
        "--api-key",
        KEY,
        "--threads",
        "1",
        "--max-batch-size",
        "8",
        "--max-payload-bytes",
        "20000",
    ]
    with ServerProcess(args, model_factory=model) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=HEADERS, timeout=30.0) as http:
        yield http


def predict(client, **body) -> dict:
    response = client.post("/predict", json=body)
    assert response.status_code == 200, response.text
    return response.json()


BAD_BODIES = [
    ("", "body"),
    ("{not json", "body"),
    ("[1, 2]", "body"),
    ('{"max_new_tokens": 4}', "prompt"),
    ('{"prompt": ""}', "prompt"),
    ('{"prompt": "\\ud800"}', "prompt"),
    ('{"prompt": "a", "colour": "red"}', "colour"),
    ('{"prompt": "a", "max_new_tokens": "5"}', "max_new_tokens"),
    ('{"prompt": "a", "max_new_tokens": -1}', "max_new_tokens"),
    ('{"prompt": "a", "max_new_tokens": 1000000}', "max_new_tokens"),
    ('{"prompt": "a", "max_new_tokens": 128}', "max_new_tokens"),  # prompt + new > context
    ('{"prompt": "a", "temperature": NaN}', "temperature"),
    ('{"prompt": "a", "temperature": -1}', "temperature"),
    ('{"prompt": "a", "temperature": 1e-60}', "temperature"),  # would overflow to NaN probabilities
    ('{"prompt": "a", "stream": 1}', "stream"),
    ('{"prompt": "a", "skip": [4]}', "skip"),
    ('{"prompt": "a", "skip": [1, 1]}', "skip"),
    ('{"prompt": "a", "keep": [0, 9]}', "keep"),
    ('{"prompt": "a", "exit_at": 5}', "exit_at"),
    ('{"prompt": "a", "exit_at": 0}', "exit_at"),
    ('{"prompt": "a", "overwrite": [2], "skip": [2]}', "overwrite"),
    ('{"prompt": "a", "adaptive": 1.5}', "adaptive"),
    ('{"prompt": "a", "adaptive_min_blocks": 2}', "adaptive_min_blocks"),
    ('{"prompt": "a", "adaptive": 0.9, "exit_at": 2}', "exit_at"),
    ('{"prompt": "a", "skip": [1], "keep": [2]}', "keep"),
    ('{"prompt": "a", "blocks": "skip=1", "skip": [1]}', "blocks"),
    ('{"prompt": "a", "blocks": "skip=9"}', "blocks"),
    ('{"prompt": "a", "blocks": "frobnicate=1"}', "blocks"),
    ('{"prompt": "a", "blocks": "adaptive=0.9;check=probe"}', "blocks"),  # the tiny model has no probe
    ('{"prompt": "a", "adaptive": 0.9, "adaptive_check": "probe"}', "adaptive_check"),
    ('{"prompt": "a", "adaptive": 0.9, "adaptive_check": "vibes"}', "adaptive_check"),
    ('{"prompt": "a", "adaptive_check": "probe"}', "adaptive_check"),  # without adaptive
    ('{"prompt": "a", "max_new_tokens": 0}', "prompt"),  # scoring needs two tokens
    ('{"prompt": "' + "word " * 200 + '"}', "prompt"),  # over the context
    ('{"prompt_ids": [1], "max_new_tokens": 0}', "prompt_ids"),  # the field given, not "prompt"
    ('{"prompt_ids": [' + "1, " * 200 + "1]}", "prompt_ids"),
]


@pytest.mark.parametrize(("body", "field"), BAD_BODIES, ids=[field for _, field in BAD_BODIES])
def test_bad_input_gets_422_naming_the_field(client, body, field):
    response = client.post("/predict", content=body.encode(), headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert field in response.text


def test_undecodable_body_and_oversized_body(client):
    response = client.post(
        "/predict", content=b'{"prompt": "\xff\xfe"}', headers={"Content-Type": "application/json"}
    )
    assert response.status_code in (400, 422), response.text  # FastAPI: 400 "error parsing the body"
    big = json.dumps({"prompt": "x" * 30_000})
    assert (
        client.post("/predict", content=big, headers={"Content-Type": "application/json"}).status_code == 413
    )


def test_oversized_headers_get_400_and_the_server_keeps_serving(server, client):
    padding = {"X-Padding": "a" * 1_000_000}
    with httpx.Client(base_url=server.url, headers=HEADERS) as new_connection:
        for sender in (new_connection, client):  # a connection's first request, and a reused one's
            response = sender.post("/predict", json={"prompt": PROMPT}, headers=padding)
            # parsing stops past 32 kB (serve.connections), so the header is never held whole; the server
            # reads and drops the rest while the client sends it, or closing would reset the 400 away
            assert response.status_code == 400
    assert predict(client, prompt=PROMPT, max_new_tokens=1)["finish_reason"] == "length"


def test_quantized_weights_are_refused_off_the_cpu_before_anything_starts(capsys):
    from lab import cli

    assert cli.main(["serve", "--dtype", "int4", "--accelerator", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "blocklab serve: --dtype int4 runs on the CPU: use --accelerator cpu (or auto)\n"
    )


def field_docstrings(cls) -> dict[str, str]:
    """Each dataclass field's docstring (the string right after it in the class body)."""
    import ast
    import inspect
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    return {
        field.target.id: " ".join(doc.value.value.split())
        for field, doc in zip(body, body[1:], strict=False)
        if isinstance(field, ast.AnnAssign)
        and isinstance(doc, ast.Expr)
        and isinstance(doc.value, ast.Constant)
    }


def test_serve_help_is_every_serve_config_field_with_its_docstring(capsys):
    from dataclasses import fields

    from serve.app import ServeConfig, options

    with pytest.raises(SystemExit) as exit_info:
        options(["--help"])
    assert exit_info.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    docstrings = field_docstrings(ServeConfig)
    assert set(docstrings) == {field.name for field in fields(ServeConfig)}  # every field has one
    for name, docstring in docstrings.items():
        assert f"--{name.replace('_', '-')} " in shown and docstring in shown, name
    assert "--batch-invariant {true,false}" in shown and "--no-X for --X false" in shown
    config = options(["--no-batch-invariant", "--max-batch-size", "4", "--default-blocks", "skip=1"])
    assert (config.batch_invariant, config.max_batch_size, config.default_blocks) == (False, 4, "skip=1")


def test_api_key_is_required_everywhere_but_the_docs(server):
    for path in ("/predict", "/v1/completions"):
        assert httpx.post(server.url + path, json={"prompt": "a"}).status_code == 401
    assert httpx.get(server.url + "/info").status_code == 401
    assert (
        httpx.post(server.url + "/predict", json={"prompt": "a"}, headers={"X-API-Key": "wrong"}).status_code
        == 401
    )
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.post(server.url + "/predict", json={"prompt": "ab cd"}, headers=bearer).status_code == 200
    assert httpx.get(server.url + "/openapi.json").status_code == 200


def test_info_reports_the_model(client):
    assert client.get("/health").status_code == 200
    probe = client.head("/health")  # a load balancer's probe may ask with HEAD
    assert probe.status_code == 200 and probe.content == b""
    model = client.get("/info").json()["model"]
    assert model["depth"] == N_LAYER and model["context_length"] == CONTEXT
    assert model["dtype"] == "float32" and model["blocklab_version"]


def test_response_reports_tokens_blocks_timings_and_echoes_id(client):
    out = predict(client, id="req-7", prompt=PROMPT, max_new_tokens=5, seed=3)
    assert out["id"] == "req-7"
    assert len(out["tokens"]) == 5 and out["finish_reason"] == "length"
    assert out["text"] == tokens.decode(out["tokens"])
    assert out["prompt_tokens"] == len(tokens.encode(PROMPT))
    assert out["blocks_run"] == list(range(N_LAYER)) and out["blocks_per_token"] == [N_LAYER] * 5
    timings = out["timings"]
    assert 0 <= timings["queue_ms"] <= timings["first_token_ms"] <= timings["total_ms"]
    assert timings["prefill_ms"] > 0 and timings["per_token_ms"] > 0


def test_skip_and_exit_change_the_loss_and_the_blocks_run(client):
    runs = {
        spec: predict(client, prompt=PROMPT, max_new_tokens=0, blocks=spec)
        for spec in ("all", "skip=1,2", "exit=2")
    }
    assert runs["all"]["blocks_run"] == [0, 1, 2, 3]
    assert runs["skip=1,2"]["blocks_run"] == [0, 3] and runs["exit=2"]["blocks_run"] == [0, 1]
    losses = {spec: out["score"]["mean_loss"] for spec, out in runs.items()}
    assert losses["skip=1,2"] != losses["all"] and losses["exit=2"] != losses["all"]
    assert runs["exit=2"]["mean_blocks_per_token"] == 2.0
    assert runs["exit=2"]["blocks_per_token"] == [2] * (runs["exit=2"]["prompt_tokens"] - 1)
    structured = predict(client, prompt=PROMPT, max_new_tokens=0, skip=[1, 2])
    assert structured["score"] == runs["skip=1,2"]["score"]


def test_lens_tuned_exits_through_the_served_models_lens(server, client):
    """``/info`` reports the lens; ``exit=2;lens=tuned`` as a spec, as the structured fields and through
    the OpenAI route's extra_body gives what ``lab.generate`` gives on the same model, not the logit
    lens's exit."""
    from lab.blocks import BlockSet
    from lab.generate import generate, score

    assert client.get("/info").json()["model"]["tuned_lens"] is True
    body = {"prompt": PROMPT, "max_new_tokens": 6, "score": True}
    tuned = predict(client, **body, blocks="exit=2;lens=tuned")
    assert tuned["block_set"] == "exit=2;lens=tuned" and tuned["blocks_run"] == [0, 1]
    structured = predict(client, **body, exit_at=2, lens="tuned")
    assert structured["tokens"] == tuned["tokens"] and structured["score"] == tuned["score"]
    model, block_set, prompt = SERVED("cpu"), BlockSet(exit_at=2, lens="tuned"), tokens.encode(PROMPT)
    expected = [step.token for step in generate(model, prompt, 6, block_set=block_set, eos_token=tokens.EOT)]
    assert tuned["tokens"] == expected
    local = score(model, prompt, block_set).mean_loss
    assert tuned["score"]["mean_loss"] == pytest.approx(local, rel=1e-4)
    logit = predict(client, **body, blocks="exit=2")
    assert logit["score"]["mean_loss"] != pytest.approx(tuned["score"]["mean_loss"], rel=1e-3)
    drafting = predict(client, prompt=PROMPT, max_new_tokens=6, blocks="speculate=2;k=3;vocab=512")
    full = [step.token for step in generate(model, prompt, 6, eos_token=tokens.EOT)]
    assert drafting["tokens"] == full and drafting["speculation"]["drafted"] > 0
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"blocks": "exit=2;lens=tuned"}
    )
    assert out.blocklab["block_set"] == "exit=2;lens=tuned" and out.choices[0].text == tuned["text"]


def test_adaptive_exit_reports_blocks_per_token(client):
    out = predict(client, prompt=PROMPT, max_new_tokens=6, blocks="adaptive=0.5;min=1", score=True)
    assert out["blocks_run"] is None and len(out["blocks_per_token"]) == len(out["tokens"])
    assert all(1 <= blocks <= N_LAYER for blocks in out["blocks_per_token"])
    assert out["score"] is not None


def test_streaming_equals_non_streaming(client):
    body = {"prompt": PROMPT, "max_new_tokens": 8, "temperature": 0.8, "top_k": 50, "seed": 11, "score": True}
    whole = predict(client, **body)
    with client.stream("POST", "/predict", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        events = [json.loads(line) for line in response.iter_lines() if line]
    token_events, done = events[:-1], events[-1]
    assert done["event"] == "done" and all(event["event"] == "token" for event in token_events)
    assert [event["token"] for event in token_events] == whole["tokens"] == done["response"]["tokens"]
    assert whole["text"].startswith("".join(event["text"] for event in token_events))
    for key in ("text", "score", "block_set", "blocks_per_token", "finish_reason", "seed"):
        assert done["response"][key] == whole[key]


def test_concurrent_requests_of_every_block_set_share_steps_and_get_what_they_get_alone(client):
    """A slow request holds the worker; what arrives meanwhile joins it between steps, every block set
    in the same decode steps, and each request gets exactly the tokens it gets alone."""
    slow = {"prompt": "The" + SLOW_WORD + " cat", "max_new_tokens": 1}
    specs = ["all", "skip=1", "all", "skip=1", "exit=2", "all"]
    alone = {spec: predict(client, prompt=PROMPT, max_new_tokens=4, blocks=spec) for spec in set(specs)}
    with ThreadPoolExecutor(len(specs) + 1) as pool:
        held = pool.submit(client.post, "/predict", json=slow)
        time.sleep(0.2)  # let the worker take it
        futures = [
            pool.submit(predict, client, prompt=PROMPT, max_new_tokens=4, blocks=spec) for spec in specs
        ]
        outs = [future.result() for future in futures]
        assert held.result().status_code == 200
    for spec, out in zip(specs, outs, strict=True):
        assert out["block_set"] == spec and out["tokens"] == alone[spec]["tokens"]
    assert max(out["batch_size"] for out in outs) == len(specs)  # all six decoded in the same steps


def test_a_crashing_request_gets_500_and_the_server_keeps_serving(client):
    response = client.post("/predict", json={"prompt": "Please" + FAIL_WORD, "max_new_tokens": 3})
    assert response.status_code == 500
    assert "injected failure" in response.json()["detail"]
    with client.stream("POST", "/predict", json={"prompt": "Please" + FAIL_WORD, "stream": True}) as streamed:
        assert streamed.status_code == 500  # failed before the first token: a status, not a cut stream
    assert predict(client, prompt=PROMPT, max_new_tokens=2)["finish_reason"] == "length"


def test_openai_client_completions_chat_and_streaming(server):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    out = api.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, extra_body={"blocks": "skip=1"}
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 5
    assert out.blocklab["block_set"] == "skip=1" and out.blocklab["blocks_run"] == [0, 2, 3]
    chunks = list(
        api.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            extra_body={"blocks": "skip=1"},
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == out.choices[0].text
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi there"}], max_tokens=3, seed=1
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3
    assert [model.id for model in api.models.list()] == ["tiny-test"]
    with pytest.raises(openai.BadRequestError, match="best_of: not supported"):
        api.completions.create(model="tiny", prompt=PROMPT, best_of=2)
    with pytest.raises(openai.BadRequestError, match="blocks"):
        api.completions.create(model="tiny", prompt=PROMPT, extra_body={"blocks": "skip=99"})
