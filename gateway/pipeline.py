"""The request pipeline: prepare (gateway.prepare) then run (gateway.run).

`build_pipeline` builds it once, complete, from the app's services once they are loaded (the
lifespan calls it when the engine, the compression stage and retrieval are ready), so that no
request pays a load. Each part takes the few services it uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from ragspeed.engine.protocol import EngineClient
from ragspeed.gateway.admission import TTFTAdmission
from ragspeed.gateway.compress import CompressionStage
from ragspeed.gateway.cpu_jobs import CpuJobs
from ragspeed.gateway.document_stage import DocumentStage
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import ArmEngines, LiveExperiment
from ragspeed.gateway.fidelity_gate import DocumentCacheDefault, RequestDocumentCache
from ragspeed.gateway.limits import arrival_time
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.prepare import Markers, Preparer
from ragspeed.gateway.prepared import PreparedRequest, RequestLimits, request_priority
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.protocol import ChatCompletionRequest, CompletionRequest
from ragspeed.gateway.retrieval_service import RetrievalService
from ragspeed.gateway.run import Generation, Recorder
from ragspeed.gateway.settings import Settings


@dataclass(frozen=True)
class Pipeline:
    preparer: Preparer
    recorder: Recorder
    admission: TTFTAdmission | None = None  # admission by predicted TTFT of the server's engine
    request_timeout_s: float | None = None

    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        """The request prepared; judged before its compression by the compression's forecast,
        whose document tokens it carries (`judged_document_tokens`): the admission judges it
        again if it sends more."""
        options = req.ragspeed
        deadline_ms, priority = options.deadline_ms if options else None, request_priority(options)
        forecast_tokens: list[int] = []  # the document tokens of the forecast it was judged by

        def check_work(tokens: int, seconds: float) -> float:
            forecast_tokens.append(tokens)
            return self.check_arrival(deadline_ms, priority, tokens, seconds)

        with self.preparing(deadline_ms, priority):
            prepared = await self.preparer.chat(req, check_work=check_work)
        if prepared.judged_before_compression:
            prepared = replace(prepared, judged_document_tokens=forecast_tokens[-1])
        return prepared

    def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        with self.preparing(None, request_priority(None)):
            return self.preparer.completion(req)

    @contextmanager
    def preparing(self, deadline_ms: float | None, priority: int) -> Iterator[None]:
        """The arrival check, then the preparation inside; one that fails leaves the ledger."""
        arrived_at = self.check_arrival(deadline_ms, priority)
        try:
            yield
        except BaseException:
            self.forget_arrival(arrived_at)
            raise

    def check_arrival(
        self, deadline_ms: float | None, priority: int, tokens: int | None = None, stage_s: float = 0.0
    ) -> float:
        """429 at once, before any preparation, when the work ahead makes the request late (the
        rule of gateway.admission); else the request's arrival time, under which the admission
        counts it as preparing. Checked again before an expensive stage with `tokens`, a lower
        bound of the request's work, and `stage_s`, the stage's expected seconds."""
        arrived_at = arrival_time() or time.perf_counter()
        admission = self.admission
        if admission is not None:
            try:
                deadline_s = admission.deadline_s(deadline_ms, priority)
                admission.check_arrival(deadline_s, priority, arrived_at, tokens, stage_s)
            except APIError:
                self.recorder.refused("arrival")
                raise
        return arrived_at

    def forget_arrival(self, arrived_at: float) -> None:
        if self.admission is not None:
            self.admission.forget_arrival(arrived_at)

    def run(self, prepared: PreparedRequest) -> Generation:
        """The request in its engine, not started yet: iterate `deltas()` to run it. The
        admission judges the server's engine; an A/B arm's own engine queues apart."""
        timeout_s = self.request_timeout_s
        if prepared.engine is not self.preparer.engine:
            self.forget_arrival(prepared.timer.start)
            return Generation(prepared, self.recorder, timeout_s, admission=None)
        return Generation(prepared, self.recorder, timeout_s, admission=self.admission)


def build_pipeline(
    settings: Settings,
    *,
    metrics: GatewayMetrics,
    engine: EngineClient,
    prompts: PromptService,
    retrieval: RetrievalService,
    compression: CompressionStage | None = None,
    experiment: LiveExperiment | None = None,
    arm_engines: Mapping[str, EngineClient] | None = None,
    admission: TTFTAdmission | None = None,
    document_cache_default: DocumentCacheDefault | None = None,
) -> Pipeline:
    """The pipeline over loaded services, in stages: where requests' figures go, the document
    stage, the preparer, then the pipeline that admits and runs what it prepares."""
    recorder = Recorder(metrics, settings.model_id, experiment)
    options = settings.engine
    documents = DocumentStage(
        retrieval,
        compression,
        RequestDocumentCache(
            options.document_cache, options.document_cache_options(), document_cache_default
        ),
        recorder,
        CpuJobs(engine),
        settings.limits.max_documents,
    )
    prompt_settings = settings.prompts
    preparer = Preparer(
        settings.model_id,
        ArmEngines(engine, experiment, dict(arm_engines or {})),
        prompts,
        documents,
        Markers(prompt_settings.document_start_marker, prompt_settings.document_end_marker),
        RequestLimits(prompt_settings.default_max_tokens, settings.limits.max_prompt_tokens),
    )
    return Pipeline(preparer, recorder, admission, settings.limits.request_timeout_s)
