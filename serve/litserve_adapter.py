"""The worker pool over LitServe (``serve.pool.WorkerPool``): the one module that touches LitServe.

What LitServe gives the server: its worker processes. ``LitServer`` spawns one per device times
``--workers``, runs ``setup`` in each (``serve.worker.Worker.setup``: the model loads there) and
reports each one's state in ``workers_setup_status``; its manager process holds the queues between
the workers and this process, and a queue of its requests per API.

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
- **Its response transport and worker monitor**: the monitor fails a dead worker's requests from
  its own thread, whose ``event.set()`` does not wake the event loop (a waiting request learns of
  the death when something else wakes it), and it skips a request whose event is set at that
  moment. Here the workers put their messages on a queue of this module's own, made on LitServe's
  manager (a managed queue: a worker killed mid-``put`` leaves no lock held, as a
  ``multiprocessing.Queue``'s would), which one thread reads and hands to the event loop with
  ``call_soon_threadsafe``; ``_watch`` waits on the workers' process sentinels and puts a worker's
  death on the same queue, after everything the worker sent, then starts its replacement. Each wait
  wakes when there is news: nothing polls.

The undocumented members of LitServe used, here only: ``LitServer._init_manager``,
``litapi_request_queues``, ``workers_setup_status``, ``launch_inference_worker``,
``launch_single_inference_worker``, ``_inference_workers_config_for_api``, ``devices``, and the
``LitLoop.__call__`` signature. pyproject pins litserve below 0.3; this module refuses any release
but 0.2.x at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import wait

import litserve as ls
from litserve.loops.base import LitLoop
from litserve.utils import WorkerSetupStatus

from serve.pool import Channel, Switchboard
from serve.schema import Job, ModelLimits
from serve.shared import SharedState
from serve.worker import Worker

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
        lit_api.worker.serve(request_queue, lit_api.events, worker_id)


class _LitWorker(ls.LitAPI):
    """The ``serve.worker.Worker`` as LitServe's API object: pickled into each worker process."""

    def __init__(self, worker: Worker):
        super().__init__(api_path=API_PATH, loop=_WorkerLoop())
        self.worker = worker
        self.events = None  # the pool's queue of messages, set before the workers start

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
        count = len(self.server._inference_workers_config_for_api(API_PATH))
        if count > SharedState.MAX_WORKERS:
            raise ValueError(f"{count} workers: at most {SharedState.MAX_WORKERS} are supported")
        self.board = Switchboard(len(self.shared.cancelled), queue_timeout, self.shared.cancelled.__setitem__)
        self.workers = []
        self.manager = None
        self.stopping = False
        self.monitor: threading.Thread | None = None

    def start(self) -> None:
        # LitServe's manager holds the queues every job goes through. Forked while SIGTERM is
        # ignored, it keeps that disposition, so a SIGTERM sent to the whole process group
        # (``timeout``, some supervisors) reaches only the server, which then drains; SIGINT it
        # ignores itself.
        handler = signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            self.manager = self.server._init_manager(1)
        finally:
            signal.signal(signal.SIGTERM, handler)
        self.requests = self.server.litapi_request_queues[API_PATH]
        self.events = self.api.events = self.manager.Queue()
        self.workers = self.server.launch_inference_worker(self.api)
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

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        reader = threading.Thread(target=self._read, args=(loop,), name="blocklab-worker-events", daemon=True)
        reader.start()
        try:
            yield
        finally:
            with contextlib.suppress(OSError, EOFError):  # the manager is gone: so is the reader
                self.events.put(None)
            reader.join(timeout=5)

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

    def submit(self, job: Job) -> Channel:
        order, channel = self.board.open(job)
        self.requests.put(order)
        return channel

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

    # -- the pool's threads ----------------------------------------------------------------------

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hand each message of the workers to the event loop, until None."""
        while True:
            try:
                message = self.events.get()
            except (OSError, EOFError):
                logger.warning("LitServe's manager process is gone: no more messages from the workers")
                return
            if message is None:
                return
            loop.call_soon_threadsafe(self.board.route, *message)

    def _watch(self) -> None:
        """Replace each worker that dies, after telling the HTTP side (through the same queue as the
        worker's own messages, so after all of them) which jobs it held."""
        while not self.stopping:
            sentinels = {worker.sentinel: index for index, worker in enumerate(self.workers)}
            for sentinel in wait(list(sentinels)):
                if self.stopping:
                    return
                index = sentinels[sentinel]
                dead = self.workers[index]
                logger.warning("worker %d (pid %d) died; starting a new one", index, dead.pid)
                self.events.put(("died", 0, dead.pid))
                self.workers[index] = self.server.launch_single_inference_worker(self.api, index)
