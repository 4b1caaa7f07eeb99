"""FastAPI dependencies: what a route needs from the app's `AppState`, checked once."""

from __future__ import annotations

from fastapi import Request

from ragspeed.gateway.errors import APIError
from ragspeed.gateway.pipeline import Pipeline
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.retrieval_service import RetrievalService
from ragspeed.gateway.state import AppState


def app_state(request: Request) -> AppState:
    return request.app.state.services


def ready_state(request: Request) -> AppState:
    """The state once every service is loaded; 503 while loading or after a failed start."""
    state = app_state(request)
    if state.engine_error is not None:
        raise APIError(503, f"the engine failed to start: {state.engine_error}", code="engine_failed")
    if not state.ready:
        raise APIError(
            503,
            "the engine is still loading; retry shortly",
            code="engine_not_ready",
            headers={"Retry-After": "2"},
        )
    return state


def ready_pipeline(request: Request) -> Pipeline:
    pipeline = ready_state(request).pipeline
    assert pipeline is not None  # ready_state checked it
    return pipeline


def prompt_service(request: Request) -> PromptService:
    return ready_state(request).prompts


def retrieval_service(request: Request) -> RetrievalService:
    """Collections are served while the engine loads (they do not need it)."""
    return app_state(request).retrieval
