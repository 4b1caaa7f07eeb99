"""Health and metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from ragspeed.gateway.dependencies import app_state
from ragspeed.gateway.state import AppState

router = APIRouter()


@router.get("/healthz")
async def healthz(state: AppState = Depends(app_state)):
    if state.engine_error is not None:
        return JSONResponse({"status": "failed", "error": state.engine_error}, status_code=503)
    if not state.ready:
        return JSONResponse({"status": "loading"}, status_code=503, headers={"Retry-After": "2"})
    return {
        "status": "ok",
        "model": state.settings.model_id,
        "engine": state.settings.engine.backend,
        # What start-up loaded (gateway.app): the compressors offered, retrieval's embedder.
        "compressors": list(state.compression.loaded_methods) if state.compression else [],
        "retrieval": state.retrieval.loaded,
    }


@router.get("/metrics")
async def metrics(state: AppState = Depends(app_state)):
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
