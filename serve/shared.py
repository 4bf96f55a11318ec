"""Memory shared by the pool's HTTP side and the worker processes: the model's shape, cancellations,
counters. Lock-free: each cell has one writer (a worker killed while holding a lock would leave it
locked for good)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from collections.abc import Callable

from lab.model import GPT
from lab.quantize import parameter_count
from serve.engine import COUNTERS, LEVELS, Tally
from serve.schema import ModelLimits


class SharedState:
    """Memory shared by the pool's HTTP side and the spawned workers, made before the workers start.

    ``model``: the served model's n_layer, block_size, vocab_size, parameter count and whether it has
    an exit probe and a tuned lens, written by the first worker to finish ``setup`` (n_layer last:
    nonzero means ready). ``cancelled``: one cell per in-flight slot; the pool writes a request's
    ticket there when it is cancelled, and the worker stops that job. ``taken``: one cell per slot
    too; a worker writes a job's ticket there as it takes the job, before anything else it does with
    it, so the HTTP side knows which jobs a worker holds without a message (which would wake it).
    ``counters``: a row of ``engine.COUNTERS`` per worker, written only by that worker (no lock,
    which a worker killed while holding it would leave locked); a replaced worker continues its
    predecessor's row, but for ``engine.LEVELS``, which it starts again from 0.
    """

    MAX_WORKERS = 64

    def __init__(self, slots: int):
        context = mp.get_context("spawn")
        self.model = context.RawArray(ctypes.c_int64, 7)
        self.cancelled = context.RawArray(ctypes.c_int64, slots)
        self.taken = context.RawArray(ctypes.c_int64, slots)
        self.counters = context.RawArray(ctypes.c_int64, self.MAX_WORKERS * len(COUNTERS))

    def cancellation(self, slot: int, ticket: int) -> Callable[[], bool]:
        """The check of whether the job ``ticket`` holding ``slot`` was cancelled (the engine asks it)."""
        cells = self.cancelled
        return lambda: cells[slot] == ticket

    def take(self, slot: int, ticket: int) -> None:
        """A worker took the job ``ticket`` holding ``slot``."""
        self.taken[slot] = ticket

    def was_taken(self, slot: int, ticket: int) -> bool:
        """Whether a worker took the job ``ticket`` holding ``slot`` (a later job in the slot starts
        untaken: the cell holds an earlier ticket)."""
        return self.taken[slot] == ticket

    def tally(self, worker_id: int) -> Tally:
        """The engine's ``Tally`` for worker ``worker_id``: adds to that worker's row of counters (its
        ``LEVELS`` zeroed: a new engine holds nothing yet)."""
        row = worker_id * len(COUNTERS)
        columns = {name: row + column for column, name in enumerate(COUNTERS)}

        def add(name: str, count: int) -> None:
            self.counters[columns[name]] += count

        for name in LEVELS:  # what a predecessor held is gone with it
            self.counters[columns[name]] = 0
        return add

    def totals(self) -> dict[str, int]:
        """Each counter summed over the workers."""
        width = len(COUNTERS)
        values = self.counters[:]
        return {name: sum(values[column::width]) for column, name in enumerate(COUNTERS)}

    def publish(self, model: GPT) -> None:
        cfg = model.config
        has_probe, has_lens = int(model.exit_probe is not None), int(model.tuned_lens is not None)
        has_ranking = int(has_lens and model.tuned_lens.ranking is not None)
        described = [cfg.block_size, cfg.vocab_size, parameter_count(model), has_probe, has_lens, has_ranking]
        self.model[1:] = described
        self.model[0] = cfg.n_layer  # last: a depth marks the rest as written (see limits)

    def limits(self) -> ModelLimits | None:
        n_layer, block_size, _, _, has_probe, has_lens, has_ranking = self.model[:]
        if not n_layer:
            return None
        lens = {"tuned_lens": bool(has_lens), "ranking": bool(has_ranking)}
        return ModelLimits(n_layer, block_size, exit_probe=bool(has_probe), **lens)

    def model_info(self) -> dict:
        n_layer, block_size, vocab_size, n_params, has_probe, has_lens, _ = self.model[:]
        return {
            "depth": n_layer,
            "context_length": block_size,
            "vocab_size": vocab_size,
            "parameters": n_params,
            "exit_probe": bool(has_probe),
            "tuned_lens": bool(has_lens),
        }
