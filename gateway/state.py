"""`AppState`: every service the app serves with, built by the lifespan (gateway.app) and kept
on `app.state.services`; routes read it through gateway.dependencies. The pipeline built over
those services (gateway.pipeline.build_pipeline) holds the few that each of its parts uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from ragspeed.engine.protocol import EngineClient
from ragspeed.gateway.admission import TTFTAdmission
from ragspeed.gateway.compress import CompressionStage
from ragspeed.gateway.document_precompute import DocumentPrecompute
from ragspeed.gateway.experiments import LiveExperiment
from ragspeed.gateway.fidelity_gate import DocumentCacheDefault
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.pipeline import Pipeline
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.retrieval_service import RetrievalService
from ragspeed.gateway.settings import Settings


@dataclass
class AppState:
    settings: Settings
    metrics: GatewayMetrics
    engine: EngineClient
    retrieval: RetrievalService
    prompts: PromptService
    started_at: int  # unix seconds: `created` in /v1/models
    experiment: LiveExperiment | None = None
    arm_engines: dict[str, EngineClient] = field(default_factory=dict)  # A/B arms with an engine
    admission: TTFTAdmission | None = None  # admission by predicted TTFT of the server's engine
    # Built once the engines have started (the stage counts tokens with the engine's tokenizer).
    compression: CompressionStage | None = None
    precompute: DocumentPrecompute | None = None  # collections' document KV, at ingestion
    # The document-cache policy of requests that do not ask (gateway.fidelity_gate), once the
    # engine has started; None: exact prefill.
    document_cache_default: DocumentCacheDefault | None = None
    # Built once every service above is loaded; None while loading (and after a failed load).
    pipeline: Pipeline | None = None
    engine_error: str | None = None  # why loading failed: "ExceptionType: message"

    @property
    def ready(self) -> bool:
        return self.pipeline is not None
