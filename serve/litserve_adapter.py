"""The worker pool over LitServe (``serve.pool.WorkerPool``): the one module that touches LitServe.

What LitServe gives the server: its worker processes. ``LitServer`` spawns one per device times
``--workers``, runs ``setup`` in each (``serve.worker.Worker.setup``: the model loads there) and
reports each one's state in ``workers_setup_status``; its manager process holds those states (and a
request queue per API, which nothing here uses).

What it does not give, and why LitServe's own parts are not used for it (measured on 0.2.19,
docs/serving.md):

- **Its loops** (``ContinuousBatchingLoop`` and the batched streaming loop): an idle worker spins,
  polling the queue every millisecond; every decode step hops to another thread; one request that
  raises fails every request of its batch; and a batch runs to its end before the queue is looked at
  again. The worker runs ``serve.worker.Worker.serve`` instead, through ``_WorkerLoop``, LitServe's
  ``loop=`` extension point.
- **Its routes and request handlers**: an error in mid-stream answers 200 and cuts the body, with
  no error event; there is no bound on requests in flight, no queue deadline a dead worker cannot
  break, no cancellation when a client leaves; its API key is a per-route dependency FastAPI runs
  after reading the body. ``serve.http_front`` builds the app, with every route, after the pool.
- **Its queues and response transport**: every ``put`` and ``get`` on a managed queue is a round
  trip to the manager process, several per request; and its worker monitor fails a dead worker's
  requests from its own thread, whose ``event.set()`` does not wake the event loop (a waiting
  request learns of the death when something else wakes it). Here each worker has two pipes of its
  own (``serve.transport``), read and written in the event loop: the HTTP side hands each order to
  the least loaded live worker, and a worker's death is the end of its pipe, after everything it
  sent, at which its requests fail with 503 and the orders it had not taken go to another worker
  (or its replacement). ``_watch`` waits on the workers' process sentinels and starts each dead
  one's replacement. Each wait wakes when there is news: nothing polls.

The undocumented members of LitServe used, here only: ``LitServer._init_manager`` (its manager
holds ``workers_setup_status``), ``workers_setup_status``, ``launch_single_inference_worker``,
``_inference_workers_config_for_api``, ``devices``, and the ``LitLoop.__call__`` signature.
pyproject pins litserve below 0.3; this module refuses any release but 0.2.x at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from multiprocessing.connection import wait

import litserve as ls
from litserve.loops.base import LitLoop
from litserve.utils import WorkerSetupStatus

from serve.pool import Channel, Switchboard
from serve.schema import Job, ModelLimits
from serve.shared import SharedState
from serve.transport import Link, WorkerEnds
from serve.worker import Order, Worker

logger = logging.getLogger(__name__)

WRITTEN_FOR = "0.2"
"""The LitServe minor release this module's use of its internals was written and tested against."""
if ".".join(ls.__version__.split(".")[:2]) != WRITTEN_FOR:
    raise ImportError(
        f"serve.litserve_adapter uses internals of litserve {WRITTEN_FOR}.x (tested on 0.2.19); "
        f"litserve {ls.__version__} is installed: install the pinned one (requirements.lock)"
    )

API_PATH = "/predict"
"""LitServe's name for the one API's queue (no route is served from it)."""


class _WorkerLoop(LitLoop):
    """LitServe calls this in each worker process after ``setup``: the worker's own loop runs."""

    def __call__(
        self, lit_api, device, worker_id, request_queue, transport, workers_setup_status, callback_runner
    ) -> None:
        lit_api.worker.serve(lit_api.ends, lit_api.ends, worker_id)


class _LitWorker(ls.LitAPI):
    """The ``serve.worker.Worker`` as LitServe's API object: pickled into each worker process."""

    def __init__(self, worker: Worker):
        super().__init__(api_path=API_PATH, loop=_WorkerLoop())
        self.worker = worker
        self.ends: WorkerEnds | None = None  # this worker's pipes, set before each worker starts

    def setup(self, device: str) -> None:
        self.worker.setup(device)

    def predict(self, x):
        raise NotImplementedError("the worker's own loop runs the jobs (serve.worker.Worker.serve)")


class LitServePool:
    """``serve.pool.WorkerPool`` over LitServe's worker processes; see the module docstring.

    ``slots``: the most jobs in flight (queued or running); each has a cell in the workers'
    ``SharedState.cancelled``, through which a closed channel cancels its job.
    """

    def __init__(self, worker: Worker, *, accelerator: str, workers_per_device: int, queue_timeout: float):
        self.api = _LitWorker(worker)
        self.shared = worker.shared
        self.workers_per_device = workers_per_device
        self.server = ls.LitServer(self.api, accelerator=accelerator, workers_per_device=workers_per_device)
        self.count = len(self.server._inference_workers_config_for_api(API_PATH))
        if self.count == 0:  # no device of the kind: start() would wait for ever for none to be ready
            raise RuntimeError(f"LitServe finds no {accelerator} device here: no worker to start")
        if self.count > SharedState.MAX_WORKERS:
            raise ValueError(f"{self.count} workers: at most {SharedState.MAX_WORKERS} are supported")
        cancel, taken = self.shared.cancelled.__setitem__, self.shared.was_taken
        self.board = Switchboard(len(self.shared.cancelled), queue_timeout, cancel, taken)
        self.workers = []
        self.links: list[Link | None] = [None] * self.count  # each worker's newest, connected or not
        self.live: dict[int, Link] = {}  # index -> link, connected and its worker alive (event loop's)
        self.placed: dict[int, tuple[int, Order]] = {}
        """ticket -> the index of the worker its order was sent to, and the order."""
        self.backlog: deque[Order] = deque()  # orders sent while no worker was live
        self.loop: asyncio.AbstractEventLoop | None = None
        self.lock = threading.Lock()  # between the monitor's replacements and ``running``'s start
        self.manager = None
        self.stopping = False
        self.monitor: threading.Thread | None = None

    def start(self) -> None:
        # LitServe's manager holds the workers' setup states. Forked while SIGTERM is ignored, it
        # keeps that disposition, so a SIGTERM sent to the whole process group (``timeout``, some
        # supervisors) reaches only the server, which then drains; SIGINT it ignores itself.
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.manager = self.server._init_manager(1)
        finally:
            signal.signal(signal.SIGTERM, handler)
        self.workers = [self._launch(index) for index in range(self.count)]
        while True:
            states = dict(self.server.workers_setup_status)
            if states and all(state == WorkerSetupStatus.READY for state in states.values()):
                break
            if any(state == WorkerSetupStatus.ERROR for state in states.values()):
                raise RuntimeError("a worker failed to load the model (its traceback is above)")
            if any(not worker.is_alive() for worker in self.workers):
                raise RuntimeError("a worker died while loading the model")
            time.sleep(0.05)
        self.monitor = threading.Thread(target=self._watch, name="blocklab-worker-monitor", daemon=True)
        self.monitor.start()

    def _launch(self, index: int):
        """Start worker ``index`` with pipes of its own; its link is connected once the loop runs."""
        link = Link()
        self.api.ends = link.worker_ends  # pickled into the process as it starts
        process = self.server.launch_single_inference_worker(self.api, index)
        link.spawned()
        with self.lock:
            self.links[index] = link
            if self.loop is not None:
                asyncio.run_coroutine_threadsafe(self._connect(index, link), self.loop)
        return process

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        with self.lock:
            self.loop = asyncio.get_running_loop()
            links = list(self.links)
        for index, link in enumerate(links):
            await self._connect(index, link)
        try:
            yield
        finally:
            with self.lock:
                self.loop = None  # the pipes stay open: ``stop`` stops the workers first

    def stop(self) -> None:
        """Stop the monitor first (else it replaces the workers stopped), then the workers, then the
        manager. Workers ignore SIGTERM (``Worker.setup``), so they are killed."""
        self.stopping = True
        for worker in self.workers:
            worker.kill()
            worker.join(timeout=5)
        if self.monitor is not None:
            self.monitor.join(timeout=5)
        if self.manager is not None:
            try:
                self.manager.shutdown()
            except OSError:  # killed from outside: nothing to stop
                logger.warning("LitServe's manager process died before shutdown")

    # -- the HTTP side's calls, in the event loop's thread ------------------------------------------

    def room(self) -> int:
        return len(self.board.free_slots)

    def submit(self, job: Job) -> Channel:
        order, channel = self.board.open(job)
        for ticket in [ticket for ticket in self.placed if ticket not in self.board.channels]:
            del self.placed[ticket]  # its channel is closed
        self._dispatch(order)
        return channel

    def _dispatch(self, order: Order) -> None:
        """Send ``order`` to the live worker with the fewest jobs in flight, or keep it for the next."""
        if not self.live:
            self.backlog.append(order)
            return
        held = [index for index, _ in self.placed.values()]
        index = min(self.live, key=held.count)
        self.placed[order.ticket] = (index, order)
        self.live[index].send(order)

    async def _connect(self, index: int, link: Link) -> None:
        """Worker ``index``'s pipes on this loop, unless a newer worker replaced it meanwhile; then
        the backlog goes out."""
        if self.links[index] is not link or self.stopping:
            return
        await link.connect(lambda message: self.board.route(*message), lambda: self._ended(index, link))
        self.live[index] = link
        while self.backlog:
            order = self.backlog.popleft()
            if order.ticket in self.board.channels:  # not closed while it waited
                self._dispatch(order)

    def _ended(self, index: int, link: Link) -> None:
        """Worker ``index``'s pipe ended, after all it sent: it died. Its jobs fail with 503 and the
        orders it had not taken go to another worker, or wait for its replacement."""
        link.close()
        if self.live.get(index) is link:
            del self.live[index]
        if self.stopping:
            return
        sent = [order for held_by, order in self.placed.values() if held_by == index]
        for order in sent:
            del self.placed[order.ticket]
        for order in self.board.worker_died(sent):
            self._dispatch(order)

    def ready(self) -> bool:
        states = dict(self.server.workers_setup_status)
        return bool(states) and all(state == WorkerSetupStatus.READY for state in states.values())

    def limits(self) -> ModelLimits | None:
        return self.shared.limits()

    def model_info(self) -> dict:
        return self.shared.model_info()

    def stats(self) -> dict:
        in_flight, running = self.board.in_flight(), self.board.running()
        return {
            "in_flight": in_flight,
            "running": running,
            "waiting": in_flight - running,
            "max_in_flight": self.board.slots,
            **self.shared.totals(),
        }

    def describe(self) -> dict:
        return {"devices": self.server.devices, "workers_per_device": self.workers_per_device}

    def worker_pids(self) -> list[int]:
        return [worker.pid for worker in self.workers]

    # -- the monitor's thread --------------------------------------------------------------------

    def _watch(self) -> None:
        """Replace each worker that dies (the HTTP side learns of the death from its pipe)."""
        while not self.stopping:
            sentinels = {worker.sentinel: index for index, worker in enumerate(self.workers)}
            for sentinel in wait(list(sentinels)):
                if self.stopping:
                    return
                index = sentinels[sentinel]
                logger.warning("worker %d (pid %d) died; starting a new one", index, self.workers[index].pid)
                self.workers[index] = self._launch(index)
