"""Health and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

router = APIRouter()


@router.get("/healthz")
async def healthz(request: Request):
    state = request.app.state
    if state.engine_error is not None:
        return JSONResponse({"status": "failed", "error": state.engine_error}, status_code=503)
    if not state.engine_ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "2"})
    return {"status": "ok", "model": state.settings.model_id, "engine": state.settings.engine}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
