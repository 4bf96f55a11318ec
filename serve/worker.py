"""The worker: a model in each worker process, fed resolved jobs, its engine stepped between arrivals.

``Worker`` is pickled into every worker process the pool (``serve.litserve_adapter``) starts;
``setup`` loads the model there and publishes its shape into ``serve.shared.SharedState`` (the pool
reports it to the HTTP side, which checks requests against it). ``serve`` is the worker's loop,
iteration-level scheduling around ``serve.engine.Engine``: it blocks while it has nothing to do,
and otherwise, between any two ticks of the engine, admits whatever has arrived (up to
``max_batch_size`` rows) and sends each event as it comes. Jobs arrive resolved
(``serve.schema.Job``: tokenised, block set and sampling made, once, on the HTTP side); nothing
here re-validates them.

The loop talks through two queues and knows nothing of LitServe: ``inbox.get()`` gives ``Order``s
(None: finish what is held, then stop), and it puts onto ``outbox`` the message ``(ticket, event)``
for each of the order's events (``serve.engine``'s dicts). That it took an order it says in
``serve.shared.SharedState.taken``, not in a message: the HTTP side reads it when it needs it (a
queue timeout, this worker's death, the running count), and is not woken for it.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty

import torch

from lab.model import GPT
from lab.threads import ThreadTuner
from serve.engine import Engine
from serve.schema import Job, error_event
from serve.shared import SharedState

logger = logging.getLogger(__name__)

ModelFactory = Callable[[str], GPT]
"""Builds the served model on a device ("cpu", "cuda:0"); must pickle (it travels to each worker)."""


@dataclass(frozen=True)
class WeightsLoader:
    """The model factory of ``blocklab serve --model SPEC``: ``lab.weights.load_model`` in each worker."""

    spec: str
    dtype: str = "float32"
    compile: bool = False
    """Give the model lab.fast's static-shape decode steps."""

    def __call__(self, device: str) -> GPT:
        from lab import fast
        from lab.weights import load_model

        model = load_model(self.spec, self.dtype, device=device)
        return fast.accelerate(model) if self.compile else model


@dataclass(frozen=True)
class Order:
    """A job as the pool hands it to a worker."""

    ticket: int
    """Unique per request in this server's life."""
    slot: int
    """Its cell in ``serve.shared.SharedState.cancelled``: the job is cancelled once the cell holds
    its ticket."""
    job: Job


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker if the server process dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


class Worker:
    """The served model in a worker process, built by ``model_factory``, one engine each."""

    def __init__(
        self,
        model_factory: ModelFactory,
        shared: SharedState,
        *,
        max_batch_size: int = 8,
        batch_timeout: float = 0.0,
        queue_timeout: float = float("inf"),
        threads: int | None = None,
        max_threads: int | None = None,
        prefill_chunk: int = 64,
        prefill_per_step: int = 256,
        prefill_lane: bool = True,
        prompt_cache_bytes: int = 64 << 20,
        batch_invariant: bool = True,
        warm_up: tuple[int, ...] = (),
        warm_up_blocks: str | None = None,
    ):
        self.model_factory = model_factory
        self.shared = shared
        self.max_batch_size = max_batch_size
        self.batch_timeout = batch_timeout
        self.queue_timeout = queue_timeout
        self.threads = threads
        self.max_threads = max_threads
        self.tuner: ThreadTuner | None = None  # threads=None: chosen from the free cores as the load changes
        self.prefill_chunk = prefill_chunk
        self.prefill_per_step = prefill_per_step
        self.prefill_lane = prefill_lane
        self.prompt_cache_bytes = prompt_cache_bytes
        self.batch_invariant = batch_invariant
        self.warm_up = warm_up  # request lengths whose fast step is built before the worker is ready
        self.warm_up_blocks = warm_up_blocks  # under this block set (the server's default; None: all)

    def setup(self, device: str) -> None:
        """The worker process's setup, then ``load``."""
        _die_with_parent()
        # Ctrl-C (or a SIGTERM to the process group) must not kill the worker under requests in
        # flight: the server drains first, then kills the workers itself.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.choose_threads(device)
        self.load(device)

    def choose_threads(self, device: str) -> None:
        """``threads`` fixed, or on the CPU a tuner that ``serve`` ticks (its first window: the loading)."""
        if self.threads:
            torch.set_num_threads(self.threads)
        elif torch.device(device).type == "cpu":
            self.tuner = ThreadTuner(most=self.max_threads)

    def load(self, device: str) -> None:
        """The model and its engine in this process (``setup`` without the worker's process setup)."""
        self.model = self.model_factory(device).eval()
        self.engine = Engine(
            self.model,
            max_rows=self.max_batch_size,
            prefill_chunk=self.prefill_chunk,
            prefill_per_step=self.prefill_per_step,
            prefill_lane=self.prefill_lane,
            prompt_cache_bytes=self.prompt_cache_bytes,
            batch_invariant=self.batch_invariant,
        )
        if self.warm_up and getattr(self.model, "fast", None) is not None:
            self.warm_up_fast_step()
        self.shared.publish(self.model)

    def warm_up_fast_step(self) -> None:
        """Build the fast step for ``warm_up``'s lengths at every thread count this worker may step at
        (its fixed count, or each the tuner may choose), so that no request waits for a compile."""
        from lab import fast
        from lab.blocks import BlockSet

        n_layer = self.model.config.n_layer
        block_set = BlockSet.parse(self.warm_up_blocks, n_layer) if self.warm_up_blocks else BlockSet()
        counts = range(1, self.tuner.most + 1) if self.tuner is not None else [torch.get_num_threads()]
        seconds = fast.warm_up(self.model, self.warm_up, counts, block_set)
        logger.info(
            "fast step built for lengths %s at %s thread(s) in %.1f s",
            ", ".join(map(str, self.warm_up)), ", ".join(map(str, counts)), seconds,
        )  # fmt: skip

    def serve(self, inbox, outbox, worker_id: int) -> None:
        """The worker's loop (see the module docstring); after an order that is None, it finishes the
        jobs it holds and returns."""
        engine = self.engine
        engine.tally = self.shared.tally(worker_id)
        open_ = True  # still taking orders
        while open_ or engine.busy:
            if open_ and not engine.busy:  # idle: block for an order, then wait batch_timeout for company
                open_ = self._admit(inbox.get(), outbox)
                if self.batch_timeout > 0:
                    time.sleep(self.batch_timeout)
            while open_ and engine.capacity > 0:
                try:
                    open_ = self._admit(inbox.get_nowait(), outbox)
                except Empty:
                    break
            if self.tuner is not None:
                self.tuner.tick()  # every few seconds: threads for the cores other processes leave
            try:
                for events in engine.tick_parts():  # each part's events leave at once
                    for ticket, event in events:
                        outbox.put((ticket, event))
            except Exception as error:  # a bug outside the engine's per-row handling: fail what it holds
                logger.exception("engine tick failed")
                for ticket, event in engine.abort(error):
                    outbox.put((ticket, event))

    def _admit(self, order: Order | None, outbox) -> bool:
        """Take ``order`` into the engine (an error event if it cannot run); False: it is None."""
        if order is None:
            return False
        self.shared.take(order.slot, order.ticket)
        waited = time.monotonic() - order.job.submitted_at
        if waited > self.queue_timeout:
            message = f"waited more than {self.queue_timeout:g} s in the queue"
            outbox.put((order.ticket, error_event(504, message)))
            return True
        ticket = order.ticket
        try:
            self.engine.add(ticket, order.job, cancelled=self.shared.cancellation(order.slot, ticket))
        except Exception as error:  # a job the engine cannot hold fails alone, the loop goes on
            logger.exception("engine.add failed")
            outbox.put((ticket, error_event(500, f"{type(error).__name__}: {error}")))
        return True
