"""``blocklab traffic``: block set defaults, prompt sources, the rounds and their order, statistics with
intervals and significance, the frontier, outputs, and real runs."""

import asyncio
import json

import httpx
import numpy as np
import pytest
from tqdm import tqdm

from lab import tokens
from lab.corpora import held_out_stdlib_files
from lab.errors import UserError
from serve import traffic, traffic_report
from serve.client import Reply, arrival_gaps
from serve.process import ServerProcess, save_tiny_model
from serve.traffic_report import Run
from tests.tiny import TinyModel, predict_response


def test_default_block_sets_follow_the_depth():
    assert traffic.default_block_sets(12) == [
        "all",
        "skip=5",
        "skip=3,4,5",
        "exit=6",
        "exit=9",
        "adaptive=0.98",
    ]
    assert traffic.default_block_sets(12, exit_probe=True)[-1] == "adaptive=0.8;min=2;check=probe"
    small = traffic.default_block_sets(2)
    assert len(small) == len(set(small)) and small[0] == "all"


def test_only_loopback_unless_allowed():
    with pytest.raises(UserError, match="not a loopback address; pass --allow-remote"):
        traffic.main(["traffic", "--url", "http://192.0.2.1:8000"])
    with pytest.raises(UserError, match="no server at http://127.0.0.1:9"):  # allowed, then nobody answers
        traffic.main(["traffic", "--url", "http://127.0.0.1:9"])


def test_options_keep_their_spellings_and_refuse_what_cannot_run():
    options = traffic.parse(
        traffic.TrafficOptions,
        [
            "--block-sets",
            "all",
            "skip=5",
            "--rate",
            "2",
            "--rates",
            "4",
            "8",
            "--slo",
            "ttft_ms=200",
            "--target-ci",
            "5%",
            "--json",
        ],
        prog="t",
        description="",
    )
    assert options.block_sets == ["all", "skip=5"] and options.rates == [2.0, 4.0, 8.0] and options.json
    assert options.slo_ms == {"ttft_ms": 200.0} and options.target == traffic.Target(5.0, relative=True)
    assert options.order == "interleaved" and traffic.TrafficOptions(sequential=True).rounds == 1
    assert traffic.TrafficOptions(requests=5, rounds=2).per_turn == 3
    for bad, message in [
        ({"concurrency": 0}, "must be >= 1"),
        ({"rates": [0.0]}, "must be positive"),
        ({"mix": True, "sequential": True}, "not both"),
        ({"serve_dtype": "int3"}, "--serve-dtype: one of"),
        ({"target_ci": "narrow"}, "milliseconds .20. or a percentage"),
        ({"target_ci": "-5%"}, "must be positive"),
    ]:
        with pytest.raises(UserError, match=message):
            traffic.TrafficOptions(**bad)


def test_prompts_from_text_jsonl_and_held_out_source(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert traffic.read_prompts(text, 10) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a"}\n"b"\n')
    assert traffic.read_prompts(jsonl, 10) == ["a", "b"]
    bundled = traffic.read_prompts(None, 5, seed=1)
    assert len(bundled) == 5 and bundled == traffic.read_prompts(None, 5, seed=1)
    assert all(len(prompt) >= 80 for prompt in bundled)
    held_out = "".join(path.read_text(errors="replace") for path in held_out_stdlib_files())
    assert all(prompt in held_out for prompt in bundled)  # code the builtin model never trained on
    assert len(tokens.encode(traffic.fit_prompt(bundled[0] * 20, 30))) <= 30


def reply(
    latency: float,
    ttft: float,
    gaps: tuple[float, ...] = (0.001, 0.003),
    *,
    loss: float | None = 2.0,
    prompt: str = "p",
    blocks: str = "all",
    tokens: int = 4,
    error: str | None = None,
) -> Reply:
    """A completed request (or, with ``error``, a failed one) as the client saw it."""
    times = [ttft + sum(gaps[:i]) for i in range(len(gaps) + 1)]
    body = {"prompt": prompt, "blocks": blocks}
    if error is not None:
        return Reply(body=body, latency_s=latency, status=500, error=error)
    return Reply(
        body=body, latency_s=latency, status=200, response=predict_response(tokens, loss), token_s=times
    )


def test_summary_statistics_goodput_and_loss_increase():
    run = Run(
        "all", None, [reply(0.1 * (i + 1), 0.01 * (i + 1), loss=2.0 + i, prompt=str(i)) for i in range(10)]
    )
    run.replies.append(reply(5.0, 0.0, error="500: boom"))
    run.wall_s = 2.0
    base = traffic_report.summarize(run, concurrency=2, slo={"ttft_ms": 50, "itl_ms": 5})
    assert base.completed == 10 and base.errors == 1 and base.first_error == "500: boom"
    assert base.median_e2el_ms == pytest.approx(550.0) and base.p99_e2el_ms <= 1000.0
    assert base.mean_e2el_ms == pytest.approx(550.0) and base.median_ttft_ms == pytest.approx(55.0)
    assert base.median_tpot_ms == pytest.approx(2.0) and base.mean_itl_ms == pytest.approx(2.0)
    assert base.p99_itl_ms == pytest.approx(3.0, abs=0.01)
    assert base.mean_loss == pytest.approx(6.5) and base.output_throughput == pytest.approx(20.0)
    assert base.request_throughput == pytest.approx(5.0)
    assert base.request_goodput == pytest.approx(2.5)  # the 5 requests with ttft <= 50 ms, per 2 s
    assert base.median_e2el_ms_low < base.median_e2el_ms < base.median_e2el_ms_high <= 1000.0
    assert base.mean_loss_low < base.mean_loss < base.mean_loss_high
    assert traffic_report.summarize(run, slo={"itl_ms": 2.5}).request_goodput == 0.0  # all had a 3 ms gap
    assert traffic_report.summarize(run).request_goodput is None  # no SLO given
    other = Run("skip=1", None, [reply(0.2, 0.01, loss=7.0, prompt="0")], wall_s=1.0)
    first, second = traffic_report.compare([run, other], [base, traffic_report.summarize(other)])
    assert second.loss_increase == pytest.approx(0.5) and first.loss_increase == 0.0
    assert second.loss_increase_low is None  # one shared prompt: no interval


def test_slo_parsing_names_the_part_at_fault():
    assert traffic.parse_slo(["ttft_ms=200", "tpot_ms=50"]) == {"ttft_ms": 200.0, "tpot_ms": 50.0}
    for bad, part in [("ttft=200", "ttft=200"), ("tpot_ms=fast", "tpot_ms"), ("e2el_ms=-1", "e2el_ms")]:
        with pytest.raises(UserError, match=part):
            traffic.parse_slo([bad])


def test_arrival_gaps_are_poisson_at_the_rate_or_burstier():
    poisson = np.array(arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=0))
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.array(arrival_gaps(20000, rate=4.0, burstiness=0.25, seed=0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma: CV 1/sqrt(shape)


def test_every_round_gives_every_set_one_turn_in_a_seeded_order():
    sets = ["all", "skip=5", "skip=3,4,5", "exit=6", "exit=9", "adaptive=0.98"]
    rounds = [traffic.turns_of_round(sets, number, "interleaved", seed=0) for number in range(40)]
    for turns in rounds:
        assert sorted(block_set for (block_set,) in turns) == sorted(sets)  # each once, alone
    assert rounds == [traffic.turns_of_round(sets, n, "interleaved", seed=0) for n in range(40)]
    assert rounds != [traffic.turns_of_round(sets, n, "interleaved", seed=1) for n in range(40)]
    firsts = [turns[0][0] for turns in rounds]
    assert len(set(firsts)) == len(sets) and len({tuple(turns) for turns in rounds}) > 30  # no fixed order
    assert traffic.turns_of_round(sets, 3, "sequential", seed=0) == [(s,) for s in sets]
    assert traffic.turns_of_round(sets, 3, "mixed", seed=0) == [tuple(sets)]


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_more_rounds_until_narrow_or_out_of_budget():
    def rounds(narrow_after: int | None, budget_s: float, target: bool = True) -> tuple[int, bool | None]:
        clock, ran = FakeClock(), []

        async def one_round(number: int) -> None:
            ran.append(number)
            clock.now += 10.0  # every round takes 10 s

        narrow = (lambda: narrow_after is not None and len(ran) >= narrow_after) if target else None
        done, met = asyncio.run(traffic.rounds_until(one_round, 2, narrow, budget_s, clock=clock))
        assert ran == list(range(done))
        return done, met

    assert rounds(None, 1000.0, target=False) == (2, None)  # no target: the first rounds only
    assert rounds(5, 1000.0) == (5, True)  # narrow after the 5th round
    assert rounds(1, 1000.0) == (2, True)  # the first rounds always run
    assert rounds(None, 45.0) == (4, False)  # a 5th round (40 s + 10 s) would overrun the budget
    assert rounds(None, 5.0) == (2, False)  # the budget spent by the first rounds


def test_the_target_is_met_once_every_median_is_that_narrow():
    rng = np.random.default_rng(0)

    def run(n: int) -> Run:
        latencies = rng.lognormal(-1.0, 0.3, size=n)
        return Run("all", None, [reply(e, e / 4, gaps=(e / 40, e / 40)) for e in latencies])

    few, many = run(8), run(2000)
    assert not traffic.Target(5.0, relative=True).met(few) and traffic.Target(5.0, relative=True).met(many)
    assert traffic.Target(1e4, relative=False).met(few) and not traffic.Target(1.0, relative=False).met(few)
    assert not traffic.Target(50.0, relative=True).met(Run("all", None, [reply(0.1, 0.01)]))  # one request


def _runs(shift: float, loss_shift: float, n: int = 40, seed: int = 0) -> list[Run]:
    """``all`` and ``fast``: latencies from one distribution times ``1 - shift``, losses per prompt
    plus ``loss_shift``."""
    rng = np.random.default_rng(seed)
    prompt_losses = rng.normal(6.0, 1.0, size=n)
    runs = []
    for name, factor, extra in (("all", 1.0, 0.0), ("fast", 1.0 - shift, loss_shift)):
        latencies = rng.lognormal(-1.0, 0.3, size=n) * factor
        runs.append(
            Run(
                name,
                None,
                [
                    reply(e, e / 4, gaps=(e / 40,) * 3, loss=loss + extra, prompt=str(i))
                    for i, (e, loss) in enumerate(zip(latencies, prompt_losses, strict=True))
                ],
                wall_s=1.0,
            )
        )
    return runs


def test_differences_from_all_are_significant_only_when_real():
    for seed in range(4):
        runs = _runs(shift=0.0, loss_shift=0.0, seed=seed)
        _, same = traffic_report.compare(runs, [traffic_report.summarize(r) for r in runs])
        assert not any(same.differs(s) for s in ("median_ttft_ms", "median_tpot_ms", "median_e2el_ms"))
    runs = _runs(shift=0.5, loss_shift=0.05)
    _, faster = traffic_report.compare(runs, [traffic_report.summarize(r) for r in runs])
    assert all(
        faster.differs(s) for s in ("median_ttft_ms", "median_tpot_ms", "median_e2el_ms", "loss_increase")
    )
    assert faster.median_e2el_ms_diff_high < 0 and faster.loss_increase_low > 0
    table = traffic_report.render([traffic_report.summarize(r) for r in _runs(0.0, 0.0)])
    assert "~" in table and "worth serving" in table


def test_the_frontier_is_what_no_set_beats_significantly_on_both():
    runs = _runs(shift=0.5, loss_shift=-0.05)  # fast is faster and better: it rules out all
    summaries = traffic_report.compare(runs, [traffic_report.summarize(r) for r in runs])
    assert [s.frontier for s in summaries] == [False, True]
    runs = _runs(shift=0.5, loss_shift=0.05)  # faster but worse: both are worth serving
    assert all(s.frontier for s in traffic_report.compare(runs, [traffic_report.summarize(r) for r in runs]))
    runs = _runs(shift=0.0, loss_shift=-0.05)  # as fast (within the noise), better: still not ruled out
    assert all(s.frontier for s in traffic_report.compare(runs, [traffic_report.summarize(r) for r in runs]))
    text = traffic_report.render(traffic_report.compare(*_dominated()))
    assert text.splitlines()[-1].endswith("significantly faster end to end and lower in loss): fast")


def _dominated():
    runs = _runs(shift=0.5, loss_shift=-0.05)
    return runs, [traffic_report.summarize(r) for r in runs]


def test_results_are_written_as_csv_json_and_png(tmp_path):
    runs, summaries = _dominated()
    summaries = traffic_report.compare(runs, summaries)
    paths = traffic_report.write_results(summaries, tmp_path, {"model": "m", "concurrency": 2})
    assert paths["png"].stat().st_size > 1000  # a frontier of one, the point it rules out greyed
    header = paths["csv"].read_text().splitlines()[0]
    assert header.startswith("block_set,request_rate,concurrency,completed")
    assert "median_e2el_ms,median_e2el_ms_low,median_e2el_ms_high" in header and header.endswith(",frontier")
    rows = json.loads(paths["json"].read_text())["block_sets"]
    assert rows[1]["loss_increase"] == pytest.approx(-0.05, abs=0.01) and rows[1]["frontier"] is True
    assert rows[1]["loss_increase_low"] <= rows[1]["loss_increase"] <= rows[1]["loss_increase_high"] < 0


def _fake_server(request: httpx.Request) -> httpx.Response:
    """/predict as NDJSON: two tokens then the summary; a prompt saying 'fail' gets a 500."""
    body = json.loads(request.content)
    if "fail" in body["prompt"]:
        return httpx.Response(500, json={"detail": "RuntimeError: boom"})
    events = [{"event": "token", "index": i, "token": i, "text": "a", "blocks": 3} for i in range(2)]
    lines = [
        *map(json.dumps, events),
        json.dumps({"event": "done", "response": predict_response().model_dump()}),
    ]
    return httpx.Response(200, content="".join(line + "\n" for line in lines))


def test_a_turn_counts_requests_errors_and_honours_the_duration():
    bodies = [traffic.request_body(p, "skip=1", 2) for p in ["ok", "please fail"]]

    async def turn(options, rate=None):
        transport = httpx.MockTransport(_fake_server)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            with tqdm(disable=True) as progress:
                return await traffic.run_turn(client, bodies * 3, rate, options, seed=0, progress=progress)

    replies, _ = asyncio.run(turn(traffic.TrafficOptions(concurrency=2)))
    assert len(replies) == 6 and sum(not r.ok for r in replies) == 3
    ok = next(r for r in replies if r.ok)
    assert (
        ok.response.score.mean_loss == 2.5 and len(ok.response.tokens) == 2 and 0 <= ok.ttft_s <= ok.latency_s
    )
    assert "500" in next(r.error for r in replies if not r.ok)
    assert sorted(r.body["seed"] for r in replies) == [1, 2, 3, 4, 5, 6]
    timed, wall_s = asyncio.run(turn(traffic.TrafficOptions(duration=0.4, rounds=2)))  # 0.2 s a turn
    assert len(timed) > 6 and 0.2 <= wall_s < 2.0
    arrived, _ = asyncio.run(turn(traffic.TrafficOptions(), rate=200.0))
    assert len(arrived) == 6


def _main_json(capsys, *argv) -> tuple[int, dict]:
    code = traffic.main(["traffic", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.slow
def test_traffic_against_a_real_server(tmp_path, capsys):
    with ServerProcess(["--threads", "1", "--model", "tiny"], model_factory=TinyModel(n_layer=4)) as server:
        code, result = _main_json(
            capsys,
            "--url",
            server.url,
            "--requests",
            "6",
            "--rounds",
            "3",
            "--concurrency",
            "3",
            "--max-new-tokens",
            "4",
            "--block-sets",
            "all",
            "skip=1,2",
            "exit=1",
            "--out",
            str(tmp_path),
        )
    assert code == 0 and result["order"] == "interleaved" and result["rounds"] == {"None": 3}
    by_set = {row["block_set"]: row for row in result["block_sets"]}
    assert set(by_set) == {"all", "skip=1,2", "exit=1"}
    assert all(row["completed"] == 6 and row["errors"] == 0 for row in by_set.values())
    assert by_set["exit=1"]["mean_blocks_per_token"] == 1.0 and by_set["all"]["mean_blocks_per_token"] == 4.0
    assert by_set["skip=1,2"]["loss_increase"] != 0.0
    assert by_set["all"]["median_ttft_ms"] <= by_set["all"]["median_e2el_ms"]
    for row in by_set.values():
        for statistic in ("median_ttft_ms", "median_tpot_ms", "median_e2el_ms", "mean_loss"):
            assert row[f"{statistic}_low"] <= row[statistic] <= row[f"{statistic}_high"]
    assert by_set["exit=1"]["median_e2el_ms_diff_low"] is not None and any(
        r["frontier"] for r in by_set.values()
    )
    assert (tmp_path / "frontier.png").exists() and (tmp_path / "traffic.csv").exists()


@pytest.mark.slow
def test_open_loop_sweep_with_mixed_block_sets_against_a_real_server(tmp_path, capsys):
    with ServerProcess(["--threads", "1", "--model", "tiny"], model_factory=TinyModel(n_layer=4)) as server:
        code, result = _main_json(
            capsys,
            "--url",
            server.url,
            "--requests",
            "4",
            "--rates",
            "4",
            "16",
            "--mix",
            "--max-new-tokens",
            "3",
            "--block-sets",
            "all",
            "exit=1",
            "--slo",
            "e2el_ms=60000",
            "--out",
            str(tmp_path),
        )
    assert code == 0
    assert result["mode"] == "open loop" and result["mixed"] is True
    rows = {(row["request_rate"], row["block_set"]): row for row in result["block_sets"]}
    assert set(rows) == {(4.0, "all"), (4.0, "exit=1"), (16.0, "all"), (16.0, "exit=1")}
    for (_, block_set), row in rows.items():
        assert row["completed"] == 4 and row["errors"] == 0 and row["concurrency"] is None
        assert row["request_goodput"] == row["request_throughput"]  # a minute meets every request
        assert row["mean_blocks_per_token"] == (1.0 if block_set == "exit=1" else 4.0)
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 1000


@pytest.mark.slow
def test_serve_a_model_and_send_until_the_target_or_the_budget(tmp_path, capsys):
    """``--serve DIR`` starts and stops a server; ``--target-ci`` adds rounds; ``--sequential`` runs
    the sets one after another."""
    model = str(save_tiny_model(tmp_path / "tiny"))
    code, result = _main_json(
        capsys,
        "--serve",
        model,
        "--requests",
        "4",
        "--max-new-tokens",
        "3",
        "--block-sets",
        "all",
        "exit=1",
        "--target-ci",
        "0.001",
        "--budget",
        "3",
        "--out",
        str(tmp_path / "a"),
    )
    assert code == 0 and result["rounds"]["None"] > 2  # 1 us is never reached: rounds until the budget
    assert result["target_met"] == {"None": False}  # and it says so
    assert all(row["completed"] == 2 * result["rounds"]["None"] for row in result["block_sets"])
    code, result = _main_json(
        capsys,
        "--serve",
        model,
        "--requests",
        "3",
        "--max-new-tokens",
        "3",
        "--block-sets",
        "all",
        "exit=1",
        "--sequential",
        "--out",
        str(tmp_path / "b"),
    )
    assert code == 0 and result["order"] == "sequential" and result["rounds"] == {"None": 1}
    assert [row["completed"] for row in result["block_sets"]] == [3, 3]
