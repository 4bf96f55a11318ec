"""A real server in a subprocess, and small models to serve, for tests and benchmarks.

    with ServerProcess(["--max-batch-size", "8"], model_factory=TinyModel()) as server:
        httpx.post(server.url + "/predict", json={"prompt": "Hello", "max_new_tokens": 4})

``TinyModel`` is a random GPT with GPT-2's vocabulary (so the real tokenizer applies) and a few
narrow blocks: it loads in milliseconds and runs a step in about one. Its ``step_s``,
``slow_token`` and ``fail_token`` make every step or one request slow, or make a request raise
inside the worker, to provoke the faults the server must survive; all are off by default.
"""

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from lab.config import GPT2_VOCAB_SIZE, GPTConfig
from lab.model import GPT


class _InstrumentedGPT(GPT):
    """A GPT whose every pass sleeps, or sleeps or raises when it sees a given token.

    Hooked on ``embed_tokens``, where every pass starts (``forward``, the server's prefill, adaptive exit).
    """

    step_s: float = 0.0
    slow_token: int | None = None
    slow_s: float = 0.0
    fail_token: int | None = None

    def embed_tokens(self, idx: torch.Tensor, pos: int = 0) -> torch.Tensor:
        if self.fail_token is not None and bool((idx == self.fail_token).any()):
            raise RuntimeError(f"injected failure: token {self.fail_token} in the input")
        if self.slow_token is not None and bool((idx == self.slow_token).any()):
            time.sleep(self.slow_s)
        if self.step_s:
            time.sleep(self.step_s)
        return super().embed_tokens(idx, pos)


@dataclass(frozen=True)
class TinyModel:
    """Model factory (``serve.worker.ModelFactory``) of a small random GPT with GPT-2's vocabulary."""

    n_layer: int = 4
    n_embd: int = 32
    n_head: int = 2
    block_size: int = 128
    seed: int = 0
    step_s: float = 0.0
    """Every pass sleeps this long first: a slower model, so requests stay in flight."""
    slow_token: int | None = None
    """A pass over this token sleeps ``slow_s`` first."""
    slow_s: float = 0.0
    fail_token: int | None = None
    """A pass over this token raises RuntimeError."""

    def config(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            vocab_size=GPT2_VOCAB_SIZE,
            block_size=self.block_size,
        )

    def __call__(self, device: str) -> GPT:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = _InstrumentedGPT(self.config())
        model.step_s, model.slow_token, model.slow_s = self.step_s, self.slow_token, self.slow_s
        model.fail_token = self.fail_token
        return model.to(device).eval()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z":  # zombies are dead, only not reaped yet
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


_LAUNCH = (
    "import pickle, sys\n"
    "from serve.app import main\n"
    "factory = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
    "sys.exit(main(['serve', *sys.argv[2:]], model_factory=factory))\n"
)


class ServerProcess:
    """``blocklab serve ARGS`` in a subprocess on a free loopback port, ready when entered.

    With ``model_factory`` the model comes from it (pickled to the subprocess) instead of ``--model``.
    ``host=None`` leaves ``--host`` to the server's default. Leaving the block sends SIGTERM and waits
    for the server to drain and exit (SIGKILL if it hangs).
    """

    def __init__(
        self,
        args: list[str],
        model_factory=None,
        startup_timeout: float = 120.0,
        host: str | None = "127.0.0.1",
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        where = [] if host is None else ["--host", host]
        self.args = [*args, *where, "--port", str(self.port), "--log-level", "warning"]
        self.model_factory = model_factory
        self.startup_timeout = startup_timeout
        handle, log_path = tempfile.mkstemp(prefix="blocklab-serve-", suffix=".log")
        os.close(handle)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def workers(self) -> list[int]:
        """Pids of the inference workers (the processes LitServe spawned)."""
        return sorted(
            pid
            for pid in descendants(self.pid)
            if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self) -> "ServerProcess":
        if self.model_factory is None:
            command = [sys.executable, "-m", "lab.cli", "serve", *self.args]
        else:
            command = [sys.executable, "-c", _LAUNCH, pickle.dumps(self.model_factory).hex(), *self.args]
        root = Path(__file__).resolve().parents[1]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
        }
        with self.log_path.open("wb") as log:  # the server keeps its own copy of the descriptor
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self._fail(f"server exited with {self.process.returncode} while starting")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        self._fail(f"server not ready after {self.startup_timeout} s")

    def _fail(self, reason: str) -> None:
        log = self.log()
        self.log_path.unlink()
        raise RuntimeError(f"{reason}:\n{log}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit; SIGKILL (and an AssertionError) if it does not come."""
        if self.process is None or self.returncode is not None:
            return self.returncode
        self.process.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            for pid in descendants(self.process.pid):
                os.kill(pid, signal.SIGKILL)
            self.process.kill()
            self.returncode = self.process.wait()
            raise AssertionError(f"server did not stop within {timeout} s:\n{self.log()}") from None
        return self.returncode

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        self.log_path.unlink()
