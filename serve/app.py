"""``blocklab serve``: one LitAPI behind LitServe, with a block set chosen per request.

    blocklab serve --model builtin --port 8000
    curl -s localhost:8000/predict -H 'Content-Type: application/json' \\
        -d '{"prompt": "def main(", "max_new_tokens": 20, "blocks": "skip=5", "score": true}'

Routes: ``POST /predict`` (``serve.schema``), ``POST /v1/completions`` and ``/v1/chat/completions``
and ``GET /v1/models`` (OpenAI-compatible, ``serve.openai_compat``), LitServe's ``GET /health`` and
``GET /info``, ``GET /stats`` (counters and memory), and ``/docs`` + ``/openapi.json``. With an API
key, every route but ``gateway.PUBLIC_PATHS`` (health and the schema) needs it.

How it runs: LitServe's parts (request queue, response buffer, inference workers, worker monitor
with ``restart_workers``) with uvicorn in the main thread, as LitServe's ``api_server_worker_type=
"thread"`` does, so a dead worker's requests are failed at once; not ``LitServer.run`` itself, which
leaves the HTTP thread running after shutdown and ignores SIGTERM. Every use of LitServe's internals
is in ``serve.litserve_seam``. uvicorn's own graceful shutdown
drains on SIGTERM or Ctrl-C (requests in flight finish, new connections are refused), then the
workers and LitServe's manager are stopped: no process is left behind.
"""

import argparse
import functools
import ipaddress
import logging
import os
import signal
import subprocess
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import uvicorn
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lab.quantize import WEIGHT_DTYPES
from lab.weights import locate
from serve import gateway, openai_compat
from serve.api import BlockLabAPI, ModelFactory, SharedState, WeightsLoader
from serve.connections import ReadDeadlineH11Protocol
from serve.litserve_seam import SeamServer
from serve.schema import PredictResponse

logger = logging.getLogger("blocklab.serve")


MAX_HEADER_BYTES = 32 * 1024
"""The request line and headers together (nginx's default buffers hold 32 kB); past it, 400."""


@dataclass
class ServeConfig:
    """Everything ``blocklab serve`` takes; each field is a command-line option of the same name."""

    model: str = "builtin"
    """builtin | gpt2-random | Hugging Face id | local dir | checkpoint file (lab.weights)."""
    host: str = "127.0.0.1"
    """Address to bind; loopback unless you mean otherwise."""
    port: int = 8000
    api_key: str | None = None
    """Require this key (X-API-Key or Authorization: Bearer) on every route but /health and the docs."""
    dtype: str = "float32"
    """float32 | bfloat16 | float16 weights, or int8 | int4 weight-only quantized (CPU, lab.quantize)."""
    accelerator: str = "auto"
    """auto | cpu | cuda | mps (LitServe's)."""
    workers: int = 1
    """Inference workers per device, each with its own copy of the model."""
    threads: int | None = None
    """torch threads per worker (default: the cores but one, for the HTTP side, divided among the workers).

    Too many hurts far more than too few: torch's threads spin while they wait, so on a busy 2-core
    machine a GPT-2 step took 830 ms with 2 threads against 80 ms with 1."""
    max_batch_size: int = 8
    """Most requests one worker runs together (rows of every block set share each decode step)."""
    batch_timeout: float = 0.0
    """Seconds an idle worker waits for company after a request arrives (0: start at once)."""
    prefill_chunk: int = 64
    """Prompt tokens per prefill pass; running rows wait about one such pass per step."""
    batch_invariant: bool = True
    """Each row's logits bit for bit those it gets alone (``lab.model.rows_alone``); off: faster
    matrix-matrix steps with many rows, equal up to rounding."""
    max_in_flight: int = 64
    """Most requests admitted at once (queued or running); past it, 429 with Retry-After."""
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
    """Open connections past which a request gets 503 (uvicorn's limit_concurrency)."""
    backlog: int = 2048
    """Connections the kernel queues before the server accepts them."""
    log_level: str = "info"


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


ERROR_RESPONSES = {
    400: {"description": "The body is not parseable (not UTF-8, or JSON nested too deep)"},
    401: {"description": "Missing or wrong API key"},
    413: {"description": "Body over --max-payload-bytes"},
    422: {"description": "Invalid request, naming the field"},
    429: {"description": "--max-in-flight requests in flight; retry after Retry-After seconds"},
    500: {"description": "The request's processing raised; the message says what"},
    503: {"description": "The model is loading, or the worker running the request died"},
    504: {"description": "Queue timeout, or --request-timeout reached"},
}
"""What the model routes answer besides 200, for the OpenAPI schema."""


def _rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (Linux /proc); None where it cannot be read."""
    try:
        resident_pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class BlockLabServer(SeamServer):
    """A LitServer whose model routes go through ``serve.gateway`` (see its docstring for why)."""

    def __init__(self, api: BlockLabAPI, config: ServeConfig):
        self.config = config
        # LitServer.__init__ registers the routes, which need the gateway.
        self.gateway = gateway.Gateway(
            self,
            api,
            max_in_flight=config.max_in_flight,
            queue_timeout=config.queue_timeout,
            request_timeout=config.request_timeout,
        )
        super().__init__(
            api,
            accelerator=config.accelerator,
            workers_per_device=config.workers,
            timeout=config.queue_timeout,
            max_payload_size=config.max_payload_bytes,  # an int: LitServe's string form breaks every request
            restart_workers=True,
            model_metadata={
                "name": config.model,
                "dtype": config.dtype,
                "blocklab_version": blocklab_version(),
            },
        )
        workers = self.worker_count(api)
        if workers > SharedState.MAX_WORKERS:
            raise ValueError(f"{workers} workers: at most {SharedState.MAX_WORKERS} are supported")
        self.app.add_exception_handler(RequestValidationError, gateway.validation_error)
        self.app.add_exception_handler(StarletteHTTPException, gateway.http_error)
        self.app.add_api_route("/stats", self._stats, methods=["GET"], summary="Counters and memory")
        if config.api_key is not None:  # outermost: before routing, the size limit and the body
            self.app.add_middleware(gateway.ApiKeyMiddleware, api_key=config.api_key)

    async def _stats(self) -> dict:
        """Requests in flight and admitted, the workers' counters, and resident memory in bytes."""
        workers = [worker.pid for worker in self.inference_workers]
        return {
            **self.gateway.stats(),
            "rss_bytes": {"server": _rss_bytes(os.getpid()), "workers": [_rss_bytes(pid) for pid in workers]},
        }

    def register_routes(self, lit_api: BlockLabAPI, request_type) -> None:
        """``/predict`` and the OpenAI routes; ``request_type`` is decode_request's annotation."""
        admitted = self.gateway

        async def predict(request: request_type, client: Request) -> Response:
            return await gateway.predict(admitted, request, client)

        self.app.add_api_route(
            lit_api.api_path,
            predict,
            methods=["POST"],
            response_model=None,
            responses={
                200: {"model": PredictResponse, "description": "The summary (NDJSON events if stream)"},
                **ERROR_RESPONSES,
            },
            summary="Generate and/or score under a block set",
        )
        openai_compat.register(self.app, admitted, model_name=self.config.model, responses=ERROR_RESPONSES)


def build_server(config: ServeConfig, model_factory: ModelFactory | None = None) -> BlockLabServer:
    """The server for ``config``; ``model_factory`` (tests) replaces loading ``config.model``."""
    shared = SharedState(config.max_in_flight)
    api = BlockLabAPI(
        model_factory or WeightsLoader(config.model, config.dtype),
        shared,
        max_batch_size=config.max_batch_size,
        batch_timeout=config.batch_timeout,
        prefill_chunk=config.prefill_chunk,
        batch_invariant=config.batch_invariant,
        threads=config.threads or max(1, ((os.cpu_count() or 1) - 1) // config.workers),
    )
    return BlockLabServer(api, config)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve(config: ServeConfig, model_factory: ModelFactory | None = None) -> None:
    """Run until SIGTERM or SIGINT; then drain and stop everything this started."""
    # Until uvicorn runs (loading the model) and after it returns (it re-raises the signal it
    # caught), SIGTERM ends the process the way Ctrl-C does: through the cleanup below.
    signal.signal(signal.SIGTERM, _interrupt)
    server = build_server(config, model_factory)
    api = server.lit_api
    # LitServe's manager process holds the queues every request goes through. Forked while SIGTERM
    # is ignored, it keeps that disposition, so a SIGTERM sent to the whole process group (``timeout``,
    # some supervisors) reaches only this process, which then drains; SIGINT it ignores itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    server.start_manager()
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        server.start_workers(api)
        server.model_metadata.update(api.shared.model_info())
        logger.info("serving %s: %s", config.model, server.model_metadata)
        uvicorn.Server(
            uvicorn.Config(
                server.app,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                timeout_graceful_shutdown=config.drain_timeout,
                # h11, not httptools: httptools takes headers of any size (20 MB were accepted), h11
                # answers 400 once the request line and headers pass this many bytes; with a
                # deadline on each request's arrival (uvicorn has none).
                http=functools.partial(ReadDeadlineH11Protocol, read_timeout=config.read_timeout),
                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
                timeout_keep_alive=config.keep_alive_timeout,
                limit_concurrency=config.max_connections,
                backlog=config.backlog,
            )
        ).run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
        server.stop()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blocklab serve",
        description="Serve a model over HTTP; each request picks its block set. See docs/serving.md.",
    )
    d = ServeConfig()
    add = parser.add_argument
    add("--model", default=d.model, help="builtin | gpt2-random | Hugging Face id | local dir | checkpoint")
    add("--host", default=d.host, help="address to bind (default: loopback)")
    add("--port", type=int, default=d.port)
    add(
        "--api-key",
        default=os.environ.get("LIT_SERVER_API_KEY"),
        help="require this key on every route but /health and the docs (default: $LIT_SERVER_API_KEY)",
    )
    add("--dtype", choices=WEIGHT_DTYPES, default=d.dtype, help="int8 / int4: weight-only, CPU")
    add("--accelerator", choices=["auto", "cpu", "cuda", "mps"], default=d.accelerator)
    add("--workers", type=int, default=d.workers, help="inference workers per device, each with a model copy")
    add(
        "--threads",
        type=int,
        default=d.threads,
        help="torch threads per worker (default: (cores - 1) / workers)",
    )
    add("--max-batch-size", type=int, default=d.max_batch_size, help="most requests a worker runs together")
    add(
        "--batch-timeout",
        type=float,
        default=d.batch_timeout,
        help="seconds an idle worker waits for company after a request arrives (default 0)",
    )
    add(
        "--prefill-chunk",
        type=int,
        default=d.prefill_chunk,
        help="prompt tokens per prefill pass; running rows wait about one such pass per step",
    )
    add(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=d.batch_invariant,
        help="each row computes exactly what it computes alone (default); --no-batch-invariant: "
        "faster shared products, equal up to rounding",
    )
    add("--max-in-flight", type=int, default=d.max_in_flight, help="most requests admitted at once; then 429")
    add("--queue-timeout", type=float, default=d.queue_timeout, help="seconds a request may wait; then 504")
    add(
        "--request-timeout",
        type=float,
        default=d.request_timeout,
        help="seconds a request may take in all; then it is stopped at its next step with 504",
    )
    add("--max-payload-bytes", type=int, default=d.max_payload_bytes, help="largest request body; then 413")
    add(
        "--drain-timeout",
        type=float,
        default=d.drain_timeout,
        help="on SIGTERM/SIGINT, seconds for requests in flight to finish",
    )
    add(
        "--read-timeout",
        type=float,
        default=d.read_timeout,
        help="seconds from a request's first byte for headers and body to arrive; then the connection closes",
    )
    add(
        "--keep-alive-timeout",
        type=float,
        default=d.keep_alive_timeout,
        help="seconds a connection may idle, new or between requests",
    )
    add("--max-connections", type=int, default=d.max_connections, help="open connections; past them, 503")
    add("--backlog", type=int, default=d.backlog, help="connections the kernel queues before accept")
    add("--log-level", choices=["critical", "error", "warning", "info", "debug"], default=d.log_level)
    return parser


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"


def main(argv: list[str], model_factory: ModelFactory | None = None) -> int:
    parser = _parser()
    config = ServeConfig(**vars(parser.parse_args(argv[1:])))
    if config.dtype in ("int8", "int4"):  # torch's weight-only kernels are CPU kernels
        if config.accelerator not in ("auto", "cpu"):
            parser.error(f"--dtype {config.dtype} runs on the CPU: use --accelerator cpu (or auto)")
        config = replace(config, accelerator="cpu")
    if config.max_batch_size < 1 or config.prefill_chunk < 1:
        parser.error("--max-batch-size and --prefill-chunk must be at least 1")
    for name in ("queue_timeout", "request_timeout", "drain_timeout", "read_timeout", "keep_alive_timeout"):
        if not 0 < getattr(config, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds")
    for name in ("max_connections", "backlog"):
        if getattr(config, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if not _is_loopback(config.host) and config.api_key is None:
        logger.warning("binding %s without --api-key: anyone who can reach it can use it", config.host)
    if model_factory is None:  # a missing model fails here in one line, not in every worker
        locate(config.model)
    try:
        serve(config, model_factory)
    except KeyboardInterrupt:
        logger.info("stopped")
    except RuntimeError as error:  # a worker could not load the model; its traceback is logged above
        logger.error("%s", error)
        return 1
    return 0
