"""``blocklab traffic``: block set defaults, prompt sources, statistics, outputs, and one real run."""

import asyncio
import json

import httpx
import numpy as np
import pytest
from tqdm import tqdm

from lab import tokens
from lab.errors import UserError
from serve import traffic
from serve.process import ServerProcess
from serve.traffic import Sample, Summary
from tests.tiny import TinyModel


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
    traffic.check_loopback("http://127.0.0.1:8000", allow_remote=False)
    traffic.check_loopback("http://localhost:8000", allow_remote=False)
    traffic.check_loopback("http://[::1]:8000", allow_remote=False)
    for url in ("http://10.0.0.5:8000", "http://example.com"):
        with pytest.raises(UserError, match="not a loopback"):
            traffic.check_loopback(url, allow_remote=False)
    traffic.check_loopback("http://10.0.0.5:8000", allow_remote=True)
    with pytest.raises(UserError, match="not a loopback"):
        traffic.main(["traffic", "--url", "http://192.0.2.1:8000"])


def test_prompts_from_text_jsonl_and_the_bundled_docs(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert traffic.read_prompts(text, 10) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a"}\n"b"\n')
    assert traffic.read_prompts(jsonl, 10) == ["a", "b"]
    bundled = traffic.read_prompts(None, 5, seed=1)
    assert len(bundled) == 5 and bundled == traffic.read_prompts(None, 5, seed=1)
    assert all(len(prompt) >= 80 for prompt in bundled)
    assert len(tokens.encode(traffic.fit_prompt(bundled[0] * 20, 30))) <= 30


def test_summary_statistics_goodput_and_loss_increase():
    samples = [
        Sample(latency_s=0.1 * (i + 1), ttft_s=0.01 * (i + 1), tpot_s=0.002, new_tokens=4, loss=2.0 + i,
               itl_s=[0.001, 0.003])
        for i in range(10)
    ]  # fmt: skip
    samples.append(Sample(latency_s=5.0, error="500: boom"))
    base = traffic.summarize("all", samples, wall_s=2.0, concurrency=2, slo={"ttft_ms": 50, "itl_ms": 5})
    assert base.completed == 10 and base.errors == 1 and base.first_error == "500: boom"
    assert base.median_e2el_ms == pytest.approx(550.0) and base.p99_e2el_ms <= 1000.0
    assert base.mean_e2el_ms == pytest.approx(550.0) and base.median_ttft_ms == pytest.approx(55.0)
    assert base.mean_itl_ms == pytest.approx(2.0) and base.p99_itl_ms == pytest.approx(3.0, abs=0.01)
    assert base.mean_loss == pytest.approx(6.5) and base.output_throughput == pytest.approx(20.0)
    assert base.request_throughput == pytest.approx(5.0)
    assert base.request_goodput == pytest.approx(2.5)  # the 5 requests with ttft <= 50 ms, per 2 s
    tight = traffic.summarize("all", samples, wall_s=2.0, slo={"itl_ms": 2.5})
    assert tight.request_goodput == 0.0  # every request had a 3 ms gap
    assert traffic.summarize("all", samples, wall_s=2.0).request_goodput is None  # no SLO given
    other = traffic.summarize("skip=1", [Sample(latency_s=0.2, loss=7.0)], wall_s=1.0)
    traffic.with_loss_increase([base, other])
    assert other.loss_increase == pytest.approx(0.5) and base.loss_increase == 0.0


def test_slo_parsing_names_the_part_at_fault():
    assert traffic.parse_slo(["ttft_ms=200", "tpot_ms=50"]) == {"ttft_ms": 200.0, "tpot_ms": 50.0}
    for bad, part in [("ttft=200", "ttft=200"), ("tpot_ms=fast", "tpot_ms"), ("e2el_ms=-1", "e2el_ms")]:
        with pytest.raises(ValueError, match=part):
            traffic.parse_slo([bad])


def test_arrival_gaps_are_poisson_at_the_rate_or_burstier():
    poisson = np.array(traffic.arrival_gaps(20000, rate=4.0, burstiness=1.0, seed=0))
    assert poisson.mean() == pytest.approx(0.25, rel=0.03)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.array(traffic.arrival_gaps(20000, rate=4.0, burstiness=0.25, seed=0))
    assert bursty.mean() == pytest.approx(0.25, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.1)  # gamma: CV 1/sqrt(shape)


def _summary(name: str, latency: float, loss: float) -> Summary:
    return traffic.summarize(name, [Sample(latency_s=latency, loss=loss)], wall_s=1.0, concurrency=2)


def test_frontier_keeps_what_nothing_faster_beats():
    points = [
        _summary("all", 1.0, 2.0),
        _summary("a", 0.5, 2.5),
        _summary("b", 0.6, 3.0),
        _summary("c", 0.2, 4.0),
    ]
    assert [s.block_set for s in traffic.frontier(points)] == ["c", "a", "all"]


def test_results_are_written_as_csv_json_and_png(tmp_path):
    summaries = traffic.with_loss_increase([_summary("all", 1.0, 2.0), _summary("exit=1", 0.4, 3.0)])
    paths = traffic.write_results(summaries, tmp_path, {"model": "m", "concurrency": 2})
    assert paths["png"].stat().st_size > 1000
    assert paths["csv"].read_text().splitlines()[0].startswith("block_set,request_rate,concurrency,completed")
    assert json.loads(paths["json"].read_text())["block_sets"][1]["loss_increase"] == pytest.approx(1.0)


@pytest.mark.slow
def test_traffic_against_a_real_server(tmp_path, capsys):
    with ServerProcess(["--threads", "1", "--model", "tiny"], model_factory=TinyModel(n_layer=4)) as server:
        code = traffic.main(
            [
                "traffic",
                "--url",
                server.url,
                "--requests",
                "6",
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
                "--json",
            ]
        )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    by_set = {row["block_set"]: row for row in result["block_sets"]}
    assert set(by_set) == {"all", "skip=1,2", "exit=1"}
    assert all(row["completed"] == 6 and row["errors"] == 0 for row in by_set.values())
    assert by_set["exit=1"]["mean_blocks_per_token"] == 1.0 and by_set["all"]["mean_blocks_per_token"] == 4.0
    assert by_set["skip=1,2"]["loss_increase"] != 0.0
    assert by_set["all"]["median_ttft_ms"] <= by_set["all"]["median_e2el_ms"]
    assert (tmp_path / "frontier.png").exists() and (tmp_path / "traffic.csv").exists()


@pytest.mark.slow
def test_open_loop_sweep_with_mixed_block_sets_against_a_real_server(tmp_path, capsys):
    with ServerProcess(["--threads", "1", "--model", "tiny"], model_factory=TinyModel(n_layer=4)) as server:
        code = traffic.main(
            ["traffic", "--url", server.url, "--requests", "4", "--rates", "4", "16", "--mix",
             "--max-new-tokens", "3", "--block-sets", "all", "exit=1", "--slo", "e2el_ms=60000",
             "--out", str(tmp_path), "--json"]
        )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "open loop" and result["mixed"] is True
    rows = {(row["request_rate"], row["block_set"]): row for row in result["block_sets"]}
    assert set(rows) == {(4.0, "all"), (4.0, "exit=1"), (16.0, "all"), (16.0, "exit=1")}
    for (_, block_set), row in rows.items():
        assert row["completed"] == 4 and row["errors"] == 0 and row["concurrency"] is None
        assert row["request_goodput"] == row["request_throughput"]  # a minute meets every request
        assert row["mean_blocks_per_token"] == (1.0 if block_set == "exit=1" else 4.0)
    assert (tmp_path / "latency_vs_rate.png").stat().st_size > 1000


def _fake_server(request: httpx.Request) -> httpx.Response:
    """/predict as NDJSON: two tokens then the summary; a prompt saying 'fail' gets a 500."""
    body = json.loads(request.content)
    if "fail" in body["prompt"]:
        return httpx.Response(500, json={"detail": "RuntimeError: boom"})
    done = {"tokens": [1, 2], "score": {"mean_loss": 2.5}, "mean_blocks_per_token": 3.0}
    lines = [
        {"event": "token", "text": "a"},
        {"event": "token", "text": "b"},
        {"event": "done", "response": done},
    ]
    return httpx.Response(200, content="".join(json.dumps(line) + "\n" for line in lines))


def test_run_block_set_counts_requests_errors_and_honours_the_duration():
    async def run(requests, duration_s):
        transport = httpx.MockTransport(_fake_server)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            with tqdm(disable=True) as progress:
                return await traffic.run_block_set(
                    client,
                    "skip=1",
                    ["ok", "please fail"],
                    max_new_tokens=2,
                    concurrency=2,
                    requests=requests,
                    duration_s=duration_s,
                    progress=progress,
                )

    samples, _ = asyncio.run(run(requests=6, duration_s=None))
    assert len(samples) == 6 and sum(sample.error is not None for sample in samples) == 3
    ok = next(sample for sample in samples if sample.error is None)
    assert ok.loss == 2.5 and ok.new_tokens == 2 and 0 <= ok.ttft_s <= ok.latency_s
    assert "500" in next(sample.error for sample in samples if sample.error)
    timed, wall_s = asyncio.run(run(requests=None, duration_s=0.2))
    assert len(timed) > 6 and 0.2 <= wall_s < 2.0
