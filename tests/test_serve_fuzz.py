"""Fuzzing every route of a real server: no input gets a 5xx, nothing crashes, the server stays healthy.

Two generators: schemathesis, from the server's own ``/openapi.json`` (bodies that follow the schema
and bodies that break it, on every operation), and hypothesis strategies for what a schema does not
describe: raw bytes (invalid UTF-8, truncated JSON) under any content type, any JSON value, bodies
with the right field names and wild values (huge and negative numbers, NaN, unicode, lone
surrogates, block-set specs made of the spec's own characters), random query strings and header
bytes. A streamed answer counts too: it must not end with a 5xx error event. Example counts are
bounded (``EXAMPLES``) and derandomised, so a CI run is repeatable; raise them locally to dig.
"""

import json
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import status_code_conformance

from serve.process import ServerProcess
from tests.soak import run_load
from tests.tiny import TinyModel

pytestmark = pytest.mark.slow

KEY = "fuzz-key"
AUTH = {"X-API-Key": KEY}
N_LAYER, CONTEXT = 4, 64
POST_ROUTES = ("/predict", "/v1/completions", "/v1/chat/completions")
GET_ROUTES = ("/", "/health", "/info", "/stats", "/v1/models", "/openapi.json", "/docs")
EXAMPLES = {"schema": 40, "bytes": 120, "json": 120, "fields": 250, "valid": 150, "get": 80}
SEEN: Counter = Counter()
"""(generator, status) of every request sent, reported by the last test."""


def fuzz_settings(examples: int):
    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module")
def server():
    args = ["--threads", "1", "--api-key", KEY, "--max-payload-bytes", "20000", "--max-in-flight", "16"]
    with ServerProcess(args, model_factory=TinyModel(n_layer=N_LAYER, block_size=CONTEXT)) as running:
        yield running


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def anonymous(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def assert_no_server_error(generator: str, status: int, content_type: str, body: bytes) -> None:
    """No 5xx status, and a 200 stream that does not end with a 5xx error event."""
    SEEN[generator, status] += 1
    text = body.decode(errors="replace")
    assert status < 500, (status, text[:500])
    lines = [line for line in text.splitlines() if line.strip()]
    if status != 200 or not lines:
        return
    if content_type.startswith("application/x-ndjson"):
        last = json.loads(lines[-1])
        assert last["event"] == "done" or last["status"] < 500, last
    elif content_type.startswith("text/event-stream"):
        last = lines[-1].removeprefix("data: ")
        assert last == "[DONE]" or json.loads(last)["error"]["code"] < 500, last


def check(generator: str, response: httpx.Response) -> None:
    content_type = response.headers.get("content-type", "")
    assert_no_server_error(generator, response.status_code, content_type, response.content)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@fuzz_settings(EXAMPLES["schema"])
def test_schema_driven_requests_never_get_a_5xx(case, server):
    response = case.call(base_url=server.url, headers=AUTH, timeout=60)
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance], headers=AUTH)
    if not response.stream_cut_short:
        content_type = response.headers.get("content-type", [""])[0]
        assert_no_server_error(case.operation.label, response.status_code, content_type, response.content)


CONTENT_TYPES = st.one_of(
    st.sampled_from(
        [
            "application/json",
            "application/json; charset=utf-16",
            "text/plain",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/octet-stream",
            "",
        ]
    ),
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=40).map(str.strip),
)


@given(
    route=st.sampled_from(POST_ROUTES),
    body=st.one_of(
        st.binary(max_size=400),
        st.text(max_size=200).map(lambda text: text.encode("utf-8", "surrogatepass")),
        st.text(max_size=200).map(lambda text: ('{"prompt": "' + text).encode("utf-8", "surrogatepass")),
    ),
    content_type=CONTENT_TYPES,
)
@fuzz_settings(EXAMPLES["bytes"])
def test_raw_bytes_under_any_content_type(http, route, body, content_type):
    check("bytes", http.post(route, content=body, headers={"Content-Type": content_type}))


WILD_NUMBERS = st.one_of(
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63), 1e308, -0.0, 5e-324, 1e-7]),
)
WILD_TEXT = st.one_of(
    st.text(max_size=60),
    st.text(st.characters(blacklist_categories=()), max_size=30),  # lone surrogates included
    st.sampled_from(["", " ", "\x00", "<|endoftext|>", "\u202e", "🙂" * 20, "a" * 3000, "../../etc/passwd"]),
)
WILD_JSON = st.recursive(
    st.none() | st.booleans() | WILD_NUMBERS | WILD_TEXT,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(WILD_TEXT, children, max_size=4),
    max_leaves=12,
)


def dumps(value) -> bytes:
    """JSON as a client might send it: NaN and Infinity as bare words, lone surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


@given(route=st.sampled_from(POST_ROUTES), value=WILD_JSON)
@fuzz_settings(EXAMPLES["json"])
def test_any_json_value(http, route, value):
    check("json", http.post(route, content=dumps(value), headers={"Content-Type": "application/json"}))


SPEC_CHARACTERS = st.text(st.sampled_from("skipeoverwritexadaptvmn=,;.-0123456789 all"), max_size=24)
BLOCK_INDICES = st.lists(st.integers(min_value=-2, max_value=N_LAYER + 1), max_size=5)
PREDICT_FIELDS = {
    "id": WILD_TEXT | WILD_NUMBERS,
    "prompt": WILD_TEXT,
    "max_new_tokens": st.integers(min_value=-2, max_value=5) | WILD_NUMBERS,
    "temperature": st.floats(min_value=0, max_value=3) | WILD_NUMBERS,
    "top_k": st.integers(min_value=-1, max_value=60000) | WILD_NUMBERS,
    "seed": WILD_NUMBERS,
    "stream": st.booleans() | WILD_JSON,
    "score": st.booleans() | WILD_JSON,
    "blocks": SPEC_CHARACTERS | WILD_TEXT,
    "skip": BLOCK_INDICES | WILD_JSON,
    "keep": BLOCK_INDICES,
    "overwrite": BLOCK_INDICES,
    "exit_at": st.integers(min_value=-1, max_value=N_LAYER + 2),
    "adaptive": st.floats(min_value=-0.5, max_value=1.5) | WILD_NUMBERS,
    "adaptive_min_blocks": st.integers(min_value=-1, max_value=N_LAYER + 2),
}
OPENAI_FIELDS = {
    "model": WILD_TEXT,
    "max_tokens": st.integers(min_value=-2, max_value=5) | WILD_NUMBERS,
    "temperature": st.floats(min_value=0, max_value=2.5) | WILD_NUMBERS,
    "seed": WILD_NUMBERS,
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans() | WILD_JSON}),
    "top_p": WILD_NUMBERS,
    "n": WILD_NUMBERS,
    "stop": WILD_JSON,
    "logit_bias": WILD_JSON,
    "blocks": SPEC_CHARACTERS,
    "top_k": st.integers(min_value=-1, max_value=60000),
    "user": WILD_TEXT,
}
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]), "content": WILD_TEXT},
    optional={"name": WILD_TEXT},
)
ROUTE_FIELDS = {
    "/predict": PREDICT_FIELDS,
    "/v1/completions": {
        **OPENAI_FIELDS,
        "prompt": WILD_TEXT | st.lists(WILD_TEXT, max_size=2),
        "echo": st.booleans(),
        "logprobs": WILD_NUMBERS,
        "suffix": WILD_TEXT,
    },
    "/v1/chat/completions": {
        **OPENAI_FIELDS,
        "messages": st.lists(MESSAGE, max_size=3),
        "max_completion_tokens": st.integers(min_value=-1, max_value=5),
    },
}


@st.composite
def route_and_body(draw) -> tuple[str, dict]:
    """A route and a body of some of its own fields (each usually well-typed, sometimes not), a
    required one usually present, and now and then an unknown field."""
    route = draw(st.sampled_from(POST_ROUTES))
    fields = ROUTE_FIELDS[route]
    names = draw(st.sets(st.sampled_from(sorted(fields)), max_size=6))
    body = {name: draw(fields[name]) for name in names}
    required = "messages" if route.endswith("chat/completions") else "prompt"
    if draw(st.integers(0, 9)):
        body.setdefault(required, draw(fields[required]))
    if not draw(st.integers(0, 9)):
        body[draw(WILD_TEXT)] = draw(WILD_JSON)
    return route, body


@given(request=route_and_body())
@fuzz_settings(EXAMPLES["fields"])
def test_the_right_fields_with_wild_values(http, request):
    route, body = request
    check("fields", http.post(route, content=dumps(body), headers={"Content-Type": "application/json"}))


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=80)  # encodable
INDICES = st.lists(st.integers(0, N_LAYER - 1), min_size=1, max_size=N_LAYER, unique=True).map(
    lambda indices: ",".join(map(str, indices))
)
BLOCK_SPECS = st.one_of(
    st.just("all"),
    INDICES.map("skip={}".format),
    INDICES.map("keep={}".format),
    INDICES.map("overwrite={}".format),
    st.integers(1, N_LAYER).map("exit={}".format),
    st.tuples(st.floats(0.01, 1.0), st.integers(1, N_LAYER)).map(lambda a: f"adaptive={a[0]:.3f};min={a[1]}"),
    st.tuples(INDICES, st.integers(1, N_LAYER)).map(lambda a: f"overwrite={a[0]};exit={a[1]}"),
)
SAMPLING = {
    "temperature": st.just(0.0) | st.floats(1e-6, 5.0),
    "top_k": st.integers(1, 50257),
    "seed": st.integers(0, 2**63 - 1),
    "stream": st.booleans(),
    "blocks": BLOCK_SPECS,
}


@st.composite
def valid_route_and_body(draw) -> tuple[str, dict]:
    """Well-formed requests with arbitrary text, block sets and sampling: they reach the model."""
    route = draw(st.sampled_from(POST_ROUTES))
    options = draw(st.fixed_dictionaries({}, optional=SAMPLING))
    if route == "/predict":
        extra = {"max_new_tokens": draw(st.integers(0, 4)), "score": draw(st.booleans())}
        return route, {"prompt": draw(TEXT), **extra, **options}
    options["temperature"] = min(options.get("temperature", 1.0), 2.0)
    if options.get("stream") and draw(st.booleans()):
        options["stream_options"] = {"include_usage": draw(st.booleans())}
    if route == "/v1/completions":
        return route, {"prompt": draw(TEXT), "max_tokens": draw(st.integers(0, 4)), **options}
    messages = draw(
        st.lists(
            st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]), "content": TEXT}),
            min_size=1,
            max_size=3,
        )
    )
    return route, {"messages": messages, "max_completion_tokens": draw(st.integers(0, 4)), **options}


@given(request=valid_route_and_body())
@fuzz_settings(EXAMPLES["valid"])
def test_well_formed_requests_with_arbitrary_content(http, request):
    route, body = request
    check("valid", http.post(route, json=body))


# What HTTP allows in a header value (visible ASCII and bytes past 127, spaces only inside): anything
# else the client library refuses to send.
HEADER_BYTES = st.binary(max_size=60).map(lambda raw: bytes(b for b in raw if 0x21 <= b != 0x7F))
QUERY_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)


@given(
    route=st.sampled_from(GET_ROUTES),
    query=st.dictionaries(QUERY_TEXT, QUERY_TEXT, max_size=3),
    key=st.one_of(st.just(KEY.encode()), HEADER_BYTES),
    bearer=st.one_of(st.none(), HEADER_BYTES),
)
@fuzz_settings(EXAMPLES["get"])
def test_get_routes_with_any_query_and_key_bytes(anonymous, route, query, key, bearer):
    headers = [(b"X-API-Key", key)] + (
        [] if bearer is None else [(b"Authorization", (b"Bearer " + bearer).strip())]
    )
    response = anonymous.get(route, params=query, headers=headers)
    check("get", response)
    if key != KEY.encode() and route not in ("/health", "/openapi.json", "/docs"):
        assert response.status_code == 401


def test_the_server_is_healthy_after_the_fuzzing(server, http):
    """Runs last (file order): every worker alive, nothing failed inside one, every slot free."""
    assert http.get("/health").status_code == 200
    stats = http.get("/stats").json()
    assert stats["requests_failed"] == 0 and stats["in_flight"] == 0
    assert stats["tokens_generated"] > 0  # the fuzzing reached the model, not only the validation
    print(f"\nfuzzing: {sum(SEEN.values())} requests; by (generator, status): {dict(sorted(SEEN.items()))}")
    report = run_load(server.url, clients=2, duration_s=1.0, headers=AUTH)
    assert report.requests > 0 and report.statuses == {"200": report.requests} and report.problems == []
