"""The one LitAPI: a model in each worker, requests decoded into jobs, batches run by ``serve.engine``.

The worker side of the server. ``BlockLabAPI`` is pickled into every inference worker LitServe
spawns; ``setup`` loads the model there and publishes its shape into shared memory (the HTTP side
checks requests against it and reports it at ``/info``), ``decode_request`` turns a validated
``PredictRequest`` into an ``engine.Job``, and ``predict`` yields the events of a batch tick by tick.
``decode_request``'s annotation is the body's type FastAPI validates (so no ``from __future__ import
annotations`` here: the annotation must stay a class).

``BatchLoop`` replaces LitServe's batched streaming loop, whose idle worker polls the request queue
with 1 ms timeouts (or spins, with ``batch_timeout=0``) and whose batch sends an empty message per
request per step: this loop blocks until a request arrives, takes every request already waiting (up
to ``max_batch_size``, waiting ``batch_timeout`` for more), and sends each event as it comes.
"""

import ctypes
import logging
import multiprocessing as mp
import secrets
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from queue import Empty

import litserve as ls
import torch
from litserve.loops.base import LitLoop
from litserve.utils import LitAPIStatus, LoopResponseType, PickleableHTTPException

from lab.model import GPT
from lab.quantize import parameter_count
from serve.engine import COUNTERS, Engine, Job, Tally, error_event
from serve.schema import ModelLimits, PredictRequest, RequestError, resolve

logger = logging.getLogger(__name__)

API_PATH = "/predict"

ModelFactory = Callable[[str], GPT]
"""Builds the served model on a device ("cpu", "cuda:0"); must pickle (it travels to each worker)."""


@dataclass(frozen=True)
class WeightsLoader:
    """The model factory of ``blocklab serve --model SPEC``: ``lab.weights.load_model`` in each worker."""

    spec: str
    dtype: str = "float32"

    def __call__(self, device: str) -> GPT:
        from lab.quantize import load

        return load(self.spec, self.dtype, device=device)


class SharedState:
    """Memory shared by the HTTP side and the spawned workers, made before the workers start.

    ``model``: the served model's n_layer, block_size, vocab_size, parameter count and whether it has
    an exit probe, written by the first worker to finish ``setup`` (n_layer last: nonzero means
    ready). ``cancelled``: one cell per in-flight slot; the HTTP side writes a request's ticket there
    when its client is gone, and the worker stops that job. ``counters``: a row of
    ``engine.COUNTERS`` per worker, written only by that worker (no lock, which a worker killed while
    holding it would leave locked); a replaced worker continues its predecessor's row.
    """

    MAX_WORKERS = 64

    def __init__(self, max_in_flight: int, default_blocks: str | None = None):
        self.default_blocks = default_blocks  # a plain attribute: it travels to the workers pickled
        context = mp.get_context("spawn")
        self.model = context.RawArray(ctypes.c_int64, 5)
        self.cancelled = context.RawArray(ctypes.c_int64, max_in_flight)
        self.counters = context.RawArray(ctypes.c_int64, self.MAX_WORKERS * len(COUNTERS))

    def tally(self, worker_id: int) -> Tally:
        """The engine's ``Tally`` for worker ``worker_id``: adds to that worker's row of counters."""
        row = worker_id * len(COUNTERS)
        columns = {name: row + column for column, name in enumerate(COUNTERS)}

        def add(name: str, count: int) -> None:
            self.counters[columns[name]] += count

        return add

    def totals(self) -> dict[str, int]:
        """Each counter summed over the workers."""
        width = len(COUNTERS)
        values = self.counters[:]
        return {name: sum(values[column::width]) for column, name in enumerate(COUNTERS)}

    def publish(self, model: GPT) -> None:
        cfg = model.config
        has_probe = int(model.exit_probe is not None)
        self.model[1:] = [cfg.block_size, cfg.vocab_size, parameter_count(model), has_probe]
        self.model[0] = cfg.n_layer  # last: a depth marks the rest as written (see limits)

    def limits(self) -> ModelLimits | None:
        n_layer, block_size, _, _, has_probe = self.model[:]
        if not n_layer:
            return None
        return ModelLimits(
            n_layer, block_size, exit_probe=bool(has_probe), default_blocks=self.default_blocks
        )

    def model_info(self) -> dict:
        n_layer, block_size, vocab_size, n_params, has_probe = self.model[:]
        return {
            "depth": n_layer,
            "context_length": block_size,
            "vocab_size": vocab_size,
            "parameters": n_params,
            "exit_probe": bool(has_probe),
        }


@dataclass(frozen=True)
class Rejection:
    """A request the worker cannot run (it failed ``resolve``); answered with an error event."""

    status: int
    message: str


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker if the server process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class BlockLabAPI(ls.LitAPI):
    """The served model behind LitServe: built by ``model_factory`` in each worker, one engine each.

    ``stream=True`` for every request: LitServe then gives each request a queue of messages, which
    the routes of ``serve.gateway`` read, whether they stream to their client or not.
    """

    def __init__(
        self,
        model_factory: ModelFactory,
        shared: SharedState,
        *,
        max_batch_size: int = 8,
        batch_timeout: float = 0.0,
        threads: int | None = None,
    ):
        super().__init__(
            max_batch_size=max_batch_size,
            batch_timeout=batch_timeout,
            api_path=API_PATH,
            stream=True,
            loop=BatchLoop(),
        )
        self.model_factory = model_factory
        self.shared = shared
        self.threads = threads

    def setup(self, device: str) -> None:
        _die_with_parent()
        # Ctrl-C (or a SIGTERM to the process group) must not kill the worker under requests in
        # flight: the server drains first, then kills the workers itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.threads:
            torch.set_num_threads(self.threads)
        self.load(device)

    def load(self, device: str) -> None:
        """The model and its engine in this process (``setup`` without the worker's process setup)."""
        self.model = self.model_factory(device).eval()
        self.engine = Engine(self.model)
        self.shared.publish(self.model)
        self.limits = self.shared.limits()

    def decode_request(self, request: PredictRequest) -> Job | Rejection:
        """A job for the engine. Never raises for one bad request: that would fail its whole batch."""
        try:
            resolved = resolve(request, self.limits)
        except RequestError as error:
            return Rejection(422, str(error))
        admission = request.admission
        if admission is None:  # called in-process (benchmarks), not through the server
            submitted_at, deadline, cancelled = time.monotonic(), float("inf"), lambda: False
        else:
            submitted_at, deadline = admission.submitted_at, admission.deadline
            cancelled = lambda: self.shared.cancelled[admission.slot] == admission.ticket
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        return Job(
            request_id=request.id,
            prompt_tokens=resolved.prompt_tokens,
            block_set=resolved.block_set,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_k=request.top_k,
            seed=seed,
            score=request.score,
            stream=request.stream,
            submitted_at=submitted_at,
            cancelled=cancelled,
            deadline=deadline,
        )

    def predict(self, jobs: list[Job | Rejection]) -> Iterator[list[tuple[int, dict]]]:
        """Per tick, (position in ``jobs``, event) pairs; every job ends with a done or error event."""
        rejected = [
            (i, error_event(job.status, job.message))
            for i, job in enumerate(jobs)
            if isinstance(job, Rejection)
        ]
        if rejected:
            yield rejected
        runnable = [(i, job) for i, job in enumerate(jobs) if isinstance(job, Job)]
        if runnable:
            yield from self.engine.run(runnable)


class BatchLoop(LitLoop):
    """The worker's loop: a batch of what is waiting, each event sent as soon as it exists."""

    def __call__(
        self,
        lit_api: BlockLabAPI,
        device: str,
        worker_id: int,
        request_queue,
        transport,
        workers_setup_status,
        callback_runner,
    ) -> None:
        lit_api.engine.tally = lit_api.shared.tally(worker_id)
        while True:
            batch = self._take_batch(lit_api, request_queue, transport)
            if batch:
                self._run_batch(lit_api, batch, transport)

    def _take_batch(self, lit_api: BlockLabAPI, request_queue, transport) -> list[tuple[int, str, object]]:
        """Block for one request, then take the ones already waiting, up to ``max_batch_size``."""
        first = self.get_request(request_queue, timeout=1.0)
        if first is None:
            return []
        waiting = [first]
        deadline = time.monotonic() + lit_api.batch_timeout
        while len(waiting) < lit_api.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                waiting.append(
                    request_queue.get(timeout=remaining) if remaining > 0 else request_queue.get_nowait()
                )
            except Empty:
                break
        batch = []
        for response_queue_id, uid, queued_at, request in waiting:
            # START tells the server which worker holds the request, so it can fail it if the worker dies.
            self.put_response(
                transport, response_queue_id, uid, (), LitAPIStatus.START, LoopResponseType.STREAMING
            )
            timeout = lit_api.request_timeout
            if timeout not in (None, False, -1) and time.monotonic() - queued_at > timeout:
                error = PickleableHTTPException(504, f"waited more than {timeout:g} s in the queue")
                self.put_response(
                    transport, response_queue_id, uid, error, LitAPIStatus.ERROR, LoopResponseType.STREAMING
                )
                continue
            batch.append((response_queue_id, uid, request))
        return batch

    def _run_batch(self, lit_api: BlockLabAPI, batch: list[tuple[int, str, object]], transport) -> None:
        finished: set[int] = set()
        try:
            jobs = [lit_api.decode_request(request) for _, _, request in batch]
            for events in lit_api.predict(jobs):
                for position, event in events:
                    response_queue_id, uid, _ = batch[position]
                    self.put_response(
                        transport, response_queue_id, uid, event, LitAPIStatus.OK, LoopResponseType.STREAMING
                    )
                    if event["event"] in ("done", "error"):
                        finished.add(position)
        except Exception as error:  # a bug outside the engine's per-group handling: fail what is left
            logger.exception("batch failed")
            for position, (response_queue_id, uid, _) in enumerate(batch):
                if position not in finished:
                    self.put_error_response(
                        transport, response_queue_id, uid, error, LoopResponseType.STREAMING
                    )
