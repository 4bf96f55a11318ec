"""The worker pool as the HTTP side sees it: submit a resolved job, read its events from a channel.

    channel = pool.submit(job)          # PoolFull when every slot is taken
    event = await channel.next_event()  # token events, then one done or error event
    channel.close()                     # frees its slot; a job not finished yet is cancelled

``WorkerPool`` is the whole interface; ``serve.litserve_adapter.LitServePool`` implements it over
LitServe's worker processes (its ``Switchboard`` keeps the slots and routes the workers' messages
to the channels), and the HTTP front end (``serve.http_front``) knows nothing else of the workers.
Data flows one way: the front end calls the pool, never the reverse; a job's events come back
through its ``Channel``.

A channel's wait wakes up when an event arrives, when the HTTP side interrupts it (its client
left), and at its limits: a job no worker took within the queue timeout gets 504 (even if the worker
that took it died without a word; one taken meanwhile waits on), and one still running
``TIMEOUT_GRACE_S`` past its deadline gets 504 too (its worker ends it with 504 at its next step,
so only a step that never returns gets that far). Nothing polls.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from typing import Protocol

from serve.schema import Job, ModelLimits, error_event
from serve.worker import Order

WORKER_DIED = "the worker running this request died; it is being replaced, retry"
TIMEOUT_GRACE_S = 2.0
"""How long past a job's deadline its channel waits for the worker's own 504 (sent at its next
step) before answering 504 itself: only a step that never returns takes that long."""


class PoolFull(Exception):
    """Every slot is taken: as many jobs are in flight as the pool holds."""


class Channel:
    """One submitted job's events, in order, as they arrive (see the module docstring).

    The pool calls ``deliver`` (in the event loop's thread); the HTTP side reads ``next_event``, may
    ``interrupt`` it, and calls ``close`` once, when it is done with the job. ``taken()``: whether a
    worker has taken the job (read when it matters, never announced: its queue limit is over, which a
    wait finds when it wakes at it).
    """

    def __init__(
        self, job: Job, queue_timeout: float, on_close: Callable[[], None], taken: Callable[[], bool]
    ):
        self.job = job
        self.queue_timeout = queue_timeout
        self.on_close = on_close
        self.taken = taken
        self.finished = False
        """The worker is done with the job: its done or error event arrived."""
        self.closed = False
        self._events: deque[dict] = deque()
        self._interruption: dict | None = None
        self._waiter: asyncio.Future | None = None  # what ``next_event`` awaits, while it waits

    def deliver(self, event: dict) -> None:
        if self.finished:  # a worker's message after the job's end (its death was told first)
            return
        self.finished = event["event"] in ("done", "error")
        self._events.append(event)
        self._wake()

    def interrupt(self, event: dict) -> None:
        """From now on, ``next_event`` returns ``event`` whenever no worker's event is waiting (the
        job is not finished by it: ``close`` cancels it)."""
        self._interruption = event
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def next_event(self) -> dict:
        """The next event; a ``done`` or ``error`` event is the last. Past a limit, a 504 error event
        (the job is not finished: ``close`` then cancels it)."""
        loop = asyncio.get_running_loop()
        while not self._events:
            if self._interruption is not None:
                return self._interruption
            now = time.monotonic()
            queue_limit = math.inf if self.taken() else self.job.submitted_at + self.queue_timeout
            hard_limit = self.job.deadline + TIMEOUT_GRACE_S
            if now > queue_limit:
                return error_event(
                    504, f"queue timeout: no worker took the request within {self.queue_timeout:g} s"
                )
            if now > hard_limit:
                timeout = self.job.deadline - self.job.submitted_at
                return error_event(
                    504,
                    f"request timeout: no answer within {timeout:g} s (the server's --request-timeout) "
                    f"and {TIMEOUT_GRACE_S:g} s of grace: its worker is stuck in a step",
                )
            self._waiter = loop.create_future()
            limit = loop.call_later(min(queue_limit, hard_limit) - now + 0.01, self._wake)
            try:
                await self._waiter
            finally:
                limit.cancel()
                self._waiter = None
        return self._events.popleft()

    def close(self) -> None:
        """Done with the job: its slot is freed, and the job cancelled if not finished."""
        if not self.closed:
            self.closed = True
            self.on_close()


class Switchboard:
    """A pool's bookkeeping on the HTTP side: a slot, a ticket and a channel per job in flight, and
    the workers' events routed to the channels (``serve.worker`` says what they are).

    ``cancel(slot, ticket)`` tells the workers that the job holding ``slot`` is cancelled;
    ``taken(slot, ticket)`` says whether a worker has taken it (``serve.shared.SharedState``'s).
    """

    def __init__(
        self,
        slots: int,
        queue_timeout: float,
        cancel: Callable[[int, int], None],
        taken: Callable[[int, int], bool],
    ):
        self.slots = slots
        self.queue_timeout = queue_timeout
        self.cancel = cancel
        self.taken = taken
        # least recently freed first, so a cancelled job's slot is reused as late as possible
        self.free_slots = deque(range(slots))
        self.channels: dict[int, Channel] = {}
        self.slot_of: dict[int, int] = {}  # ticket -> slot
        self.tickets = 0

    def open(self, job: Job) -> tuple[Order, Channel]:
        """The order a worker takes for ``job``, and its channel; PoolFull when every slot is taken."""
        if not self.free_slots:
            raise PoolFull(f"{self.slots} requests in flight, the most this server takes")
        self.tickets += 1
        ticket, slot = self.tickets, self.free_slots.popleft()
        taken = partial(self.taken, slot, ticket)
        channel = Channel(job, self.queue_timeout, lambda: self._closed(ticket), taken)
        self.channels[ticket], self.slot_of[ticket] = channel, slot
        return Order(ticket, slot, job), channel

    def _closed(self, ticket: int) -> None:
        channel, slot = self.channels.pop(ticket), self.slot_of.pop(ticket)
        if not channel.finished:  # its worker stops it at its next step
            self.cancel(slot, ticket)
        self.free_slots.append(slot)

    def route(self, ticket: int, event: dict) -> None:
        """A worker's event for job ``ticket``, in the event loop's thread."""
        channel = self.channels.get(ticket)
        if channel is not None:  # else closed already: its client is gone
            channel.deliver(event)

    def worker_died(self, orders: list[Order]) -> list[Order]:
        """The worker ``orders`` were sent to died (after all it sent): the jobs it took fail with
        503; those it had not taken and still open, returned, go to another worker."""
        untaken = []
        for order in orders:
            channel = self.channels.get(order.ticket)
            if channel is None:
                continue
            if channel.taken():
                channel.deliver(error_event(503, WORKER_DIED))
            else:
                untaken.append(order)
        return untaken

    def in_flight(self) -> int:
        return len(self.channels)

    def running(self) -> int:
        """Jobs a worker has taken and not finished (the rest of those in flight wait for one)."""
        return sum(channel.taken() and not channel.finished for channel in self.channels.values())


class WorkerPool(Protocol):
    """The worker processes behind the HTTP side: what ``serve.http_front`` may ask of them."""

    def start(self) -> None:
        """Start the workers and wait until each has loaded the model (RuntimeError if one fails)."""

    def running(self) -> AbstractAsyncContextManager[None]:
        """While the HTTP app runs (its lifespan): deliver the workers' events on this event loop."""

    def stop(self) -> None:
        """Stop every worker and whatever else the pool started."""

    def submit(self, job: Job) -> Channel:
        """Queue ``job`` for a worker; its channel. PoolFull when every slot is taken."""

    def room(self) -> int:
        """Slots free now: jobs ``submit`` takes before PoolFull."""

    def ready(self) -> bool:
        """Every worker has loaded the model (False while one starts or is replaced)."""

    def limits(self) -> ModelLimits | None:
        """What requests are checked against: the served model's shape (None: still loading)."""

    def model_info(self) -> dict:
        """The served model's depth, context length, vocabulary, parameters, exit probe."""

    def stats(self) -> dict:
        """Jobs ``in_flight`` (``running`` on a worker, ``waiting`` for one) and the workers'
        counters (``serve.engine.COUNTERS``), summed."""

    def describe(self) -> dict:
        """The pool's configuration, for ``/info``."""

    def worker_pids(self) -> list[int]:
        """The worker processes, for their memory at ``/stats``."""
