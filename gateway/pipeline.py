"""The request pipeline: segments → (retrieval) → compression → prompt → engine, each stage timed.

Terms: *TTFT* is the time from the request's arrival to its first output token; *TPOT* the mean
time per output token after the first; *e2e* the time to the last token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError

from ragspeed.engine.protocol import (
    EngineClient,
    GenerationRequest,
    PromptTooLongError,
    SamplingParams,
    TokenDelta,
    TokenLogprob,
)
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import LiveExperiment, current_hints
from ragspeed.gateway.limits import DeadlineExceeded, next_before
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.prompt import Document, Prompt, Segments, assemble_prompt, split_segments
from ragspeed.gateway.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from ragspeed.gateway.security import Principal, current_principal
from ragspeed.gateway.settings import Settings

DEFAULT_ARM = "default"


class StageTimer:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class CompressionReport:
    method: str
    original_tokens: int
    compressed_tokens: int
    seconds: float
    failed: bool = False  # the compressor raised; the documents went through uncompressed
    skipped_reason: str | None = None  # e.g. below the break-even length


@dataclass
class PreparedRequest:
    request_id: str
    generation: GenerationRequest
    timer: StageTimer
    compression: CompressionReport | None = None
    arm: str = DEFAULT_ARM
    principal: Principal | None = None  # the authenticated caller; None with auth off
    engine: EngineClient | None = None  # the A/B arm's own engine; None: the pipeline's
    return_prompt: bool = False  # echo the prompt as sent in `ragspeed.prompt`


# Compression and retrieval plug in as callables the app builds in its lifespan:
#   compress(segments, documents, options) -> (documents, CompressionReport | None)
#   retrieve(question, options) -> documents
Compress = Callable[[Segments, tuple[Document, ...], Any], tuple[tuple[Document, ...], CompressionReport | None]]
Retrieve = Callable[[str, Any], list[Document]]


def sampling_params(req: _SamplingFields, max_tokens: int | None, default_max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens or default_max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=max(req.top_k, 0),
        min_p=req.min_p,
        seed=req.seed,
        stop=tuple(req.stop or ()),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=req.num_logprobs,
    )


def _reject_lone_surrogates(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(400, f"'{path}' holds a lone UTF-16 surrogate, which is not valid Unicode",
                           param=path or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _reject_lone_surrogates(item, f"{path}.{index}")


@dataclass
class Pipeline:
    settings: Settings
    engine: EngineClient
    metrics: GatewayMetrics
    compress: Compress | None = None
    retrieve: Retrieve | None = None
    experiment: LiveExperiment | None = None  # live A/B arms; None: every request is DEFAULT_ARM
    arm_engines: dict[str, EngineClient] = field(default_factory=dict)  # arms that own an engine
    prompts: Any = None  # gateway.routes.prompts.PromptService: `ragspeed.system_prompt` names

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_id:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.settings.model_id}'", param="model", code="model_not_found")

    async def prepare_chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        self.check_model(req.model)
        self.check_input(req)
        arm = self.experiment.assign(req.user, current_hints()) if self.experiment is not None else None
        if arm is not None:
            req = arm.apply(req)  # the arm's per-request options win over the client's
        engine = self.arm_engines.get(arm.name, self.engine) if arm is not None else self.engine
        timer = StageTimer()
        with timer.stage("segments"):
            segments = split_segments(
                req.messages, req.documents,
                start_marker=self.settings.document_start_marker,
                end_marker=self.settings.document_end_marker,
            )
        options = req.ragspeed
        if options and options.system_prompt:
            if self.prompts is None:
                raise APIError(400, "this server has no prompt registry", param="ragspeed.system_prompt")
            segments = self.prompts.apply(segments, options.system_prompt)
        documents = segments.documents
        if options and options.retrieval:
            if self.retrieve is None:
                raise APIError(400, "retrieval is not enabled on this server", param="ragspeed.retrieval")
            with timer.stage("retrieval"):
                retrieved = await asyncio.to_thread(self.retrieve, segments.question, options.retrieval)
                documents = documents + tuple(retrieved)
        if len(documents) > self.settings.max_documents:
            raise APIError(400, f"the request has {len(documents)} documents; the limit is "
                                f"{self.settings.max_documents} (max_documents)", param="documents",
                           code="too_many_documents")
        report = None
        if documents and self.compress is not None and (options is None or options.compression is not False):
            with timer.stage("compression"):
                documents, report = await asyncio.to_thread(
                    self.compress, segments, documents, options.compression if options else None)
            if report is not None:
                self._count_compression(report, arm.name if arm is not None else DEFAULT_ARM)
        with timer.stage("prompt"):
            try:
                prompt = assemble_prompt(engine.tokenizer, segments, documents)
            except TemplateError as exc:  # e.g. a role the model's chat template does not know
                raise APIError(400, f"the model's chat template rejects these messages: {exc}",
                               param="messages", code="invalid_messages") from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        prepared = self._prepared(req, prompt, timer, max_tokens, report, engine)
        if arm is not None:
            prepared.arm, prepared.engine = arm.name, (engine if engine is not self.engine else None)
        prepared.return_prompt = bool(options and options.return_prompt)
        return prepared

    def _count_compression(self, report: CompressionReport, arm: str) -> None:
        labels = {"model": self.settings.model_id, "arm": arm}
        self.metrics.documents_tokens.labels(**labels, phase="original").inc(report.original_tokens)
        self.metrics.documents_tokens.labels(**labels, phase="compressed").inc(report.compressed_tokens)
        if report.failed:
            self.metrics.compression_fallbacks.labels(**labels).inc()

    def check_input(self, req: _SamplingFields) -> None:
        """What the schema cannot say: text that is valid JSON but not valid Unicode (a lone
        surrogate cannot be tokenized), token ids outside the vocabulary, seeds torch refuses."""
        _reject_lone_surrogates(req.model_dump(exclude_none=True), "")
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
            raise APIError(400, f"stop_token_ids must lie in [0, {vocab})", param="stop_token_ids")
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise APIError(400, "seed must be a 64-bit integer", param="seed")

    def prepare_completion(self, req: CompletionRequest) -> PreparedRequest:
        self.check_model(req.model)
        self.check_input(req)
        timer = StageTimer()
        with timer.stage("prompt"):
            if isinstance(req.prompt, str):
                text = req.prompt
                token_ids = self.engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
            else:
                vocab = len(self.engine.tokenizer)
                if any(not 0 <= t < vocab for t in req.prompt):
                    raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
                token_ids = list(req.prompt)
                text = self.engine.tokenizer.decode(token_ids)
        prompt = Prompt(text=text, token_ids=tuple(token_ids), num_static_tokens=0)
        return self._prepared(req, prompt, timer, req.max_tokens, None)

    def _prepared(self, req: _SamplingFields, prompt: Prompt, timer: StageTimer,
                  max_tokens: int | None, report: CompressionReport | None,
                  engine: EngineClient | None = None) -> PreparedRequest:
        sampling = sampling_params(req, max_tokens, self.settings.default_max_tokens)
        limit = (engine or self.engine).max_model_len
        if len(prompt.token_ids) + sampling.max_tokens > limit:
            param = "max_tokens" if len(prompt.token_ids) < limit else "messages"
            raise APIError(
                400,
                f"this model's context is {limit} tokens; the prompt has {len(prompt.token_ids)} "
                f"and max_tokens asks for {sampling.max_tokens} more",
                param=param, code="context_length_exceeded")
        if not prompt.token_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        max_prompt_tokens = self.settings.max_prompt_tokens
        if max_prompt_tokens is not None and len(prompt.token_ids) > max_prompt_tokens:
            raise APIError(400, f"the prompt has {len(prompt.token_ids)} tokens; the limit is "
                                f"{max_prompt_tokens} (max_prompt_tokens)",
                           param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                           code="prompt_too_long")
        principal = current_principal()
        if principal is not None:
            principal.admit_tokens(len(prompt.token_ids))  # 429 while the key's token budget is spent
        request_id = uuid.uuid4().hex
        generation = GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            sampling=sampling,
            prompt=prompt.text,
            num_static_tokens=prompt.num_static_tokens,
            # A tenant's salt always wins over the client's: tenants never share or time a cache.
            cache_salt=principal.cache_salt if principal is not None else req.cache_salt,
        )
        return PreparedRequest(request_id, generation, timer, report, principal=principal)


@dataclass
class Generation:
    """One request running in the engine: iterate it for deltas; figures fill in as it goes."""

    pipeline: Pipeline
    prepared: PreparedRequest
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    _engine_start: float = 0.0
    _first_token_at: float = 0.0

    @property
    def labels(self) -> dict[str, str]:
        return {"model": self.pipeline.settings.model_id, "arm": self.prepared.arm}

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def wants_logprobs(self) -> bool:
        return self.prepared.generation.sampling.logprobs is not None

    @property
    def tokenizer(self) -> Any:
        return (self.prepared.engine or self.pipeline.engine).tokenizer

    @property
    def tpot_s(self) -> float | None:
        if self.e2e_s is None or self.ttft_s is None or self.num_completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_completion_tokens - 1)

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        metrics, labels = self.pipeline.metrics, self.labels
        timer = self.prepared.timer
        metrics.in_flight.labels(**labels).inc()
        outcome = "error"
        self._engine_start = time.perf_counter()
        counted_ids = 0
        timeout_s = self.pipeline.settings.request_timeout_s
        deadline = None  # event-loop time; the deadline counts from the request's arrival
        if timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + timeout_s - (self._engine_start - timer.start)
        engine_stream = (self.prepared.engine or self.pipeline.engine).generate(self.prepared.generation)
        try:
            while True:
                try:
                    delta = await next_before(engine_stream, deadline, timeout_s)
                except StopAsyncIteration:
                    break
                now = time.perf_counter()
                if self.ttft_s is None and (delta.token_ids or delta.text or delta.finish_reason):
                    self.ttft_s = now - timer.start
                    self._first_token_at = now
                self.num_prompt_tokens = max(self.num_prompt_tokens, delta.num_prompt_tokens)
                self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
                counted_ids += len(delta.token_ids)
                if delta.num_completion_tokens is not None:
                    self.num_completion_tokens = delta.num_completion_tokens
                else:
                    self.num_completion_tokens = counted_ids
                self.text_parts.append(delta.text)
                if delta.logprobs:
                    self.logprobs.extend(delta.logprobs)
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
            await engine_stream.aclose()
            if self.prepared.principal is not None:
                self.prepared.principal.charge_tokens(self.num_completion_tokens)
            metrics.in_flight.labels(**labels).dec()
            metrics.requests.labels(**labels, outcome=outcome).inc()
            if outcome not in ("error", "rejected"):
                self._record(outcome)

    def _record(self, outcome: str) -> None:
        metrics, labels, timer = self.pipeline.metrics, self.labels, self.prepared.timer
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
        if self.pipeline.experiment is not None:
            self.pipeline.experiment.observe(self.prepared.arm, self.ttft_s, self.tpot_s, self.e2e_s)
        metrics.prompt_tokens.labels(**labels).inc(self.num_prompt_tokens)
        metrics.cached_tokens.labels(**labels).inc(self.num_cached_tokens)
        metrics.generation_tokens.labels(**labels).inc(self.num_completion_tokens)

    def ragspeed_fields(self) -> dict[str, Any]:
        """Per-request figures for the response's `ragspeed` object (milliseconds)."""
        timings = {k: round(v * 1000, 3) for k, v in self.prepared.timer.seconds.items()}
        out: dict[str, Any] = {
            "request_id": self.prepared.request_id,
            "arm": self.prepared.arm,
            "timings_ms": timings,
            "ttft_ms": round(self.ttft_s * 1000, 3) if self.ttft_s is not None else None,
            "e2e_ms": round(self.e2e_s * 1000, 3) if self.e2e_s is not None else None,
            "tpot_ms": round(self.tpot_s * 1000, 3) if self.tpot_s is not None else None,
            "num_static_tokens": self.prepared.generation.num_static_tokens,
        }
        if self.prepared.return_prompt:
            out["prompt"] = self.prepared.generation.prompt
        report = self.prepared.compression
        if report is not None:
            out["compression"] = {
                "method": report.method,
                "original_tokens": report.original_tokens,
                "compressed_tokens": report.compressed_tokens,
                "ms": round(report.seconds * 1000, 3),
                "failed": report.failed,
                "skipped_reason": report.skipped_reason,
            }
        return out

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }
