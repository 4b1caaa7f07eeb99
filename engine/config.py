"""The engine's frozen configs, built at the edge (CLI, settings file) and passed down:
`EngineConfig` for every backend, `UpstreamConfig` beside it for the remote (openai) one.

Each setting is declared once, here: the server's options (gateway.settings) take their names
and their defaults from these classes, and add only what a user reads (flag, description,
bounds). `SERVED_ENGINE` is the engine `ragspeed serve` builds when no option is given.
"""

from __future__ import annotations

from dataclasses import dataclass

# The model a server runs unless told otherwise: a model-zoo name (engine.native.loading.model_zoo
# keys the model under it). Declared here, in the seam, so that the config imports nothing of an
# engine.
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "native"  # a key of engine.backends.BACKENDS
    model: str = DEFAULT_MODEL_NAME  # a model-zoo name, a local folder, a .gguf file or a hub id
    tokenizer: str | None = None  # defaults to the model's
    device: str = "cpu"
    # A key of engine.native.loading.dtypes.DTYPES; "auto": prefill in bf16 where the CPU has AMX-BF16 or
    # AVX512-BF16 and the quality gate passes it, else fp32.
    dtype: str = "auto"
    max_model_len: int | None = None  # defaults to the model's context length
    seed: int = 0
    num_threads: int | None = None  # CPU threads of the forward pass; None: torch's count

    # Native engine: paged KV cache and scheduler.
    block_size: int = 16
    num_kv_cache_tokens: int | None = None  # pool size in tokens; None: from memory fraction
    kv_cache_memory_fraction: float = 0.1  # of free host/device memory, when tokens unset
    kv_cache_dtype: str = "auto"  # "auto" | "fp32" | "fp16" (engine.native.core.kv_cache.resolve_kv_dtype)
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    # A step that carries decodes gets this time budget; its prefill chunks are sized to fit it
    # from the measured prefill rate (None: the token budget alone).
    tpot_target_ms: float | None = 50.0
    enable_prefix_caching: bool = True
    # None | "auto" | "int8" | "gguf" (engine.native.loading.loader.resolve_quantization)
    quantization: str | None = None
    speculative: str | None = None  # None | "ngram" | "draft"
    draft_model: str | None = None
    # The draft's weights: "auto" is int8 on a CPU where int8 runs, else `quantization`.
    draft_quantization: str | None = "auto"
    num_speculative_tokens: int = 4
    # Document KV reuse (engine.native.core.document_kv.open_document_store): the store's RAM budget (None:
    # a quarter of available memory, at most 4 GiB), its disk folder ("auto": <model
    # cache>/documents; None: RAM only), the disk tier's budget (bounded at start-up by half the
    # folder's free space) and the dtype its KV is kept in.
    document_cache_bytes: int | None = None
    document_cache_dir: str | None = None
    document_cache_disk_bytes: int = 8 * 2**30
    document_cache_dtype: str = "float16"

    def __post_init__(self) -> None:
        # "none" (a command line, a settings file) means off.
        for name in ("quantization", "draft_quantization", "speculative", "document_cache_dir"):
            if getattr(self, name) == "none":
                object.__setattr__(self, name, None)


# The engine a server runs unless told otherwise: EngineConfig's defaults but two. A server takes
# the quality gate's choice of weights ("auto": int8 or a GGUF file's blocks where they pass) and
# keeps its document store across restarts in a folder of the model cache; an engine built in
# code (a bench, a test, the evals) is exact and RAM-only unless it asks, so that its figures
# depend on no gate and no folder.
SERVED_ENGINE = EngineConfig(quantization="auto", document_cache_dir="auto")


@dataclass(frozen=True)
class UpstreamConfig:
    """The remote (openai) backend's upstreams; its model, tokenizer and context are EngineConfig's."""

    urls: tuple[str, ...] = ()  # OpenAI-compatible base URLs
    api_key: str | None = None
    model: str | None = None  # model name to send upstream; defaults to EngineConfig.model
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 60.0
    max_retries: int = 2  # retries of requests that failed to connect (nothing sent)
    circuit_failures: int = 5  # failures in a row that open an upstream's circuit
    circuit_reset_s: float = 30.0
    affinity: bool = True  # same static prefix -> same upstream (backends/routing.py)
    # "chat": chat requests go to the upstream's /v1/chat/completions as chat (tools, formats and
    # vendor fields intact); "completions": ragspeed renders the prompt and posts it as text.
    api: str = "chat"
