"""The live run's services through the dashboard's own origin: `GET /api/{trainer|evaluator|feedback}/{path}` is
forwarded to that service (`CommonSettings.service_url`), so the page makes every call to its own origin (no CORS,
one address to publish). Read-only: GET only, nothing but the path and the query string is forwarded (no
headers, no token). A service that does not answer gives 502 naming it.
"""
from __future__ import annotations

from typing import Literal

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from shared.config import CommonSettings

TIMEOUT_S = 10.0


def create_router(settings: CommonSettings) -> APIRouter:
    router = APIRouter(tags=["live"])

    @router.get("/api/{service}/{path:path}", summary="GET a live service's endpoint")
    async def forward(service: Literal["trainer", "evaluator", "feedback"], path: str, request: Request) -> Response:
        url = f"{settings.service_url(service)}/{path}"
        try:
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
                r = await client.get(url, params=request.query_params)
        except httpx.HTTPError as exc:
            return JSONResponse({"detail": f"{service} unreachable at {settings.service_url(service)}: "
                                           f"{type(exc).__name__}"}, status_code=502)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type", "application/json"),
                        headers={"Cache-Control": "no-store"})

    return router
