"""blocklab explore: the Block, its parameters, the bus, ablation and the latency/loss frontier on one
local page, computed live on your model and text.

    blocklab explore                                   # the builtin model (shipped)
    blocklab explore --model gpt2-random --text notes.txt --port 8001
    blocklab explore --host 0.0.0.0 --api-key KEY      # reachable from elsewhere: with a key

The page (``static/``) is served from the package and asks nothing of any other server; each view's
numbers are the JSON its measurement command prints (``lab.explore.reports``), fetched from
``/api/...``. Binding anything but loopback follows ``blocklab serve``'s rule: give ``--api-key`` (or
set ``LIT_SERVER_API_KEY``), or be warned that anyone who can reach the port can use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

from lab import flags
from lab.analysis.common import default_model_spec
from lab.api_key import ENV_VAR, ApiKeyMiddleware, warn_if_open
from lab.errors import UserError
from lab.explore.reports import DEPTH_DEFAULTS, T_MAX, Explorer

logger = logging.getLogger("blocklab.explore")

STATIC = Path(__file__).parent / "static"
PUBLIC_PREFIXES = ("/static/",)
PUBLIC_PATHS = frozenset({"/", "/favicon.ico"})
SECURITY_HEADERS = {
    # The browser itself refuses any request to another origin: no CDN, font or tracker can slip in.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def is_public(path: str) -> bool:
    """The page itself holds no data (every number is behind ``/api/``): it answers without the key."""
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


async def off_the_loop(compute: Callable[[], dict]) -> dict:
    """``compute()`` in a daemon thread of its own, for the views that run a model: the server answers
    meanwhile, and stopping it does not wait for a view still being computed (an ablation of a large
    model takes minutes; Python waits for a thread pool's threads at exit)."""
    loop = asyncio.get_running_loop()
    answer = loop.create_future()

    def settle(set_outcome: Callable, outcome) -> None:
        if not answer.done():  # else the request was given up meanwhile (its client left)
            set_outcome(outcome)

    def work() -> None:
        try:
            outcome = (answer.set_result, compute())
        except Exception as error:  # a UserError becomes the 422 the handler writes
            outcome = (answer.set_exception, error)
        with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped meanwhile
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=work, daemon=True, name="blocklab-explore-view").start()
    return await answer


def create_app(explorer: Explorer, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="blocklab explore", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, public=is_public)

    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    @app.exception_handler(UserError)
    async def user_error(_request: Request, error: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(error)}, status_code=422)

    @app.get("/", include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    # Plain functions (the quick views): FastAPI runs them in its thread pool.
    @app.get("/api/info")
    def info() -> dict:
        return explorer.info()

    @app.get("/api/block")
    def block(T: Annotated[int, Query(ge=1, le=T_MAX)]) -> dict:
        return explorer.block_view(T)

    @app.get("/api/params")
    def params() -> dict:
        return explorer.params_view()

    @app.get("/api/bus")
    async def bus() -> dict:
        return await off_the_loop(explorer.bus_view)

    @app.get("/api/ablate")
    async def ablate() -> dict:
        return await off_the_loop(explorer.ablate_view)

    @app.get("/api/depth")
    async def depth(
        stacks: Annotated[list[str], Query(min_length=1, max_length=8)] = DEPTH_DEFAULTS["stacks"],
        baseline: str = DEPTH_DEFAULTS["baseline"],
        new: Annotated[int, Query(ge=2, le=512)] = DEPTH_DEFAULTS["new"],
        repeats: Annotated[int, Query(ge=1, le=20)] = DEPTH_DEFAULTS["repeats"],
    ) -> dict:
        return await off_the_loop(lambda: explorer.depth_view(stacks, baseline, new, repeats))

    return app


# ---------------------------------------------------------------------------------------------------
# The command


@dataclass
class ExploreConfig:
    """Everything ``blocklab explore`` takes; each field is a command-line option of the same name."""

    model: str | None = None
    """builtin | gpt2-random | Hugging Face id | local dir | checkpoint (default: builtin, shipped)."""
    text: Path | None = None
    """UTF-8 text for the bus and ablation views (default: standard-library source the builtin model
    never trained on)."""
    host: str = "127.0.0.1"
    """Address to bind; loopback unless you mean otherwise (then give --api-key)."""
    port: int = 8001
    """Port to bind (0: any free one; the address printed names it)."""
    api_key: str | None = None
    """Require this key (X-API-Key or Authorization: Bearer) for the page's data (default:
    $LIT_SERVER_API_KEY); the page asks for it."""


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (IPv4 or IPv6, as the host resolves), bound before the
    address is printed, so the address printed answers."""
    try:
        family, *_, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        return socket.create_server(address, family=family)
    except OSError as error:  # unknown host, address in use, port below 1024 without the right
        raise UserError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def parse(argv: list[str]) -> ExploreConfig:
    """``ExploreConfig`` from the command line (``lab.flags``: spelled as blocklab serve's)."""
    description = "The Block, parameters, bus, ablation and frontier as one local page."
    config = flags.parse(ExploreConfig, argv, "blocklab explore", description)
    if config.api_key is None:  # read here, not as the flag's default, which --help would print
        config.api_key = os.environ.get(ENV_VAR)
    return config


def main(argv: list[str]) -> int:
    config = parse(argv[1:])
    from lab.weights import load_model  # after parsing: --help stays quick

    logging.basicConfig(level="INFO", format="%(name)s %(levelname)s %(message)s")
    warn_if_open(config.host, config.api_key, logger)
    spec = config.model or default_model_spec()
    print(f"blocklab explore: loading {spec} ...", file=sys.stderr, flush=True)
    explorer = Explorer(load_model(spec), spec, config.text)
    sock = bind(config.host, config.port)
    host = f"[{config.host}]" if ":" in config.host else config.host
    print(f"blocklab explore: http://{host}:{sock.getsockname()[1]}/  (Ctrl-C to stop)", flush=True)
    if config.api_key:
        print("blocklab explore: the page asks for the API key (or add #key=KEY to the address)", flush=True)
    app = create_app(explorer, config.api_key)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    server.run(sockets=[sock])  # until Ctrl-C or SIGTERM
    return 0
