"""The request pipeline: prepare (gateway.prepare) then run (gateway.run).

Built once, complete, over the app's state once its services are loaded (the app builds it when
the engine, the compression stage and retrieval are ready), so no request pays a load.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

from ragspeed.gateway.errors import APIError
from ragspeed.gateway.limits import arrival_time
from ragspeed.gateway.prepare import PreparedRequest, Preparer, request_priority
from ragspeed.gateway.protocol import ChatCompletionRequest, CompletionRequest
from ragspeed.gateway.run import Generation

if TYPE_CHECKING:  # gateway.state holds the pipeline
    from ragspeed.gateway.state import AppState


@dataclass(frozen=True)
class Pipeline:
    state: AppState

    @cached_property
    def preparer(self) -> Preparer:
        return Preparer(self.state)

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
        rule of gateway.admission); else the request's arrival time, under which the admission counts it as preparing. Checked
        again before an expensive stage with `tokens`, a lower bound of the request's work, and
        `stage_s`, the stage's expected seconds."""
        arrived_at = arrival_time() or time.perf_counter()
        admission = self.state.admission
        if admission is not None:
            try:
                deadline_s = admission.deadline_s(deadline_ms, priority)
                admission.check_arrival(deadline_s, priority, arrived_at, tokens, stage_s)
            except APIError:
                self.state.metrics.ttft_refused.labels(
                    model=self.state.settings.model_id, stage="arrival"
                ).inc()
                raise
        return arrived_at

    def forget_arrival(self, arrived_at: float) -> None:
        if self.state.admission is not None:
            self.state.admission.forget_arrival(arrived_at)

    def run(self, prepared: PreparedRequest) -> Generation:
        """The request in its engine, not started yet: iterate `deltas()` to run it. The
        admission judges the server's engine; an A/B arm's own engine queues apart."""
        if prepared.engine is not self.state.engine:
            self.forget_arrival(prepared.timer.start)
            return Generation(self.state, prepared, admission=None)
        return Generation(self.state, prepared, admission=self.state.admission)
