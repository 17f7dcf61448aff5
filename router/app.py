"""The router's FastAPI application: middleware, the small endpoints, and wiring."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.body import read_model
from router.completions.api import routes, state_of
from router.completions.protocol import DetokenizeRequest, TokenizeRequest, WorkerChange
from router.console.page import routes as console_routes
from router.errors import APIError, bad_request, unavailable
from router.responses.api import routes as responses_routes
from router.state import RouterState, bearer, new_id
from services.settings import Settings
from services.tracing import RECEIVED

log = logging.getLogger("pdserve.router")
VERSION = "0.1.0"
OPEN_PATHS = {"/", "/health", "/version", "/metrics", "/openapi.json", "/docs", "/redoc"}


def create_app(settings: Settings, state: RouterState | None = None) -> FastAPI:
    """The app; `settings` checked (services.settings.check: secret files read)."""
    state = state or RouterState.create(settings)
    config = settings.router

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # channels belong to the serving loop: the configured workers are added here
        roles = (("prefill", config.prefill), ("decode", config.decode), ("encode", config.encode))
        for role, addresses in roles:
            for address in addresses:
                state.registry.configure(role, address)
        await state.registry.resolve()
        await state.registry.check_all()
        state.registry.start()
        yield
        await state.registry.stop()

    app = FastAPI(
        title="pdserve",
        version=VERSION,
        lifespan=lifespan,
        description="OpenAI-compatible API over disaggregated prefill and decode",
    )
    app.state.router = state
    app.include_router(routes)
    app.include_router(responses_routes)
    app.include_router(console_routes)
    app.add_middleware(Edge)
    app.add_exception_handler(APIError, _api_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    _small_endpoints(app, state)
    return app


class Edge:
    """The ASGI layer around every request: body size and API keys before any handler; any
    exception a handler lets out becomes a 500 in OpenAI's shape with a request id (logged
    with its traceback); every answer counted by endpoint and status. Plain ASGI, not
    BaseHTTPMiddleware: a streamed response goes straight to the client, and a client that
    goes away is seen by the stream at once (its work is cancelled)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[RECEIVED] = time.time_ns()  # where a request's trace starts
        request = Request(scope)
        state: RouterState = request.app.state.router
        status = 0

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            refusal = _refusal(request, state)
            if refusal is not None:
                await refusal.response()(scope, receive, counted)
            else:
                await self.app(scope, receive, counted)
        except Exception:
            rid = new_id("error")
            fields = {"request_id": rid, "path": request.url.path}
            log.exception("unhandled error", extra={"fields": fields})
            if not status:  # nothing sent yet: the client gets an answer it can parse
                error = APIError(
                    500,
                    f"Internal server error (request id {rid})",
                    None,
                    "internal_error",
                    {"X-Request-Id": rid},
                )
                await error.response()(scope, receive, counted)
        path = request.url.path
        # unknown paths share one label: a scanner's random URLs must not grow the series
        known = path in OPEN_PATHS or path in request.app.openapi()["paths"]  # openapi() caches
        state.metrics.requests.labels(path if known else "other", str(status or 500)).inc()


def _refusal(request: Request, state: RouterState) -> APIError | None:
    """413 for a body declared too large, 401 for a missing or wrong API key."""
    path = request.url.path
    try:
        length = int(request.headers.get("content-length") or 0)
    except ValueError:
        return bad_request("Content-Length is not a number")
    if length > state.config.max_body_bytes:
        return APIError(
            413,
            f"request body of {length} bytes exceeds {state.config.max_body_bytes}",
            None,
            "request_too_large",
        )
    keys = state.config.api_keys
    # the admin API and the console's stack view check their own keys (router/console/page.py)
    guarded = keys and path not in OPEN_PATHS and not path.startswith(("/admin", "/console/"))
    key = bearer(request)
    if guarded and key not in keys:
        why = "Incorrect API key provided" if key else "Missing API key (Authorization: Bearer)"
        return APIError(401, why, None, "invalid_api_key")
    return None


async def _api_error(request: Request, error: APIError) -> JSONResponse:
    return error.response()


async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """Routing's own errors (404 no such path, 405 wrong method) in OpenAI's shape too."""
    headers = dict(error.headers or {})
    return APIError(error.status_code, str(error.detail), None, None, headers).response()


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if p != "body") or None
    return bad_request(f"{param}: {first['msg']}", param).response()


def _small_endpoints(app: FastAPI, state: RouterState) -> None:
    @app.get("/health")
    async def health() -> dict[str, str]:
        roles = ("decode",) if state.colocated else ("prefill", "decode")
        if not all(state.registry.available(role) for role in roles):
            raise unavailable(f"no healthy {' and '.join(roles)} workers yet", retry_after=1)
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    def model_card() -> dict[str, Any]:
        return {
            "id": state.model_id,
            "object": "model",
            "created": state.started,
            "owned_by": "pdserve",
            "root": state.model_root,
            "max_model_len": state.model.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card()

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            state.metrics.render(state.registry).decode(), media_type="text/plain; version=0.0.4"
        )

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        req = await read_model(request, TokenizeRequest, state.config.max_body_bytes)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        if req.messages is not None:
            ids = state.tokenizer.encode_chat([m.as_template_input() for m in req.messages])
        else:
            ids = state.tokenizer.encode(req.prompt or "", req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.model.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        req = await read_model(request, DetokenizeRequest, state.config.max_body_bytes)
        state.check_model(req.model)
        if any(not 0 <= t < state.model.vocab_size for t in req.tokens):
            raise bad_request(f"token ids must be in [0, {state.model.vocab_size})", "tokens")
        return {"prompt": state.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def admin(request: Request) -> WorkerChange:
        if state.config.admin_key is None or bearer(request) != state.config.admin_key:
            raise APIError(401, "the admin API needs the admin key", None, "invalid_api_key")
        return await read_model(request, WorkerChange, state.config.max_body_bytes)

    @app.post("/admin/workers")
    async def add_worker(request: Request) -> dict[str, Any]:
        change = await admin(request)
        worker = state.registry.add(change.role, change.address)
        await state.registry.check_all()
        return {"role": worker.role, "address": worker.address, "healthy": worker.healthy}

    @app.delete("/admin/workers")
    async def remove_worker(request: Request) -> dict[str, Any]:
        change = await admin(request)
        if not await state.registry.remove(change.role, change.address):
            raise APIError(404, f"no {change.role} worker at {change.address}", "address")
        return {"removed": True, "at": time.time()}

    _ = (health, version, models, model, metrics, tokenize, detokenize, add_worker, remove_worker)
    _ = state_of
