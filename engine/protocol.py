"""The one protocol between the gateway and every engine backend (docs/architecture.md, contract 2).

Terms used across the engine:

- *prompt tokens*: the token ids of the fully rendered prompt (chat template applied).
- *static prefix*: the first `num_static_tokens` prompt tokens, the static system prompt. Only
  this part is worth pre-warming and pinning; everything after it changes per request.
- *cached tokens*: prompt tokens whose KV came from the prefix cache instead of a prefill.
- *delta*: what one engine step adds to a request's output: token ids and the text they decode
  to (never a split UTF-8 character).
- *pinned prefix*: a static prefix whose full cached blocks carry an extra reference, so they
  are never evicted while it is pinned (a registered prompt, `PrefixCacheControl`).
- *document spans*: `[start, end)` ranges of prompt tokens, one per retrieved document, each
  tokenized on its own, so that a document's KV can be computed once and reused at any position
  (engine.native.core.document_kv). Tokens outside every span (the static prefix, the glue between
  documents, history and question) are always computed in context.
- *logprobs*: the natural log of a token's probability under the model's raw next-token
  distribution, log_softmax of the unprocessed logits (vLLM's default `raw_logprobs`): before
  temperature, top-k, top-p or min-p, so they do not depend on the sampling parameters.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

# The kinds of output constraint (`StructuredOutput.kind`) and what `spec` holds for each.
STRUCTURED_KINDS = {
    "json_schema": "a JSON Schema, as JSON text",
    "json_object": "nothing: any JSON object",
    "regex": "a regular expression the whole output matches",
    "choice": "a JSON list of strings, one of which is the whole output",
    "grammar": "a grammar in Lark syntax (llguidance's), or GBNF",
}


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output text: every sampled token keeps the text a prefix of
    some string the constraint accepts, and the request may end only where the text is one.
    `kind` is a key of STRUCTURED_KINDS; `spec` is what that kind holds (text, so that the
    record stays hashable and compiled grammars can be kept by it)."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs. k in [0, MAX_LOGPROBS]: each output token carries its logprob and the
    # k most likely tokens with theirs (TokenDelta.logprobs).
    logprobs: int | None = None
    # OpenAI's penalties: subtract frequency_penalty * count and presence_penalty * (count > 0)
    # from the logit of every token already in the output. vLLM's repetition_penalty (> 1
    # discourages) divides positive logits and multiplies negative ones of tokens already in
    # the prompt or the output.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether anything changes this request's logits before sampling (a free row: no)."""
        return (
            self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
            or self.structured is not None
        )


# Repair policies of document KV reuse (engine.native.core.document_kv says what each recomputes).
DOCUMENT_CACHE_POLICIES = ("reuse", "sink", "blend")
# What becomes of the glue, the tokens between two documents (their separator and number).
DOCUMENT_GLUE_MODES = ("recompute", "reuse")


@dataclass(frozen=True)
class DocumentCacheOptions:
    """How a request's documents reuse stored KV: `policy` is one of DOCUMENT_CACHE_POLICIES;
    `num_tokens` is sink's count of each document's first tokens recomputed in context, `ratio`
    blend's share of document tokens recomputed through the later layers. `glue` is one of
    DOCUMENT_GLUE_MODES: recomputed in context, or stored and placed like a document."""

    policy: str = "sink"
    num_tokens: int = 16
    ratio: float = 0.15
    glue: str = "recompute"

    def __post_init__(self) -> None:
        if self.policy not in DOCUMENT_CACHE_POLICIES:
            raise ValueError(f"document cache policy must be one of {', '.join(DOCUMENT_CACHE_POLICIES)}")
        if self.num_tokens < 0:
            raise ValueError(f"document cache tokens must be >= 0, got {self.num_tokens}")
        if not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"document cache ratio must be in [0, 1], got {self.ratio}")
        if self.glue not in DOCUMENT_GLUE_MODES:
            raise ValueError(f"document cache glue must be one of {', '.join(DOCUMENT_GLUE_MODES)}")


@dataclass(frozen=True)
class DocumentReuse:
    """What document KV reuse did for one request (reported on its first delta)."""

    num_hit: int = 0  # documents whose KV came from the store (or a computation in flight)
    num_computed: int = 0  # documents prefilled on their own for the store, at first sight
    num_recomputed_tokens: int = 0  # tokens computed in context: glue, question, repair


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # Rendered prompt text; remote backends forward text, the native engine uses the ids.
    prompt: str = ""
    num_static_tokens: int = 0
    cache_salt: str | None = None
    # Each document's [start, end) in prompt_token_ids, in order (see the module docstring).
    document_spans: tuple[tuple[int, int], ...] = ()
    # None: the prompt is prefilled as a whole; else its documents reuse stored KV.
    document_cache: DocumentCacheOptions | None = None
    # Lower runs first among waiting requests: PRIORITY_INTERACTIVE, PRIORITY_BATCH.
    priority: int = 0
    # A chat request as an upstream chat server takes it (the openai backend's chat mode):
    # the client's messages with the documents rendered into their fixed place, and every field
    # the gateway does not consume passed through as the client sent it. None: a text prompt.
    chat: dict[str, Any] | None = None


PRIORITY_INTERACTIVE, PRIORITY_BATCH = 0, 1

# The most alternatives per token a request may ask for (OpenAI's `top_logprobs` limit).
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's logprob and the `SamplingParams.logprobs` most likely tokens at its
    position (`top`: (token_id, logprob) pairs, most likely first)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """One step's output for one request. The last delta has `finish_reason` set."""

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    # Backends that stream text without token ids (remote upstreams) report the output token
    # count here on the final delta; otherwise the gateway counts `token_ids`.
    num_completion_tokens: int | None = None
    # One entry per `token_ids` entry when the request asked for logprobs; None otherwise.
    logprobs: tuple[TokenLogprob, ...] | None = None
    # On the first delta of a request whose documents went through the document KV cache.
    documents: DocumentReuse | None = None
    # On the final delta of a pinning prefill (`NativeEngine.pin`): the blocks it pinned.
    pinned_block_ids: tuple[int, ...] = ()
    # OpenAI `delta.tool_calls` entries ({index, id?, type?, function: {name?, arguments}}), as
    # an upstream chat server streams them; the gateway merges them by index.
    tool_calls: tuple[dict[str, Any], ...] = ()
    # An upstream chat server's `choices[0].logprobs` for this delta, passed back as it came.
    wire_logprobs: dict[str, Any] | None = None


class EngineError(Exception):
    """A request the engine refuses ("never"); the gateway maps it to an HTTP status."""

    status_code = 400

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class PromptTooLongError(EngineError):
    status_code = 400


def check_context_length(num_prompt: int, max_tokens: int, max_model_len: int) -> None:
    """Raise PromptTooLongError when the prompt plus `max_tokens` exceeds the context; the
    parameter named is `messages` when the prompt alone does not fit."""
    if num_prompt + max_tokens > max_model_len:
        raise PromptTooLongError(
            f"prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) exceeds the "
            f"model's context of {max_model_len} tokens",
            param="messages" if num_prompt >= max_model_len else "max_tokens",
            code="context_length_exceeded",
        )


class UpstreamError(EngineError):
    """An upstream server failed (502) or timed out (504)."""

    status_code = 502


class UpstreamTimeoutError(UpstreamError):
    status_code = 504


@runtime_checkable
class PrefixCacheControl(Protocol):
    """Pinned static prefixes in an engine's prefix cache: what the prompt registry needs of an
    engine (`EngineClient.prefix_cache`). Block ids are the engine's own; pass them back as
    returned. The KV that `export` returns and `restore` takes is the engine's own layout
    (the native engine: a tensor `[2, num_layers, num_blocks, block_size, num_kv_heads,
    head_dim]`), saved and loaded by the store that `fingerprint` keys."""

    @property
    def block_size(self) -> int:
        """Tokens per KV block: a pin of n blocks holds n * block_size prompt tokens."""

    async def fingerprint(self) -> dict[str, Any]:
        """What must be equal for exported KV to be restored here (model, tokenizer, layout)."""

    async def pin(self, token_ids: tuple[int, ...], cache_salt: str | None) -> tuple[int, ...]:
        """Prefill `token_ids` into the cache and pin its full blocks under `cache_salt`;
        returns the pinned block ids (the longest cached prefix, () if nothing fits)."""

    async def unpin(self, block_ids: tuple[int, ...]) -> None:
        """Drop a pin (`block_ids` as `pin` or `restore` returned them); the blocks stay cached
        and become evictable."""

    async def export(self, block_ids: tuple[int, ...]) -> Any:
        """A copy of the KV of `block_ids`, in order, for a store to save."""

    async def restore(
        self, token_ids: tuple[int, ...], kv: Any, cache_salt: str | None
    ) -> tuple[int, ...] | None:
        """Put exported KV of `token_ids`' leading full blocks back into the cache, pinned;
        returns the pinned block ids, or None while the pool has no room."""


@runtime_checkable
class EngineClient(Protocol):
    """What the gateway needs of a backend. Implementations are built by `engine.backends`."""

    model_name: str
    max_model_len: int

    @property
    def tokenizer(self) -> Any:
        """A Hugging Face tokenizer of the target model (counts tokens, renders chat)."""

    async def start(self) -> None:
        """Load weights and start any background loop; ready after it returns."""

    async def shutdown(self) -> None:
        """Abort everything and release all resources."""

    def generate(self, request: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Stream the request's deltas. Closing the iterator early aborts the request."""

    async def abort(self, request_id: str) -> None:
        """Stop a request and free everything it holds; unknown ids are ignored."""

    async def warm(self, prefix_token_ids: tuple[int, ...], cache_salt: str | None = None) -> int:
        """Prefill a static prefix into the cache; returns the number of tokens now cached."""

    async def store_documents(self, request: GenerationRequest) -> DocumentReuse | None:
        """Prefill `request`'s documents (its document_spans) into the document store, sampling
        nothing; None where this engine keeps no document KV."""

    def stats(self) -> dict[str, float]:
        """Numbers for /metrics: blocks in use, cache hits, and so on."""

    def prefix_cache(self) -> PrefixCacheControl | None:
        """This engine's pinned-prefix control; None when it has no prefix cache to pin in (a
        remote upstream, the transformers baseline, the native engine with caching off)."""
