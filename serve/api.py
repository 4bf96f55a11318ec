"""The one LitAPI: a model in each worker, requests decoded into jobs, batches run by ``serve.engine``.

The worker side of the server. ``BlockLabAPI`` is pickled into every inference worker LitServe
spawns; ``setup`` loads the model there and publishes its shape into shared memory (the HTTP side
checks requests against it and reports it at ``/info``), ``decode_request`` turns a validated
``PredictRequest`` into an ``engine.Job``, and ``predict`` yields the events of a batch tick by tick.
``decode_request``'s annotation is the body's type FastAPI validates (so no ``from __future__ import
annotations`` here: the annotation must stay a class).

``ContinuousLoop`` replaces LitServe's batched streaming loop, which takes a batch and runs it to
its end before it looks at the queue again (and whose idle worker polls with 1 ms timeouts): this
loop blocks while it has nothing to do, and otherwise, between any two ticks of the engine, admits
whatever has arrived (up to ``max_batch_size`` rows) and sends each event as it comes.
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

import litserve as ls
import torch

from lab.model import GPT
from lab.quantize import parameter_count
from serve.engine import COUNTERS, Engine, Job, Tally, error_event
from serve.litserve_seam import SeamLoop
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
        prefill_chunk: int = 64,
        batch_invariant: bool = True,
    ):
        super().__init__(
            max_batch_size=max_batch_size,
            batch_timeout=batch_timeout,
            api_path=API_PATH,
            stream=True,
            loop=ContinuousLoop(),
        )
        self.model_factory = model_factory
        self.shared = shared
        self.threads = threads
        self.prefill_chunk = prefill_chunk
        self.batch_invariant = batch_invariant

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
        self.engine = Engine(
            self.model,
            max_rows=self.max_batch_size,
            prefill_chunk=self.prefill_chunk,
            batch_invariant=self.batch_invariant,
        )
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
            top_p=request.top_p,
            min_tokens=request.min_tokens,
            ignore_eos=request.ignore_eos,
            stop=tuple(request.stop or ()),
        )

    def predict(self, jobs: list[Job | Rejection]) -> Iterator[list[tuple[int, dict]]]:
        """In-process use (benchmarks): per tick, (position in ``jobs``, event) pairs; every job ends
        with a done or error event. The server's loop feeds the engine itself (``ContinuousLoop``)."""
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


class ContinuousLoop(SeamLoop):
    """The worker's loop: iteration-level scheduling around ``serve.engine.Engine``."""

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
        engine = lit_api.engine
        engine.tally = lit_api.shared.tally(worker_id)
        routes: dict[str, int] = {}  # uid -> response_queue_id, for the requests the engine holds
        while True:
            if not engine.busy:  # idle: block for a request, then wait batch_timeout for company
                if not self._admit(lit_api, request_queue, transport, routes, timeout=1.0):
                    continue
                if lit_api.batch_timeout > 0:
                    time.sleep(lit_api.batch_timeout)
            while engine.capacity > 0 and self._admit(lit_api, request_queue, transport, routes):
                pass
            try:
                for events in engine.tick_parts():  # each part's events leave at once
                    for uid, event in events:
                        self._send(transport, routes, uid, event)
            except Exception as error:  # a bug outside the engine's per-row handling: fail what it holds
                logger.exception("engine tick failed")
                for uid, event in engine.abort(error):
                    self._send(transport, routes, uid, event)
            if len(routes) > len(engine.rows):  # cancelled jobs leave the engine without an event
                held = {row.key for row in engine.rows}
                for uid in [uid for uid in routes if uid not in held]:
                    del routes[uid]

    def _admit(self, lit_api: BlockLabAPI, request_queue, transport, routes, timeout: float = 0.0) -> bool:
        """Take one request off the queue (waiting up to ``timeout``) into the engine; False if none."""
        taken = self.take(request_queue, timeout)
        if taken is None:
            return False
        response_queue_id, uid, queued_at, request = taken
        self.started(transport, response_queue_id, uid)
        timeout_s = lit_api.request_timeout  # LitServe's name for the queue timeout
        if timeout_s not in (None, False, -1) and time.monotonic() - queued_at > timeout_s:
            message = f"waited more than {timeout_s:g} s in the queue"
            self.refuse(transport, response_queue_id, uid, 504, message)
            return True
        routes[uid] = response_queue_id
        try:
            job = lit_api.decode_request(request)
        except Exception as error:  # decode_request answers bad requests itself; this is a bug
            logger.exception("decode_request failed")
            job = Rejection(500, f"{type(error).__name__}: {error}")
        if isinstance(job, Rejection):
            self._send(transport, routes, uid, error_event(job.status, job.message))
            return True
        try:
            lit_api.engine.add(uid, job)
        except Exception as error:  # a job the engine cannot hold fails alone, the loop goes on
            logger.exception("engine.add failed")
            self._send(transport, routes, uid, error_event(500, f"{type(error).__name__}: {error}"))
        return True

    def _send(self, transport, routes: dict[str, int], uid: str, event: dict) -> None:
        self.reply(transport, routes[uid], uid, event)
        if event["event"] in ("done", "error"):
            del routes[uid]
