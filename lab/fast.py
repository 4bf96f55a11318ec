"""Fast decode steps: one sequence's step with static shapes, compiled (CPU) or captured (CUDA graphs).

    model = lab.weights.load_model("gpt2-random")
    lab.fast.accelerate(model)          # every Decoder of this model now steps through it where it can
    blocklab generate --compile ...     # the same from the command line (serve and bench_decode too)

A decode step at batch 1 is a few hundred small kernel calls; on a GPU each costs a launch, on a CPU
a trip through Python and torch's dispatcher. gpt-fast's approach removes that cost by giving the step
static shapes: the KV cache is preallocated to a length bucket (``bucket``: a power of two, at most
the context), the new position is a tensor rather than a Python int, the keys and values are written
at it with ``index_copy_`` and attention reads every slot of the bucket with a mask up to the
position (``lab.model.attend_static``). Then one step's work is the same graph at every position:

- on the CPU, ``torch.compile`` (inductor) turns it into generated C++ (``INDUCTOR_OPTIONS``),
  compiled once per length bucket and block set, and kept on disk (``TORCHINDUCTOR_CACHE_DIR``,
  here under the blocklab cache dir, with inductor's FX graph cache) so a restart reloads it;
- on a GPU, the step is captured in a CUDA graph (``GraphedStep``) on static input buffers and a
  static cache (``CacheSlots``: decoders borrow a bucket's cache and give it back when collected),
  and each step is one replay.

What takes the fast path: one row's step under a fixed block set (``skip``, ``keep``, ``overwrite``,
``exit``, exits read through the tuned lens (``lens=tuned``: its translator is part of the graph) and
their combinations; each combination is its own graph), and on the CPU self-speculation's rounds
(``lab.speculate``: the draft steps, and the verification of a round's positions as one graph per
round length). What falls back to the eager step, saying so once (``FastDecode.fallbacks`` counts
it): adaptive exit (it decides after each block, on the host), self-speculation under CUDA graphs,
any step while a hook is registered (``lab.hooks``: the hooks see the eager step's tensors), and
steps of many rows without ``lab.rows.rows_alone`` (one batched product reads the weights once;
under ``rows_alone`` each row takes its own fast step, which is batch-invariant by construction). The
fast step's logits equal the eager step's up to rounding (tests/test_fast.py).
"""

from __future__ import annotations

import functools
import logging
import os
import time
import types
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

from lab.blocks import BlockSet
from lab.hooks import hooked
from lab.model import GPT, KVCache

logger = logging.getLogger(__name__)

Mode = Literal["compile", "graphs"]
"""How the static step runs: compiled by inductor, or captured once and replayed (CUDA graphs)."""

INDUCTOR_OPTIONS = {"freezing": True, "cpp_wrapper": True}
"""Inductor's settings for the CPU step: the weights become constants of the graph (freezing lets
inductor lay them out for its kernels), and the generated code is called from C++, not Python."""

SMALLEST_BUCKET = 64
"""The shortest cache a fast decoder gets: attention over a few masked slots costs nothing."""


def bucket(max_len: int, block_size: int) -> int:
    """The cache length a fast decoder of ``max_len`` positions gets: the power of two at or above it
    (at least ``SMALLEST_BUCKET``), at most ``block_size``. Few lengths, so few compiled graphs, and
    attention reads at most twice the slots it needs."""
    length = SMALLEST_BUCKET
    while length < max_len:
        length *= 2
    return min(length, block_size)


def static_blocks(
    model: GPT,
    blocks: tuple[int, ...],
    overwrite: frozenset[int],
    x: torch.Tensor,
    pos: torch.Tensor,
    k_cache: Sequence[torch.Tensor],
    v_cache: Sequence[torch.Tensor],
) -> torch.Tensor:
    """The stream x [1, T, D] at positions pos [T] (a tensor, so every position runs the same graph)
    through ``blocks``, writing keys and values into each block's caches ([1, H, T_max, Dh] each);
    [1, T, D]. The caller checks that the positions are inside the cache."""
    for i in blocks:
        x = model.blocks[i](x, (k_cache[i], v_cache[i]), pos, overwrite=i in overwrite)  # [1, T, D]
    return x


def static_feed(model: GPT, blocks, overwrite, idx, pos, k_cache, v_cache) -> torch.Tensor:
    """Token idx [1, 1] at position pos [1] through ``blocks``: the stream leaving them [1, 1, D]."""
    x = model.embed(model.wte(idx) + model.wpe(pos))  # [1, 1, D]; dropout is off in eval
    return static_blocks(model, blocks, overwrite, x, pos, k_cache, v_cache)


def static_read(model: GPT, lens_block: int | None, x: torch.Tensor) -> torch.Tensor:
    """The last position of x [1, T, D] read out, through the tuned lens's translator of
    ``lens_block`` (None: the logit lens): the logits [1, V]."""
    x = x[:, -1:]  # [1, 1, D]
    return model.unembed(x if lens_block is None else model.tuned_lens(lens_block, x))[:, -1]  # [1, V]


def static_step(model: GPT, blocks, overwrite, lens_block, idx, pos, k_cache, v_cache) -> torch.Tensor:
    """One decode step with static shapes: token idx [1, 1] at position pos [1] through ``blocks``,
    read out (through ``lens_block``'s translator); the logits [1, V]."""
    return static_read(model, lens_block, static_feed(model, blocks, overwrite, idx, pos, k_cache, v_cache))


def static_draft(model: GPT, blocks, overwrite, lens_block, idx, pos, k_cache, v_cache):
    """A self-speculation draft: ``static_step`` through the drafting blocks, which also returns the
    stream leaving them [1, 1, D] (verification continues it) beside the logits [1, V]."""
    x = static_feed(model, blocks, overwrite, idx, pos, k_cache, v_cache)  # [1, 1, D]
    return x, static_read(model, lens_block, x)


def static_draft_rows(model: GPT, blocks, overwrite, lens_block, idx, pos, k_cache, v_cache, table, bias):
    """``static_draft`` read out over a draft vocabulary's rows ``table`` [N, D] and ``bias`` [N] only
    (``GPT.unembed_rows``): the stream [1, 1, D] and the logits [N]."""
    x = static_feed(model, blocks, overwrite, idx, pos, k_cache, v_cache)  # [1, 1, D]
    read = x if lens_block is None else model.tuned_lens(lens_block, x)  # [1, 1, D]
    return x, model.unembed_rows(read, table, bias)


def static_verify(model: GPT, blocks, overwrite, x, pos, k_cache, v_cache) -> torch.Tensor:
    """A self-speculation round's verification: the drafts' streams x [1, T, D] at positions pos [T]
    through the remaining ``blocks``, every position read out: the logits [T, V]. Each position is
    read out on its own, as a decode step reads one: inductor's code for T matrix-vector products
    over the token table is faster than one T-row matrix product."""
    x = static_blocks(model, blocks, overwrite, x, pos, k_cache, v_cache)  # [1, T, D]
    return torch.cat([model.unembed(x[:, t : t + 1])[0] for t in range(x.size(1))])  # [T, V]


def eager_reason(block_set: BlockSet, graphs: bool = False) -> str | None:
    """Why a decoder under ``block_set`` cannot take the fast step (None: it can); ``graphs``: the
    steps are CUDA graphs."""
    if block_set.is_adaptive:
        return "adaptive exit decides after each block, on the host"
    if graphs and block_set.is_speculative:
        return "self-speculation's rounds are compiled on the CPU, not captured in CUDA graphs"
    return None


def cuda_capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """``fn`` run on a side stream to warm up, then captured in a CUDA graph: its output (a static
    tensor the replays write into) and the replay. fn's inputs must stay where they are."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # cuBLAS and the allocator set up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = fn()
    return output, graph.replay


def eager_capture(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, Callable[[], None]]:
    """``cuda_capture``'s contract without a GPU (tests): the output buffer of a first run, and a
    replay that runs ``fn`` again into it."""
    output = fn()
    return output, lambda: output.copy_(fn())


class GraphedStep:
    """``fn(*inputs)`` captured once on static copies of its inputs: each call copies the new inputs
    into them, replays, and returns the static output (read it before the next call)."""

    def __init__(
        self, fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], capture=cuda_capture
    ):
        self.inputs = tuple(x.clone() for x in inputs)
        self.output, self.replay = capture(lambda: fn(*self.inputs))

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        for static, x in zip(self.inputs, inputs, strict=True):
            static.copy_(x)
        self.replay()
        return self.output


class CacheSlots:
    """Static KV caches a graph was captured on, one pool per length bucket: a decoder borrows one
    and it returns to the pool when the decoder is collected."""

    def __init__(self, model: GPT):
        self.model = model
        self.free: dict[int, list[KVCache]] = {}

    def borrow(self, owner: object, length: int) -> KVCache:
        pool = self.free.setdefault(length, [])
        weight = self.model.wte.weight
        cache = pool.pop() if pool else KVCache(self.model.config, 1, length, weight.device, weight.dtype)
        cache.length = 0
        weakref.finalize(owner, pool.append, cache)
        return cache


def layers_apart(cache: KVCache) -> KVCache:
    """``cache`` with each block's keys and values in tensors of their own (lists of [1, H, T_max, Dh])
    instead of views of one [L, 1, H, T_max, Dh] tensor. The compiled step writes a block's new key
    into its input in place; written through a view of a larger input, inductor would rebuild and
    copy back the whole [L, ...] tensor at every step, several copies of the cache per token."""
    cache.k = [layer.clone() for layer in cache.k]  # each its own storage: [1, H, T_max, Dh] each
    cache.v = [layer.clone() for layer in cache.v]
    return cache


def bind(fn: Callable[..., torch.Tensor], *bound) -> Callable[..., torch.Tensor]:
    """``fn`` with its first arguments ``bound``, as a function with a code object of its own (what
    ``_compiled`` compiles). dynamo keeps a function's compiled graphs on its code object (a
    ``functools.partial`` on the code of dynamo's one wrapper for partials) and at every call checks
    the guards of each graph before the one that matches: with one code object for every block set,
    bucket and kind of step, a step would cost more the more graphs the model had compiled."""

    def step(*inputs):
        return fn(*bound, *inputs)

    code = step.__code__.replace()  # an equal code object, distinct from every other step's
    return types.FunctionType(code, step.__globals__, fn.__name__, None, step.__closure__)


class WarmGraph:
    """A compiled step (``bind``'s function under ``torch.compile``) that checks dynamo's guards on its
    first call at each thread count only. The guards (every module's flags, hooks and parameters,
    every input's shape) cost a sizeable share of a small model's step; here nothing they check can
    change between calls but the thread count: each graph has a code object and a key of its own
    (kind of step, block set, bucket, round length), whose inputs have fixed shapes, freezing made the
    weights constants (the tuned lens's tensors are inputs, read at every call: a lens attached later
    is the one read), and hooks send the step to the eager path before it gets here
    (``FastDecode.ready``). The thread count is part of dynamo's global state and ``lab.threads``
    changes it with the load: a count not seen yet compiles (or loads) its own graph with the guards;
    after that, skipping guards still checks the ones that tell a function's graphs apart."""

    def __init__(self, compiled: Callable[..., torch.Tensor]):
        self.compiled = compiled
        self.warm_threads: set[int] = set()

    def __call__(self, *inputs):
        threads = torch.get_num_threads()
        if threads not in self.warm_threads:  # compiles (or loads what inductor cached) with the guards
            output = self.compiled(*inputs)
            self.warm_threads.add(threads)
            return output
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self.compiled(*inputs)


def _compile_cache_dir() -> Path:
    """Where inductor keeps what it compiled (``TORCHINDUCTOR_CACHE_DIR`` if set): beside the models."""
    from lab.weights import cache_root

    return Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR", cache_root() / "inductor"))


class FastDecode:
    """A model's fast decode steps (see the module docstring); ``accelerate`` attaches one."""

    def __init__(self, model: GPT, mode: Mode | None = None, capture=cuda_capture):
        self.model = model
        self.device = model.wte.weight.device
        self.mode = mode or ("graphs" if self.device.type == "cuda" else "compile")
        self.graphs = self.mode == "graphs"
        self.capture = capture  # graphs: how a step is captured (eager_capture replays it on a CPU)
        self.slots = CacheSlots(model)
        self.steps: dict[tuple, Callable[..., torch.Tensor]] = {}
        self.fallbacks: Counter[str] = Counter()
        self.modules = list(model.modules())
        # torch.compile's backend; "eager" traces the same graphs without generating code (tests)
        self.backend = "inductor"
        if not self.graphs:
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_compile_cache_dir()))

    def takes(self, block_set: BlockSet) -> bool:
        """Whether decoders under ``block_set`` take the fast step; if not, says why (once per reason)."""
        reason = eager_reason(block_set, self.graphs)
        if reason is not None:
            self.fell_back(reason)
        return reason is None

    def fell_back(self, reason: str) -> None:
        if not self.fallbacks[reason]:
            logger.info("fast decode falls back to the eager step: %s", reason)
        self.fallbacks[reason] += 1

    def cache(self, owner: object, max_len: int) -> KVCache:
        """A cache for a fast decoder (``owner``) of ``max_len`` positions, bucket-long: a borrowed
        static one where steps are CUDA graphs."""
        length = bucket(max_len, self.model.config.block_size)
        if self.graphs:
            return self.slots.borrow(owner, length)
        weight = self.model.wte.weight
        return layers_apart(KVCache(self.model.config, 1, length, weight.device, weight.dtype))

    def ready(self) -> bool:
        """False while any hook would see the model run, a global one included (its step then runs
        eager, said once)."""
        if hooked(self.modules):
            self.fell_back("a hook is registered (hooks see the eager step's tensors)")
            return False
        return True

    @torch.inference_mode()
    def step(
        self, blocks: list[int], overwrite: frozenset[int], cache: KVCache, token: int, lens_block: int | None
    ) -> torch.Tensor:
        """One fast step of ``token`` at ``cache.length``, read out through ``lens_block``'s translator
        (None: the logit lens): the logits [V] (the caller moves the length)."""
        idx, pos = self._inputs(token, cache.length)
        bound = (tuple(blocks), overwrite, lens_block)
        if not self.graphs:
            return self._compiled(("step", *bound, cache.max_len), static_step, *bound)(
                idx, pos, cache.k, cache.v
            )[0]
        key = ("graph", *bound, id(cache))
        if key not in self.steps:  # the cache is static: captured in place; token and position are copied in
            step = functools.partial(static_step, self.model, *bound)
            self.steps[key] = GraphedStep(lambda i, p: step(i, p, cache.k, cache.v), (idx, pos), self.capture)
        return self.steps[key](idx, pos)[0].clone()  # the graph's output is overwritten by the next replay

    @torch.inference_mode()
    def draft(
        self, blocks: list[int], overwrite: frozenset[int], cache: KVCache, token: int, position: int,
        lens_block: int | None, rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A self-speculation draft of ``token`` at ``position`` (``static_draft``; the cache's length
        stays): the stream leaving ``blocks`` [1, 1, D] and the logits [V], or [N] over a draft
        vocabulary's ``rows`` (its table [N, D] and bias [N], ``static_draft_rows``)."""
        idx, pos = self._inputs(token, position)
        bound = (tuple(blocks), overwrite, lens_block)
        if rows is not None:  # a draft vocabulary: its table and bias are inputs, its size in the key
            key = ("draft", *bound, rows[0].size(0), cache.max_len)
            return self._compiled(key, static_draft_rows, *bound)(idx, pos, cache.k, cache.v, *rows)
        x, logits = self._compiled(("draft", *bound, cache.max_len), static_draft, *bound)(
            idx, pos, cache.k, cache.v
        )
        return x, logits[0]

    @torch.inference_mode()
    def feed(
        self, blocks: list[int], overwrite: frozenset[int], cache: KVCache, token: int, position: int
    ) -> torch.Tensor:
        """``draft`` without the read-out: a round's last draft, which only verification reads."""
        idx, pos = self._inputs(token, position)
        bound = (tuple(blocks), overwrite)
        return self._compiled(("feed", *bound, cache.max_len), static_feed, *bound)(
            idx, pos, cache.k, cache.v
        )

    @torch.inference_mode()
    def verify(
        self, blocks: list[int], overwrite: frozenset[int], cache: KVCache, streams: torch.Tensor, start: int
    ) -> torch.Tensor:
        """A round's verification (``static_verify``) of the drafts' streams [1, T, D] at positions
        start..: the logits [T, V]. Each T compiles once (a round drafts fewer near the end)."""
        pos = torch.arange(start, start + streams.size(1), device=self.device)  # [T]
        bound = (tuple(blocks), overwrite)
        key = ("verify", *bound, streams.size(1), cache.max_len)
        return self._compiled(key, static_verify, *bound)(streams, pos, cache.k, cache.v)

    def _inputs(self, token: int, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's token [1, 1] and position [1], as tensors (a position is an input, not a constant)."""
        return torch.tensor([[token]], device=self.device), torch.tensor([position], device=self.device)

    def _compiled(self, key: tuple, fn: Callable[..., torch.Tensor], *bound) -> Callable[..., torch.Tensor]:
        """``fn`` for the model and the ``bound`` arguments (blocks, overwrite...), compiled once per key."""
        if key not in self.steps:
            options = INDUCTOR_OPTIONS if self.backend == "inductor" else None
            step = bind(fn, self.model, *bound)
            self.steps[key] = WarmGraph(
                torch.compile(step, fullgraph=True, dynamic=False, backend=self.backend, options=options)
            )
        return self.steps[key]


def warm_up(
    model: GPT, lengths: Sequence[int], thread_counts: Sequence[int], block_set: BlockSet | None = None
) -> float:
    """Build ``model``'s fast step under ``block_set`` (default: every block) for the bucket of each of
    ``lengths`` (prompt + new tokens) at each of ``thread_counts``, so that no request waits for it: a
    compiled step's first call compiles, or loads what inductor cached on disk, and a thread count
    not seen yet is its own graph (``WarmGraph``). Returns the seconds it took (0 if ``block_set``
    does not take the fast path); torch's thread count is left as it was."""
    from lab.decode import Decoder  # here: lab.decode reads model.fast, made by this module

    start, threads = time.perf_counter(), torch.get_num_threads()
    try:
        for count in thread_counts:
            torch.set_num_threads(count)
            for length in sorted({bucket(n, model.config.block_size) for n in lengths}):
                decoder = Decoder(model, block_set, max_len=length)
                if decoder.fast is None:
                    return 0.0
                decoder.prefill([0])
                decoder.fast_step(0)
    finally:
        torch.set_num_threads(threads)
    return time.perf_counter() - start


def accelerate(model: GPT, mode: Mode | None = None, capture=cuda_capture) -> GPT:
    """Give ``model`` fast decode steps (``FastDecode``), in place; returns it. ``mode``: "compile"
    (inductor) or "graphs" (captured steps); default: graphs on CUDA, compile elsewhere."""
    model.fast = FastDecode(model, mode, capture)
    return model
