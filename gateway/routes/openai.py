"""The OpenAI-compatible endpoints."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ragspeed.gateway.dependencies import ready_pipeline
from ragspeed.gateway.pipeline import Generation, Pipeline
from ragspeed.gateway.protocol import ChatCompletionRequest, CompletionRequest
from ragspeed.gateway.streaming import CHAT, TEXT, complete, stream

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           pipeline: Pipeline = Depends(ready_pipeline)):
    gen = Generation(pipeline, await pipeline.prepare_chat(body))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream(gen, CHAT, include_usage)
    return await complete(gen, CHAT, request)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request,
                      pipeline: Pipeline = Depends(ready_pipeline)):
    gen = Generation(pipeline, pipeline.prepare_completion(body))
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await stream(gen, TEXT, include_usage)
    return await complete(gen, TEXT, request)


@router.get("/v1/models")
async def list_models(request: Request):
    settings = request.app.state.settings
    engine = request.app.state.engine
    return {"object": "list", "data": [{
        "id": settings.model_id,
        "object": "model",
        "created": request.app.state.started_at,
        "owned_by": "ragspeed",
        "max_model_len": engine.max_model_len or None,
        "engine": settings.engine,
    }]}
