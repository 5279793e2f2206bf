"""The FastAPI application: routes, the chat page, error handlers, the guard; and `serve`."""

from __future__ import annotations

import logging
from importlib import resources
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp

from hetmoe.server.anthropic_api import router as anthropic_router
from hetmoe.server.api import router
from hetmoe.server.config import ServerConfig
from hetmoe.server.errors import APIError, error_response
from hetmoe.server.guard import LOOPBACK_HOSTS, Guard
from hetmoe.server.metrics import Metrics
from hetmoe.server.service import ModelService
from hetmoe.server.tokenize_api import router as tokenize_router

if TYPE_CHECKING:
    from hetmoe.engine.engine import LLM

log = logging.getLogger("hetmoe.server")

# The only files the server ever sends: fixed names read from the package, never client paths.
_PAGE_FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/static/app.js": ("app.js", "text/javascript; charset=utf-8"),
    "/static/style.css": ("style.css", "text/css; charset=utf-8"),
}


def build_app(service: ModelService, config: ServerConfig) -> ASGIApp:
    """The ASGI app serving `service` under `config` (key, body limit)."""
    app = FastAPI(title="hetmoe", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = service
    app.state.metrics = metrics = Metrics()
    app.include_router(router)
    app.include_router(anthropic_router)
    app.include_router(tokenize_router)
    _add_page(app)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return exc.response(request.url.path)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("request failed")  # the server keeps serving; the client gets a 500
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}",
                              path=request.url.path)

    loopback = config.host in LOOPBACK_HOSTS
    return Guard(
        app,
        api_key=config.api_key,
        max_body_bytes=config.max_body_bytes,
        metrics=metrics,
        allowed_hosts=LOOPBACK_HOSTS if loopback else None,
    )


def _add_page(app: FastAPI) -> None:
    static = resources.files("hetmoe.server") / "static"
    for route, (name, media_type) in _PAGE_FILES.items():
        page = _page_route((static / name).read_bytes(), media_type)
        app.add_api_route(route, page, methods=["GET"], response_class=HTMLResponse)


def _page_route(content: bytes, media_type: str) -> Any:
    async def page() -> Response:
        return Response(content, media_type=media_type)

    return page


def serve(llm: LLM, name: str, config: ServerConfig) -> None:
    """Serves `llm` as model `name` with uvicorn until interrupted."""
    if config.api_key is None and config.host not in LOOPBACK_HOSTS:
        log.warning("serving on %s without an API key: whoever reaches it may use it", config.host)
    service = ModelService(llm, name, config.max_queue)
    try:
        uvicorn.run(
            build_app(service, config),
            host=config.host,
            port=config.port,
            log_level="info",
            lifespan="off",  # no startup work; the model is loaded before the socket opens
            timeout_graceful_shutdown=5,
        )
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    finally:
        service.close()
