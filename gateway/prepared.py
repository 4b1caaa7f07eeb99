"""A request prepared for its engine (`PreparedRequest`), and the last stage of preparing one:
`build_prepared` turns what the stages made (`Staged`: the prompt, its engine, the compression
report, the document cache's options...) into the engine's `GenerationRequest`, after the checks
that need the whole prompt (context length, `max_prompt_tokens`, the key's token budget).

The stages themselves are gateway.prepare's; running the result is gateway.run's.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

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
from ragspeed.gateway.compress import CompressionReport
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import DEFAULT_ARM
from ragspeed.gateway.limits import arrival_time
from ragspeed.gateway.prompt import Prompt
from ragspeed.gateway.protocol import ChatCompletionRequest, RagspeedOptions, _SamplingFields
from ragspeed.gateway.security import Principal, current_principal
from ragspeed.gateway.tools import ToolCalls


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
class PreparedRequest:
    """A request ready for the engine: what `run.Generation` needs, and what it reports. Built
    complete by `build_prepared` (the timer inside it keeps counting the stages that follow)."""

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


@dataclass(frozen=True)
class Surface:
    """What the engine makes of a request's fields beyond plain chat (gateway.surface)."""

    tools: ToolCalls | None = None
    constraint: StructuredOutput | None = None
    ignored_fields: tuple[str, ...] = ()


@dataclass(frozen=True)
class Staged:
    """What the stages made of a request: its prompt and the engine it runs on, with what the
    response reports about them."""

    prompt: Prompt
    engine: EngineClient
    surface: Surface
    max_tokens: int | None  # as asked; None: the server's default_max_tokens
    options: RagspeedOptions | None = None
    arm: str = DEFAULT_ARM
    compression: CompressionReport | None = None
    judged_before_compression: bool = False
    document_cache: DocumentCacheOptions | None = None  # None: exact prefill
    chat: dict[str, Any] | None = None  # the chat body a proxy that forwards chat sends upstream


@dataclass(frozen=True)
class RequestLimits:
    """The server's options that the last stage applies (the prompts and limits sections')."""

    default_max_tokens: int
    max_prompt_tokens: int | None = None


def request_priority(options: RagspeedOptions | None) -> int:
    """The engine priority of `ragspeed.priority`."""
    batch = options is not None and options.priority == "batch"
    return PRIORITY_BATCH if batch else PRIORITY_INTERACTIVE


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


def build_prepared(
    req: _SamplingFields, staged: Staged, timer: StageTimer, limits: RequestLimits
) -> PreparedRequest:
    """The request for its engine, once the checks that need its whole prompt pass."""
    prompt, engine, options = staged.prompt, staged.engine, staged.options
    sampling = sampling_params(req, staged.max_tokens, limits.default_max_tokens, staged.surface.constraint)
    # The one context check (the engines run the same one on their own inputs): here, before
    # the key's token budget is charged.
    check_context_length(len(prompt.token_ids), sampling.max_tokens, engine.max_model_len)
    if not prompt.token_ids:
        raise APIError(400, "the prompt is empty", param="prompt")
    max_prompt_tokens = limits.max_prompt_tokens
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
        document_cache=staged.document_cache if prompt.document_spans else None,
        priority=request_priority(options),
        chat=staged.chat,
    )
    return PreparedRequest(
        request_id,
        generation,
        timer,
        engine,
        staged.compression,
        arm=staged.arm,
        principal=principal,
        return_prompt=bool(options and options.return_prompt),
        deadline_ms=options.deadline_ms if options is not None else None,
        judged_before_compression=staged.judged_before_compression,
        tools=staged.surface.tools,
        ignored_fields=staged.surface.ignored_fields,
        n=req.n,
    )
