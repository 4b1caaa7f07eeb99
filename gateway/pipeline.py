"""The request pipeline: prepare (gateway.prepare) then run (gateway.run).

Built once, complete, from services that are already loaded (the app builds it when the engine,
the compression stage and retrieval are ready), so no request pays a load.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from ragspeed.engine.protocol import EngineClient
from ragspeed.gateway.admission import TTFTAdmission
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import LiveExperiment
from ragspeed.gateway.limits import arrival_time
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.prepare import Compress, PreparedRequest, Preparer, Retrieve, request_priority
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.protocol import ChatCompletionRequest, CompletionRequest
from ragspeed.gateway.run import Generation
from ragspeed.gateway.settings import Settings


@dataclass(frozen=True)
class Pipeline:
    settings: Settings
    engine: EngineClient
    metrics: GatewayMetrics
    compress: Compress | None = None
    retrieve: Retrieve | None = None
    prompts: PromptService | None = None
    experiment: LiveExperiment | None = None  # live A/B arms; None: every request is the default arm
    arm_engines: Mapping[str, EngineClient] = field(default_factory=dict)  # arms that own an engine
    admission: TTFTAdmission | None = None  # admission by predicted TTFT; None: none

    @cached_property
    def preparer(self) -> Preparer:
        return Preparer(
            self.settings,
            self.engine,
            self.metrics,
            compress=self.compress,
            retrieve=self.retrieve,
            prompts=self.prompts,
            experiment=self.experiment,
            arm_engines=self.arm_engines,
        )

    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        options = req.ragspeed
        self.check_arrival(options.deadline_ms if options else None, request_priority(options))
        return await self.preparer.chat(req)

    def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        self.check_arrival(None, request_priority(None))
        return self.preparer.completion(req)

    def check_arrival(self, deadline_ms: float | None, priority: int) -> None:
        """429 at once, before any preparation, when the backlog alone passes the deadline."""
        if self.admission is not None:
            try:
                deadline_s = self.admission.deadline_s(deadline_ms, priority)
                self.admission.check_arrival(deadline_s, priority, arrival_time() or time.perf_counter())
            except APIError:
                self.metrics.ttft_refused.labels(model=self.settings.model_id).inc()
                raise

    def run(self, prepared: PreparedRequest) -> Generation:
        """The request in its engine, not started yet: iterate `deltas()` to run it. The
        admission judges the server's engine; an A/B arm's own engine queues apart."""
        admission = self.admission if prepared.engine is self.engine else None
        return Generation(
            self.settings, self.metrics, prepared, experiment=self.experiment, admission=admission
        )
