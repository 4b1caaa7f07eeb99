"""Wire models: the OpenAI chat-completions and completions schemas plus ragspeed's extensions.

Extensions follow vLLM where vLLM has one (`documents`, `cache_salt`, `top_k`, `min_p`,
`repetition_penalty`, `structured_outputs` and its older `guided_*` names,
`usage.prompt_tokens_details.cached_tokens`); ragspeed's own per-request options live in one
`ragspeed` object, which the openai SDK sends through `extra_body`.

No field is dropped in silence. A declared field is honoured. Every other field stays on the
request (`model_extra`): OpenAI's fields that change the output and that the native engine
cannot honour are refused with a 400 naming them (REFUSED_FIELDS), those that change nothing
here are accepted and named in the response's `x-ragspeed-ignored-fields` header
(IGNORED_FIELDS, and any vendor field ragspeed does not know); the proxy forwards them all.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ragspeed.engine.protocol import MAX_LOGPROBS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# OpenAI's request fields that change nothing on this server: accepted, and named in the
# response's `x-ragspeed-ignored-fields` header.
IGNORED_FIELDS = frozenset(
    {
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",  # the prefix cache keys by tokens (and `cache_salt`), not by a name
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "prediction",  # a predicted output speeds OpenAI's decoding; it never changes the text
        "reasoning_effort",  # no reasoning model is served natively
        "guided_decoding_backend",  # one grammar library serves every constraint
    }
)

# OpenAI's (and vLLM's) request fields that change the output and that the native engine cannot
# honour: a 400 naming the field, with the reason. The proxy forwards them to its upstream.
REFUSED_FIELDS = {
    "audio": "audio output is not supported: the model writes text only",
    "web_search_options": "web search is not supported",
    "verbosity": "verbosity is not supported; bound the answer with max_tokens",
    "moderation": "moderation is not supported",
    "functions": "functions is deprecated and not supported; send tools",
    "function_call": "function_call is deprecated and not supported; send tool_choice",
    "guided_whitespace_pattern": "a whitespace pattern is not supported",
    "best_of": "best_of is not supported; ask for n choices",
    "suffix": "suffix (insertion) is not supported",
}


class ToolCallFunction(BaseModel):
    name: str
    arguments: str = Field("", description="The arguments as JSON text.")


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    # Kept whole (`extra`: e.g. `refusal`) so that the proxy forwards the message as it came.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or content parts ({"type": "text", "text": ...}, images, audio...): the native
    # engine reads text parts only and refuses the others (gateway.prepare).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant turn's calls.")
    tool_call_id: str | None = Field(None, description="The call a tool message answers.")

    @field_validator("content")
    @classmethod
    def _parts_have_types(cls, content: Any) -> Any:
        if isinstance(content, list):
            for part in content:
                if not isinstance(part.get("type"), str):
                    raise ValueError("every content part needs a 'type'")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs a 'text' string")
        return content

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part["text"] for part in self.content if part["type"] == "text")

    @property
    def non_text_parts(self) -> list[str]:
        """The types of this message's content parts that are not text (images, audio...)."""
        if not isinstance(self.content, list):
            return []
        return [part["type"] for part in self.content if part["type"] != "text"]


class FunctionDefinition(BaseModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="The arguments' JSON Schema.")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class StructuredOutputsIn(_Strict):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's switches that change no output here (one backend, no fallback to choose).
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None

    @model_validator(mode="after")
    def _one_constraint(self) -> StructuredOutputsIn:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object") if self.given(name)]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar or json_object")
        return self

    def given(self, name: str) -> bool:
        value = self.json_ if name == "json" else getattr(self, name)
        return value is not None and value is not False


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
    # Undeclared fields are kept (`model_extra`): refused, named as ignored, or forwarded.
    model_config = ConfigDict(extra="allow")

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
    n: int = Field(1, ge=1, le=16)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=10, description="vLLM's: > 1 discourages repeats.")
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100]."
    )
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(None, min_length=1)

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None (off) or the number of alternatives per token."""
        return None

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, logit_bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (logit_bias or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids written as strings, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"a bias must lie in [-100, 100], got {bias} for token {key}")
        return logit_bias

    @property
    def extra_fields(self) -> dict[str, Any]:
        """The undeclared fields the client sent (null ones left out)."""
        return {k: v for k, v in (self.model_extra or {}).items() if v is not None}

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
    response_format: ResponseFormat | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    structured_outputs: StructuredOutputsIn | None = None
    # vLLM's older names of structured_outputs' fields.
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    @model_validator(mode="after")
    def _consistent_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: function names must be unique")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(
                f"tool_choice names the function {choice.function.name!r}, which is not in tools"
            )
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return self

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
