"""Preparing a request: segments -> (retrieval) -> compression -> prompt, each stage timed.

What comes out is a `PreparedRequest`: the engine's `GenerationRequest` (prompt token ids with
the static prefix first, sampling parameters, cache salt), the engine it runs on (the A/B arm's),
the stage timings so far and the compression report. Running it is gateway.run.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

from jinja2 import TemplateError

from ragspeed.engine.protocol import (
    PRIORITY_BATCH,
    PRIORITY_INTERACTIVE,
    DocumentCacheOptions,
    EngineClient,
    GenerationRequest,
    SamplingParams,
    StructuredOutput,
    check_context_length,
)
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import current_hints
from ragspeed.gateway.limits import arrival_time
from ragspeed.gateway.prompt import (
    Prompt,
    assemble_prompt,
    split_segments,
    static_prefix_token_ids,
    with_tools,
)
from ragspeed.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DocumentCacheIn,
    RagspeedOptions,
    _SamplingFields,
)
from ragspeed.gateway.security import Principal, current_principal
from ragspeed.gateway.surface import output_constraint, tool_calls, unhonoured_fields
from ragspeed.gateway.tools import ToolCalls, tool_format
from ragspeed.gateway.upstream_chat import upstream_chat_body

if TYPE_CHECKING:  # gateway.state holds the pipeline that holds the preparer
    from ragspeed.gateway.state import AppState

DEFAULT_ARM = "default"


class StageTimer:
    """Seconds per stage of one request, from its arrival (`start`: when it reached the app)."""

    def __init__(self) -> None:
        self.start = arrival_time() or time.perf_counter()
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


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready for the engine: what `run.Generation` needs, and what it reports. Built
    complete by `Preparer` (the timer inside it keeps counting the stages that follow)."""

    request_id: str
    generation: GenerationRequest
    timer: StageTimer
    engine: EngineClient  # the engine it runs on: the A/B arm's own, else the server's
    compression: CompressionReport | None = None
    arm: str = DEFAULT_ARM
    principal: Principal | None = None  # the authenticated caller; None with auth off
    return_prompt: bool = False  # echo the prompt as sent in `ragspeed.prompt`
    deadline_ms: float | None = None  # `ragspeed.deadline_ms`: this request's TTFT deadline
    # Judged against its deadline before its compression, with its forecast: admitted after it
    # without a second judgement (a refusal then would waste the compression and come late).
    judged_before_compression: bool = False
    judged_document_tokens: int | None = None  # that forecast's; a request sending more is judged again
    tools: ToolCalls | None = None  # tools the gateway renders and parses (not a forwarded chat)
    ignored_fields: tuple[str, ...] = ()  # what the client sent that changes nothing here
    n: int = 1  # choices: n generations of the same prompt

    def choices(self) -> list[PreparedRequest]:
        """One request per choice: the same prompt, its KV shared through the prefix cache;
        a seeded request's choice i draws from seed + i, so that the choices differ."""
        choices = [self]
        for index in range(1, self.n):
            sampling = self.generation.sampling
            seed = None if sampling.seed is None else sampling.seed + index
            request_id = f"{self.request_id}-{index}"
            chat = self.generation.chat
            if chat is not None and chat.get("seed") is not None:  # a forwarded chat's own seed
                chat = {**chat, "seed": chat["seed"] + index}
            generation = replace(
                self.generation, request_id=request_id, sampling=replace(sampling, seed=seed), chat=chat
            )
            choices.append(replace(self, request_id=request_id, generation=generation))
        return choices


def sampling_params(
    req: _SamplingFields,
    max_tokens: int | None,
    default_max_tokens: int,
    structured: StructuredOutput | None = None,
) -> SamplingParams:
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
        frequency_penalty=req.frequency_penalty,
        presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=tuple(sorted((int(token), bias) for token, bias in (req.logit_bias or {}).items())),
        structured=structured,
    )


@dataclass(frozen=True)
class Surface:
    """What the engine makes of a request's fields beyond plain chat (gateway.surface)."""

    tools: ToolCalls | None = None
    constraint: StructuredOutput | None = None
    ignored_fields: tuple[str, ...] = ()


def request_priority(options: RagspeedOptions | None) -> int:
    """The engine priority of `ragspeed.priority`."""
    batch = options is not None and options.priority == "batch"
    return PRIORITY_BATCH if batch else PRIORITY_INTERACTIVE


def _reject_lone_surrogates(value: Any, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise APIError(
                400, f"'{path}' holds a lone UTF-16 surrogate, which is not valid Unicode", param=path or None
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_lone_surrogates(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _reject_lone_surrogates(item, f"{path}.{index}")


@dataclass(frozen=True)
class Preparer:
    """Turns a parsed request into a `PreparedRequest`; raises APIError for what cannot run.
    It reads the app's services (engines, compression, retrieval, registered prompts, A/B arms)
    and options (the prompts and limits sections) from `state`."""

    state: AppState

    @property
    def engine(self) -> EngineClient:
        return self.state.engine

    @cached_property
    def _cached_static_token_ids(self) -> Callable[[Any, str], tuple[int, ...]]:
        return functools.lru_cache(maxsize=64)(static_prefix_token_ids)

    def static_token_ids(self, tokenizer: Any, static_system_prompt: str) -> tuple[int, ...]:
        """`static_prefix_token_ids`, kept by (tokenizer, text): an application sends the same
        static system prompt with every request. Not for a chat template that reads the clock
        (`strftime_now`, e.g. Llama 3's date line): its rendering changes with the day."""
        if "strftime_now" in str(getattr(tokenizer, "chat_template", "")):
            return static_prefix_token_ids(tokenizer, static_system_prompt)
        return self._cached_static_token_ids(tokenizer, static_system_prompt)

    def check_model(self, model: str | None) -> None:
        model_id = self.state.settings.model_id
        if model is not None and model != model_id:
            raise APIError(
                404,
                f"the model '{model}' does not exist; this server serves '{model_id}'",
                param="model",
                code="model_not_found",
            )

    async def chat(
        self, req: ChatCompletionRequest, check_work: Callable[[int, float], object] | None = None
    ) -> PreparedRequest:
        """The request prepared for its engine. `check_work(tokens, seconds)` (the admission's
        check, which raises 429) runs before compression on the server's engine, with the
        compressed documents' budget and the compression's expected time: a request that will
        miss its deadline is refused before its most expensive stage, not after it."""
        self.check_model(req.model)
        self.check_input(req)
        state, prompts = self.state, self.state.settings.prompts
        arm = state.experiment.assign(req.user, current_hints()) if state.experiment is not None else None
        if arm is not None:
            req = arm.apply(req)  # the arm's per-request options win over the client's
        arm_name = arm.name if arm is not None else DEFAULT_ARM
        engine = state.arm_engines.get(arm_name, state.engine)
        surface = self.surface(req, engine)
        timer = StageTimer()
        with timer.stage("segments"):
            segments = split_segments(
                req.messages,
                req.documents,
                start_marker=prompts.document_start_marker,
                end_marker=prompts.document_end_marker,
            )
        options = req.ragspeed
        if options and options.system_prompt:
            segments = state.prompts.apply(segments, options.system_prompt)
        if surface.tools is not None:
            segments = with_tools(segments, surface.tools)
        documents = segments.documents
        if options and options.retrieval:
            if not state.retrieval.enabled:
                raise APIError(400, "retrieval is not enabled on this server", param="ragspeed.retrieval")
            with timer.stage("retrieval"):
                retrieved = await self._cpu_job(state.retrieval, segments.question, options.retrieval)
                documents = documents + tuple(retrieved)
        max_documents = state.settings.limits.max_documents
        if len(documents) > max_documents:
            raise APIError(
                400,
                f"the request has {len(documents)} documents; the limit is {max_documents} (max_documents)",
                param="documents",
                code="too_many_documents",
            )
        report, judged = None, False
        compression = options.compression if options else None
        compress = state.compression
        if documents and compress is not None and compression is not False and compress.runs(compression):
            if check_work is not None and engine is state.engine:
                forecast = compress.forecast(segments, documents, compression)
                check_work(forecast.kept_tokens, forecast.seconds)
                judged = True
            with timer.stage("compression"):
                documents, report = await self._cpu_job(compress, segments, documents, compression)
            if report is not None:
                self._count_compression(report, arm_name)
        compressed = report is not None and not report.failed and report.skipped_reason is None
        document_cache = self.document_cache(options, compressed=compressed)
        with timer.stage("prompt"):
            try:
                prompt = assemble_prompt(
                    engine.tokenizer,
                    segments,
                    documents,
                    document_spans=document_cache is not None,
                    static_token_ids=self.static_token_ids,
                )
            except TemplateError as exc:  # e.g. a role the model's chat template does not know
                raise APIError(
                    400,
                    f"the model's chat template rejects these messages: {exc}",
                    param="messages",
                    code="invalid_messages",
                ) from None
        max_tokens = req.max_completion_tokens or req.max_tokens
        # A proxy that forwards chat sends the request itself upstream, its documents in place.
        chat = None
        if getattr(engine, "forwards_chat", False):
            start, end = prompts.document_start_marker, prompts.document_end_marker
            chat = upstream_chat_body(req, segments, documents, start_marker=start, end_marker=end)
        return self._prepared(
            req,
            prompt,
            timer,
            max_tokens,
            report,
            engine,
            options,
            document_cache,
            arm_name,
            judged,
            chat,
            surface=surface,
        )

    def surface(self, req: _SamplingFields, engine: EngineClient) -> Surface:
        """What the engine makes of the request's fields beyond plain chat. A proxy that
        forwards chat sends them upstream as they came, for the upstream to honour or refuse."""
        if getattr(engine, "forwards_chat", False) and isinstance(req, ChatCompletionRequest):
            return Surface()
        chat = isinstance(req, ChatCompletionRequest)
        tools = tool_calls(req, tool_format(engine.tokenizer)) if chat else None
        return Surface(tools, output_constraint(req, tools), unhonoured_fields(req))

    async def _cpu_job(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Compression or retrieval embedding, off the event loop: beside a native engine, on a
        CPU thread the engine gives up while it runs (engine.backends.native.CpuBudget), so
        the process keeps to `num_threads` busy threads; else in a plain worker thread."""
        run_beside = getattr(self.engine, "run_beside", None)
        if run_beside is None:
            return await asyncio.to_thread(fn, *args)
        return await run_beside(fn, *args)

    def document_cache(
        self, options: RagspeedOptions | None, *, compressed: bool = False
    ) -> DocumentCacheOptions | None:
        """The request's document KV reuse: its `ragspeed.document_cache` (a policy, true, or
        false: exact prefill) over the server's policy; absent, the server's `document_cache`
        decides, for documents that went uncompressed (after top-docs selection reuse lost 0.09
        of accuracy against the selection alone): auto, the fidelity gate's choice for this
        model (`state.document_cache_default`, gateway.fidelity_gate: exact prefill unless a
        policy measured faithful); on, `document_cache_policy`; off, exact prefill."""
        asked = options.document_cache if options is not None else None
        settings = self.state.settings.engine
        configured = settings.document_cache_options()
        gated = self.state.document_cache_default
        default = {
            "on": configured,
            "auto": gated.options if gated is not None else None,
        }.get(settings.document_cache)
        if asked is False or (asked is None and (default is None or compressed)):
            return None
        if asked is None:
            return default
        given = asked if isinstance(asked, DocumentCacheIn) else DocumentCacheIn()
        base = default or configured
        return DocumentCacheOptions(
            policy=given.policy or base.policy,
            num_tokens=base.num_tokens if given.tokens is None else given.tokens,
            ratio=base.ratio if given.ratio is None else given.ratio,
            glue=given.glue or base.glue,
        )

    def _count_compression(self, report: CompressionReport, arm: str) -> None:
        labels = {"model": self.state.settings.model_id, "arm": arm}
        metrics = self.state.metrics
        metrics.documents_tokens.labels(**labels, phase="original").inc(report.original_tokens)
        metrics.documents_tokens.labels(**labels, phase="compressed").inc(report.compressed_tokens)
        if report.failed:
            metrics.compression_fallbacks.labels(**labels).inc()

    def check_input(self, req: _SamplingFields) -> None:
        """What the schema cannot say: text that is valid JSON but not valid Unicode (a lone
        surrogate cannot be tokenized), token ids outside the vocabulary, seeds torch refuses."""
        _reject_lone_surrogates(req.model_dump(exclude_none=True), "")
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
            raise APIError(400, f"stop_token_ids must lie in [0, {vocab})", param="stop_token_ids")
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise APIError(400, "seed must be a 64-bit integer", param="seed")

    def completion(self, req: CompletionRequest) -> PreparedRequest:
        self.check_model(req.model)
        self.check_input(req)
        timer = StageTimer()
        with timer.stage("prompt"):
            if isinstance(req.prompt, str):
                text = req.prompt
                token_ids = self.engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
            else:
                prompt_ids = cast(list[int], req.prompt)  # the validator turns one text in a list into str
                vocab = len(self.engine.tokenizer)
                if any(not 0 <= t < vocab for t in prompt_ids):
                    raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
                token_ids = list(prompt_ids)
                text = self.engine.tokenizer.decode(token_ids)
        prompt = Prompt(text=text, token_ids=tuple(token_ids), num_static_tokens=0)
        return self._prepared(
            req,
            prompt,
            timer,
            req.max_tokens,
            None,
            self.engine,
            None,
            surface=self.surface(req, self.engine),
        )

    def _prepared(
        self,
        req: _SamplingFields,
        prompt: Prompt,
        timer: StageTimer,
        max_tokens: int | None,
        report: CompressionReport | None,
        engine: EngineClient,
        options: RagspeedOptions | None,
        document_cache: DocumentCacheOptions | None = None,
        arm: str = DEFAULT_ARM,
        judged_before_compression: bool = False,
        chat: dict[str, Any] | None = None,
        *,
        surface: Surface,
    ) -> PreparedRequest:
        settings = self.state.settings
        sampling = sampling_params(req, max_tokens, settings.prompts.default_max_tokens, surface.constraint)
        # The one context check (the engines run the same one on their own inputs): here, before
        # the key's token budget is charged.
        check_context_length(len(prompt.token_ids), sampling.max_tokens, engine.max_model_len)
        if not prompt.token_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        max_prompt_tokens = settings.limits.max_prompt_tokens
        if max_prompt_tokens is not None and len(prompt.token_ids) > max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(prompt.token_ids)} tokens; the limit is "
                f"{max_prompt_tokens} (max_prompt_tokens)",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="prompt_too_long",
            )
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
            document_spans=prompt.document_spans,
            document_cache=document_cache if prompt.document_spans else None,
            priority=request_priority(options),
            chat=chat,
        )
        return PreparedRequest(
            request_id,
            generation,
            timer,
            engine,
            report,
            arm=arm,
            principal=principal,
            return_prompt=bool(options and options.return_prompt),
            deadline_ms=options.deadline_ms if options is not None else None,
            judged_before_compression=judged_before_compression,
            tools=surface.tools,
            ignored_fields=surface.ignored_fields,
            n=req.n,
        )
