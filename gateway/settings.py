"""Settings: the serving options, read from the command line, the environment and the config file.

The environment is read here and in ragspeed.environment (the cache folders and the CPU
kernels' switches, beneath the serving options), nowhere else.

Precedence, highest first: command-line flags, `RAGSPEED_*` environment variables, the config
file (YAML or TOML, `--config`), the defaults below. Every field is one documented option.

Terms: an *option* is one setting as users name it, flat: `compression_rate` is the flag
`--compression-rate`, the variable `RAGSPEED_COMPRESSION_RATE` and the config-file key. A
*section* groups the options one part of the server takes (`Settings.compression` is what the
compression stage reads, as `rate`); a field whose name inside its section differs from its
option's carries the option's name as its alias. The sections are the settings' shape in code,
the flat names their shape outside it: every option keeps its name.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, cast, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ragspeed.compression.registry import COMPRESSORS, DEFAULT_METHOD, OFFERED_METHODS
from ragspeed.engine.config import SERVED_ENGINE, EngineConfig, UpstreamConfig
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.engine.protocol import DocumentCacheOptions
from ragspeed.gateway.security import ApiKeyEntry, KeyHash

ENV_PREFIX = "RAGSPEED_"

# The values EngineConfig's string fields take, as types (settings import no torch): the keys of
# engine.native.loading.dtypes.DTYPES, engine.native.core.kv_cache.resolve_kv_dtype's, engine.native.loading.loader.resolve_quantization's
# ("none": off) and engine.native.core.document_kv.STORAGE_DTYPES; engine.protocol.DOCUMENT_CACHE_POLICIES and
# DOCUMENT_GLUE_MODES.
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp32", "fp16"]
Quantization = Literal["auto", "none", "int8", "gguf"]
DocumentCacheDtype = Literal["float16", "bfloat16", "float32"]
DocumentCachePolicy = Literal["reuse", "sink", "blend"]
DocumentGlue = Literal["recompute", "reuse"]


class ConfigError(ValueError):
    """A configuration file or option that cannot be used; the message names the culprit."""


class Section(BaseModel):
    # Built from option names (aliases) by Settings, from field names by code and tests.
    model_config = ConfigDict(extra="forbid", frozen=True, validate_by_name=True, validate_by_alias=True)

    @field_validator("*", mode="before")
    @classmethod
    def _none_as_text(cls, value: Any, info: ValidationInfo) -> Any:
        """`none` where a number option takes None, as a flag or a variable writes it."""
        if isinstance(value, str) and value.strip().lower() == "none" and info.field_name is not None:
            if takes_none_number(cls.model_fields[info.field_name].annotation):
                return None
        return value


def takes_none_number(annotation: Any) -> bool:
    """Whether an option is a number or None (`int | None`, `float | None`)."""
    args = get_args(annotation)
    return type(None) in args and any(arg in (int, float) for arg in args)


class ServerSettings(Section):
    """Server: where it listens, what it logs and the model name it answers to."""

    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on (0: any free port).")
    log_level: str = Field("info", description="Log level: debug, info, warning, error.")
    access_log: bool = Field(True, description="Log one line per HTTP request (uvicorn's access log).")
    served_model_name: str | None = Field(
        None, description="Model name clients use; default: the --model value."
    )
    shutdown_drain_s: float = Field(
        10.0, ge=0, description="On SIGTERM: seconds to let in-flight requests finish before aborting them."
    )


class SecuritySettings(Section):
    """Security (gateway/security.py): API keys and admin keys; auth is off while no key is
    configured."""

    api_keys: list[ApiKeyEntry] = Field(
        default_factory=list,
        description="API keys as {hash, tenant, requests_per_minute, tokens_per_minute}; on the command line 'sha256:<hex>,tenant=NAME,requests_per_minute=N,tokens_per_minute=N'.",
    )
    admin_key_hashes: list[KeyHash] = Field(
        default_factory=list,
        description="sha256:<hex> hashes of admin keys (needed for /v1/prompts, /v1/collections, /v1/experiments).",
    )


_SERVED = SERVED_ENGINE


class EngineSettings(Section):
    """Model and engine: the model, the backend and the native engine's KV cache, scheduler,
    weights, speculative decoding and document KV reuse (its store, and the policy of the
    requests that place documents from it).

    Every field but the document cache's policy (`document_cache`, `_policy`, `_tokens`,
    `_ratio`, `_glue`, which the gateway applies) is EngineConfig's, by the same name, with
    `SERVED_ENGINE`'s default: engine.config declares each setting once."""

    model: str = Field(
        _SERVED.model,
        description=f"Model: a zoo name ({DEFAULT_MODEL_NAME}, bench-135m, bench-0.5b), a local HF-format folder, a .gguf file or a hub id (org/name).",
    )
    backend: str = Field(
        _SERVED.backend, alias="engine", description="Engine backend: native, transformers, openai or vllm."
    )
    tokenizer: str | None = Field(
        _SERVED.tokenizer, description="Tokenizer path or id; default: the model's."
    )
    device: str = Field(_SERVED.device, description="Device for embedded engines: cpu or cuda.")
    dtype: Dtype = Field(
        cast(Dtype, _SERVED.dtype),
        description="Precision of embedded engines: auto, float32, bfloat16 or float16. On CPU the native engine keeps fp32 weights, activations and KV cache and chooses only its prefill products' precision: auto takes bf16 where the CPU has AMX-BF16 or AVX512-BF16, a start-up measurement finds it faster than fp32 (kept per machine beside the CPU kernels) and the start-up quality gate passes it, fp32 elsewhere, and on a CPU with AVX2 computes the prefill attention's scores and weighted sums on int16 where that gate passes them too (float32 keeps them fp32); bfloat16 fails to start on a CPU without them. Elsewhere the compute dtype (auto: bf16 where supported).",
    )
    num_threads: int | None = Field(
        _SERVED.num_threads,
        ge=1,
        description="CPU threads of the native engine's forward pass; default: torch's (one per core). 1 on a CPU shared with other jobs.",
    )
    max_model_len: int | None = Field(
        _SERVED.max_model_len, ge=16, description="Context length; default: the model's."
    )
    block_size: int = Field(
        _SERVED.block_size, ge=1, description="Tokens per KV cache block (native engine)."
    )
    num_kv_cache_tokens: int | None = Field(
        _SERVED.num_kv_cache_tokens,
        ge=1,
        description="KV cache pool size in tokens (native); default: from kv_cache_memory_fraction.",
    )
    kv_cache_memory_fraction: float = Field(
        _SERVED.kv_cache_memory_fraction,
        gt=0,
        le=1,
        description="Share of free memory for the KV cache when num_kv_cache_tokens is unset.",
    )
    max_num_seqs: int = Field(_SERVED.max_num_seqs, ge=1, description="Most requests in one batch (native).")
    max_num_batched_tokens: int = Field(
        _SERVED.max_num_batched_tokens,
        ge=1,
        description="Token budget of one engine step: decodes plus prefill chunks (native).",
    )
    tpot_target_ms: float | None = Field(
        _SERVED.tpot_target_ms,
        gt=0,
        description="Time budget of an engine step that carries decodes, ms: the prefill chunks beside them are sized to fit it (native; none: the token budget alone).",
    )
    enable_prefix_caching: bool = Field(
        _SERVED.enable_prefix_caching, description="Reuse the KV of shared prompt prefixes (native)."
    )
    kv_cache_dtype: KVCacheDtype = Field(
        cast(KVCacheDtype, _SERVED.kv_cache_dtype),
        description="KV cache dtype (native): auto (fp16 on a CPU with ragspeed's kernels for an fp32 model, else the model's dtype), fp32 or fp16. fp16 halves what decode attention reads and what the pool, the document store and the prefix store hold.",
    )
    quantization: Quantization | None = Field(
        cast(Quantization | None, _SERVED.quantization),
        description="Weights (native): auto (on CPU a GGUF file's own blocks, else int8 where its quality gate passes on the model at start-up, else none), gguf (a GGUF file's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K blocks as stored; other types dequantized), int8 (group-wise, its quality gate) or none (the checkpoint's dtype).",
    )
    speculative: str | None = Field(
        _SERVED.speculative, description="Speculative decoding: ngram or draft (native)."
    )
    draft_model: str | None = Field(
        _SERVED.draft_model,
        description="Draft model for --speculative draft: a zoo name, a local folder, a .gguf file or a hub id; same tokenizer as the model.",
    )
    draft_quantization: str | None = Field(
        _SERVED.draft_quantization,
        description="Draft model weights: auto (int8 on a CPU, else as --quantization), none or int8. The target verifies every draft, so this moves acceptance, never the output.",
    )
    num_speculative_tokens: int = Field(
        _SERVED.num_speculative_tokens, ge=1, description="Draft tokens proposed per step."
    )
    document_cache: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Reuse each document's stored KV at any position instead of prefilling it again (placing a document approximates attention). auto: requests whose documents go uncompressed get the cheapest repair policy that passed the fidelity gate for this model in `ragspeed bench fidelity` (gateway/fidelity_gate.py; the result is read at start-up), else exact prefill; on: document_cache_policy for every such request, measured or not; off: exact prefill. A request may always ask (`ragspeed.document_cache`: a policy, true, or false for exact prefill); compressed documents reuse only when they ask. Token-level compression makes new documents; document selection keeps them whole and reusable.",
    )
    document_cache_policy: DocumentCachePolicy = Field(
        "reuse",
        description="Repair after placing stored documents, under document_cache on and for a request that asks without naming one (under auto, the gate's policy where one passed): reuse (none), sink (each document's first document_cache_tokens tokens recomputed in context) or blend (the document_cache_ratio of document tokens whose keys deviate most, recomputed).",
    )
    document_cache_tokens: int = Field(16, ge=0, description="sink: each document's first tokens recomputed.")
    document_cache_ratio: float = Field(
        0.15,
        ge=0,
        le=1,
        description="blend: share of document tokens recomputed.",
    )
    document_cache_glue: DocumentGlue = Field(
        "reuse",
        description="The text between two documents (separator and number): recompute (in context) or reuse (stored and placed as a document is; fewer fresh tokens).",
    )
    document_cache_bytes: int | None = Field(
        _SERVED.document_cache_bytes,
        ge=0,
        description="RAM budget of the document KV store, bytes (LRU beyond it); default: a quarter of available memory, at most 4 GiB.",
    )
    document_cache_dir: str | None = Field(
        _SERVED.document_cache_dir,
        description="Folder of the document KV store's disk tier (one file per document under the HMAC of a server key kept there, mode 0600; LRU by last use, kept across restarts); auto: <model cache>/documents; none: RAM only.",
    )
    document_cache_disk_bytes: int = Field(
        _SERVED.document_cache_disk_bytes,
        ge=0,
        description="Disk budget of the document KV store's files, bytes (least recently used deleted beyond it); at most half the folder's free space at start-up.",
    )
    document_cache_dtype: DocumentCacheDtype = Field(
        cast(DocumentCacheDtype, _SERVED.document_cache_dtype),
        description="Precision of stored document KV: float16, bfloat16 or float32.",
    )

    def config(self) -> EngineConfig:
        """The engine these options build: EngineConfig's fields, by the same names."""
        return EngineConfig(**self.model_dump(include=set(_CONFIG_FIELDS)))

    def document_cache_options(self) -> DocumentCacheOptions:
        """The repair policy the document cache options name (under `on`, and for a request
        that asks without naming one where the fidelity gate chose none)."""
        return DocumentCacheOptions(
            policy=self.document_cache_policy,
            num_tokens=self.document_cache_tokens,
            ratio=self.document_cache_ratio,
            glue=self.document_cache_glue,
        )


_CONFIG_FIELDS = frozenset(field.name for field in fields(EngineConfig))


class UpstreamSettings(Section):
    """Remote upstreams: the OpenAI-compatible servers that `--engine openai` forwards to."""

    urls: list[str] = Field(
        default_factory=list,
        alias="upstreams",
        description="OpenAI-compatible upstream base URLs (engine=openai).",
    )
    api_key: str | None = Field(None, alias="upstream_api_key", description="Bearer key sent to upstreams.")
    model: str | None = Field(
        None, alias="upstream_model", description="Model name sent upstream; default: --model."
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Upstream connect timeout, seconds.")
    read_timeout_s: float = Field(60.0, gt=0, description="Upstream read timeout between chunks, seconds.")
    max_retries: int = Field(
        2,
        alias="upstream_max_retries",
        ge=0,
        description="Retries, with jitter, of an upstream request that failed to connect (nothing sent yet).",
    )
    circuit_failures: int = Field(
        5,
        alias="upstream_circuit_failures",
        ge=1,
        description="Failures in a row that open an upstream's circuit breaker.",
    )
    circuit_reset_s: float = Field(
        30.0,
        alias="upstream_circuit_reset_s",
        gt=0,
        description="Seconds an open circuit waits before one trial request.",
    )
    affinity: bool = Field(
        True,
        alias="upstream_affinity",
        description="Send requests with the same static prefix to the same upstream (consistent hashing with bounded load), so its prefix cache hits.",
    )
    api: Literal["chat", "completions"] = Field(
        "chat",
        alias="upstream_api",
        description="How chat requests go upstream: chat (to /v1/chat/completions as the client sent them, the documents compressed into the system message; tools, response_format and vendor fields pass through) or completions (the prompt rendered through ragspeed's chat template, to /v1/completions).",
    )

    def config(self) -> UpstreamConfig:
        # The fields are UpstreamConfig's, by the same names.
        return UpstreamConfig(**{**self.model_dump(), "urls": tuple(self.urls)})


class CompressionSettings(Section):
    """Compression: how the documents are compressed (a request's `ragspeed.compression`
    overrides these defaults)."""

    # Every option here is `compression_` and the field's name.
    model_config = ConfigDict(alias_generator=lambda name: f"compression_{name}")  # and Section's

    method: str | None = Field(
        None,
        description="Default compressor for every request: coarse-to-fine, fast, bm25, top-docs, first-docs, llmlingua2, identity; none: only when a request asks.",
    )
    default_method: str = Field(
        DEFAULT_METHOD,
        description="Compressor for a request whose `ragspeed.compression` names no method (a rate or target_tokens alone), when compression_method is unset.",
    )
    methods: list[str] = Field(
        default_factory=lambda: list(OFFERED_METHODS),
        description="Compressors this server offers, each loaded at start-up so that no request pays a load; a request naming another gets 400. llmlingua2 also needs compression_llmlingua2_model.",
    )
    llmlingua2_model: str | None = Field(
        None,
        description="Local LLMLingua-2 model folder for the llmlingua2 compressor (needs the llmlingua extra).",
    )
    rate: float = Field(0.25, gt=0, le=1, description="Default share of document tokens to keep (0.25 = 4x).")
    target_tokens: int | None = Field(
        None, ge=1, description="Default prompt-token target instead of a rate."
    )
    min_document_tokens: int = Field(
        256, ge=0, description="Break-even: documents shorter than this go through uncompressed."
    )
    order: str = Field(
        "original", description="Order of kept documents: original, or edges (most relevant first and last)."
    )
    cache_entries: int = Field(
        100_000, ge=0, description="Sentence embeddings kept in the content-hash cache."
    )

    @field_validator("methods")
    @classmethod
    def _known_compressors(cls, methods: list[str]) -> list[str]:
        unknown = sorted(set(methods) - set(COMPRESSORS))
        if unknown:
            raise ValueError(
                f"unknown compressor(s) {', '.join(unknown)}; known: {', '.join(sorted(COMPRESSORS))}"
            )
        return methods


class RetrievalSettings(Section):
    """Retrieval: the collections behind `ragspeed.retrieval` and /v1/collections."""

    collections_dir: str = Field(
        ".ragspeed/collections",
        description="Folder of persisted document collections (loaded at start-up when retrieval is enabled).",
    )
    enabled: bool = Field(
        True,
        alias="enable_retrieval",
        description="Serve retrieval (`ragspeed.retrieval`, /v1/collections); its embedding model loads at start-up.",
    )
    embedding_model: str | None = Field(
        None, description="sentence-transformers model for retrieval; default: the bundled all-MiniLM-L6-v2."
    )


class PromptSettings(Section):
    """Prompts: how a request becomes a prompt (document markers, max_tokens) and where
    registered prompts are kept."""

    cache_dir: str | None = Field(
        ".ragspeed/prompts",
        alias="prompt_cache_dir",
        description="Folder where registered prompts (their text, and their pinned KV) are saved and restored from at start-up (native; a prompt whose KV cannot be used is prefilled again); none: not persisted.",
    )
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request gives none.")
    document_start_marker: str = Field(
        "<document>",
        min_length=1,
        description="Marks the start of a document inside a message, for clients that cannot send `documents`.",
    )
    document_end_marker: str = Field(
        "</document>", min_length=1, description="Marks the end of a document inside a message."
    )


class LimitSettings(Section):
    """Limits (gateway/limits.py): what one request may ask, and how many run at once."""

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
        description="Deadline of an interactive request's first token from its arrival, ms: a request that the work queued ahead of it is predicted to make miss it is refused at once with 429 and Retry-After; one that misses it alone is served, and refused only behind more than a tenth of it of other work (a request's `ragspeed.deadline_ms` overrides it; none: no such check).",
    )
    request_timeout_s: float | None = Field(
        600.0,
        gt=0,
        description="Deadline of one request from its arrival, seconds: then it is aborted and its KV blocks freed (504, or finish_reason abort once streaming).",
    )


class ExperimentSettings(Section):
    """Experiments (gateway/experiments.py): the live A/B arms."""

    path: str | None = Field(
        None,
        alias="experiment",
        description="Live A/B experiment: a YAML file of weighted arms (see gateway/experiments.py).",
    )


class _OptionsFromEnvironment(PydanticBaseSettingsSource):
    """`RAGSPEED_<OPTION>` for every option, by its flat name (pydantic-settings' own source
    would look for one variable per section)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # unused: __call__ reads every option at once

    def __call__(self) -> dict[str, Any]:
        return options_from_environment(os.environ)


class Settings(BaseSettings):
    """Every option, in sections; `Settings(compression_rate=0.5)` takes the flat names too."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    server: ServerSettings = Field(default_factory=ServerSettings)
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    upstreams: UpstreamSettings = Field(default_factory=UpstreamSettings)
    compression: CompressionSettings = Field(default_factory=CompressionSettings)
    retrieval: RetrievalSettings = Field(default_factory=RetrievalSettings)
    prompts: PromptSettings = Field(default_factory=PromptSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    experiments: ExperimentSettings = Field(default_factory=ExperimentSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Keyword arguments over the environment; both by flat name, nested by `_nest_options`.
        return init_settings, _OptionsFromEnvironment(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _nest_options(cls, data: Any) -> Any:
        """Flat option names (`compression_rate`) into their sections; a section given whole
        (`compression={...}`) stays, the flat names of the same section over it. Two options
        share a section's name (`engine`: the backend; `upstreams`: the URLs): a mapping or a
        Section under such a name is the section, anything else the option."""
        if not isinstance(data, dict):
            return data
        nested: dict[str, Any] = {}
        options: list[tuple[Option, Any]] = []
        for key, value in data.items():
            is_section = key in cls.model_fields and isinstance(value, dict | BaseModel)
            if key in OPTIONS and not is_section:
                options.append((OPTIONS[key], value))
            else:  # a section, or an unknown key that extra="forbid" names
                nested[key] = value
        for option, value in options:
            section = nested.get(option.section, {})
            if isinstance(section, BaseModel):
                section = section.model_dump(by_alias=True)
            nested[option.section] = {**section, option.name: value}
        return nested

    @property
    def model_id(self) -> str:
        """The name this server answers to in `model` fields."""
        return self.server.served_model_name or self.engine.model

    def options(self) -> dict[str, Any]:
        """Every option's value by its flat name: what a config file of these settings holds."""
        return {name: getattr(getattr(self, o.section), o.field) for name, o in OPTIONS.items()}

    def with_options(self, overrides: Mapping[str, Any]) -> Settings:
        """These settings with some options (flat names) changed, validated."""
        return Settings(**{**self.options(), **overrides})


@dataclass(frozen=True)
class Option:
    """One option: `name` is its flag, its environment variable and its config-file key."""

    name: str
    section: str  # the Settings field that holds it
    field: str  # its field in the section
    info: FieldInfo

    @property
    def env(self) -> str:
        return f"{ENV_PREFIX}{self.name.upper()}"


def _options() -> dict[str, Option]:
    options = {}
    for section, section_info in Settings.model_fields.items():
        model = section_info.annotation
        assert isinstance(model, type) and issubclass(model, Section)
        for field, info in model.model_fields.items():
            name = info.alias or field
            options[name] = Option(name, section, field, info)
    return options


# Option name -> Option, in the order of the sections and their fields.
OPTIONS: Mapping[str, Option] = MappingProxyType(_options())


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list or any(_is_list(arg) for arg in get_args(annotation))


def options_from_environment(environ: Mapping[str, str]) -> dict[str, Any]:
    """The options `RAGSPEED_*` variables set, by flat name. Names match in any case and list
    options are JSON, as pydantic-settings read them before the settings had sections."""
    by_name = {key.upper(): value for key, value in environ.items()}
    values: dict[str, Any] = {}
    for name, option in OPTIONS.items():
        text = by_name.get(option.env)
        if text is None:
            continue
        try:
            values[name] = json.loads(text) if _is_list(option.info.annotation) else text
        except json.JSONDecodeError as exc:
            raise ConfigError(f"invalid settings: {option.env} is not a JSON list: {exc}") from exc
    return values


def check_settings(settings: Settings) -> None:
    """What no single field can check: options that must agree (every layer merged first)."""
    compression = settings.compression
    for name, method in (
        ("compression_default_method", compression.default_method),
        ("compression_method", compression.method),
    ):
        if method not in (None, "none") and method not in compression.methods:
            raise ConfigError(
                f"invalid settings: {name}: {method!r} is not among compression_methods "
                f"({', '.join(compression.methods) or 'none'})"
            )
    if "llmlingua2" in compression.methods and not compression.llmlingua2_model:
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
    unknown = sorted(set(data) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"config file {path}: unknown option(s) {', '.join(unknown)}")
    return data


def option_path(loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """A validation error's place, by option name: ("compression", "compression_rate") is
    ("compression_rate",), as the option is named everywhere outside the code."""
    return loc[1:] if len(loc) > 1 and loc[0] in Settings.model_fields else loc


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Defaults < config file < environment < `overrides` (CLI flags; None means unset)."""
    values = read_config_file(config_file) if config_file else {}
    values.update(options_from_environment(os.environ))
    values.update({k: v for k, v in overrides.items() if v is not None})
    try:
        settings = Settings(**values)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(map(str, option_path(err['loc'])))}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc
    check_settings(settings)
    return settings
