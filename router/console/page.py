"""The console at `/`: a chat playground streaming from /v1/chat/completions, and a live view
of the stack (its workers, the KV store, the last requests phase by phase, TTFT and
inter-token latency over the last minutes).

Plain HTML, CSS and JavaScript from router/console/static/ (no build step, nothing fetched from
elsewhere: the page calls this origin only); the page polls `GET /console/stack` every
second. The page and its files are open; the chat needs an API key where `--api-keys` asks
for one (the page asks for it), and the stack view the admin key where one is set, else an
API key where those are set, else nothing.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from router.errors import APIError
from router.state import RouterState, bearer

if TYPE_CHECKING:
    from router.workers.registry import WorkerState

routes = APIRouter()
STATIC = Path(__file__).parent / "static"
ASSETS = {"console.js": "text/javascript", "console.css": "text/css"}


@routes.get("/", include_in_schema=False)
async def page() -> FileResponse:
    return FileResponse(
        STATIC / "console.html", media_type="text/html", headers={"Cache-Control": "no-cache"}
    )


@routes.get("/console/static/{name}", include_in_schema=False)
async def asset(name: str) -> FileResponse:
    if name not in ASSETS:
        raise APIError(404, f"no console file {name!r}", None, "not_found")
    return FileResponse(
        STATIC / name, media_type=ASSETS[name], headers={"Cache-Control": "no-cache"}
    )


@routes.get("/console/stack")
async def stack(request: Request) -> dict[str, Any]:
    """What the stack view shows, now."""
    state: RouterState = request.app.state.router
    _check_key(request, state)
    workers = state.registry.of("prefill") + state.registry.of("decode")
    encoders = state.registry.of("encode")
    now = time.time()
    return {
        "model": state.model_id,
        "colocated": state.colocated,
        "reads_images": state.model.vision is not None,
        "time": round(now, 3),
        "workers": [_worker(w) for w in (*workers, *encoders)],
        "store": state.store_rates.sample(now, workers),
        "requests": list(state.recent.requests),
        "latency": state.recent.latency(),
    }


def _check_key(request: Request, state: RouterState) -> None:
    key, admin, keys = bearer(request), state.config.admin_key, state.config.api_keys
    if admin is not None and key != admin:
        raise APIError(401, "the stack view needs the admin key", None, "invalid_api_key")
    if admin is None and keys and key not in keys:
        raise APIError(401, "the stack view needs an API key", None, "invalid_api_key")


def _worker(w: WorkerState) -> dict[str, Any]:
    load = w.load
    return {
        "role": w.role,
        "address": w.address,
        "healthy": w.healthy,
        "available": w.available,
        "refused": w.refused,
        "running": load.running,
        "waiting": load.waiting,
        "inflight": w.inflight,
        "blocks_used": load.referenced_blocks,
        "blocks_cached": load.cached_blocks,
        "blocks_total": load.total_blocks,
        "images_encoded": load.images_encoded,
        "images_from_store": load.images_from_store,
        "exact_hit_tokens": load.prefix_hit_tokens,
        "approximate_tokens": load.approximate_tokens,
        "cached_chunks": load.cached_chunks,
        "chunks_from_store": load.chunks_from_store,
        "chunks_stored": load.chunks_stored,
    }
