"""One request path: from the route to ``decode_rows``, each module entered once, the prompt tokenised
once, and the worker handed an already resolved job.

In one process: the app of ``serve.app.build_app`` over a ``serve.pool.WorkerPool`` whose worker
(``serve.worker.Worker``, the real one) runs its loop in a thread, fed through plain queues: the
LitServe adapter's part, processes and manager queues, is what this leaves out."""

import asyncio
import contextlib
import queue
import sys
import threading
import time
from collections import defaultdict

import pytest
from fastapi.testclient import TestClient

from lab import tokens
from lab.model import GPT
from serve.app import ServeConfig, build_app
from serve.http_front import Front
from serve.pool import TIMEOUT_GRACE_S, Channel, PoolFull, Switchboard
from serve.schema import Job
from serve.shared import SharedState
from serve.worker import Order, Worker
from tests.tiny import TinyModel


class ThreadPool:
    """``serve.pool.WorkerPool`` in this process: the worker's loop in a thread; every order it is
    handed is kept in ``orders``."""

    def __init__(self, worker: Worker, queue_timeout: float = 30.0):
        self.worker = worker
        shared = worker.shared
        cancel, taken = shared.cancelled.__setitem__, shared.was_taken
        self.board = Switchboard(len(shared.cancelled), queue_timeout, cancel, taken)
        self.inbox: queue.Queue = queue.Queue()
        self.orders: list[Order] = []

    def start(self) -> None:
        self.worker.load("cpu")

    @contextlib.asynccontextmanager
    async def running(self):
        loop = asyncio.get_running_loop()

        class Outbox:  # the worker's events, handed to the event loop as the adapter's reader does
            def put(self, message) -> None:
                loop.call_soon_threadsafe(board.route, *message)

        board = self.board
        thread = threading.Thread(target=self.worker.serve, args=(self.inbox, Outbox(), 0), daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.inbox.put(None)
            thread.join(timeout=30)

    def stop(self) -> None:
        pass

    def room(self) -> int:
        return len(self.board.free_slots)

    def submit(self, job: Job) -> Channel:
        order, channel = self.board.open(job)
        self.orders.append(order)
        self.inbox.put(order)
        return channel

    def ready(self) -> bool:
        return self.worker.shared.limits() is not None

    def limits(self):
        return self.worker.shared.limits()

    def model_info(self) -> dict:
        return self.worker.shared.model_info()

    def stats(self) -> dict:
        return {"in_flight": self.board.in_flight(), **self.worker.shared.totals()}

    def describe(self) -> dict:
        return {"devices": ["cpu"], "workers_per_device": 1}

    def worker_pids(self) -> list[int]:
        return []


@contextlib.contextmanager
def served():
    """A client of the app over a ThreadPool with a tiny model, and the pool."""
    config = TinyModel().config()  # a plain GPT: TinyModel's own hooks its passes from another module
    pool = ThreadPool(Worker(lambda device: GPT(config).to(device), SharedState(slots=4)))
    pool.start()
    app = build_app(Front(pool), ServeConfig(model="tiny"))
    with TestClient(app) as client:
        yield client, pool


def test_the_prompt_is_tokenised_once_and_the_worker_gets_the_resolved_job(monkeypatch):
    calls = []
    encode = tokens.encode
    monkeypatch.setattr(
        tokens, "encode", lambda *args, **kwargs: calls.append(args) or encode(*args, **kwargs)
    )
    with served() as (client, pool):
        for body in (
            {"prompt": "The quick brown fox", "max_new_tokens": 3, "blocks": "skip=1"},
            {"prompt": "The quick brown fox", "max_new_tokens": 3, "stream": True, "score": True},
        ):
            calls.clear()
            response = client.post("/predict", json=body)
            assert response.status_code == 200, response.text
            assert calls == [("The quick brown fox",)]  # one tokenisation per request, on the HTTP side
    jobs = [order.job for order in pool.orders]
    assert [job.prompt_tokens for job in jobs] == [encode("The quick brown fox")] * 2
    assert str(jobs[0].block_set) == "skip=1" and jobs[0].sampling.seed is not None
    assert jobs[1].stream and jobs[1].score


def test_following_predict_enters_each_module_once():
    """A profile of every Python call in every thread while requests are served: the project's
    modules on each call stack (consecutive frames of one module counted once) never repeat, so no
    module is re-entered on the way from the route to ``lab.decode.decode_rows``."""
    stacks: dict[int, list[str]] = defaultdict(list)  # thread -> the modules of its frames
    repeated: set[tuple[str, ...]] = set()
    seen: set[str] = set()
    recording = threading.Event()

    def module_path(thread: int) -> tuple[str, ...]:
        path: list[str] = []
        for module in stacks[thread]:
            if module.startswith(("serve.", "lab.")) and (not path or path[-1] != module):
                path.append(module)
        return tuple(path)

    def profile(frame, event, arg) -> None:
        thread = threading.get_ident()
        if event == "call":
            stacks[thread].append(frame.f_globals.get("__name__", ""))
            if recording.is_set():
                path = module_path(thread)
                seen.update(path)
                if len(set(path)) < len(path):
                    repeated.add(path)
        elif event == "return" and stacks[thread]:
            stacks[thread].pop()

    threading.setprofile(profile)  # for the threads started from here on: the app's and the worker's
    sys.setprofile(profile)
    try:
        with served() as (client, _):
            body = {"prompt": "The quick brown fox", "max_new_tokens": 3, "blocks": "adaptive=0.5"}
            recording.set()
            with client.stream("POST", "/predict", json={**body, "stream": True}) as response:
                lines = list(response.iter_lines())
            whole = client.post("/predict", json=body)
            recording.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert response.status_code == whole.status_code == 200 and len(lines) == 4
    assert repeated == set()
    path = ["serve.http_front", "serve.schema", "serve.pool", "serve.worker", "serve.engine"]
    assert set(path) | {"lab.generate", "lab.decode", "lab.sampling", "lab.model"} <= seen


def job_at(submitted_at: float, timeout: float = 60.0) -> Job:
    from lab.blocks import BlockSet
    from lab.sampling import SamplingParams

    return Job(
        [1, 2],
        BlockSet(),
        1,
        SamplingParams(seed=0),
        submitted_at=submitted_at,
        deadline=submitted_at + timeout,
    )


def test_the_switchboard_routes_messages_and_cancels_only_unfinished_jobs():
    async def scenario() -> None:
        cancelled, taken = [], set()  # taken: what the workers' cells say (slot, ticket)
        board = Switchboard(
            2,
            queue_timeout=60.0,
            cancel=lambda slot, ticket: cancelled.append((slot, ticket)),
            taken=lambda slot, ticket: (slot, ticket) in taken,
        )
        now = time.monotonic()
        (first, a), (second, b) = board.open(job_at(now)), board.open(job_at(now))
        with pytest.raises(PoolFull, match="2 requests in flight"):
            board.open(job_at(now))
        taken.add((first.slot, first.ticket))
        board.route(first.ticket, {"event": "token", "index": 0})
        assert (board.running(), board.in_flight()) == (1, 2)
        taken.add((second.slot, second.ticket))
        assert board.worker_died([second]) == []  # the worker holding the second job: nothing to resend
        assert (await a.next_event())["event"] == "token"
        died = await b.next_event()
        assert died["status"] == 503 and "died" in died["message"]
        board.route(second.ticket, {"event": "done"})  # after its end: dropped
        b.close()
        a.close()  # not finished: cancelled
        assert cancelled == [(first.slot, first.ticket)] and board.in_flight() == 0
        board.route(first.ticket, {"event": "done"})  # closed already: dropped
        third, c = board.open(job_at(now))
        assert third.slot == second.slot  # the least recently freed slot first
        assert board.running() == 0  # the slot's cell holds an earlier ticket: not taken
        assert board.worker_died([third, first]) == [third]  # not taken: for another worker; first: closed
        assert not c.finished

    asyncio.run(scenario())


def test_a_channel_answers_504_past_the_queue_timeout_and_past_a_stuck_step():
    async def scenario() -> None:
        taken = set()
        board = Switchboard(
            2, queue_timeout=0.2, cancel=lambda slot, ticket: None, taken=lambda *cell: cell in taken
        )
        _, waiting = board.open(job_at(time.monotonic()))
        started = time.monotonic()
        event = await waiting.next_event()  # no worker takes it
        assert event["status"] == 504 and "queue timeout" in event["message"]
        assert 0.2 <= time.monotonic() - started < 2 and not waiting.finished
        order, stuck = board.open(job_at(time.monotonic() - 60, timeout=60 - TIMEOUT_GRACE_S - 0.2))
        taken.add((order.slot, order.ticket))  # taken: the queue timeout no longer applies
        event = await stuck.next_event()
        assert event["status"] == 504 and "stuck in a step" in event["message"]

    asyncio.run(scenario())


def test_the_adapter_refuses_another_litserve_release(monkeypatch):
    import importlib

    import litserve

    import serve.litserve_adapter as adapter

    monkeypatch.setattr(litserve, "__version__", "0.3.0")
    with pytest.raises(ImportError, match="litserve 0.3.0 is installed"):
        importlib.reload(adapter)
    monkeypatch.undo()
    importlib.reload(adapter)
