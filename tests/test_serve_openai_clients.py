"""The OpenAI routes as stock clients use them, replayed without the clients.

The bodies below are what aiperf 0.13 (``aiperf profile --endpoint-type completions|chat
--streaming --extra-inputs ignore_eos:true``) and lm-eval 0.4.13 (``--model local-completions``,
generate_until and loglikelihood requests) sent to ``blocklab serve``, captured from the runs in
docs/serving.md ("Stock clients"); the checks read the answers the way those tools do. So the
suite needs neither tool installed, and breaks when the server stops answering them.
"""

import concurrent.futures
import json
import time
from operator import itemgetter

import httpx
import openai
import pytest

from lab import tokens
from serve.openai_compat import _echoed
from serve.process import ServerProcess
from serve.schema import MIN_TOP_P
from tests.tiny import TinyModel

MODEL = "gpt2-random"
CONTEXT = 256

AIPERF_COMPLETIONS = {
    "prompt": " what to me my love But what to me A wife KATHARINE A beard fair health and honesty With "
    "threefold love I wish you all these three DUMAINE O shall I say I thank you gentle wife KATHARINE No so "
    "my lord A twelvemonth and a day Ill mark no words that smoothfaced",
    "model": MODEL,
    "stream": True,
    "max_tokens": 32,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}
AIPERF_CHAT = {
    "messages": [
        {
            "role": "user",
            "content": " to be made For such a guest is meet HAMLET I think it be thine indeed for thou "
            "liest int FIRST CLOWN You lie out ont sir and therefore tis not yours For my part I do not "
            "lie int yet it is mine HAMLET Thou dost lie int to be int and say it is th",
        }
    ],
    "model": MODEL,
    "stream": True,
    "max_completion_tokens": 32,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}
LM_EVAL_GENERATE = {
    "prompt": [[48, 25, 9022, 8265, 17105, 3218, 14700, 30, 198, 32, 25]],
    "model": MODEL,
    "max_tokens": 16,
    "temperature": 0.0,
    "stop": ["\n", "Q:"],
    "seed": 1234,
}
LM_EVAL_LOGLIKELIHOOD = {
    "model": MODEL,
    "prompt": [[2514, 2666, 257, 9052, 1903, 11, 11361, 2438, 3544, 262, 2643, 220, 1441]],
    "temperature": 0,
    "max_tokens": 1,
    "logprobs": 1,
    "seed": 1234,
    "echo": True,
}
CONTEXT_LENGTH = 11
"""lm-eval's ``ctxlen`` for that request: the context's tokens; the rest is the continuation."""


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--model", MODEL], model_factory=TinyModel(block_size=CONTEXT)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def sse(response: httpx.Response) -> list[dict]:
    """The JSON chunks of a server-sent-event stream, which must end with ``[DONE]``."""
    lines = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(line) for line in lines[:-1]]


def predict(client: httpx.Client, **body) -> dict:
    response = client.post("/predict", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize(
    ("path", "body"), [("/v1/completions", AIPERF_COMPLETIONS), ("/v1/chat/completions", AIPERF_CHAT)]
)
def test_aiperf_streams_get_exactly_their_tokens_and_usage(client, path, body):
    chunks = sse(client.post(path, json=body))
    *tokens_chunks, usage_chunk = chunks
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 32  # ignore_eos
    key = "text" if path == "/v1/completions" else "delta"
    assert all(chunk["choices"][0]["index"] == 0 for chunk in tokens_chunks)
    assert tokens_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert len(tokens_chunks) == 32 + 1  # a chunk per token, then the one with the finish reason
    assert all(
        isinstance(chunk["choices"][0][key], str if key == "text" else dict) for chunk in tokens_chunks
    )
    assert usage_chunk["usage"]["prompt_tokens"] > 0
    if key == "delta":  # the role in the first delta only, as OpenAI's streams have it
        deltas = [chunk["choices"][0]["delta"] for chunk in tokens_chunks]
        assert deltas[0]["role"] == "assistant" and not any("role" in delta for delta in deltas[1:])


def test_lm_eval_generate_until_stops_before_its_stop_strings(client):
    greedy = LM_EVAL_GENERATE | {"stop": None, "max_tokens": 16}
    free = client.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # a string the greedy text is known to hold
    body = LM_EVAL_GENERATE | {"stop": ["never generated", stop]}
    answer = client.post("/v1/completions", json=body).json()
    choice = answer["choices"][0]
    assert choice["text"] == free[: free.index(stop)] and choice["finish_reason"] == "stop"
    plain = client.post("/v1/completions", json=LM_EVAL_GENERATE).json()["choices"][0]
    assert not any(text in plain["text"] for text in LM_EVAL_GENERATE["stop"])


def test_streams_and_logprobs_stop_where_the_text_does(client):
    """With a stop string, every route's stream joins to the text answered without streaming, which
    ends before it; no chunk carries it. Logprobs list the generated tokens up to the text's end."""
    greedy = LM_EVAL_GENERATE | {"stop": None, "max_tokens": 16, "ignore_eos": True}
    free = client.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    body = greedy | {"stop": [stop]}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    assert whole["text"] == free[: free.index(stop)] and whole["finish_reason"] == "stop"
    streamed = sse(client.post("/v1/completions", json=body | {"stream": True}))
    assert "".join(chunk["choices"][0]["text"] for chunk in streamed) == whole["text"]
    chat = {"messages": [{"role": "user", "content": "Q: why?"}], "model": MODEL, "max_tokens": 16,
            "temperature": 0.0, "ignore_eos": True}  # fmt: skip
    chat_free = client.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    chat_stop = chat_free[len(chat_free) // 2 : len(chat_free) // 2 + 3]
    deltas = sse(client.post("/v1/chat/completions", json=chat | {"stop": chat_stop, "stream": True}))
    joined = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in deltas)
    assert joined == chat_free[: chat_free.index(chat_stop)]
    native = {"prompt_ids": LM_EVAL_GENERATE["prompt"][0], "max_new_tokens": 16, "temperature": 0.0,
              "ignore_eos": True, "stop": [stop], "stream": True}  # fmt: skip
    events = [json.loads(line) for line in client.post("/predict", json=native).text.splitlines()]
    assert "".join(e["text"] for e in events if e["event"] == "token") == events[-1]["response"]["text"]
    scored = client.post("/v1/completions", json=body | {"logprobs": 1, "echo": True}).json()["choices"][0]
    assert all(offset < len(scored["text"]) for offset in scored["logprobs"]["text_offset"])
    assert scored["text"].endswith(whole["text"])


def test_tokens_begin_where_their_text_is_decoded_piece_by_piece():
    """``lab.tokens.char_offsets``, by which ``_logprobs`` keeps the generated tokens that begin within
    the text (a completion decoded on its own, as its text is, so that a prompt ending mid-character,
    echoed, does not shift them): a character in three tokens begins at each of them."""
    byte = tokens.encoding().encode_single_token
    euro = [byte(b"\xe2"), byte(b"\x82"), byte(b"\xac")]  # one character in three tokens
    assert tokens.char_offsets(euro + tokens.encode("X")) == [0, 0, 0, 1]  # "X" begins after "€"
    assert tokens.char_offsets(euro[2:] + tokens.encode("X")) == [0, 1]  # "\ufffd": bytes the prompt had
    assert tokens.char_offsets(tokens.encode("ab cd")) == [0, 2] and tokens.char_offsets([]) == []


def lm_eval_parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """lm-eval 0.4.13's ``LocalCompletionsAPI.parse_logprobs``, as it reads the answer."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=itemgetter("index")), ctxlens, strict=False):
        logprobs = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        is_greedy = all(
            token == max(top.values())
            for token, top in zip(
                choice["logprobs"]["token_logprobs"][ctxlen:-1],
                choice["logprobs"]["top_logprobs"][ctxlen:-1],
                strict=False,
            )
        )
        res.append((logprobs, is_greedy))
    return res


def test_lm_eval_loglikelihood_is_the_loss_of_the_continuation(client):
    """Needs the engine's top tokens (``PromptScore.top_tokens``/``top_losses``) for ``logprobs: 1``."""
    ids = LM_EVAL_LOGLIKELIHOOD["prompt"][0]
    two = LM_EVAL_LOGLIKELIHOOD | {"prompt": [ids, ids[:CONTEXT_LENGTH] + [tokens.EOT]]}
    response = client.post("/v1/completions", json=two)
    assert response.status_code == 200, response.text
    out = response.json()
    assert [choice["index"] for choice in out["choices"]] == [0, 1]
    details = out["choices"][0]["logprobs"]
    generated = out["choices"][0]["text"][len(tokens.decode(ids)) :]  # echo: the prompt, then the new token
    assert len(details["token_logprobs"]) == len(ids) + 1 and details["token_logprobs"][0] is None
    assert details["top_logprobs"][0] is None and details["text_offset"][:2] == [
        0,
        len(tokens.decode(ids[:1])),
    ]
    assert "".join(details["tokens"][len(ids) :]) == generated

    losses = predict(client, prompt_ids=ids, max_new_tokens=0)["score"]["token_losses"]
    [(loglikelihood, is_greedy)] = lm_eval_parse_logprobs({"choices": out["choices"][:1]}, [CONTEXT_LENGTH])
    assert loglikelihood == pytest.approx(-sum(losses[CONTEXT_LENGTH - 1 :]), abs=1e-4)
    greedy = [
        predict(client, prompt_ids=ids[:position], max_new_tokens=1, temperature=0.0)["tokens"][0]
        for position in range(CONTEXT_LENGTH, len(ids))
    ]
    assert is_greedy == (greedy == ids[CONTEXT_LENGTH:])
    for position, top in zip(range(CONTEXT_LENGTH, len(ids)), greedy, strict=True):
        best = details["top_logprobs"][position]
        assert tokens.decode([top]) in best and max(best.values()) == best[tokens.decode([top])]


def test_prompts_as_lists_become_choices_whole_and_streamed(client):
    ids = tokens.encode("Hello there, general")
    body = {
        "model": MODEL,
        "prompt": ["Hello there", "Hello there, general"],
        "max_tokens": 4,
        "temperature": 0,
    }
    whole = client.post("/v1/completions", json=body).json()
    texts = [choice["text"] for choice in whole["choices"]]
    assert [choice["index"] for choice in whole["choices"]] == [0, 1]
    assert texts[1] == predict(client, prompt_ids=ids, max_new_tokens=4)["text"]
    assert whole["usage"]["prompt_tokens"] == 2 + len(ids)
    as_ids = client.post(
        "/v1/completions", json=body | {"prompt": [tokens.encode("Hello there"), ids]}
    ).json()
    assert [choice["text"] for choice in as_ids["choices"]] == texts
    chunks = sse(client.post("/v1/completions", json=body | {"stream": True}))
    streamed = ["", ""]
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    echoed = client.post("/v1/completions", json=body | {"echo": True, "max_tokens": 0}).json()
    assert [choice["text"] for choice in echoed["choices"]] == ["Hello there", "Hello there, general"]
    mixed = body | {"prompt": ["Hello there", ids]}
    assert error(client.post("/v1/completions", json=mixed))["param"] == "prompt"


def test_n_choices_per_prompt_are_seeded_apart_and_count_each_prompt_once(client):
    """n choices of each prompt in OpenAI's order (a prompt's n together), choice j of a seeded body
    drawn with seed + j, whole and streamed; the usage counts each prompt once, as OpenAI's does."""
    prompts = ["Hello there", "Hello there, general"]
    ids = [tokens.encode(prompt) for prompt in prompts]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 5, "temperature": 1.0, "seed": 11, "n": 3}
    whole = client.post("/v1/completions", json=body).json()
    assert [choice["index"] for choice in whole["choices"]] == list(range(6))
    texts = [choice["text"] for choice in whole["choices"]]
    for index, text in enumerate(texts):
        alone = predict(
            client, prompt_ids=ids[index // 3], max_new_tokens=5, temperature=1.0, seed=11 + index % 3
        )
        assert text == alone["text"], index
    assert len(set(texts[:3])) > 1  # a seed each: not n copies of one draw
    assert whole["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    stream = body | {"stream": True, "stream_options": {"include_usage": True}}
    streamed = [""] * 6
    chunks = sse(client.post("/v1/completions", json=stream))
    for chunk in chunks:
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    too_many = error(client.post("/v1/completions", json=body | {"n": 9}))  # 2 x 9 > 16 slots
    assert too_many["param"] == "n" and "at most 16 choices" in too_many["message"]
    too_many_prompts = error(client.post("/v1/completions", json=body | {"n": None, "prompt": ["a"] * 17}))
    assert too_many_prompts["param"] == "prompt"


def test_explicit_nulls_mean_the_defaults(client):
    nulls = dict.fromkeys(["temperature", "top_p", "stream", "stop", "n", "seed", "logprobs", "echo", "user"])
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there", **nulls})
    assert answer.status_code == 200, answer.text
    assert 1 <= answer.json()["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens
    chat_nulls = dict.fromkeys(["temperature", "max_tokens", "tools", "tool_choice", "response_format"])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    assert client.post("/v1/chat/completions", json=chat | chat_nulls).status_code == 200


def test_sampling_options_reach_the_engine(client):
    greedy = {"model": MODEL, "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    expected = client.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    for top_p in (MIN_TOP_P, 5e-324):  # only the most likely token is left (below MIN_TOP_P too)
        narrow = greedy | {"temperature": 1.0, "top_p": top_p, "seed": 3}
        assert client.post("/v1/completions", json=narrow).json()["choices"][0]["text"] == expected
    nearly_greedy = greedy | {"temperature": 1e-7, "seed": 3}  # vLLM's: below 1e-5 is greedy
    assert client.post("/v1/completions", json=nearly_greedy).json()["choices"][0]["text"] == expected
    exact = greedy | {"ignore_eos": True, "min_tokens": 6, "top_k": -1}  # vLLM's -1: no top-k
    assert client.post("/v1/completions", json=exact).json()["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1.0}, "frequency_penalty"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"logprobs": 3}, "logprobs"),
        ({"logprobs": 1, "stream": True}, "logprobs"),
        ({"suffix": "tail"}, "suffix"),
        ({"tools": [{"type": "function"}]}, "tools"),
        (
            {"max_tokens": CONTEXT},
            "max_tokens",
        ),  # with the prompt, over the context: checked against the model
        ({"min_tokens": 20}, "min_tokens"),  # more than the default max_tokens
        ({"blocks": "skip=99"}, "blocks"),
        ({"prompt": [[1, tokens.VOCAB_SIZE]]}, "prompt[1]"),
        ({"stop": [1, 2]}, "stop"),  # not "stop.str": the union's members are pydantic's, not the field
        ({"prompt": []}, "prompt"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"top_p": 0}, "top_p"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # not streaming, as OpenAI has it
    ],
)
def test_what_stays_unsupported_is_refused_naming_the_field(client, body, param):
    refused = error(client.post("/v1/completions", json={"model": MODEL, "prompt": "Hello there"} | body))
    assert refused["param"] == param and refused["message"].startswith(f"{param}: ")
    assert refused["type"] == "invalid_request_error"


def test_an_unknown_path_under_v1_answers_in_openais_shape(client):
    for path in ("/v1", "/v1/embeddings"):
        assert error(client.get(path), 404)["type"] == "invalid_request_error"


def test_json_that_does_not_parse_is_the_bodys_fault_not_a_fields(client):
    json_type = {"Content-Type": "application/json"}
    refused = error(client.post("/v1/completions", content=b'{"prompt": "a",', headers=json_type))
    assert refused["param"] is None and refused["message"].startswith("body: JSON decode error")


def test_chat_refuses_tools_and_logprobs_naming_them(client):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    for field, value in [("tools", [{"type": "function"}]), ("tool_choice", "auto"), ("logprobs", True)]:
        assert error(client.post("/v1/chat/completions", json=chat | {field: value}))["param"] == field
    over = chat | {"max_completion_tokens": CONTEXT}
    assert error(client.post("/v1/chat/completions", json=over))["param"] == "max_completion_tokens"


def test_the_openai_client_reads_models_and_errors(server):
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    assert api.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        api.models.retrieve("gpt-4")
    assert missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as refused:  # 400, as OpenAI's and vLLM's
        api.completions.create(model=MODEL, prompt="Hi", n=17)  # over the default 16 choices a request
    assert refused.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": 5}])
    assert refused.value.body["param"] == "messages[0].content"
    several = api.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=3, max_tokens=3, seed=5
    )
    assert [choice.index for choice in several.choices] == [0, 1, 2]
    out = api.completions.create(model=MODEL, prompt=[[15496, 995], [15496]], max_tokens=2, temperature=0)
    assert len(out.choices) == 2 and out.usage.completion_tokens == 4


@pytest.fixture(scope="module")
def ending():
    """A server whose model draws end-of-text at once (unless ``ignore_eos``), its steps slowed so a
    long request stays in flight, and room for 4 requests."""
    args = ["--model", MODEL, "--max-in-flight", "4", "--max-prompts-per-request", "4"]
    model = TinyModel(block_size=CONTEXT, eos_logit=30.0, step_s=0.005)
    with (
        ServerProcess(args, model_factory=model) as running,
        httpx.Client(base_url=running.url, timeout=60) as http,
    ):
        yield http


def test_end_of_text_is_counted_and_listed_with_its_logprob_as_openai_does(ending):
    """lm-eval sums ``token_logprobs[ctxlen:-1]``, taking the last entry for the generated token: when
    that token is end-of-text it must be there (OpenAI's and vLLM's answers have it), or the sum
    loses the continuation's last token. The usage counts it too; the text leaves it out."""
    ids = LM_EVAL_LOGLIKELIHOOD["prompt"][0]
    generated = ending.get("/stats").json()["tokens_generated"]
    answer = ending.post("/v1/completions", json=LM_EVAL_LOGLIKELIHOOD).json()
    [choice], usage = answer["choices"], answer["usage"]
    assert ending.get("/stats").json()["tokens_generated"] == generated + 1  # the server counts it too
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", None)
    assert choice["text"] == tokens.decode(ids) and usage["completion_tokens"] == 1
    details = choice["logprobs"]
    assert len(details["tokens"]) == len(ids) + 1 and details["tokens"][-1] == "<|endoftext|>"
    assert details["token_logprobs"][-1] > -0.01  # its logit raised by 30: all but certain
    assert details["text_offset"][-1] == len(choice["text"])
    [(loglikelihood, _)] = lm_eval_parse_logprobs({"choices": [choice]}, [CONTEXT_LENGTH])
    assert loglikelihood == pytest.approx(sum(details["token_logprobs"][CONTEXT_LENGTH : len(ids)]))
    alone = ending.post("/v1/completions", json=LM_EVAL_LOGLIKELIHOOD | {"echo": False}).json()["choices"][0]
    assert alone["logprobs"]["tokens"] == ["<|endoftext|>"] and alone["text"] == ""
    streamed = sse(
        ending.post(
            "/v1/chat/completions",
            json=AIPERF_CHAT | {"ignore_eos": None, "max_completion_tokens": 8},
        )
    )
    assert streamed[-1]["usage"]["completion_tokens"] == 1
    last = streamed[-2]["choices"][0]
    assert (last["finish_reason"], last["stop_reason"]) == ("stop", None)


def test_a_stop_string_is_the_choices_stop_reason(client):
    greedy = LM_EVAL_GENERATE | {"stop": None, "max_tokens": 16, "ignore_eos": True}
    free = client.post("/v1/completions", json=greedy).json()["choices"][0]
    assert (free["finish_reason"], free["stop_reason"]) == ("length", None)
    stop = free["text"][len(free["text"]) // 2 : len(free["text"]) // 2 + 3]
    stopped = client.post("/v1/completions", json=greedy | {"stop": ["never", stop]}).json()["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", stop)
    body = greedy | {"stop": ["never", stop], "stream": True}
    *chunks, last = sse(client.post("/v1/completions", json=body))
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == ("stop", stop)
    assert not any("stop_reason" in chunk["choices"][0] for chunk in chunks)  # the choice's last chunk


def test_a_body_without_room_for_all_its_choices_is_refused_whole(ending):
    """429 past --max-in-flight admits none of the body's choices: /stats counts none admitted and
    none cancelled, by the front or by a worker (each choice of the body used to be admitted, then
    cancelled, up to the full one; then submitted and withdrawn, which its worker counted)."""
    long = AIPERF_COMPLETIONS | {"stream": False, "max_tokens": 150, "stream_options": None}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(ending.post, "/v1/completions", json=long)
        while ending.get("/stats").json()["in_flight"] == 0:
            time.sleep(0.01)
        before = ending.get("/stats").json()
        refused = ending.post("/v1/completions", json={"prompt": "Hi", "n": 4, "max_tokens": 2})
        assert running.result().status_code == 200
    after = ending.get("/stats").json()
    assert refused.status_code == 429 and refused.headers["Retry-After"]
    assert after["admitted"] == before["admitted"]
    assert after["ended"]["cancelled"] == before["ended"]["cancelled"] == 0
    assert after["requests_cancelled"] == before["requests_cancelled"] == 0


def test_max_tokens_left_out_runs_to_the_context_in_chat_and_16_or_what_is_left_in_completions(client):
    chat = {"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True, "temperature": 0}
    usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
    assert usage["completion_tokens"] == CONTEXT - usage["prompt_tokens"]  # OpenAI's chat has no default
    near_the_end = {"prompt": [15496] * (CONTEXT - 6), "ignore_eos": True}
    assert client.post("/v1/completions", json=near_the_end).json()["usage"]["completion_tokens"] == 6
    assert client.post("/v1/completions", json={"prompt": "Hi", "ignore_eos": True}).json()["usage"][
        "completion_tokens"
    ] == 16  # fmt: skip
    full = error(client.post("/v1/completions", json={"prompt": [15496] * CONTEXT}))
    assert "maximum context length is 256 tokens" in full["message"]  # the words clients look for


def test_what_sdks_add_is_accepted_and_changes_nothing(client):
    """``store`` and ``metadata`` (OpenAI's, sent by wrappers), a tool-calling assistant turn's null
    content, and ``stream_options.include_obfuscation`` are taken; the answer is what it is without."""
    plain = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    expected = client.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]
    extra = plain | {"store": False, "metadata": {"team": "lab"}}
    assert client.post("/v1/chat/completions", json=extra).json()["choices"][0]["message"] == expected
    turns = {"messages": [{"role": "assistant", "content": None}, {"role": "user", "content": "Hi"}]}
    assert client.post("/v1/chat/completions", json=plain | turns).status_code == 200
    nobody = {"messages": [{"role": "user", "content": None}]}
    assert error(client.post("/v1/chat/completions", json=plain | nobody))["param"] == "messages[0].content"
    options = {"stream": True, "stream_options": {"include_obfuscation": False}}
    assert sse(client.post("/v1/chat/completions", json=plain | options))


def test_an_echoed_prompt_that_ends_mid_character_is_decoded_with_what_follows():
    euro = tokens.encoding().encode_single_token
    prompt, generated = [euro(b"\xe2"), euro(b"\x82")], [euro(b"\xac")] + tokens.encode("X")
    response = {"text": tokens.decode(generated), "tokens": generated, "stop_reason": None}
    assert _echoed(prompt, response) == "€X"
    assert _echoed("a", response | {"text": "b", "stop_reason": "c"}) == "ab"


def test_the_responses_api_answers_the_openai_client_whole_and_streamed(server, client):
    """``client.responses.create``: the SDK's own models parse the answer; its text is what chat
    generates for the same turns (the instructions a system turn before them), its usage counts the
    prompt and the new tokens; streamed, the deltas join to that text, in OpenAI's event order."""
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    chat = {"messages": turns, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    expected = client.post("/v1/chat/completions", json=chat).json()
    kept = {"input": "Hello", "instructions": "Be brief.", "max_output_tokens": 6, "temperature": 0}
    plain = api.responses.create(model=MODEL, **kept, extra_body={"ignore_eos": True})
    assert plain.output_text == expected["choices"][0]["message"]["content"]
    assert (plain.status, plain.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert plain.usage.input_tokens == expected["usage"]["prompt_tokens"] and plain.usage.output_tokens == 6
    skipping = api.responses.create(model=MODEL, **kept, extra_body={"ignore_eos": True, "blocks": "skip=1"})
    assert skipping.blocklab["block_set"] == "skip=1"  # the extension object, and the block set, reach it
    events = list(api.responses.create(model=MODEL, **kept, stream=True, extra_body={"ignore_eos": True}))
    kinds = [event.type for event in events]
    opening = ["created", "in_progress", "output_item.added", "content_part.added"]
    closing = ["output_text.done", "content_part.done", "output_item.done", "incomplete"]
    assert kinds[:4] == [f"response.{kind}" for kind in opening]
    assert kinds[-4:] == [f"response.{kind}" for kind in closing]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == plain.output_text


def test_a_conversation_passes_a_responses_output_back_and_what_the_sdk_adds_is_taken(server):
    """The SDK's way to continue without stored state: the earlier response's output items (with their
    ``id``, ``status``, ``annotations``) among the next input's turns; and OpenAI's fields at their
    "off" values. max_output_tokens 0 is incomplete, as a cut answer is."""
    api = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    first = api.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    turns = [{"role": "user", "content": "Hello"}, *first.output, {"role": "user", "content": "More"}]
    off = {"background": False, "top_logprobs": 0, "service_tier": "auto", "prompt_cache_key": "k"}
    later = api.responses.create(model=MODEL, input=turns, max_output_tokens=4, temperature=0, extra_body=off)
    assert later.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert (later.text.format.type, later.truncation) == ("text", "disabled")
    none = api.responses.create(model=MODEL, input="Hello", max_output_tokens=0)
    assert (none.status, none.incomplete_details.reason, none.output_text) == (
        "incomplete",
        "max_output_tokens",
        "",
    )


def test_a_response_that_end_of_text_ended_is_completed(ending):
    answer = ending.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 8}).json()
    assert (answer["status"], answer["incomplete_details"]) == ("completed", None)
    assert answer["usage"]["output_tokens"] == 1 and answer["output"][0]["content"][0]["text"] == ""


def test_the_responses_api_refuses_what_it_does_not_serve_naming_it(client):
    for field, value in [
        ("previous_response_id", "resp_1"),
        ("max_tokens", 3),
        ("tools", [{"type": "web_search"}]),
    ]:
        refused = error(client.post("/v1/responses", json={"input": "Hi", field: value}))
        assert refused["param"] == field
    over = error(client.post("/v1/responses", json={"input": "Hi", "max_output_tokens": CONTEXT}))
    assert over["param"] == "max_output_tokens" and "maximum context length" in over["message"]
