"""Live A/B experiments: counts and latency percentiles per arm (admin paths, see gateway.security)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from ragspeed.gateway.dependencies import app_state
from ragspeed.gateway.errors import APIError

router = APIRouter()


def _experiments(request: Request) -> dict:
    experiment = app_state(request).experiment
    return {experiment.spec.name: experiment} if experiment is not None else {}


@router.get("/v1/experiments")
async def list_experiments(request: Request):
    return {"object": "list", "data": [e.summary() for e in _experiments(request).values()]}


@router.get("/v1/experiments/{name}")
async def get_experiment(name: str, request: Request):
    experiment = _experiments(request).get(name)
    if experiment is None:
        raise APIError(
            404,
            f"no experiment named '{name}' runs on this server",
            param="name",
            code="experiment_not_found",
        )
    return experiment.summary()
