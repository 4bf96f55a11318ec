"""blocklab plan: every method's choice is valid, losses are score's, the frontier and the
recommendation hold, the command writes its files and refuses bad input with one line and status 2."""

import json

import pytest
import torch

from lab import cli, loss_meter, plan
from lab.blocks import BlockSet
from lab.config import GPT2_VOCAB_SIZE, GPTConfig
from lab.exit_probe import ExitProbe
from lab.generate import score
from lab.model import GPT
from lab.weights import save_model

CFG = GPTConfig(n_layer=6, n_head=2, n_embd=16, vocab_size=3000, block_size=32)
"""The library's tests run on token ids below 3000: a narrow table keeps them fast."""
TEXT_CFG = GPTConfig(n_layer=3, n_head=2, n_embd=16, vocab_size=GPT2_VOCAB_SIZE, block_size=32)
"""The command reads text, so its model has GPT-2's vocabulary."""
WINDOWS = loss_meter.windows_of([(37 * i + 11) % 3000 for i in range(200)], 24)


def tiny(probe: bool = False) -> GPT:
    model = GPT(CFG).eval()
    if probe:
        model.exit_probe = ExitProbe(weight=torch.randn(6, 16), bias=torch.zeros(6))
    return model


def depth_latency(block_sets: list[BlockSet]) -> dict[str, float]:
    """A stand-in clock: ms grows with the blocks run (deterministic, so the tests are)."""
    return {str(s): 1.0 + len(s.blocks_to_run(CFG.n_layer)) + 0.01 * len(str(s)) for s in block_sets}


@pytest.fixture(scope="module")
def report() -> dict:
    torch.manual_seed(0)
    return plan.make_plan(tiny(probe=True), WINDOWS, 3, max_loss_increase=0.05, latency=depth_latency)


def test_windows_overlap_by_one_token_and_split_in_two():
    windows = loss_meter.windows_of(list(range(10)), 4)
    assert windows == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 8], [8, 9]]
    calibration, evaluation = loss_meter.split(windows)
    assert calibration == windows[:2] and evaluation == windows[2:]


def test_json_has_the_top_level_keys(report):
    assert {"all", "methods", "agreement", "frontier", "recommended"} <= set(report)
    assert set(report["methods"]) == {"single", "bi", "angular", "greedy", "exit", "adaptive"}
    assert set(report["agreement"]["spearman"]) == {"bi", "angular"}
    for group in report["methods"].values():
        for point in group:
            assert set(point) >= {"k", "block_set", "loss", "loss_increase", "ms_per_token"}


def test_each_method_drops_k_distinct_valid_blocks(report):
    for method in ("single", "bi", "angular", "greedy"):
        for k, point in enumerate(report["methods"][method], start=1):
            block_set = BlockSet.parse(point["block_set"], CFG.n_layer)
            assert point["k"] == k and len(block_set.skip) == k
    for k, point in enumerate(report["methods"]["exit"], start=1):
        assert point["block_set"] == f"exit={CFG.n_layer - k}"
    angular = [sorted(BlockSet.parse(p["block_set"], 6).skip) for p in report["methods"]["angular"]]
    assert all(blocks == list(range(blocks[0], blocks[0] + len(blocks))) for blocks in angular)
    for point in report["methods"]["adaptive"]:
        assert 0 <= point["k"] < CFG.n_layer and "check=probe" in point["block_set"]


def test_greedy_starts_with_the_best_single_block(report):
    assert report["methods"]["greedy"][0]["block_set"] == report["methods"]["single"][0]["block_set"]
    singles = report["agreement"]["per_block"]
    best = min(singles, key=lambda row: row["single_loss_increase"])["block"]
    assert report["methods"]["single"][0]["block_set"] == f"skip={best}"


def test_reported_loss_is_score_on_the_evaluation_split(report):
    model = tiny(probe=True)
    _, evaluation = loss_meter.split(WINDOWS)
    tokens = sum(len(w) - 1 for w in evaluation)
    for point in [report["all"], report["methods"]["bi"][2], report["methods"]["adaptive"][0]]:
        block_set = BlockSet.parse(point["block_set"], CFG.n_layer)
        expected = sum(score(model, w, block_set).mean_loss * (len(w) - 1) for w in evaluation) / tokens
        assert point["loss"] == pytest.approx(expected, abs=1e-4)


def test_a_model_with_a_tuned_lens_gets_its_exits_as_candidates(report):
    """Beside the logit-lens exits, the same exits through the tuned lens, each measured as score
    measures it; a model without a lens gets none."""
    from tests.tiny import random_lens

    assert "tuned" not in report["methods"]
    torch.manual_seed(0)
    model = tiny()
    model.tuned_lens = random_lens(model, scale=0.2)
    lensed = plan.make_plan(model, WINDOWS, 3, max_loss_increase=10.0, latency=depth_latency)
    tuned, exits = lensed["methods"]["tuned"], lensed["methods"]["exit"]
    assert [p["block_set"] for p in tuned] == [f"exit={CFG.n_layer - k};lens=tuned" for k in (1, 2, 3)]
    assert [p["k"] for p in tuned] == [1, 2, 3]
    _, evaluation = loss_meter.split(WINDOWS)
    tokens = sum(len(w) - 1 for w in evaluation)
    for point, logit in zip(tuned, exits, strict=True):
        block_set = BlockSet.parse(point["block_set"], CFG.n_layer)
        expected = sum(score(model, w, block_set).mean_loss * (len(w) - 1) for w in evaluation) / tokens
        assert point["loss"] == pytest.approx(expected, abs=1e-4)
        assert point["loss"] != pytest.approx(logit["loss"], abs=1e-4)


def test_repeated_table_rows_are_counted_exactly():
    """The read-out over distinct rows (weighted by their count) is the full softmax's."""
    model = tiny()
    with torch.no_grad():
        model.wte.weight[2000:] = model.wte.weight[1999]  # one row for the tokens never in the text
    meter = loss_meter.LossMeter(model, [[t % 2000 for t in w] for w in WINDOWS[:3]])
    assert meter.table.size(0) == 2000
    tokens = sum(len(w) - 1 for w in WINDOWS[:3])
    block_set = BlockSet(skip=frozenset({2}))
    expected = sum(score(model, w, block_set).mean_loss * (len(w) - 1) for w in meter.windows) / tokens
    assert meter(block_set) == pytest.approx(expected, abs=1e-5)


def test_frontier_has_no_dominated_point_and_recommended_respects_the_bound(report):
    front = report["frontier"]
    points = [report["all"], *(p for group in report["methods"].values() for p in group)]
    for p in front:
        assert not any(q["ms_per_token"] <= p["ms_per_token"] and q["loss"] < p["loss"] for q in points)
    assert [p["ms_per_token"] for p in front] == sorted(p["ms_per_token"] for p in front)
    best = report["recommended"]
    assert best["loss_increase"] <= 0.05
    within = [p for p in points if p["loss_increase"] <= 0.05]
    assert best["ms_per_token"] == min(p["ms_per_token"] for p in within)


def test_budget_picks_the_lowest_loss_within_it_or_says_what_the_fastest_costs():
    points = [
        plan.Point("all", 0, "all", 3.0, 0.0, 10.0),
        plan.Point("exit", 1, "exit=5", 3.5, 0.5, 8.0),
        plan.Point("bi", 1, "skip=2", 3.1, 0.1, 9.0),
    ]
    assert plan.recommend(points, None, 9.5).block_set == "skip=2"
    with pytest.raises(ValueError, match=r"the fastest, exit=5, takes 8.00 ms/token"):
        plan.recommend(points, None, 5.0)
    assert plan.recommend(points, 0.2, None).block_set == "skip=2"


def test_spearman():
    assert plan.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert plan.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert plan.spearman([1, 1, 2], [1, 1, 2]) == pytest.approx(1.0)


def test_decode_latency_is_measured_per_set():
    sets = [BlockSet(), BlockSet(exit_at=2)]
    ms = plan.decode_ms(tiny(), [1, 2, 3], sets, new_tokens=4, rounds=1)
    assert set(ms) == {"all", "exit=2"} and all(v > 0 for v in ms.values())


def test_only_loopback_servers():
    with pytest.raises(ValueError, match="not a loopback"):  # refused before anything is sent
        plan.served_ms("http://192.0.2.1:8000", tiny(), "def main(", [BlockSet()])
    with pytest.raises(ValueError, match="not a loopback"):
        plan.PlanOptions(url="http://192.0.2.1:8000")
    assert plan.PlanOptions(url="http://127.0.0.1:8000").url == "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_model(GPT(TEXT_CFG), tmp_path_factory.mktemp("model")))


def test_main_writes_the_plan_and_its_picture(model_dir, tmp_path, capsys):
    text = tmp_path / "prompts.jsonl"
    text.write_text(
        "\n".join(json.dumps({"prompt": f"def f{i}(x):\n    return x * {i} + 1\n" * 3}) for i in range(4))
    )
    argv = [
        "plan",
        "--model",
        model_dir,
        "--prompts",
        str(text),
        "--max-drop",
        "2",
        "--out",
        str(tmp_path / "o"),
    ]
    assert plan.main([*argv, "--json", "--window", "16", "--tokens", "120"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert json.loads((tmp_path / "o" / "plan.json").read_text())["recommended"] == report["recommended"]
    assert (tmp_path / "o" / "plan.png").stat().st_size > 0
    assert report["recommended"]["loss_increase"] <= 0.1  # the default bound


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--max-drop", "3"], "--max-drop 3: the model has 3 blocks"),
        (["--prompts", "EMPTY"], "no text in it"),
        (["--budget-ms-per-token", "0.001"], "the fastest, "),
        (["--url", "http://192.0.2.1:8000"], "not a loopback"),
    ],
)
def test_bad_input_one_line_and_status_2(model_dir, tmp_path, capsys, extra, message):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    extra = [str(empty) if arg == "EMPTY" else arg for arg in extra]
    argv = ["plan", "--model", model_dir, "--tokens", "64", "--max-drop", "1", "--out", str(tmp_path)]
    assert cli.main([*argv, *extra]) == 2  # the plan's errors are UserErrors, lab.cli's one line
    err = capsys.readouterr().err
    assert err.startswith("blocklab plan: ") and message in err and err.count("\n") == 1


# ---------------------------------------------------------------------------------------------------
# Deploying a plan: the server's default block set, and traffic replaying a plan's frontier


def test_a_request_naming_no_blocks_gets_the_servers_default():
    from serve.http_front import Front
    from serve.schema import ModelLimits, PredictRequest, resolve

    limits = ModelLimits(n_layer=4, block_size=64, default_blocks="skip=1,2")
    assert resolve(PredictRequest(prompt="hello there"), limits).block_set == BlockSet(skip={1, 2})
    assert resolve(PredictRequest(prompt="hello there", blocks="all"), limits).block_set == BlockSet()
    assert resolve(PredictRequest(prompt="hello there", exit_at=2), limits).block_set == BlockSet(exit_at=2)

    class LoadedPool:  # a pool whose workers have published the model: all the front end asks here
        def limits(self) -> ModelLimits:
            return ModelLimits(n_layer=4, block_size=64)

    front = Front(LoadedPool(), default_blocks="exit=3")  # the server's --default-blocks
    assert resolve(PredictRequest(prompt="hello there"), front.limits()).block_set == BlockSet(exit_at=3)


def test_serve_reports_its_default_and_refuses_a_bad_one_at_start():
    from fastapi.testclient import TestClient

    from serve import app
    from serve.schema import ModelLimits
    from tests.tiny import TinyModel

    config = app.options(["--default-blocks", "skip=3"])
    info = TestClient(app.build(config, TinyModel()).app).get("/info").json()  # nothing started
    assert info["model"]["default_blocks"] == "skip=3"
    app._check_default_blocks(config, ModelLimits(n_layer=4, block_size=64))
    for spec, message in [("skip=9", "out of range"), ("adaptive=0.9;check=probe", "needs an exit probe")]:
        with pytest.raises(RuntimeError, match=message):
            app._check_default_blocks(app.ServeConfig(default_blocks=spec), ModelLimits(4, 64))


def test_traffic_replays_a_plans_frontier(tmp_path, monkeypatch):
    from serve import traffic

    plan_json = tmp_path / "plan.json"
    plan_json.write_text(json.dumps({"frontier": [{"block_set": "exit=2"}, {"block_set": "all"}]}))
    seen = {}

    async def fake_run(options, url):
        seen["block_sets"] = options.block_sets
        raise SystemExit(0)

    monkeypatch.setattr(traffic, "run", fake_run)
    with pytest.raises(SystemExit):
        traffic.main(["traffic", "--block-sets-from", str(plan_json)])
    assert seen["block_sets"] == ["all", "exit=2"]


def test_sets_start_from_the_kept_stream_or_run_whole_alike(monkeypatch):
    from tests.tiny import random_lens

    model = tiny()
    model.tuned_lens = random_lens(model)
    sets = [BlockSet(skip=frozenset({2, 4})), BlockSet(exit_at=3), BlockSet(overwrite=frozenset({1})),
            BlockSet(skip=frozenset({1}), exit_at=3, lens="tuned")]  # fmt: skip
    kept = loss_meter.LossMeter(model, WINDOWS[:4])
    monkeypatch.setattr(loss_meter, "CACHE_BYTES", 0)
    whole = loss_meter.LossMeter(model, WINDOWS[:4])
    assert kept.cached is not None and whole.cached is None
    for block_set in sets:
        assert kept(block_set) == pytest.approx(whole(block_set), abs=1e-6)


@pytest.mark.slow
def test_a_served_default_and_latency_through_the_server():
    import httpx

    from serve.process import ServerProcess
    from tests.tiny import TinyModel

    factory = TinyModel(n_layer=4, block_size=64)
    with ServerProcess(["--threads", "1", "--default-blocks", "skip=1"], model_factory=factory) as server:
        assert httpx.get(server.url + "/info").json()["model"]["default_blocks"] == "skip=1"
        answer = httpx.post(server.url + "/predict", json={"prompt": "def main(", "max_new_tokens": 2}).json()
        assert answer["block_set"] == "skip=1"
        sets = [BlockSet(), BlockSet(exit_at=2)]
        ms = plan.served_ms(server.url, factory("cpu"), "def main(", sets, new_tokens=4, rounds=1)
        assert set(ms) == {"all", "exit=2"} and all(v > 0 for v in ms.values())
        with pytest.raises(ValueError, match="the server's model has 4 blocks"):
            plan.served_ms(server.url, tiny(), "def main(", sets, new_tokens=4, rounds=1)
