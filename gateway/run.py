"""Running a prepared request: the engine's deltas, the deadline, timings and metrics (the
response's wire format is gateway.streaming's).

Terms: *TTFT* is the time from the request's arrival to its first output token; *TPOT* the mean
time per output token after the first; *e2e* the time to the last token.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field, replace
from typing import Any

from ragspeed.engine.protocol import DocumentReuse, PromptTooLongError, TokenDelta, TokenLogprob
from ragspeed.gateway.admission import Ticket, TTFTAdmission, estimate_new_tokens
from ragspeed.gateway.compress import CompressionReport
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import LiveExperiment
from ragspeed.gateway.limits import DeadlineExceeded, next_before
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.prepared import PreparedRequest
from ragspeed.gateway.tools import ToolCallParser, merge_tool_calls


@dataclass(frozen=True)
class Recorder:
    """Where requests' figures go: the gateway's metrics, labelled by the model it serves, and
    the live experiment comparing its arms' latencies."""

    metrics: GatewayMetrics
    model_id: str
    experiment: LiveExperiment | None = None

    def labels(self, arm: str) -> dict[str, str]:
        return {"model": self.model_id, "arm": arm}

    def refused(self, stage: str) -> None:
        """A request refused by its predicted TTFT, at `stage` (arrival or admission)."""
        self.metrics.ttft_refused.labels(model=self.model_id, stage=stage).inc()

    def compressed(self, report: CompressionReport, arm: str) -> None:
        labels = self.labels(arm)
        self.metrics.documents_tokens.labels(**labels, phase="original").inc(report.original_tokens)
        self.metrics.documents_tokens.labels(**labels, phase="compressed").inc(report.compressed_tokens)
        if report.failed:
            self.metrics.compression_fallbacks.labels(**labels).inc()


@dataclass
class Generation:
    """One request running in its engine: iterate `deltas()`; the figures fill in as it goes."""

    prepared: PreparedRequest
    recorder: Recorder
    timeout_s: float | None = None  # request_timeout_s: from its arrival, then it is aborted
    admission: TTFTAdmission | None = None  # refuses a request predicted to miss its deadline
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked
    wire_logprobs: list[dict[str, Any]] = field(default_factory=list)  # an upstream chat's, as sent
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls, by index
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0
    documents: DocumentReuse | None = None  # what document KV reuse did (the engine's report)
    ttft_s: float | None = None
    e2e_s: float | None = None
    predicted_ttft_s: float | None = None  # the admission's prediction, from arrival
    _engine_start: float = 0.0
    _first_token_at: float = 0.0

    @property
    def model_id(self) -> str:
        return self.recorder.model_id

    @property
    def labels(self) -> dict[str, str]:
        return self.recorder.labels(self.prepared.arm)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def wants_logprobs(self) -> bool:
        return self.prepared.generation.sampling.logprobs is not None

    @property
    def tokenizer(self) -> Any:
        return self.prepared.engine.tokenizer

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.num_completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_completion_tokens - 1)

    def _admit(self) -> Ticket | None:
        """The admission's ticket (None: no admission), or APIError 429 at once. A request judged
        before its compression, by its forecast, is not judged again unless it sends more
        document tokens than that (the compression failed open, or kept more): then it is
        judged by its real size."""
        if self.admission is None:
            return None
        prepared, generation = self.prepared, self.prepared.generation
        deadline_s = self.admission.deadline_s(prepared.deadline_ms, generation.priority)
        report, forecast_tokens = prepared.compression, prepared.judged_document_tokens
        as_forecast = (
            report is not None
            and not report.failed
            and forecast_tokens is not None
            and report.compressed_tokens <= forecast_tokens
        )
        if prepared.judged_before_compression and as_forecast:
            deadline_s = None
        try:
            ticket = self.admission.admit(
                estimate_new_tokens(self.prepared.engine, generation),
                generation.priority,
                self.prepared.timer.start,
                deadline_s,
            )
        except APIError:
            self.recorder.refused("admission")
            raise
        self.predicted_ttft_s = ticket.predicted_s
        if ticket.predicted_s is not None:
            self.recorder.metrics.ttft_predicted.labels(**self.labels).observe(ticket.predicted_s)
        return ticket

    async def deltas(self) -> AsyncGenerator[TokenDelta, None]:
        metrics, labels = self.recorder.metrics, self.labels
        timer = self.prepared.timer
        ticket = self._admit()
        metrics.in_flight.labels(**labels).inc()
        outcome = "error"
        self._engine_start = time.perf_counter()
        counted_ids = 0
        timeout_s = self.timeout_s
        deadline = None  # event-loop time; the deadline counts from the request's arrival
        if timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + timeout_s - (self._engine_start - timer.start)
        engine_stream = self.prepared.engine.generate(self.prepared.generation)
        tools = self.prepared.tools
        parser = ToolCallParser(tools.format) if tools is not None else None
        try:
            while True:
                try:
                    delta = await next_before(engine_stream, deadline, timeout_s)
                except StopAsyncIteration:
                    break
                if parser is not None:
                    delta = _parse_tool_calls(parser, delta)
                now = time.perf_counter()
                if self.ttft_s is None and (delta.token_ids or delta.text or delta.finish_reason):
                    self.ttft_s = now - timer.start
                    self._first_token_at = now
                    if ticket is not None:
                        ticket.first_token()
                self.num_prompt_tokens = max(self.num_prompt_tokens, delta.num_prompt_tokens)
                self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
                if delta.documents is not None:
                    self.documents = delta.documents
                counted_ids += len(delta.token_ids)
                if delta.num_completion_tokens is not None:
                    self.num_completion_tokens = delta.num_completion_tokens
                else:
                    self.num_completion_tokens = counted_ids
                self.text_parts.append(delta.text)
                if delta.logprobs:
                    self.logprobs.extend(delta.logprobs)
                if delta.wire_logprobs is not None:
                    self.wire_logprobs.append(delta.wire_logprobs)
                if delta.tool_calls:
                    merge_tool_calls(self.tool_calls, delta.tool_calls)
                if delta.finish_reason is not None:
                    self.finish_reason = delta.finish_reason
                yield delta
            outcome = self.finish_reason or "stop"
        except PromptTooLongError:
            outcome = "rejected"
            raise
        except DeadlineExceeded:
            outcome = "deadline"  # the engine stream was cancelled: its request is aborted
            raise
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "aborted"  # the client went away; closing the engine stream aborts it
            raise
        finally:
            if ticket is not None:
                ticket.release()
            await engine_stream.aclose()
            if self.prepared.principal is not None:
                self.prepared.principal.charge_tokens(self.num_completion_tokens)
            metrics.in_flight.labels(**labels).dec()
            metrics.requests.labels(**labels, outcome=outcome).inc()
            if outcome not in ("error", "rejected"):
                self._record(outcome)

    def _record(self, outcome: str) -> None:
        metrics, labels, timer = self.recorder.metrics, self.labels, self.prepared.timer
        end = time.perf_counter()
        self.e2e_s = end - timer.start
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.prepared.generation.prompt_token_ids)
        if self._first_token_at:
            timer.seconds["engine_first_token"] = self._first_token_at - self._engine_start
            timer.seconds["decode"] = end - self._first_token_at
        for stage, seconds in timer.seconds.items():
            metrics.stage.labels(**labels, stage=stage).observe(seconds)
        if self.ttft_s is not None:
            metrics.ttft.labels(**labels).observe(self.ttft_s)
        if self.tpot_s is not None:
            metrics.tpot.labels(**labels).observe(self.tpot_s)
        metrics.e2e.labels(**labels).observe(self.e2e_s)
        if self.recorder.experiment is not None:
            self.recorder.experiment.observe(self.prepared.arm, self.ttft_s, self.tpot_s, self.e2e_s)
        metrics.prompt_tokens.labels(**labels).inc(self.num_prompt_tokens)
        metrics.cached_tokens.labels(**labels).inc(self.num_cached_tokens)
        metrics.generation_tokens.labels(**labels).inc(self.num_completion_tokens)


def _parse_tool_calls(parser: ToolCallParser, delta: TokenDelta) -> TokenDelta:
    """`delta` with its text split into content and tool calls; the last delta flushes what the
    parser held, and finishes as `tool_calls` where calls were made and the model stopped."""
    text, calls = parser.feed(delta.text)
    finish_reason = delta.finish_reason
    if finish_reason is not None:
        rest, more = parser.finish()
        text, calls = text + rest, calls + more
        if finish_reason == "stop" and parser.num_calls:
            finish_reason = "tool_calls"
    return replace(delta, text=text, tool_calls=tuple(calls), finish_reason=finish_reason)
