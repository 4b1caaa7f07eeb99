"""FastAPI dependencies: what a route needs from the app state, checked once."""

from __future__ import annotations

from fastapi import Request

from ragspeed.gateway.errors import APIError
from ragspeed.gateway.pipeline import Pipeline


def ready_pipeline(request: Request) -> Pipeline:
    state = request.app.state
    if state.engine_error is not None:
        raise APIError(503, f"the engine failed to start: {state.engine_error}", code="engine_failed")
    if not state.engine_ready:
        raise APIError(503, "the engine is still loading; retry shortly", code="engine_not_ready",
                       headers={"Retry-After": "2"})
    return state.pipeline
