"""A real server in a subprocess on a free loopback port: what ``blocklab traffic --serve`` starts,
and what the benchmarks and tests talk to.

    with ServerProcess(["--model", "builtin", "--max-batch-size", "8"]) as server:
        httpx.post(server.url + "/predict", json={"prompt": "Hello", "max_new_tokens": 4})

A ``model_factory`` (``serve.worker.ModelFactory``) instead of ``--model`` serves a model built in the
test (``tests/tiny.py``); ``save_tiny_model`` writes a small random one for the benchmarks.
"""

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from lab.config import GPT2_VOCAB_SIZE, GPTConfig
from lab.model import GPT
from lab.weights import save_model

TINY = GPTConfig(n_layer=4, n_head=2, n_embd=32, vocab_size=GPT2_VOCAB_SIZE, block_size=128)
"""A random GPT this small has GPT-2's vocabulary (so the real tokenizer applies) and costs next to
nothing per step: what a benchmark of the server, not of the model, serves."""


def save_tiny_model(directory: Path, seed: int = 0) -> Path:
    """A random ``TINY`` model saved as a model directory (``blocklab serve --model DIR``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return save_model(GPT(TINY), directory)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(process: subprocess.Popen, url: str, timeout: float) -> str | None:
    """Poll ``url``'s ``/health`` until it answers 200: None then, else why not (the process exited,
    or ``timeout`` seconds passed). Any server with that route: ours, or a peer benchmarked against."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            return f"server exited with {process.returncode} while starting"
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return None
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return f"server not ready after {timeout} s"


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
        reason = wait_until_healthy(self.process, self.url, self.startup_timeout)
        if reason is None:
            return self
        if self.process.poll() is None:
            self.stop()
        self._fail(reason)

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
