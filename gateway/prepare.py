"""Preparing a request: segments -> (retrieval) -> compression -> prompt, each stage timed.

`Preparer` runs the stages in order over the few services they need, built once the app has
loaded them (gateway.pipeline.build_pipeline): the A/B arms and their engines
(gateway.experiments), the registered prompts, the document stage (gateway.document_stage:
retrieval, compression, document KV reuse), then the prompt. What comes out is a
`PreparedRequest` (gateway.prepared); running it is gateway.run.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from jinja2 import TemplateError

from ragspeed.engine.protocol import EngineClient
from ragspeed.gateway.document_stage import DocumentStage
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.experiments import ArmEngines
from ragspeed.gateway.prepared import (
    PreparedRequest,
    RequestLimits,
    Staged,
    StageTimer,
    Surface,
    build_prepared,
)
from ragspeed.gateway.prompt import (
    Prompt,
    assemble_prompt,
    split_segments,
    static_prefix_token_ids,
)
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.protocol import ChatCompletionRequest, CompletionRequest, _SamplingFields
from ragspeed.gateway.surface import output_constraint, tool_calls, unhonoured_fields, with_tools
from ragspeed.gateway.tools import tool_format
from ragspeed.gateway.upstream_chat import upstream_chat_body


class StaticPrefixes:
    """`static_prefix_token_ids`, kept by (tokenizer, text): an application sends the same
    static system prompt with every request. Not for a chat template that reads the clock
    (`strftime_now`, e.g. Llama 3's date line): its rendering changes with the day."""

    def __init__(self, maxsize: int = 64) -> None:
        self._cached: Callable[[Any, str], tuple[int, ...]] = functools.lru_cache(maxsize=maxsize)(
            static_prefix_token_ids
        )

    def static_token_ids(self, tokenizer: Any, static_system_prompt: str) -> tuple[int, ...]:
        if "strftime_now" in str(getattr(tokenizer, "chat_template", "")):
            return static_prefix_token_ids(tokenizer, static_system_prompt)
        return self._cached(tokenizer, static_system_prompt)


@dataclass(frozen=True)
class Markers:
    """The marks of a document inside a message (the prompts section's)."""

    start: str
    end: str


@dataclass(frozen=True)
class Preparer:
    """Turns a parsed request into a `PreparedRequest`; raises APIError for what cannot run."""

    model_id: str  # the name this server answers to
    arms: ArmEngines  # the server's engine, and each A/B arm's
    registry: PromptService  # registered system prompts (`ragspeed.system_prompt`)
    documents: DocumentStage
    markers: Markers
    limits: RequestLimits
    prefixes: StaticPrefixes = field(default_factory=StaticPrefixes)

    @property
    def engine(self) -> EngineClient:
        return self.arms.engine

    def check(self, req: _SamplingFields) -> None:
        """What the schema cannot say: the model's name; text that is valid JSON but not valid
        Unicode (a lone surrogate cannot be tokenized), token ids outside the vocabulary, seeds
        torch refuses."""
        if req.model is not None and req.model != self.model_id:
            raise APIError(
                404,
                f"the model '{req.model}' does not exist; this server serves '{self.model_id}'",
                param="model",
                code="model_not_found",
            )
        _reject_lone_surrogates(req.model_dump(exclude_none=True), "")
        vocab = len(self.engine.tokenizer)
        if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
            raise APIError(400, f"stop_token_ids must lie in [0, {vocab})", param="stop_token_ids")
        if req.seed is not None and not -(2**63) <= req.seed < 2**64:
            raise APIError(400, "seed must be a 64-bit integer", param="seed")

    async def chat(
        self, req: ChatCompletionRequest, check_work: Callable[[int, float], object] | None = None
    ) -> PreparedRequest:
        """The request prepared for its engine. `check_work(tokens, seconds)`, the admission's
        check, runs before the compression of a request on the server's engine
        (gateway.document_stage)."""
        self.check(req)
        req, arm, engine = self.arms.choose(req)
        # What the engine makes of the fields beyond plain chat; a proxy that forwards chat
        # sends them upstream as they came, for the upstream to honour or refuse.
        surface = Surface()
        if not getattr(engine, "forwards_chat", False):
            tools = tool_calls(req, tool_format(engine.tokenizer))
            surface = Surface(tools, output_constraint(req, tools), unhonoured_fields(req))
        timer = StageTimer()
        with timer.stage("segments"):
            segments = split_segments(
                req.messages, req.documents, start_marker=self.markers.start, end_marker=self.markers.end
            )
        options = req.ragspeed
        if options and options.system_prompt:
            segments = self.registry.with_registered_prompt(segments, options.system_prompt)
        if surface.tools is not None:
            segments = with_tools(segments, surface.tools)
        prepared = await self.documents.prepare(
            segments, options, timer, arm=arm, check_work=check_work if engine is self.engine else None
        )
        documents = prepared.documents
        # A proxy that forwards chat sends the request itself upstream, its documents in place.
        chat = None
        if getattr(engine, "forwards_chat", False):
            chat = upstream_chat_body(
                req, segments, documents, start_marker=self.markers.start, end_marker=self.markers.end
            )
        with timer.stage("prompt"):
            try:
                prompt = assemble_prompt(
                    engine.tokenizer,
                    segments,
                    documents,
                    document_spans=prepared.document_cache is not None,
                    static_token_ids=self.prefixes.static_token_ids,
                )
            except TemplateError as exc:  # e.g. a role the model's chat template does not know
                raise APIError(
                    400,
                    f"the model's chat template rejects these messages: {exc}",
                    param="messages",
                    code="invalid_messages",
                ) from None
        staged = Staged(
            prompt,
            engine,
            surface,
            max_tokens=req.max_completion_tokens or req.max_tokens,
            options=options,
            arm=arm,
            compression=prepared.compression,
            judged_before_compression=prepared.judged_before_compression,
            document_cache=prepared.document_cache,
            chat=chat,
        )
        return build_prepared(req, staged, timer, self.limits)

    def completion(self, req: CompletionRequest) -> PreparedRequest:
        self.check(req)
        timer = StageTimer()
        tokenizer = self.engine.tokenizer
        with timer.stage("prompt"):
            if isinstance(req.prompt, str):
                text = req.prompt
                token_ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
            else:
                prompt_ids = cast(list[int], req.prompt)  # the validator turns one text in a list into str
                vocab = len(tokenizer)
                if any(not 0 <= t < vocab for t in prompt_ids):
                    raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
                token_ids = list(prompt_ids)
                text = tokenizer.decode(token_ids)
        prompt = Prompt(text=text, token_ids=tuple(token_ids), num_static_tokens=0)
        surface = Surface(None, output_constraint(req), unhonoured_fields(req))
        staged = Staged(prompt, self.engine, surface, max_tokens=req.max_tokens)
        return build_prepared(req, staged, timer, self.limits)


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
