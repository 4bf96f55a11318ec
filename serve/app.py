"""``blocklab serve``: a model behind HTTP, with a block set chosen per request.

    blocklab serve --model builtin --port 8000
    curl -s localhost:8000/predict -H 'Content-Type: application/json' \\
        -d '{"prompt": "def main(", "max_new_tokens": 20, "blocks": "skip=5", "score": true}'

Routes: ``POST /predict`` (``serve.schema``), ``POST /v1/completions`` and ``/v1/chat/completions``
and ``GET /v1/models`` (OpenAI-compatible, ``serve.openai_compat``), ``GET /health``, ``GET /info``,
``GET /stats`` (counters and memory), ``GET /metrics`` (Prometheus, ``serve.metrics``), and
``/docs`` + ``/openapi.json``. With an API key, every route but ``http_front.PUBLIC_PATHS`` (health
and the schema; ``/metrics`` too with ``--metrics-public``) needs it.

How it is put together (``build``): the worker pool first (``serve.litserve_adapter.LitServePool``,
LitServe's worker processes running ``serve.worker.Worker``), then the HTTP front end over it
(``serve.http_front.Front``), then the app with every route registered on it. uvicorn runs in the
main thread; its graceful shutdown drains on SIGTERM or Ctrl-C (requests in flight finish, new
connections are refused), then the pool stops its workers and LitServe's manager: no process is left
behind.
"""

import functools
import logging
import os
import signal
import socket
import subprocess
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path
from typing import Literal

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lab import api_key as key_rule
from lab import flags
from lab.blocks import BlockSet
from lab.errors import UserError
from lab.machine import missing_accelerator
from lab.quantize import QUANTIZED_DTYPES, WeightDtype, require_kernels
from lab.threads import allowed_cores, yield_while_waiting
from lab.weights import locate
from serve import http_front, openai_compat
from serve.connections import DeadlineProtocol
from serve.litserve_adapter import LitServePool
from serve.metrics import Metrics
from serve.schema import ModelLimits, RequestError, check_model_has
from serve.shared import SharedState
from serve.worker import ModelFactory, WeightsLoader, Worker

logger = logging.getLogger("blocklab.serve")


MAX_HEADER_BYTES = 32 * 1024
"""The request line and headers together (nginx's default buffers hold 32 kB); past it, 400."""


@dataclass
class ServeConfig:
    """Everything ``blocklab serve`` takes; each field is its flag (``--max-batch-size``), its
    docstring the flag's help. docs/serving.md has the measurements behind the defaults."""

    model: str = "builtin"
    """builtin | gpt2-random | Hugging Face id | local dir | checkpoint file (lab.weights)."""
    host: str = "127.0.0.1"
    """Address to bind; loopback unless you mean otherwise (anything else without --api-key warns)."""
    port: int = 8000
    """TCP port to listen on."""
    api_key: str | None = None
    """Require this key (X-API-Key or Authorization: Bearer) on every route but /health and the docs
    (default: $LIT_SERVER_API_KEY)."""
    dtype: WeightDtype = "float32"
    """float32 | bfloat16 | float16 weights; int8 | int4 weight-only quantized; or w4a8 | w8a8, int4 or
    int8 weights times int8 activations (lab.quantize; the quantized kinds run on the CPU, where w4a8
    serves fastest: docs/inference.md)."""
    accelerator: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    """Where the workers run (LitServe's choice of device for auto)."""
    workers: int = 1
    """Inference workers per device, each with its own copy of the model."""
    threads: int | None = None
    """torch threads per worker, fixed (default: chosen again every few seconds from the cores other
    processes leave free, at most this process's cores divided among the workers; lab.threads)."""
    max_batch_size: int = 8
    """Most requests one worker runs together (rows of every block set share each decode step)."""
    batch_timeout: float = 0.0
    """Seconds an idle worker waits for company after a request arrives (0: start at once)."""
    prefill_chunk: int = 64
    """Prompt tokens per prefill pass; while rows decode, each waiting prompt advances one pass per step."""
    prefill_per_step: int = 256
    """Prompt tokens prefilled per step while rows decode (one --prefill-chunk per prompt): prompts
    that arrive together start together; running rows wait for these passes (those in line: not in
    --prefill-lane's)."""
    prefill_lane: bool = True
    """Prefill prompts that arrive while rows decode on a thread of their own, beside the decode steps
    (which take one thread fewer meanwhile), instead of in line before them: running rows are never
    held back for a prompt's pass (serve.engine.PrefillLane). Needs 2 threads or more and lab's
    products (a CPU where lab.intmm builds); prompts that score stay in line."""
    prompt_cache_mb: float = 64.0
    """MiB of finished requests' prefills each worker keeps, the least recently used dropped first: a
    later prompt copies the whole prefill chunks it begins with (identical prompts running together
    share theirs whatever this is; 0: keep none)."""
    batch_invariant: bool = True
    """Each row's logits bit for bit those it gets alone (lab.rows.rows_alone); off: faster
    matrix-matrix steps with many rows, equal up to rounding."""
    compile: bool = False
    """Decode each row through lab.fast's static-shape step (inductor on the CPU, CUDA graphs on a
    GPU), built at start for --warm-up's lengths; any other length or block set compiles on its
    first request, which waits for it (kept on disk for restarts)."""
    warm_up: tuple[int, ...] = (64, 128)
    """With --compile: request lengths (prompt + new tokens) whose step under --default-blocks is
    built at start, at every thread count the workers may use, before /health reports ready (each
    length stands for its power-of-two bucket; `--warm-up []` builds nothing)."""
    max_in_flight: int = 64
    """Most requests admitted at once (queued or running); past it, 429 with Retry-After."""
    max_prompts_per_request: int | None = None
    """Most choices (prompts times n) in one OpenAI request, each taking a slot of --max-in-flight
    (default: a quarter of it), so one client cannot take every slot; more get 400."""
    queue_timeout: float = 30.0
    """Seconds a request may wait for a worker before it gets 504."""
    request_timeout: float = 300.0
    """Seconds a request may take in all, queue included; past it the worker stops it at its next
    step and it gets 504 (an error event if it streams)."""
    max_payload_bytes: int = 1_000_000
    """Largest request body; larger gets 413."""
    drain_timeout: float = 30.0
    """On SIGTERM/SIGINT, seconds to let requests in flight finish before they are cut."""
    read_timeout: float = 30.0
    """Seconds from a request's first byte for its headers and whole body to arrive; then the
    connection is closed (serve.connections: slow or stalled clients)."""
    keep_alive_timeout: float = 5.0
    """Seconds a connection may sit idle, new or between requests, before it is closed."""
    max_connections: int = 1024
    """Open connections past which a request gets 503 with Retry-After (idle ones are closed first)."""
    backlog: int = 2048
    """Connections the kernel queues before the server accepts them."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    """How much the server logs."""
    default_blocks: str | None = None
    """The block set of requests that name none, e.g. one `blocklab plan` recommended (default: all);
    checked against the model at start, reported in /info."""
    metrics_public: bool = False
    """Serve /metrics without the API key (for a Prometheus that cannot send one)."""

    @property
    def prompts_per_request(self) -> int:
        """``max_prompts_per_request``, or its default: a quarter of ``max_in_flight``."""
        if self.max_prompts_per_request is not None:
            return self.max_prompts_per_request
        return max(1, self.max_in_flight // 4)

    def check(self) -> None:
        """UserError saying what is wrong with these settings, if anything is."""
        if self.dtype in QUANTIZED_DTYPES and self.accelerator not in ("auto", "cpu"):
            raise UserError(f"--dtype {self.dtype} runs on the CPU: use --accelerator cpu (or auto)")
        missing = missing_accelerator(self.accelerator)  # LitServe would start no worker and wait for ever
        if missing is not None:
            raise UserError(f"--accelerator {self.accelerator}: {missing}")
        require_kernels(self.dtype)  # before any worker starts: the workers would fail one by one
        if any(length < 1 for length in self.warm_up):
            raise UserError("--warm-up: request lengths of at least 1")
        if min(self.max_batch_size, self.prefill_chunk, self.prefill_per_step) < 1:
            raise UserError("--max-batch-size, --prefill-chunk and --prefill-per-step must be at least 1")
        if not 0 <= self.prompt_cache_mb < float("inf"):
            raise UserError(f"--prompt-cache-mb: a number of MiB, at least 0, got {self.prompt_cache_mb}")
        for name in (
            "queue_timeout",
            "request_timeout",
            "drain_timeout",
            "read_timeout",
            "keep_alive_timeout",
        ):
            if not 0 < getattr(self, name) < float("inf"):
                raise UserError(f"--{name.replace('_', '-')} must be a positive number of seconds")
        for name in ("max_connections", "backlog", "max_in_flight", "workers", "max_payload_bytes"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1")
        if self.threads is not None and self.threads < 1:
            raise UserError("--threads must be at least 1 (or left out: chosen from the free cores)")
        if not 0 <= self.port <= 65535:  # the OS takes the port modulo 2**16: another one than asked
            raise UserError(f"--port must be in 0..65535 (0: any free port), got {self.port}")
        if not 1 <= self.prompts_per_request <= self.max_in_flight:
            raise UserError(
                f"--max-prompts-per-request must be in 1..--max-in-flight ({self.max_in_flight}), "
                f"got {self.prompts_per_request}"
            )


def blocklab_version() -> str:
    """``git describe`` of the checkout this runs from, else the installed package's version."""
    root = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return metadata.version("blocklab")


@dataclass
class Server:
    """What ``build`` makes: the pool of workers, the front end over it, and the app."""

    pool: LitServePool
    front: http_front.Front
    app: FastAPI


def build(config: ServeConfig, model_factory: ModelFactory | None = None) -> Server:
    """The server for ``config``, nothing started; ``model_factory`` (tests) replaces loading
    ``config.model``."""
    worker = Worker(
        model_factory or WeightsLoader(config.model, config.dtype, config.compile),
        SharedState(config.max_in_flight),
        max_batch_size=config.max_batch_size,
        batch_timeout=config.batch_timeout,
        queue_timeout=config.queue_timeout,
        prefill_chunk=config.prefill_chunk,
        prefill_per_step=config.prefill_per_step,
        prefill_lane=config.prefill_lane,
        prompt_cache_bytes=int(config.prompt_cache_mb * 2**20),
        batch_invariant=config.batch_invariant,
        warm_up=config.warm_up if config.compile else (),
        warm_up_blocks=config.default_blocks,
        threads=config.threads,
        max_threads=max(1, len(allowed_cores()) // config.workers),
    )
    accelerator = "cpu" if config.dtype in QUANTIZED_DTYPES else config.accelerator  # CPU kernels
    pool = LitServePool(
        worker, accelerator=accelerator, workers_per_device=config.workers, queue_timeout=config.queue_timeout
    )
    front = http_front.Front(
        pool,
        request_timeout=config.request_timeout,
        default_blocks=config.default_blocks,
        max_prompts=config.prompts_per_request,
        metrics=Metrics(model_name=config.model),
        model_name=config.model,
    )
    return Server(pool, front, build_app(front, config))


def build_app(front: http_front.Front, config: ServeConfig) -> FastAPI:
    """The app over ``front``, every route registered on it; the pool's events flow while it runs."""
    app = FastAPI(title="blocklab", lifespan=lambda app: front.pool.running())
    app.add_exception_handler(RequestValidationError, http_front.validation_error)
    app.add_exception_handler(StarletteHTTPException, http_front.http_error)
    metadata = {
        "name": config.model,
        "dtype": config.dtype,
        "blocklab_version": blocklab_version(),
        "default_blocks": config.default_blocks or "all",
    }
    server_info = {"timeout": config.queue_timeout, "max_payload_size": config.max_payload_bytes}
    http_front.register(app, front, model_name=config.model, metadata=metadata, server_info=server_info)
    openai_compat.register(app, front, model_name=config.model, responses=http_front.ERROR_RESPONSES)
    app.add_middleware(
        http_front.BodyLimitMiddleware, max_bytes=config.max_payload_bytes, metrics=front.metrics
    )
    if config.api_key is not None:  # before routing, the size limit and the body
        public = frozenset({http_front.METRICS_PATH} if config.metrics_public else ())
        app.add_middleware(http_front.ApiKeyMiddleware, api_key=config.api_key, also_public=public)
    # outermost: every answer is timed, refusals included
    app.add_middleware(http_front.HttpMetricsMiddleware, metrics=front.metrics, routes=app.routes)
    return app


def _check_default_blocks(config: ServeConfig, limits: ModelLimits) -> None:
    """Checked once against the loaded model: a bad default stops the server, not every request."""
    if config.default_blocks is None:
        return
    try:
        default = BlockSet.parse(config.default_blocks, limits.n_layer)
    except ValueError as error:
        raise RuntimeError(f"--default-blocks {config.default_blocks}: {error}") from None
    try:  # what a request's block set is checked against (its probe, its lens, the lens's ranking)
        check_model_has(default, replace(limits, model_name=config.model), in_spec=True)
    except RequestError as error:
        raise RuntimeError(f"--default-blocks {config.default_blocks}: {error.message}") from None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve(config: ServeConfig, model_factory: ModelFactory | None = None) -> None:
    """Run until SIGTERM or SIGINT; then drain and stop everything this started."""
    # Until uvicorn runs (loading the model) and after it returns (it re-raises the signal it
    # caught), SIGTERM ends the process the way Ctrl-C does: through the cleanup below.
    signal.signal(signal.SIGTERM, _interrupt)
    server = build(config, model_factory)
    try:
        server.pool.start()
        _check_default_blocks(config, server.pool.limits())
        logger.info("serving %s: %s", config.model, server.pool.model_info())
        # timed and counted as the app's own answers are
        overloaded = http_front.HttpMetricsMiddleware(
            http_front.Overloaded(config.max_connections, server.front.metrics),
            metrics=server.front.metrics,
            routes=server.app.routes,
        )
        uvicorn.Server(
            uvicorn.Config(
                server.app,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                timeout_graceful_shutdown=config.drain_timeout,
                # uvicorn's httptools protocol with a deadline on every connection (uvicorn has
                # none for a request's arrival), a bound on the headers (httptools has none) and
                # the connection limit answered in the API's own shape (serve.connections).
                http=functools.partial(
                    DeadlineProtocol,
                    read_timeout=config.read_timeout,
                    max_header_bytes=MAX_HEADER_BYTES,
                    max_connections=config.max_connections,
                    overloaded=overloaded,
                ),
                timeout_keep_alive=config.keep_alive_timeout,
                backlog=config.backlog,
            )
        ).run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        server.pool.stop()


def options(argv: list[str]) -> ServeConfig:
    """``blocklab serve``'s flags (``ServeConfig``'s fields) as a config, checked."""
    description = "Serve a model over HTTP; each request picks its block set. See docs/serving.md."
    config = flags.parse(ServeConfig, argv, prog="blocklab serve", description=description)
    config.check()
    return config


def check_port_free(host: str, port: int) -> None:
    """UserError if ``host:port`` cannot be bound now, as uvicorn would find only once every worker had
    loaded the model (a second server on the same port, say). Port 0 (any free port) always can."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind((host, port))
        except OSError as error:
            reason = error.strerror or str(error)
            raise UserError(
                f"--host {host} --port {port}: {reason} (stop what listens there, or --port 0)"
            ) from None


def main(argv: list[str], model_factory: ModelFactory | None = None) -> int:
    config = options(argv[1:])
    if config.api_key is None:
        config = replace(config, api_key=os.environ.get(key_rule.ENV_VAR))
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    key_rule.warn_if_open(config.host, config.api_key, logger)
    check_port_free(config.host, config.port)  # before the workers load the model, not after
    if model_factory is None:  # a missing model fails here in one line, not in every worker
        locate(config.model)
    yield_while_waiting()  # for the workers, which import torch after this (lab.cli did it for blocklab)
    try:
        serve(config, model_factory)
    except KeyboardInterrupt:
        logger.info("stopped")
    except RuntimeError as error:  # a worker could not load the model; its traceback is logged above
        logger.error("%s", error)
        return 1
    return 0
