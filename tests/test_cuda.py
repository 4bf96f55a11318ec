"""The commands that report ms/token on a GPU (issue #19): ``blocklab generate``, ``blocklab depth``,
``scripts/bench_decode.py --device cuda`` and ``blocklab serve --accelerator cuda``, each on CUDA,
eager and through lab.fast's CUDA graphs. Every test here is ``gpu``: skipped where torch sees no CUDA
device (the CPU-side refusals are in test_cli_errors.py); ``scripts/check_cuda.sh`` runs them on a GPU
machine with the commands themselves."""

import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

from lab import cli
from lab.analysis.depth import depth_report
from serve.process import ServerProcess

pytestmark = pytest.mark.gpu
SCRIPTS = Path(__file__).parent.parent / "scripts"


def generated(capsys, *flags: str) -> dict:
    assert cli.main(["generate", "--model", "gpt2-random", "--prompt", "def main(", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out.splitlines()[-1])


@pytest.mark.parametrize("blocks", ["all", "skip=3,4,5", "exit=6", "overwrite=5", "keep=0,1,11"])
def test_generate_on_cuda_through_graphs_gives_the_eager_tokens(capsys, blocks):
    common = ("--device", "cuda", "--max-new-tokens", "24", "--blocks", blocks)
    eager, graphed = generated(capsys, *common), generated(capsys, *common, "--compile")
    assert eager["device"] == graphed["device"] == "cuda:0"
    assert graphed["tokens"] == eager["tokens"] and len(eager["tokens"]) == 24
    assert 0 < graphed["decode_ms_per_token"] < 1000


def test_bf16_generation_and_scoring_run_on_cuda(capsys):
    result = generated(
        capsys, "--device", "cuda", "--dtype", "bfloat16", "--compile", "--blocks", "adaptive=0.9"
    )
    assert result["device"] == "cuda:0" and result["tokens"]
    assert (
        cli.main(["score", "--model", "gpt2-random", "--prompt", "def main(): pass", "--device", "cuda"]) == 0
    )


def test_depth_times_its_stacks_on_cuda():
    report = depth_report(["12x768", "24x544"], "12x768", 64, 50257, 8, 4, 1, "bfloat16", "cuda:0")
    assert report["device"] == "cuda:0"
    assert all(0 < row["ms_per_token"] < 1000 and row["blocks_ms"] > 0 for row in report["rows"])


def test_bench_decode_compares_graphs_with_eager_on_cuda():
    sys.path.insert(0, str(SCRIPTS))
    from bench_decode import CUDA_DTYPES, cuda_results

    results = cuda_results(list(range(100, 116)), tokens=4, rounds=2)
    assert results["device"] == torch.cuda.get_device_name(0)
    for dtype in CUDA_DTYPES:
        assert 0 < results["graphs_over_eager"][f"{dtype} all"] < 10
    assert results["ms_per_token"]["transformers fp32"] > 0


def test_serve_answers_from_cuda_workers():
    with ServerProcess(["--model", "gpt2-random", "--accelerator", "cuda", "--dtype", "bfloat16"]) as server:
        body = {"prompt": "def main(", "max_new_tokens": 8, "blocks": "skip=3,4"}
        response = httpx.post(f"{server.url}/predict", json=body, timeout=120).raise_for_status().json()
    assert len(response["tokens"]) == 8 and response["blocks_run"] == [0, 1, 2, 5, 6, 7, 8, 9, 10, 11]
