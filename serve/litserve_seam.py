"""Every use of LitServe's internals, in one module (litserve 0.2.19; pyproject pins it below 0.3).

blocklab runs LitServe's parts (the request queue in its manager process, the response buffer,
the inference workers and their monitor) in its own order (``serve.app``), with its own routes
(``serve.gateway``) and its own worker loop (``serve.api.ContinuousLoop``). Those need members that
LitServe does not document. Each one is used here only, with a line on why, so that an upgrade of
LitServe touches this file alone.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import threading
import time
from collections import deque
from queue import Empty

import litserve as ls
from fastapi import HTTPException
from litserve.loops.base import LitLoop
from litserve.server import no_auth
from litserve.utils import (
    LitAPIStatus,
    LoopResponseType,
    PickleableHTTPException,
    ResponseBufferItem,
    WorkerSetupStatus,
)

from serve.engine import error_event

logger = logging.getLogger(__name__)

WORKER_DIED = "the worker running this request died; it is being replaced, retry"


class _SnapshotDict(dict):
    """LitServe's response buffer, whose ``items()`` is a copy: LitServe's worker monitor iterates it
    in its own thread while requests finish (and leave it) in the event loop's; a live view there
    raises "dictionary changed size during iteration", which kills the monitor for good."""

    def items(self):
        return list(super().items())


class SeamServer(ls.LitServer):
    """A LitServer whose internals are reached through the methods below, and whose model routes
    are the subclass's ``register_routes`` instead of LitServe's handler."""

    def __init__(self, api: ls.LitAPI, **kwargs):
        super().__init__(api, **kwargs)
        self.response_buffer = _SnapshotDict()
        # seconds between the monitor's checks for dead workers (LitServe's default 2; its spelling)
        self.monitor_internal = 0.5
        self.inference_workers = []
        self.manager = None

    # -- hooks LitServe calls ----------------------------------------------------------------------

    def setup_auth(self, lit_api: ls.LitAPI | None = None):
        """No per-route check: ``gateway.ApiKeyMiddleware`` guards every route (LitServe would
        otherwise add its own, X-API-Key only, when $LIT_SERVER_API_KEY is set)."""
        return no_auth

    def _register_api_endpoints(self, lit_api: ls.LitAPI, request_type, response_type) -> None:
        """LitServer.__init__ registers each LitAPI's routes through this private hook; ours instead.
        ``request_type`` is decode_request's annotation (the body FastAPI validates)."""
        self.register_routes(lit_api, request_type)

    def register_routes(self, lit_api: ls.LitAPI, request_type) -> None:
        raise NotImplementedError

    # -- the worker side ---------------------------------------------------------------------------

    def worker_count(self, lit_api: ls.LitAPI) -> int:
        """How many inference workers LitServe will start for ``lit_api`` (devices x per device)."""
        return len(self._inference_workers_config_for_api(lit_api.api_path))

    def start_manager(self) -> None:
        """LitServe's manager process, which holds the queues every request goes through (what
        ``LitServer.run`` does first, with one API server process: ours runs in this process)."""
        self.manager = self._init_manager(1)
        self.app.response_queue_id = 0  # the response queue of our one HTTP side

    def start_workers(self, lit_api: ls.LitAPI) -> None:
        """Launch the inference workers, wait until each has loaded the model (RuntimeError if one
        fails or dies trying), then start the monitor that restarts a dead one."""
        self.inference_workers = self.launch_inference_worker(lit_api)
        while True:
            states = dict(self.workers_setup_status)
            if states and all(state == WorkerSetupStatus.READY for state in states.values()):
                break
            if any(state == WorkerSetupStatus.ERROR for state in states.values()):
                raise RuntimeError("a worker failed to load the model (its traceback is above)")
            if any(not worker.is_alive() for worker in self.inference_workers):
                raise RuntimeError("a worker died while loading the model")
            time.sleep(0.05)
        self._start_worker_monitoring(self.manager, {})

    def stop(self) -> None:
        """Stop the worker monitor first (else it restarts the workers we stop), then the workers and
        the manager. Workers ignore SIGTERM (``BlockLabAPI.setup``), so they are killed."""
        try:
            self._shutdown_event.set()
        except OSError:  # the manager is gone already (killed from outside): nothing to tell
            logger.warning("LitServe's manager process died before shutdown")
        for thread in threading.enumerate():
            if thread.name == "litserve-monitoring":  # the thread _start_worker_monitoring started
                thread.join(timeout=5)
        for worker in self.inference_workers:
            worker.kill()
            worker.join(timeout=5)
        if self.manager is not None:
            self._perform_graceful_shutdown(self.manager, {}, "normal")

    def worker_process(self, worker_id: int):
        """The inference worker process ``worker_id`` (LitServe's index for our one API), or None."""
        workers = self.inference_workers
        return workers[worker_id] if 0 <= worker_id < len(workers) else None

    # -- the HTTP side of a request ----------------------------------------------------------------

    def enqueue(self, lit_api: ls.LitAPI, uid: str, request, queued_at: float) -> ResponseBufferItem:
        """Put ``request`` on the API's queue; the buffer item its worker's messages arrive in (its
        ``worker_id`` is set once a worker took it)."""
        item = ResponseBufferItem(event=asyncio.Event(), response_queue=deque())
        self.response_buffer[uid] = item
        queue = self._get_request_queue(lit_api.api_path)
        queue.put((self.app.response_queue_id, uid, queued_at, request))
        return item

    def forget(self, uid: str) -> None:
        """Drop a finished request's buffer item."""
        self.response_buffer.pop(uid, None)


def event_from_worker(data, status) -> dict | None:
    """A message from LitServe's response queue as one of our events (None: nothing to report)."""
    if status == LitAPIStatus.OK:
        return data
    if status == LitAPIStatus.ERROR:
        if data is None:  # LitServe's monitor: the worker holding this request died
            return error_event(503, WORKER_DIED)
        error = pickle.loads(data) if isinstance(data, bytes) else data
        if isinstance(error, HTTPException):
            return error_event(error.status_code, str(error.detail))
        return error_event(500, f"{type(error).__name__}: {error}")
    if status == LitAPIStatus.FINISH_STREAMING:
        return error_event(500, "the worker ended the response without a summary")
    return None  # START: only tells LitServe which worker holds the request


class SeamLoop(LitLoop):
    """A worker loop's side of LitServe's protocol: take requests, send messages back."""

    def take(self, request_queue, timeout: float = 0.0):
        """The next (response_queue_id, uid, queued_at, request), waiting up to ``timeout``; None."""
        if timeout > 0:
            return self.get_request(request_queue, timeout=timeout)
        try:
            return request_queue.get_nowait()
        except Empty:
            return None

    def started(self, transport, response_queue_id: int, uid: str) -> None:
        """START tells the HTTP side which worker holds the request, so it can fail it if the worker
        dies."""
        self.put_response(
            transport, response_queue_id, uid, (), LitAPIStatus.START, LoopResponseType.STREAMING
        )

    def reply(self, transport, response_queue_id: int, uid: str, event: dict) -> None:
        """One of our events (``serve.engine``), as a streamed message."""
        self.put_response(
            transport, response_queue_id, uid, event, LitAPIStatus.OK, LoopResponseType.STREAMING
        )

    def refuse(self, transport, response_queue_id: int, uid: str, status: int, message: str) -> None:
        """An error status the HTTP side answers with, before any event."""
        error = PickleableHTTPException(status, message)
        self.put_response(
            transport, response_queue_id, uid, error, LitAPIStatus.ERROR, LoopResponseType.STREAMING
        )
