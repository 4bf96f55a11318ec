"""What a client cannot make the server do: use it without the key, reach it from another host by
default, send more than the bounds, or make it read or write a file. One tiny-model server for the
module, started without ``--host``, with an API key and a 20 kB body limit."""

import ctypes
import os
import re
import socket
import struct
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from lab import tokens
from serve.app import ServeConfig, build
from serve.http_front import PUBLIC_PATHS
from serve.openai_schema import ChatCompletionRequest
from serve.process import ServerProcess
from serve.schema import MAX_NEW_TOKENS, MAX_PROMPT_CHARS, PredictRequest
from tests.tiny import TinyModel

KEY = "s3cret-key"
AUTH = {"X-API-Key": KEY}
MAX_PAYLOAD = 20_000
CONTEXT = 128
DOCUMENTED_PUBLIC = {"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"}
MODEL_ROUTES = ("/predict", "/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def server():
    args = ["--threads", "1", "--api-key", KEY, "--max-payload-bytes", str(MAX_PAYLOAD)]
    with ServerProcess(args, model_factory=TinyModel(block_size=CONTEXT), host=None) as running:
        yield running


def minimal_body(path: str, text: str = "Hello there, general") -> dict:
    if path == "/predict":
        return {"prompt": text, "max_new_tokens": 2}
    if path == "/v1/completions":
        return {"prompt": text, "max_tokens": 2}
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 2}


# --------------------------------------------------------------------------------------------------
# Binding


def listening_addresses(port: int) -> set[str]:
    """Local addresses of the TCP sockets listening on ``port`` (Linux /proc/net)."""
    found = set()
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(address)
            if width == 4:
                found.add(socket.inet_ntop(socket.AF_INET, raw[::-1]))
            else:  # four little-endian 32-bit words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                found.add(socket.inet_ntop(socket.AF_INET6, words))
    return found


def test_the_server_binds_loopback_unless_told_otherwise(server):
    assert ServeConfig().host == "127.0.0.1"
    assert listening_addresses(server.port) == {"127.0.0.1"}


# --------------------------------------------------------------------------------------------------
# The API key


def raw_request(port: int, method: str, path: str, headers: dict[str, str] | None = None) -> int:
    """One request with the path exactly as given (httpx would normalise ``..``); its status."""
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close", "Content-Length: 0"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        status_line = sock.makefile("rb").readline().decode()
    return int(status_line.split()[1])


def app_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the server's app has, built in-process (nothing is started)."""
    app = build(ServeConfig(api_key=KEY), model_factory=TinyModel()).app
    return sorted(
        (method, route.path) for route in app.routes for method in route.methods if method != "HEAD"
    )


def test_every_route_but_the_documented_public_ones_needs_the_key(server):
    routes = app_routes()
    assert PUBLIC_PATHS == DOCUMENTED_PUBLIC  # what docs/serving.md says is open
    assert {path for _, path in routes} >= set(MODEL_ROUTES) | {"/info", "/stats", "/v1/models", "/health"}
    for method, path in routes:
        without = raw_request(server.port, method, path)
        wrong = raw_request(server.port, method, path, {"X-API-Key": "wrong"})
        wrong_bearer = raw_request(server.port, method, path, {"Authorization": f"Bearer {KEY}x"})
        with_key = raw_request(server.port, method, path, AUTH)
        if path in DOCUMENTED_PUBLIC:
            assert without != 401, path
        else:
            assert (without, wrong, wrong_bearer) == (401, 401, 401), (method, path)
        assert with_key != 401, (method, path)
    # paths no route has, or that only look like a public one, are refused too: deny by default
    for path in (
        "/nope",
        "/health/../info",
        "/docs/../stats",
        "//stats",
        "/predict/",
        "/PREDICT",
        "/%2e%2e/info",
    ):
        assert raw_request(server.port, "GET", path) == 401, path


def test_the_key_is_checked_before_the_body_is_read(server):
    for path in MODEL_ROUTES:
        huge = httpx.post(server.url + path, content=b"x" * (2 * MAX_PAYLOAD), timeout=10)
        garbage = httpx.post(server.url + path, content=b"{not json", timeout=10)
        assert (huge.status_code, garbage.status_code) == (401, 401), path
    bearer = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(
        server.url + "/v1/completions", json=minimal_body("/v1/completions"), headers=bearer
    )
    assert response.status_code == 200


def test_the_key_is_never_echoed(server):
    info = httpx.get(server.url + "/info", headers=AUTH).text
    assert KEY not in info
    refused = httpx.get(server.url + "/info", headers={"X-API-Key": KEY + "-wrong"})
    assert refused.status_code == 401 and KEY not in refused.text


# --------------------------------------------------------------------------------------------------
# Bounds


def test_bodies_over_the_limit_get_413_on_every_route(server):
    def chunks():
        for _ in range(4):
            yield b"x" * MAX_PAYLOAD

    for path in MODEL_ROUTES:
        body = minimal_body(path, "word " * (MAX_PAYLOAD // 5))
        sized = httpx.post(server.url + path, json=body, headers=AUTH, timeout=10)
        streamed = httpx.post(server.url + path, content=chunks(), headers=AUTH, timeout=10)  # no length
        assert (sized.status_code, streamed.status_code) == (413, 413), path


def test_token_bounds_hold(server):
    room = CONTEXT - len(tokens.encode("Hello there, general"))
    for path in MODEL_ROUTES:
        field = "max_new_tokens" if path == "/predict" else "max_tokens"
        if path.endswith("chat/completions"):
            room_here = CONTEXT - len(tokens.encode("user: Hello there, general\nassistant:"))
        else:
            room_here = room
        for wanted in (1, 7, room_here):
            body = {**minimal_body(path), field: wanted, "temperature": 0.0}
            out = httpx.post(server.url + path, json=body, headers=AUTH, timeout=60)
            assert out.status_code == 200, (path, wanted, out.text)
            answer = out.json()
            made = len(answer["tokens"]) if path == "/predict" else answer["usage"]["completion_tokens"]
            assert made <= wanted
        for too_many in (room_here + 1, MAX_NEW_TOKENS + 1, 2**63):
            body = {**minimal_body(path), field: too_many}
            refused = httpx.post(server.url + path, json=body, headers=AUTH, timeout=10)
            assert refused.status_code == (400 if path.startswith("/v1/") else 422), (path, too_many)
            assert field in refused.text, (path, too_many)


def test_request_models_bound_every_size():
    with pytest.raises(ValidationError, match="prompt"):
        PredictRequest(prompt="x" * (MAX_PROMPT_CHARS + 1))
    with pytest.raises(ValidationError, match="skip"):
        PredictRequest(prompt="a", skip=list(range(2000)))
    with pytest.raises(ValidationError, match="messages"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "a"}] * 1025)
    with pytest.raises(ValidationError, match="id"):
        PredictRequest(prompt="a", id="x" * 257)


# --------------------------------------------------------------------------------------------------
# Files


REQUEST_FIELDS = {
    # /predict
    "id", "prompt", "prompt_ids", "max_new_tokens", "temperature", "top_k", "top_p", "min_tokens",
    "ignore_eos", "stop", "seed", "stream", "score", "blocks",
    "skip", "keep", "overwrite", "exit_at", "adaptive", "adaptive_min_blocks", "adaptive_check", "lens",
    # the OpenAI routes
    "model", "max_tokens", "stream_options", "include_usage", "continuous_usage_stats", "user", "n",
    "presence_penalty", "frequency_penalty", "logit_bias", "echo", "logprobs", "best_of", "suffix",
    "messages", "role", "content", "type", "text", "name", "max_completion_tokens", "top_logprobs",
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "response_format",
    "store", "metadata", "include_obfuscation",  # taken and dropped: nothing is stored or padded
    # /v1/responses: a text, its turns, and what it refuses (previous_response_id names a response,
    # not a file: none is kept)
    "input", "instructions", "max_output_tokens", "previous_response_id", "reasoning", "include",
    "truncation", "background", "max_tool_calls", "service_tier", "safety_identifier", "prompt_cache_key",
    "status", "phase", "annotations",  # an earlier response's output passed back, with its id: not read
}  # fmt: skip
"""Every field a request body can carry. None selects a file: ``model`` is only echoed (one model
is served, chosen at start), ``blocks`` is a block-set spec. A new field fails this test until it is
added here, after asking the same question of it."""


def request_properties(schema: dict, node, seen: set[str]) -> set[str]:
    """Property names reachable from ``node`` in an OpenAPI document (following $refs once)."""
    names: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if ref is not None and ref not in seen:
            seen.add(ref)
            target = schema
            for part in ref.removeprefix("#/").split("/"):
                target = target[part]
            names |= request_properties(schema, target, seen)
        names |= set(node.get("properties", {}))
        for value in node.values():
            names |= request_properties(schema, value, seen)
    elif isinstance(node, list):
        for value in node:
            names |= request_properties(schema, value, seen)
    return names


def test_no_request_field_or_parameter_names_a_file(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    fields, parameters = set(), []
    for operations in schema["paths"].values():
        for operation in operations.values():
            parameters += operation.get("parameters", [])
            if "requestBody" in operation:
                fields |= request_properties(schema, operation["requestBody"], set())
    # One path parameter, compared with the served model's name and never used otherwise; no query.
    assert parameters == [
        {"name": "model", "in": "path", "required": True, "schema": {"type": "string", "title": "Model"}}
    ]
    assert fields == REQUEST_FIELDS
    words = "path|file|filename|dir|directory|url|uri|load|save|checkpoint|ckpt|weights|config|log|output"
    pathlike = re.compile(rf"(^|_)({words})(_|$)", re.I)
    not_paths = {"max_output_tokens"}  # OpenAI's count of new tokens: "output" as in what is generated
    assert [name for name in fields - not_paths if pathlike.search(name)] == []


class FileWatch:
    """inotify on a directory: every open, read, write, create or delete of a file in it."""

    IN_ALL_EVENTS = 0xFFF

    def __init__(self, directory: Path):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert self.libc.inotify_add_watch(self.fd, str(directory).encode(), self.IN_ALL_EVENTS) >= 0

    def events(self) -> list[tuple[int, str]]:
        """(mask, name) of the events since the last call."""
        found = []
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return found
            offset = 0
            while offset < len(data):
                _, mask, _, length = struct.unpack_from("iIII", data, offset)
                name = data[offset + 16 : offset + 16 + length].rstrip(b"\0").decode()
                found.append((mask, name))
                offset += 16 + length

    def close(self) -> None:
        os.close(self.fd)


def test_path_like_inputs_are_text_and_touch_no_file(server, tmp_path):
    canary = tmp_path / "canary.txt"
    canary.write_text("if you can read this, a request opened a file\n")
    missing = tmp_path / "written-by-a-request.txt"
    relative = os.path.relpath(canary, Path(__file__).resolve().parents[1])  # from the server's cwd
    paths = [
        str(canary),
        f"file://{canary}",
        relative,
        "../" * 12 + str(canary).lstrip("/"),
        str(missing),
        str(tmp_path),
        "~/.ssh/id_rsa",
        "/etc/passwd",
    ]
    watch = FileWatch(tmp_path)
    try:
        canary.read_text()  # the watch works: this read is seen
        assert watch.events(), "inotify saw nothing"
        for path in paths:
            predict = {"id": path, "prompt": path, "max_new_tokens": 2, "score": True}
            out = httpx.post(server.url + "/predict", json=predict, headers=AUTH, timeout=30)
            assert out.status_code == 200, out.text
            assert out.json()["id"] == path and out.json()["prompt_tokens"] == len(tokens.encode(path))
            as_blocks = httpx.post(
                server.url + "/predict", json={"prompt": "a b", "blocks": path}, headers=AUTH
            )
            assert as_blocks.status_code == 422
            completion = {"model": path, "prompt": path, "user": path, "max_tokens": 2}
            out = httpx.post(server.url + "/v1/completions", json=completion, headers=AUTH, timeout=30)
            assert out.status_code == 200 and out.json()["model"] == path
            chat = {
                "model": path,
                "messages": [{"role": "user", "content": path, "name": "x"}],
                "max_tokens": 2,
            }
            out = httpx.post(server.url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=30)
            assert out.status_code == 200
        info = httpx.get(server.url + "/info", headers=AUTH).json()
        assert info["model"]["name"] not in paths  # the served model did not change
        seen = watch.events()
    finally:
        watch.close()
    assert seen == [], f"a request touched the watched directory: {seen}"
    assert sorted(tmp_path.iterdir()) == [canary] and not missing.exists()
