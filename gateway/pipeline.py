"""The request pipeline: prepare (gateway.prepare) then run (gateway.run).

Built once, complete, from services that are already loaded (the app builds it when the engine,
the compression stage and retrieval are ready), so no request pays a load.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

from ragspeed.engine.protocol import EngineClient
from ragspeed.gateway.experiments import LiveExperiment
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.prepare import Compress, PreparedRequest, Preparer, Retrieve
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
        return await self.preparer.chat(req)

    def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        return self.preparer.completion(req)

    def run(self, prepared: PreparedRequest) -> Generation:
        """The request in its engine, not started yet: iterate `deltas()` to run it."""
        return Generation(self.settings, self.metrics, prepared, experiment=self.experiment)
