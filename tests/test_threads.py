"""lab.threads: the wait policy reaches torch and the server's workers; threads follow the free cores."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lab import threads
from lab.threads import CpuClock, ThreadTuner, free_cores, threads_for
from serve.process import ServerProcess
from serve.shared import SharedState
from serve.worker import Worker
from tests.tiny import TinyModel

ROOT = Path(__file__).resolve().parents[1]


def test_free_cores_is_what_others_left():
    before = CpuClock(busy=100.0, own=10.0, wall=50.0)
    # 2 s: the cores were busy 3.6 s, 1.6 of them ours: others took 1 core of 2
    assert free_cores(before, CpuClock(busy=103.6, own=11.6, wall=52.0), 2) == pytest.approx(1.0)
    # only ours: both free; /proc/stat's ticks can lag our own count, never below 0 for others
    assert free_cores(before, CpuClock(busy=103.0, own=13.1, wall=52.0), 2) == 2.0
    # others on more cores than we may use: nothing left, not less
    assert free_cores(before, CpuClock(busy=108.0, own=10.0, wall=52.0), 2) == 0.0
    assert free_cores(before, before, 2) == 2.0  # an empty window says nothing


@pytest.mark.parametrize(
    ("free", "most", "expected"),
    [(2.0, 2, 2), (1.6, 2, 2), (1.4, 2, 1), (0.0, 2, 1), (7.8, 4, 4), (3.5, 8, 4)],
)
def test_threads_for_one_per_free_core(free, most, expected):
    assert threads_for(free, most) == expected


def test_busy_seconds_reads_only_the_allowed_cores(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    hz = os.sysconf("SC_CLK_TCK")
    # fields: user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text(
        "cpu  900 900 900 900 0 0 0 0 0 0\n"
        "cpu0 100 50 20 1000 7 1 2 3 0 0\n"
        "cpu1 200 60 30 1000 7 0 0 0 0 0\n"
        "cpu2 400 70 40 1000 7 0 0 0 0 0\n"
        "intr 12345\n"
    )
    monkeypatch.setattr(os, "nice", lambda increment: 0)
    assert CpuClock.read({0, 2}, stat).busy == pytest.approx((126 + 440) / hz)  # nice and iowait are free
    monkeypatch.setattr(os, "nice", lambda increment: 10)  # niced ourselves: a niced job competes
    assert CpuClock.read({1}, stat).busy == pytest.approx(290 / hz)


def test_busy_seconds_count_this_process_on_linux():
    if not Path("/proc/stat").exists():
        pytest.skip("no /proc/stat")
    cores = threads.allowed_cores()
    before = CpuClock.read(cores)
    while time.process_time() - before.own < 0.5:  # half a second of our own work
        pass
    after = CpuClock.read(cores)
    assert after.busy - before.busy >= 0.8 * (after.own - before.own)


def scripted_clock(others: list[float]):
    """A clock whose cores are busy with ``others[i]`` cores of other processes' work during the i-th
    window (and none of ours), on the real time."""
    state = {"busy": 0.0, "wall": time.monotonic(), "window": 0}

    def read(cores):
        now = time.monotonic()
        rate = others[min(state["window"], len(others) - 1)]
        state["busy"] += rate * (now - state["wall"])
        state["wall"] = now
        return CpuClock(busy=state["busy"], own=0.0, wall=now)

    def next_window():
        state["window"] += 1

    return read, next_window


def test_tuner_follows_the_load(monkeypatch):
    monkeypatch.setattr(threads, "allowed_cores", lambda: {0, 1})
    before = torch.get_num_threads()
    read, next_window = scripted_clock([1.0, 0.0])
    try:
        tuner = ThreadTuner(every=0.05, read=read)
        assert tuner.tick() == 1 and torch.get_num_threads() == 1  # a core taken: one thread
        assert tuner.tick() is None  # not time yet
        next_window()  # the other job ends
        time.sleep(0.06)
        assert tuner.tick() == 2 and torch.get_num_threads() == 2
        assert ThreadTuner(most=1, read=read).tick() == 1  # the cap holds with both cores free
    finally:
        torch.set_num_threads(before)


def test_worker_tunes_on_the_cpu_unless_told_the_threads():
    tuning = Worker(TinyModel(), SharedState(4), max_threads=1)
    tuning.choose_threads("cpu")
    assert tuning.tuner is not None and tuning.tuner.most == 1
    fixed = Worker(TinyModel(), SharedState(4), threads=1)
    fixed.choose_threads("cpu")
    assert fixed.tuner is None


def test_a_compiling_worker_builds_its_default_step_at_every_thread_count_it_may_use():
    """``blocklab serve --compile``'s worker builds the step of --default-blocks for --warm-up's
    lengths at each thread count its tuner may choose, before it reports ready (publishes the model)."""
    from lab import fast

    def factory(device):
        model = fast.accelerate(TinyModel(n_layer=2)(device), "compile")
        model.fast.backend = "eager"  # dynamo traces, inductor does not generate: seconds
        return model

    worker = Worker(factory, SharedState(4), max_threads=2, warm_up=(100,), warm_up_blocks="exit=1")
    worker.choose_threads("cpu")
    worker.load("cpu")
    ((key, step),) = worker.model.fast.steps.items()
    assert key == ("step", (0,), frozenset(), None, 128) and step.warm_threads == {1, 2}
    assert worker.shared.limits() is not None


def test_cli_sets_the_wait_policy_before_torch_loads():
    """The variable is in the environment by the time a command's module imports torch."""
    probe = (
        "import os, sys, lab.cli\n"
        "assert 'torch' not in sys.modules\n"
        "import importlib\n"
        "real = importlib.import_module\n"
        "def spy(name, *a):\n"
        "    print(name, os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)\n"
        "    raise SystemExit(0)\n"
        "importlib.import_module = spy\n"
        "lab.cli.main(['shapes'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in threads.USER_WAIT_POLICY}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True)
    spin = threads.WAIT_POLICY["GOMP_SPINCOUNT"]
    assert out.stdout.split() == ["lab.analysis.shapes", spin, "False"], out.stderr
    for name, value in (("GOMP_SPINCOUNT", "7"), ("OMP_WAIT_POLICY", "ACTIVE")):  # the user's choice stands
        out = subprocess.run(
            [sys.executable, "-c", probe], env={**env, name: value}, cwd=ROOT, capture_output=True, text=True
        )
        assert out.stdout.split()[1] == ("7" if name == "GOMP_SPINCOUNT" else "None"), out.stderr


SPIN_PROBE = (
    "import time, torch\n"
    "torch.set_num_threads(2)\n"
    "x = torch.randn(256, 256)\n"
    "start, cpu = time.perf_counter(), time.process_time()\n"
    "for _ in range(100):\n"
    "    x @ x\n"
    "    time.sleep(0.005)\n"
    "print((time.process_time() - cpu) / (time.perf_counter() - start))\n"
)


@pytest.mark.slow
def test_the_wait_policy_stops_torch_spinning():
    """With the policy, torch's threads sleep between products, as with OMP_WAIT_POLICY=PASSIVE, after a
    bounded spin; spinning (libgomp's default) keeps a thread busy through every 5 ms pause. The bound
    is against the two extremes measured in the same run, not a fixed share: how long the spin lasts
    and how long a product takes differ from CPU to CPU (on one, the policy's share of a core sat on
    either side of a fixed 0.5 from run to run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}

    def cpu_share(policy: dict) -> float:
        run = subprocess.run([sys.executable, "-c", SPIN_PROBE], env={**env, **policy}, capture_output=True)
        return float(run.stdout)

    ours, sleeping, spinning = (
        cpu_share(policy) for policy in (threads.WAIT_POLICY, {"OMP_WAIT_POLICY": "PASSIVE"}, {})
    )
    assert spinning > 0.9  # a second thread busy through the pauses
    assert ours < (sleeping + spinning) / 2, (ours, sleeping, spinning)


@pytest.mark.slow
def test_server_workers_inherit_the_wait_policy(monkeypatch):
    for name in threads.USER_WAIT_POLICY:
        monkeypatch.delenv(name, raising=False)
    with ServerProcess(["--model", "tiny"], model_factory=TinyModel()) as server:
        environ = Path(f"/proc/{server.workers()[0]}/environ").read_bytes().split(b"\0")
    assert f"GOMP_SPINCOUNT={threads.WAIT_POLICY['GOMP_SPINCOUNT']}".encode() in environ
