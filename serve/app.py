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
leaves the HTTP thread running after shutdown and ignores SIGTERM. uvicorn's own graceful shutdown
drains on SIGTERM or Ctrl-C (requests in flight finish, new connections are refused), then the
workers and LitServe's manager are stopped: no process is left behind.
"""

import argparse
import ipaddress
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import litserve as ls
import uvicorn
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from litserve.server import no_auth
from litserve.utils import WorkerSetupStatus
from starlette.exceptions import HTTPException as StarletteHTTPException

from lab.blocks import BlockSet
from lab.quantize import WEIGHT_DTYPES
from serve import gateway, openai_compat
from serve.api import BlockLabAPI, ModelFactory, SharedState, WeightsLoader
from serve.schema import ModelLimits, PredictResponse

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
    """Most requests one worker runs together; those with the same block set share forward passes."""
    batch_timeout: float = 0.0
    """Seconds a worker waits for a batch to fill after its first request (0: take what is queued)."""
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
    log_level: str = "info"
    default_blocks: str | None = None
    """The block set of requests that name none, e.g. one ``blocklab plan`` recommended (None: all)."""


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


class _SnapshotDict(dict):
    """LitServe's response buffer, whose ``items()`` is a copy: LitServe's worker monitor iterates it
    in its own thread while requests finish (and leave it) in the event loop's; a live view there
    raises "dictionary changed size during iteration", which kills the monitor for good."""

    def items(self):
        return list(super().items())


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


class BlockLabServer(ls.LitServer):
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
                "default_blocks": config.default_blocks or "all",
            },
        )
        workers = len(self._inference_workers_config_for_api(api.api_path))
        if workers > SharedState.MAX_WORKERS:
            raise ValueError(f"{workers} workers: at most {SharedState.MAX_WORKERS} are supported")
        self.response_buffer = _SnapshotDict()
        self.monitor_internal = 0.5  # seconds between checks for dead workers (LitServe's default: 2)
        self.app.add_exception_handler(RequestValidationError, gateway.validation_error)
        self.app.add_exception_handler(StarletteHTTPException, gateway.http_error)
        self.app.add_api_route("/stats", self._stats, methods=["GET"], summary="Counters and memory")
        if config.api_key is not None:  # outermost: before routing, the size limit and the body
            self.app.add_middleware(gateway.ApiKeyMiddleware, api_key=config.api_key)

    def setup_auth(self, lit_api: BlockLabAPI | None = None):
        """No per-route check: ``gateway.ApiKeyMiddleware`` guards every route (LitServe would
        otherwise add its own, X-API-Key only, when $LIT_SERVER_API_KEY is set)."""
        return no_auth

    async def _stats(self) -> dict:
        """Requests in flight and admitted, the workers' counters, and resident memory in bytes."""
        workers = [worker.pid for worker in self.inference_workers]
        return {
            **self.gateway.stats(),
            "rss_bytes": {"server": _rss_bytes(os.getpid()), "workers": [_rss_bytes(pid) for pid in workers]},
        }

    def _register_api_endpoints(self, lit_api: BlockLabAPI, request_type, response_type) -> None:
        """Our routes instead of LitServe's handler; ``request_type`` is decode_request's annotation."""
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
    shared = SharedState(config.max_in_flight, config.default_blocks)
    api = BlockLabAPI(
        model_factory or WeightsLoader(config.model, config.dtype),
        shared,
        max_batch_size=config.max_batch_size,
        batch_timeout=config.batch_timeout,
        threads=config.threads or max(1, ((os.cpu_count() or 1) - 1) // config.workers),
    )
    return BlockLabServer(api, config)


def _wait_for_workers(server: BlockLabServer) -> None:
    """Until every worker has loaded the model; raise if one fails or dies trying."""
    while True:
        states = dict(server.workers_setup_status)
        if states and all(state == WorkerSetupStatus.READY for state in states.values()):
            return
        if any(state == WorkerSetupStatus.ERROR for state in states.values()):
            raise RuntimeError("a worker failed to load the model (its traceback is above)")
        if any(not worker.is_alive() for worker in server.inference_workers):
            raise RuntimeError("a worker died while loading the model")
        time.sleep(0.05)


def _check_default_blocks(config: ServeConfig, limits: ModelLimits) -> None:
    """Checked once against the loaded model: a bad default stops the server, not every request."""
    if config.default_blocks is None:
        return
    try:
        default = BlockSet.parse(config.default_blocks, limits.n_layer)
    except ValueError as error:
        raise RuntimeError(f"--default-blocks {config.default_blocks}: {error}") from None
    if default.adaptive_check == "probe" and not limits.exit_probe:
        raise RuntimeError(f"--default-blocks {config.default_blocks}: check=probe needs an exit probe")


def _stop(server: BlockLabServer, manager) -> None:
    """Stop the worker monitor first (else it restarts the workers we stop), then workers and manager."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)  # a second signal must not cut the cleanup short
    try:
        server._shutdown_event.set()
    except OSError:  # the manager is gone already (killed from outside): nothing to tell
        logger.warning("LitServe's manager process died before shutdown")
    for thread in threading.enumerate():
        if thread.name == "litserve-monitoring":
            thread.join(timeout=5)
    for worker in server.inference_workers:  # they ignore SIGTERM (see BlockLabAPI.setup)
        worker.kill()
        worker.join(timeout=5)
    server._perform_graceful_shutdown(manager, {}, "normal")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def serve(config: ServeConfig, model_factory: ModelFactory | None = None) -> None:
    """Run until SIGTERM or SIGINT; then drain and stop everything this started."""
    # Until uvicorn runs (loading the model) and after it returns (it re-raises the signal it
    # caught), SIGTERM ends the process the way Ctrl-C does: through the cleanup below.
    signal.signal(signal.SIGTERM, _interrupt)
    server = build_server(config, model_factory)
    api = server.lit_api
    server.inference_workers = []
    # LitServe's manager process holds the queues every request goes through. Forked while SIGTERM
    # is ignored, it keeps that disposition, so a SIGTERM sent to the whole process group (``timeout``,
    # some supervisors) reaches only this process, which then drains; SIGINT it ignores itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    manager = server._init_manager(1)
    signal.signal(signal.SIGTERM, _interrupt)
    server.app.response_queue_id = 0
    try:
        server.inference_workers = server.launch_inference_worker(api)
        _wait_for_workers(server)
        _check_default_blocks(config, api.shared.limits())
        server.model_metadata.update(api.shared.model_info())
        server._start_worker_monitoring(manager, {})
        logger.info("serving %s: %s", config.model, server.model_metadata)
        uvicorn.Server(
            uvicorn.Config(
                server.app,
                host=config.host,
                port=config.port,
                log_level=config.log_level,
                timeout_graceful_shutdown=config.drain_timeout,
                # h11, not httptools: httptools takes headers of any size (20 MB were accepted), h11
                # answers 400 once the request line and headers pass this many bytes.
                http="h11",
                h11_max_incomplete_event_size=MAX_HEADER_BYTES,
            )
        ).run()
    finally:
        _stop(server, manager)


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
        help="seconds a worker waits for its batch to fill (default 0: take what is queued)",
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
        "--default-blocks",
        default=d.default_blocks,
        help="block set of requests that name none (default: all)",
    )
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
    for name in ("queue_timeout", "request_timeout", "drain_timeout"):
        if not 0 < getattr(config, name) < float("inf"):
            parser.error(f"--{name.replace('_', '-')} must be a positive number of seconds")
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    if not _is_loopback(config.host) and config.api_key is None:
        logger.warning("binding %s without --api-key: anyone who can reach it can use it", config.host)
    try:
        serve(config, model_factory)
    except KeyboardInterrupt:
        logger.info("stopped")
    except RuntimeError as error:  # a worker could not load the model; its traceback is logged above
        logger.error("%s", error)
        return 1
    return 0
