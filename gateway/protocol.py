"""Wire models: the OpenAI chat-completions and completions schemas plus ragspeed's extensions.

Extensions follow vLLM where vLLM has one (`documents`, `cache_salt`, `top_k`, `min_p`,
`usage.prompt_tokens_details.cached_tokens`); ragspeed's own per-request options live in one
`ragspeed` object, which the openai SDK sends through `extra_body`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ragspeed.engine.protocol import MAX_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class DocumentIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: str
    title: str = ""
    id: str | None = None
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Free-form; carried with the document through compression."
    )


class CompressionOptions(_Strict):
    method: str | None = Field(None, description="Compressor name; default: the server's.")
    rate: float | None = Field(None, gt=0, le=1, description="Keep this share of document tokens.")
    target_tokens: int | None = Field(None, ge=1, description="Keep about this many document tokens.")

    @model_validator(mode="after")
    def _one_budget(self) -> CompressionOptions:
        if self.rate is not None and self.target_tokens is not None:
            raise ValueError("give either rate or target_tokens, not both")
        return self


class RetrievalOptions(_Strict):
    collection: str
    top_k: int = Field(5, ge=1, le=100)
    mode: Literal["dense", "bm25", "hybrid"] = "hybrid"


class DocumentCacheIn(_Strict):
    policy: Literal["reuse", "sink", "blend"] | None = Field(
        None, description="Repair policy; default: the server's."
    )
    tokens: int | None = Field(
        None, ge=0, le=4096, description="sink: each document's first tokens recomputed."
    )
    ratio: float | None = Field(None, ge=0, le=1, description="blend: share of document tokens recomputed.")
    glue: Literal["recompute", "reuse"] | None = Field(
        None, description="The text between documents: recomputed in context, or reused from the store."
    )


class RagspeedOptions(_Strict):
    system_prompt: str | None = Field(None, description="Name of a registered static system prompt.")
    compression: CompressionOptions | Literal[False] | None = None
    # true: the server's policy; false: prefill the documents in full; default: the server's choice.
    document_cache: DocumentCacheIn | bool | None = None
    retrieval: RetrievalOptions | None = None
    deadline_ms: float | None = Field(
        None,
        gt=0,
        description="Deadline of this request's first token from its arrival, ms: refused at once with 429 when the server predicts it would miss it (default: the server's ttft_deadline_ms; batch requests have none).",
    )
    priority: Literal["interactive", "batch"] = Field(
        "interactive", description="batch requests wait behind interactive ones in the engine's queue."
    )
    return_prompt: bool = Field(
        False,
        description="Return the prompt as sent to the engine (after "
        "compression) in the response's `ragspeed.prompt`; for A/B quality checks.",
    )


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="0 or -1 disables top-k.")
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(1, ge=1)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the number of alternatives per token."""
        return None

    @field_validator("n")
    @classmethod
    def _single_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return stops


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    documents: list[str | DocumentIn] | None = None
    ragspeed: RagspeedOptions | None = None
    logprobs: bool | None = Field(None, description="Return each output token's logprob.")
    top_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="Also this many most likely tokens per position."
    )

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top_logprobs: int | None, info: ValidationInfo) -> int | None:
        if top_logprobs is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top_logprobs

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int]
    # vLLM's extension: a prompt already rendered through a chat template holds its BOS token.
    add_special_tokens: bool = True
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each output token's logprob and this many most likely tokens per position.",
    )

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            return prompt[0]
        if isinstance(prompt, list) and not prompt:
            raise ValueError("prompt is empty")
        return prompt
