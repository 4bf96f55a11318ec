"""blocklab explore without a browser: each payload is what its command prints, the key rule of
blocklab serve, and static files that name no other origin."""

import json
import logging
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from lab.analysis import ablate, bus, flops, params, shapes
from lab.analysis.designs import Design
from lab.api_key import warn_if_open
from lab.config import GPTConfig
from lab.errors import UserError
from lab.explore import app as explore_app
from lab.explore.reports import ABLATE_MODES, T_MAX, Explorer
from lab.model import GPT, Block
from lab.weights import load_model, save_model

TINY = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=50257, block_size=48)
STATIC = Path(explore_app.__file__).parent / "static"
SVG_NAMESPACE = "http://www.w3.org/2000/svg"


def save_tiny_model(directory: Path, cfg: GPTConfig = TINY) -> Path:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return save_model(GPT(cfg).eval(), directory)


def write_text(path: Path) -> Path:
    """A few kB of prose that ships with every CPython (the pydoc topics)."""
    from pydoc_data.topics import topics

    path.write_text(topics["assignment"] + topics["if"], encoding="utf-8")
    return path


class Commands:
    """A Python process of its own that runs blocklab's entry point (``lab.cli.main``) on each
    ``blocklab ... --json`` line it is given and hands back the JSON printed: the CLI as a user runs it,
    torch imported once for all of them. Started at once, so its imports overlap the caller's work."""

    SCRIPT = """
import contextlib, io, json, shlex, sys
from lab.cli import main
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(shlex.split(json.loads(line))[1:])
    print(json.dumps([status, out.getvalue(), err.getvalue()]), flush=True)
"""

    def __init__(self, cwd: Path):
        self.process = subprocess.Popen([sys.executable, "-c", self.SCRIPT], cwd=cwd, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip

    def run(self, *lines: str) -> list[dict]:
        outputs = []
        for line in lines:
            assert line.startswith("blocklab "), line
            self.process.stdin.write(json.dumps(line) + "\n")
            self.process.stdin.flush()
            answer = self.process.stdout.readline()
            assert answer, f"{line}: the process running the commands died"
            status, out, err = json.loads(answer)
            assert status == 0, f"{line}: {err}"
            outputs.append(json.loads(out))
        return outputs

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def assert_same_json(got, want, rel: float = 1e-6) -> None:
    """Equal structure and strings; floats equal to ``rel`` (the command's process may use other torch
    threads than the test's)."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys()
        for key in want:
            assert_same_json(got[key], want[key], rel)
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for a, b in zip(got, want, strict=True):
            assert_same_json(a, b, rel)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=rel)
    else:
        assert got == want


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    runner = Commands(tmp_path_factory.mktemp("commands"))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def explorer(tmp_path_factory):
    root = tmp_path_factory.mktemp("explore")
    spec = str(save_tiny_model(root / "tiny"))
    return Explorer(load_model(spec), spec, write_text(root / "text.txt"))


@pytest.fixture(scope="module")
def client(explorer):
    return TestClient(explore_app.create_app(explorer))


def test_block_view_is_shapes_and_flops_at_any_T(client):
    cfg = replace(TINY, dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        block = Block(cfg).eval()  # as blocklab shapes builds it: on the CPU, with weights
    design = Design.from_config(cfg, "x")
    for T in (1, 40, TINY.block_size):
        data = client.get(f"/api/block?T={T}").json()
        assert data["shapes"] == json.loads(json.dumps(shapes.describe(block, 1, T)))  # meta run == CPU run
        assert data["flops"]["rows"] == flops.analyse(design, [T], None)["rows"]
    far = client.get("/api/block?T=100000").json()  # past the context, free on the meta device
    scores = next(r for r in far["shapes"]["rows"] if r["hook"] == "attn.scores")
    assert scores["shape"] == [1, TINY.n_head, 100000, 100000]
    assert scores["flops_per_token"] == 2 * 100000 * TINY.n_embd
    assert far["flops"]["rows"][0]["attention"] == 4 * TINY.n_layer * 100000 * TINY.n_embd
    assert [r["T"] for r in far["curve"]["rows"]] == [1 << k for k in range(18)]
    for T in (0, T_MAX + 1, "x"):
        assert client.get(f"/api/block?T={T}").status_code == 422


def test_block_views_asked_at_once_each_get_their_own_T(client):
    from concurrent.futures import ThreadPoolExecutor

    Ts = [3, 5, 7, 11, 13, 17, 19, 23] * 2
    with ThreadPoolExecutor(max_workers=8) as pool:  # as two tabs, or a slider and a typed T, would
        answers = list(pool.map(lambda T: client.get(f"/api/block?T={T}").json(), Ts))
    for T, data in zip(Ts, answers, strict=True):
        assert {r["hook"]: r["shape"][2] for r in data["shapes"]["rows"]}["attn.scores"] == T
        assert all(r["shape"][-2 if r["hook"] == "attn.scores" else 1] == T for r in data["shapes"]["rows"])


def test_params_bus_and_ablate_views_are_their_reports(client, explorer):
    model = explorer.model
    data = client.get("/api/params").json()
    assert data["model"] == params.describe(Design.from_config(model.config, explorer.spec), model)
    assert [d["design"] for d in data["designs"]] == [
        "gpt2",
        "gpt2-medium",
        "gpt2-large",
        "gpt2-xl",
        "llama3.1-8b",
    ]
    ids, _ = explorer._tokens(1024)
    assert len(ids) == TINY.block_size  # blocklab bus's 1024 tokens, capped at the context
    assert client.get("/api/bus").json()["report"]["rows"] == bus.stream_report(model, ids)["rows"]
    ids, _ = explorer._tokens(512)
    assert (
        client.get("/api/ablate").json()["report"]["rows"]
        == ablate.ablation_report(model, ids, ABLATE_MODES)["rows"]
    )


def test_depth_view_checks_its_options_before_building_anything(client):
    assert client.get("/api/depth?stacks=1x16&baseline=2x16").status_code == 422
    answer = client.get("/api/depth?stacks=1x16&stacks=twelve&baseline=1x16")
    assert answer.status_code == 422 and "twelve" in answer.json()["detail"]
    assert client.get("/api/depth?stacks=1x16&baseline=1x16&new=1").status_code == 422
    data = client.get("/api/depth?stacks=1x16&stacks=4x8&baseline=1x16&new=2&repeats=1").json()
    assert [(r["stack"], r["n_layer"], r["d"]) for r in data["report"]["rows"]] == [
        ("1x16", 1, 16),
        ("4x8", 4, 8),
    ]
    assert data["command"].startswith("blocklab depth --stacks 1x16 4x8 --baseline 1x16 --new 2 --repeats 1")


def test_a_model_without_gpt2_vocabulary_still_shows_its_block(tmp_path):
    small = replace(TINY, vocab_size=64)
    explorer = Explorer(load_model(str(save_tiny_model(tmp_path / "m", small))), str(tmp_path / "m"))
    client = TestClient(explore_app.create_app(explorer))
    assert client.get("/api/block?T=8").status_code == 200
    answer = client.get("/api/bus")
    assert answer.status_code == 422 and "vocabulary" in answer.json()["detail"]


def test_the_api_key_rule_is_serves(explorer):
    client = TestClient(explore_app.create_app(explorer, api_key="s3cret"))
    assert client.get("/").status_code == 200  # the page holds no data
    assert client.get("/static/app.js").status_code == 200
    assert client.get("/api/info").status_code == 401
    assert client.get("/api/info", headers={"X-API-Key": "wrong"}).status_code == 401
    assert client.get("/api/info", headers={"X-API-Key": "s3cret"}).status_code == 200
    assert client.get("/api/info", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/api/nothing-here").status_code == 401  # denied before routing


def test_the_key_comes_from_the_environment_and_a_wide_bind_without_one_warns(monkeypatch, caplog):
    monkeypatch.setenv("LIT_SERVER_API_KEY", "from-env")
    assert explore_app.parse([]).api_key == "from-env"
    assert explore_app.parse(["--api-key", "given"]).api_key == "given"
    logger = logging.getLogger("test_explore")
    for host, key in (("127.0.0.1", None), ("::1", None), ("localhost", None), ("0.0.0.0", "k")):
        warn_if_open(host, key, logger)
    assert not caplog.records
    warn_if_open("0.0.0.0", None, logger)
    assert "binding 0.0.0.0 without --api-key" in caplog.text


def test_every_response_forbids_other_origins(client):
    for path in ("/", "/static/app.js", "/api/info"):
        policy = client.get(path).headers["content-security-policy"]
        assert "default-src 'self'" in policy


def test_static_files_name_no_other_origin_and_all_ship():
    files = sorted(STATIC.iterdir())
    assert {f.name for f in files} >= {"index.html", "app.js", "lib.js", "style.css"}
    assert all(f.is_file() for f in files)  # pyproject's package data is explore/static/*: no subfolders
    for f in files:
        text = f.read_text(encoding="utf-8")
        urls = re.findall(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'`)]*", text)
        assert set(urls) <= {SVG_NAMESPACE}, f"{f.name}: {urls}"
        assert not re.search(r"(?:src|href)=[\"']//|@import|url\((?!data:)", text), f.name
        for ref in re.findall(r"(?:src|href)=\"([^\"]*)\"", text):
            assert ref.startswith("/static/") or ref == "data:,", f"{f.name}: {ref}"
        for module in re.findall(r"from \"([^\"]+)\"", text):
            assert module.startswith("./") and (STATIC / module).is_file(), f"{f.name}: {module}"


def test_bind_refuses_a_taken_port_in_one_line():
    taken = explore_app.bind("127.0.0.1", 0)
    try:
        with pytest.raises(UserError, match="cannot listen on 127.0.0.1"):
            explore_app.bind("127.0.0.1", taken.getsockname()[1])
    finally:
        taken.close()


@pytest.mark.slow
def test_each_payload_is_what_its_command_prints(client, commands):
    """The CLI's --json is the contract: run the command each payload names and compare."""
    T = 40
    block, params_view = client.get(f"/api/block?T={T}").json(), client.get("/api/params").json()
    bus_view, ablate_view = client.get("/api/bus").json(), client.get("/api/ablate").json()
    cli_shapes, cli_flops, cli_params, cli_designs, cli_bus, cli_ablate = commands.run(
        block["commands"]["shapes"],
        block["commands"]["flops"],
        params_view["commands"]["model"],
        params_view["commands"]["designs"],
        bus_view["command"],
        ablate_view["command"],
    )
    assert {k: v for k, v in cli_shapes.items() if k != "config"} == block["shapes"]
    assert {k: v for k, v in cli_flops.items() if k != "png"} == block["flops"]
    assert cli_params == params_view["model"]
    assert cli_designs["designs"] == params_view["designs"]
    for cli, view in ((cli_bus, bus_view), (cli_ablate, ablate_view)):
        assert_same_json({k: v for k, v in cli.items() if k != "png"}, view["report"])
