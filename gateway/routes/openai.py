"""The OpenAI-compatible endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ragspeed.gateway.dependencies import app_state, ready_pipeline
from ragspeed.gateway.pipeline import Pipeline
from ragspeed.gateway.protocol import ChatCompletionRequest, CompletionRequest
from ragspeed.gateway.state import AppState
from ragspeed.gateway.streaming import CHAT, TEXT, complete, stream

router = APIRouter()


async def pipeline_on_loop(request: Request) -> Pipeline:
    """`ready_pipeline`, run on the event loop: FastAPI runs a plain `def` dependency in a
    worker thread, and that hop was a tenth of a forwarded request's cost."""
    return ready_pipeline(request)


@router.post("/v1/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, request: Request, pipeline: Pipeline = Depends(pipeline_on_loop)
):
    prepared = await pipeline.prepare_chat(body)
    gens = [pipeline.run(choice) for choice in prepared.choices()]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream(gens, CHAT, include_usage)
    return await complete(gens, CHAT, request)


@router.post("/v1/completions")
async def completions(
    body: CompletionRequest, request: Request, pipeline: Pipeline = Depends(pipeline_on_loop)
):
    gens = [pipeline.run(choice) for choice in pipeline.prepare_completion(body).choices()]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream(gens, TEXT, include_usage)
    return await complete(gens, TEXT, request)


@router.get("/v1/models")
async def list_models(state: AppState = Depends(app_state)):
    return {
        "object": "list",
        "data": [
            {
                "id": state.settings.model_id,
                "object": "model",
                "created": state.started_at,
                "owned_by": "ragspeed",
                "max_model_len": state.engine.max_model_len or None,
                "engine": state.settings.engine.backend,
                "ragspeed": {
                    "weights": getattr(state.engine, "weights", None),
                    # the fidelity gate's choice: the policy, why, and the measured figures
                    "document_cache": _document_cache_default(state),
                },
            }
        ],
    }


def _document_cache_default(state: AppState) -> dict | None:
    """What requests that do not ask get, and why (None while the engine loads)."""
    chosen = state.document_cache_default
    return chosen.as_dict() if chosen is not None else None
