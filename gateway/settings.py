"""Settings: the serving options, read from the command line, the environment and the config file.

The environment is read here and in ragspeed.environment (the cache folders and the CPU
kernels' switches, beneath the serving options), nowhere else.

Precedence, highest first: command-line flags, `RAGSPEED_*` environment variables, the config
file (YAML or TOML, `--config`), the defaults below. Every field is one documented option.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from ragspeed.compression.registry import COMPRESSORS, DEFAULT_METHOD, OFFERED_METHODS
from ragspeed.engine.config import EngineConfig
from ragspeed.engine.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.gateway.security import ApiKeyEntry, KeyHash

# The keys of engine.dtypes.DTYPES (kept here as a type: settings import no torch).
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
# engine.protocol.DOCUMENT_CACHE_POLICIES, DOCUMENT_GLUE_MODES and engine.document_kv.STORAGE_DTYPES,
# as types.
DocumentCachePolicy = Literal["reuse", "sink", "blend"]
DocumentGlue = Literal["recompute", "reuse"]
DocumentCacheDtype = Literal["float16", "bfloat16", "float32"]


class ConfigError(ValueError):
    """A configuration file or option that cannot be used; the message names the culprit."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RAGSPEED_", extra="forbid", frozen=True)

    # Server
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port).")
    log_level: str = Field("info", description="Log level: debug, info, warning, error.")
    access_log: bool = Field(True, description="Log one line per HTTP request (uvicorn's access log).")

    # Model and engine
    model: str = Field(
        DEFAULT_MODEL_NAME,
        description=f"Model: a zoo name ({DEFAULT_MODEL_NAME}, bench-135m, bench-0.5b), a local HF-format folder, a .gguf file or a hub id (org/name).",
    )
    served_model_name: str | None = Field(
        None, description="Model name clients use; default: the --model value."
    )
    engine: str = Field("native", description="Engine backend: native, transformers, openai or vllm.")
    tokenizer: str | None = Field(None, description="Tokenizer path or id; default: the model's.")
    device: str = Field("cpu", description="Device for embedded engines: cpu or cuda.")
    dtype: Dtype = Field(
        "auto",
        description="Precision of embedded engines: auto, float32, bfloat16 or float16. On CPU the native engine keeps fp32 weights, activations and KV cache and chooses only its prefill products' precision: auto takes bf16 where the CPU has AMX-BF16 or AVX512-BF16, a start-up measurement finds it faster than fp32 (kept per machine beside the CPU kernels) and the start-up quality gate passes it, fp32 elsewhere; bfloat16 fails to start on a CPU without them. Elsewhere the compute dtype (auto: bf16 where supported).",
    )
    num_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads of the native engine's forward pass; default: torch's (one per core). 1 on a CPU shared with other jobs.",
    )
    max_model_len: int | None = Field(None, ge=16, description="Context length; default: the model's.")
    block_size: int = Field(16, ge=1, description="Tokens per KV cache block (native engine).")
    num_kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="KV cache pool size in tokens (native); default: from kv_cache_memory_fraction.",
    )
    kv_cache_memory_fraction: float = Field(
        0.1,
        gt=0,
        le=1,
        description="Share of free memory for the KV cache when num_kv_cache_tokens is unset.",
    )
    max_num_seqs: int = Field(32, ge=1, description="Most requests in one batch (native).")
    max_num_batched_tokens: int = Field(
        512, ge=1, description="Token budget of one engine step: decodes plus prefill chunks (native)."
    )
    tpot_target_ms: float | None = Field(
        50.0,
        gt=0,
        description="Time budget of an engine step that carries decodes, ms: the prefill chunks beside them are sized to fit it (native; none: the token budget alone).",
    )
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of shared prompt prefixes (native).")
    prompt_cache_dir: str | None = Field(
        ".ragspeed/prompts",
        description="Folder where registered prompts (their text, and their pinned KV) are saved and restored from at start-up (native; a prompt whose KV cannot be used is prefilled again); none: not persisted.",
    )
    kv_cache_dtype: Literal["auto", "fp32", "fp16"] = Field(
        "auto",
        description="KV cache dtype (native): auto (fp16 on a CPU with ragspeed's kernels for an fp32 model, else the model's dtype), fp32 or fp16. fp16 halves what decode attention reads and what the pool, the document store and the prefix store hold.",
    )
    quantization: Literal["auto", "none", "int8", "gguf"] | None = Field(
        "auto",
        description="Weights (native): auto (on CPU a GGUF file's own blocks, else int8 where its quality gate passes on the model at start-up, else none), gguf (a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks as stored; other types dequantized), int8 (group-wise, its quality gate) or none (the checkpoint's dtype).",
    )
    speculative: str | None = Field(None, description="Speculative decoding: ngram or draft (native).")
    draft_model: str | None = Field(
        None,
        description="Draft model for --speculative draft: a zoo name, a local folder, a .gguf file or a hub id; same tokenizer as the model.",
    )
    draft_quantization: str | None = Field(
        "auto",
        description="Draft model weights: auto (int8 on a CPU, else as --quantization), none or int8. The target verifies every draft, so this moves acceptance, never the output.",
    )
    num_speculative_tokens: int = Field(4, ge=1, description="Draft tokens proposed per step.")

    # Document KV reuse (native; per request: `ragspeed.document_cache`)
    document_cache: Literal["off", "on"] = Field(
        "on",
        description="Reuse each document's stored KV at any position instead of prefilling it again: on applies document_cache_policy to every request whose documents go uncompressed (compressed ones only when they ask: after document selection, reuse costs answers); off only to requests that ask (`ragspeed.document_cache`). Token-level compression makes new documents; document selection keeps them whole and reusable.",
    )
    document_cache_policy: DocumentCachePolicy = Field(
        "reuse",
        description="Repair after placing stored documents: reuse (none), sink (each document's first document_cache_tokens tokens recomputed in context) or blend (the document_cache_ratio of document tokens whose keys deviate most, recomputed).",
    )
    document_cache_tokens: int = Field(16, ge=0, description="sink: each document's first tokens recomputed.")
    document_cache_ratio: float = Field(
        0.15, ge=0, le=1, description="blend: share of document tokens recomputed."
    )
    document_cache_glue: DocumentGlue = Field(
        "reuse",
        description="The text between two documents (separator and number): recompute (in context) or reuse (stored and placed as a document is; fewer fresh tokens).",
    )
    document_cache_bytes: int = Field(
        256 * 2**20, ge=0, description="RAM budget of the document KV store, bytes (LRU beyond it)."
    )
    document_cache_dir: str | None = Field(
        None,
        description="Folder of the document KV store's disk tier (one checksummed file per document); none: RAM only.",
    )
    document_cache_dtype: DocumentCacheDtype = Field(
        "float16", description="Precision of stored document KV: float16, bfloat16 or float32."
    )

    # Remote upstreams (engine=openai)
    upstreams: list[str] = Field(
        default_factory=list, description="OpenAI-compatible upstream base URLs (engine=openai)."
    )
    upstream_api_key: str | None = Field(None, description="Bearer key sent to upstreams.")
    upstream_model: str | None = Field(None, description="Model name sent upstream; default: --model.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Upstream connect timeout, seconds.")
    read_timeout_s: float = Field(60.0, gt=0, description="Upstream read timeout between chunks, seconds.")
    upstream_max_retries: int = Field(
        2,
        ge=0,
        description="Retries, with jitter, of an upstream request that failed to connect (nothing sent yet).",
    )
    upstream_circuit_failures: int = Field(
        5, ge=1, description="Failures in a row that open an upstream's circuit breaker."
    )
    upstream_circuit_reset_s: float = Field(
        30.0, gt=0, description="Seconds an open circuit waits before one trial request."
    )
    upstream_affinity: bool = Field(
        True,
        description="Send requests with the same static prefix to the same upstream (consistent hashing with bounded load), so its prefix cache hits.",
    )

    # Compression of the documents (per request: `ragspeed.compression`)
    compression_method: str | None = Field(
        None,
        description="Default compressor for every request: coarse-to-fine, fast, bm25, top-docs, first-docs, llmlingua2, identity; none: only when a request asks.",
    )
    compression_default_method: str = Field(
        DEFAULT_METHOD,
        description="Compressor for a request whose `ragspeed.compression` names no method (a rate or target_tokens alone), when compression_method is unset.",
    )
    compression_methods: list[str] = Field(
        default_factory=lambda: list(OFFERED_METHODS),
        description="Compressors this server offers, each loaded at start-up so that no request pays a load; a request naming another gets 400. llmlingua2 also needs compression_llmlingua2_model.",
    )
    compression_llmlingua2_model: str | None = Field(
        None,
        description="Local LLMLingua-2 model folder for the llmlingua2 compressor (needs the llmlingua extra).",
    )
    compression_rate: float = Field(
        0.25, gt=0, le=1, description="Default share of document tokens to keep (0.25 = 4x)."
    )
    compression_target_tokens: int | None = Field(
        None, ge=1, description="Default prompt-token target instead of a rate."
    )
    compression_min_document_tokens: int = Field(
        256, ge=0, description="Break-even: documents shorter than this go through uncompressed."
    )
    compression_order: str = Field(
        "original", description="Order of kept documents: original, or edges (most relevant first and last)."
    )
    compression_cache_entries: int = Field(
        100_000, ge=0, description="Sentence embeddings kept in the content-hash cache."
    )

    # Retrieval (collections for `ragspeed.retrieval`)
    collections_dir: str = Field(
        ".ragspeed/collections",
        description="Folder of persisted document collections (loaded at start-up when retrieval is enabled).",
    )
    enable_retrieval: bool = Field(
        True,
        description="Serve retrieval (`ragspeed.retrieval`, /v1/collections); its embedding model loads at start-up.",
    )
    embedding_model: str | None = Field(
        None, description="sentence-transformers model for retrieval; default: the bundled all-MiniLM-L6-v2."
    )

    # Requests
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none.")
    document_start_marker: str = Field(
        "<document>",
        min_length=1,
        description="Marks the start of a document inside a message, for clients that cannot send `documents`.",
    )
    document_end_marker: str = Field(
        "</document>", min_length=1, description="Marks the end of a document inside a message."
    )
    experiment: str | None = Field(
        None, description="Live A/B experiment: a YAML file of weighted arms (see gateway/experiments.py)."
    )

    # Security (gateway/security.py): auth is off while no key is configured
    api_keys: list[ApiKeyEntry] = Field(
        default_factory=list,
        description="API keys as {hash, tenant, requests_per_minute, tokens_per_minute}; on the command line 'sha256:<hex>,tenant=NAME,requests_per_minute=N,tokens_per_minute=N'.",
    )
    admin_key_hashes: list[KeyHash] = Field(
        default_factory=list,
        description="sha256:<hex> hashes of admin keys (needed for /v1/prompts, /v1/collections, /v1/experiments).",
    )

    # Limits (gateway/limits.py)
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Largest request body, bytes (413 above)."
    )
    max_documents: int = Field(
        64, ge=1, description="Most documents per request, sent plus retrieved (400 above)."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Most prompt tokens per request (400 above); default: the model's context."
    )
    max_concurrent_requests: int = Field(
        64, ge=1, description="Generation requests served at once; more wait in the queue."
    )
    max_queued_requests: int = Field(
        256, ge=0, description="Requests waiting for a slot; 429 when the queue is full."
    )
    queue_timeout_s: float = Field(30.0, gt=0, description="Longest wait for a slot, seconds (429 after).")
    ttft_deadline_ms: float | None = Field(
        10000.0,
        gt=0,
        description="Deadline of an interactive request's first token from its arrival, ms: a request whose predicted time to first token passes it is refused at once with 429 and Retry-After (a request's `ragspeed.deadline_ms` overrides it; none: no such check).",
    )
    request_timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="Deadline of one request from its arrival, seconds: then it is aborted and its KV blocks freed (504, or finish_reason abort once streaming).",
    )
    shutdown_drain_s: float = Field(
        10.0, ge=0, description="On SIGTERM: seconds to let in-flight requests finish before aborting them."
    )

    @field_validator("compression_methods")
    @classmethod
    def _known_compressors(cls, methods: list[str]) -> list[str]:
        unknown = sorted(set(methods) - set(COMPRESSORS))
        if unknown:
            raise ValueError(
                f"unknown compressor(s) {', '.join(unknown)}; known: {', '.join(sorted(COMPRESSORS))}"
            )
        return methods

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            backend=self.engine,
            model=self.model,
            tokenizer=self.tokenizer,
            device=self.device,
            dtype=self.dtype,
            num_threads=self.num_threads,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_kv_cache_tokens=self.num_kv_cache_tokens,
            kv_cache_memory_fraction=self.kv_cache_memory_fraction,
            kv_cache_dtype=self.kv_cache_dtype,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            tpot_target_ms=self.tpot_target_ms,
            enable_prefix_caching=self.enable_prefix_caching,
            quantization=self.quantization,
            speculative=self.speculative,
            draft_model=self.draft_model,
            draft_quantization=self.draft_quantization,
            num_speculative_tokens=self.num_speculative_tokens,
            document_cache_bytes=self.document_cache_bytes,
            document_cache_dir=self.document_cache_dir,
            document_cache_dtype=self.document_cache_dtype,
            upstreams=tuple(self.upstreams),
            upstream_api_key=self.upstream_api_key,
            upstream_model=self.upstream_model,
            connect_timeout_s=self.connect_timeout_s,
            read_timeout_s=self.read_timeout_s,
            upstream_max_retries=self.upstream_max_retries,
            upstream_circuit_failures=self.upstream_circuit_failures,
            upstream_circuit_reset_s=self.upstream_circuit_reset_s,
            upstream_affinity=self.upstream_affinity,
        )

    @property
    def model_id(self) -> str:
        """The name this server answers to in `model` fields."""
        return self.served_model_name or self.model


def check_settings(settings: Settings) -> None:
    """What no single field can check: options that must agree (every layer merged first)."""
    for name in ("compression_default_method", "compression_method"):
        method = getattr(settings, name)
        if method not in (None, "none") and method not in settings.compression_methods:
            raise ConfigError(
                f"invalid settings: {name}: {method!r} is not among compression_methods "
                f"({', '.join(settings.compression_methods) or 'none'})"
            )
    if "llmlingua2" in settings.compression_methods and not settings.compression_llmlingua2_model:
        raise ConfigError(
            "invalid settings: compression_methods: llmlingua2 needs compression_llmlingua2_model "
            "(a local LLMLingua-2 model folder)"
        )


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"config file {path} is not valid {path.suffix.lstrip('.') or 'YAML'}: {exc}"
        ) from exc
    data = data or {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of option names to values")
    data = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(set(data) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(f"config file {path}: unknown option(s) {', '.join(unknown)}")
    return data


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Defaults < config file < environment < `overrides` (CLI flags; None means unset)."""
    values = read_config_file(config_file) if config_file else {}
    try:
        from_env = Settings()
        values.update({k: getattr(from_env, k) for k in from_env.model_fields_set})
        values.update({k: v for k, v in overrides.items() if v is not None})
        settings = Settings(**values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors())
        raise ConfigError(f"invalid settings: {problems}") from exc
    check_settings(settings)
    return settings
