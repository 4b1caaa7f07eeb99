"""The names users set options by stay those of the flat settings the sections replaced: every
`ragspeed serve` flag, every `RAGSPEED_*` variable and every config-file key, listed here as they
were (generated from the flat `Settings` before it had sections), and read into the sections."""

from __future__ import annotations

from ragspeed.cli import serve
from ragspeed.gateway.settings import OPTIONS, Settings, load_settings

FLAGS = (
    "--access-log",
    "--admin-key-hashes",
    "--api-keys",
    "--block-size",
    "--collections-dir",
    "--compression-cache-entries",
    "--compression-default-method",
    "--compression-llmlingua2-model",
    "--compression-method",
    "--compression-methods",
    "--compression-min-document-tokens",
    "--compression-order",
    "--compression-rate",
    "--compression-target-tokens",
    "--connect-timeout-s",
    "--default-max-tokens",
    "--device",
    "--document-cache",
    "--document-cache-bytes",
    "--document-cache-dir",
    "--document-cache-disk-bytes",
    "--document-cache-dtype",
    "--document-cache-glue",
    "--document-cache-policy",
    "--document-cache-ratio",
    "--document-cache-tokens",
    "--document-end-marker",
    "--document-start-marker",
    "--draft-model",
    "--draft-quantization",
    "--dtype",
    "--embedding-model",
    "--enable-prefix-caching",
    "--enable-retrieval",
    "--engine",
    "--experiment",
    "--host",
    "--kv-cache-dtype",
    "--kv-cache-memory-fraction",
    "--log-level",
    "--max-body-bytes",
    "--max-concurrent-requests",
    "--max-documents",
    "--max-model-len",
    "--max-num-batched-tokens",
    "--max-num-seqs",
    "--max-prompt-tokens",
    "--max-queued-requests",
    "--model",
    "--no-access-log",
    "--no-enable-prefix-caching",
    "--no-enable-retrieval",
    "--no-upstream-affinity",
    "--num-kv-cache-tokens",
    "--num-speculative-tokens",
    "--num-threads",
    "--port",
    "--prompt-cache-dir",
    "--quantization",
    "--queue-timeout-s",
    "--read-timeout-s",
    "--request-timeout-s",
    "--served-model-name",
    "--shutdown-drain-s",
    "--speculative",
    "--tokenizer",
    "--tpot-target-ms",
    "--ttft-deadline-ms",
    "--upstream",
    "--upstream-affinity",
    "--upstream-api",
    "--upstream-api-key",
    "--upstream-circuit-failures",
    "--upstream-circuit-reset-s",
    "--upstream-max-retries",
    "--upstream-model",
)

ENVIRONMENT = (
    "RAGSPEED_ACCESS_LOG",
    "RAGSPEED_ADMIN_KEY_HASHES",
    "RAGSPEED_API_KEYS",
    "RAGSPEED_BLOCK_SIZE",
    "RAGSPEED_COLLECTIONS_DIR",
    "RAGSPEED_COMPRESSION_CACHE_ENTRIES",
    "RAGSPEED_COMPRESSION_DEFAULT_METHOD",
    "RAGSPEED_COMPRESSION_LLMLINGUA2_MODEL",
    "RAGSPEED_COMPRESSION_METHOD",
    "RAGSPEED_COMPRESSION_METHODS",
    "RAGSPEED_COMPRESSION_MIN_DOCUMENT_TOKENS",
    "RAGSPEED_COMPRESSION_ORDER",
    "RAGSPEED_COMPRESSION_RATE",
    "RAGSPEED_COMPRESSION_TARGET_TOKENS",
    "RAGSPEED_CONNECT_TIMEOUT_S",
    "RAGSPEED_DEFAULT_MAX_TOKENS",
    "RAGSPEED_DEVICE",
    "RAGSPEED_DOCUMENT_CACHE",
    "RAGSPEED_DOCUMENT_CACHE_BYTES",
    "RAGSPEED_DOCUMENT_CACHE_DIR",
    "RAGSPEED_DOCUMENT_CACHE_DISK_BYTES",
    "RAGSPEED_DOCUMENT_CACHE_DTYPE",
    "RAGSPEED_DOCUMENT_CACHE_GLUE",
    "RAGSPEED_DOCUMENT_CACHE_POLICY",
    "RAGSPEED_DOCUMENT_CACHE_RATIO",
    "RAGSPEED_DOCUMENT_CACHE_TOKENS",
    "RAGSPEED_DOCUMENT_END_MARKER",
    "RAGSPEED_DOCUMENT_START_MARKER",
    "RAGSPEED_DRAFT_MODEL",
    "RAGSPEED_DRAFT_QUANTIZATION",
    "RAGSPEED_DTYPE",
    "RAGSPEED_EMBEDDING_MODEL",
    "RAGSPEED_ENABLE_PREFIX_CACHING",
    "RAGSPEED_ENABLE_RETRIEVAL",
    "RAGSPEED_ENGINE",
    "RAGSPEED_EXPERIMENT",
    "RAGSPEED_HOST",
    "RAGSPEED_KV_CACHE_DTYPE",
    "RAGSPEED_KV_CACHE_MEMORY_FRACTION",
    "RAGSPEED_LOG_LEVEL",
    "RAGSPEED_MAX_BODY_BYTES",
    "RAGSPEED_MAX_CONCURRENT_REQUESTS",
    "RAGSPEED_MAX_DOCUMENTS",
    "RAGSPEED_MAX_MODEL_LEN",
    "RAGSPEED_MAX_NUM_BATCHED_TOKENS",
    "RAGSPEED_MAX_NUM_SEQS",
    "RAGSPEED_MAX_PROMPT_TOKENS",
    "RAGSPEED_MAX_QUEUED_REQUESTS",
    "RAGSPEED_MODEL",
    "RAGSPEED_NUM_KV_CACHE_TOKENS",
    "RAGSPEED_NUM_SPECULATIVE_TOKENS",
    "RAGSPEED_NUM_THREADS",
    "RAGSPEED_PORT",
    "RAGSPEED_PROMPT_CACHE_DIR",
    "RAGSPEED_QUANTIZATION",
    "RAGSPEED_QUEUE_TIMEOUT_S",
    "RAGSPEED_READ_TIMEOUT_S",
    "RAGSPEED_REQUEST_TIMEOUT_S",
    "RAGSPEED_SERVED_MODEL_NAME",
    "RAGSPEED_SHUTDOWN_DRAIN_S",
    "RAGSPEED_SPECULATIVE",
    "RAGSPEED_TOKENIZER",
    "RAGSPEED_TPOT_TARGET_MS",
    "RAGSPEED_TTFT_DEADLINE_MS",
    "RAGSPEED_UPSTREAMS",
    "RAGSPEED_UPSTREAM_AFFINITY",
    "RAGSPEED_UPSTREAM_API",
    "RAGSPEED_UPSTREAM_API_KEY",
    "RAGSPEED_UPSTREAM_CIRCUIT_FAILURES",
    "RAGSPEED_UPSTREAM_CIRCUIT_RESET_S",
    "RAGSPEED_UPSTREAM_MAX_RETRIES",
    "RAGSPEED_UPSTREAM_MODEL",
)


def test_every_flag_keeps_its_name():
    flags = [name for p in serve.params if p.name in OPTIONS for name in (*p.opts, *p.secondary_opts)]
    assert sorted(flags) == sorted(FLAGS)


def test_every_environment_variable_and_config_key_keeps_its_name():
    assert sorted(option.env for option in OPTIONS.values()) == sorted(ENVIRONMENT)
    assert sorted(OPTIONS) == sorted(name.removeprefix("RAGSPEED_").lower() for name in ENVIRONMENT)


def test_flat_names_reach_their_sections_from_every_layer(tmp_path, monkeypatch):
    config = tmp_path / "ragspeed.yaml"
    config.write_text(
        "compression-rate: 0.5\nupstream_affinity: false\nmax_documents: 8\nexperiment: arms.yaml\nprompt_cache_dir: null\n"
    )
    monkeypatch.setenv("RAGSPEED_ENABLE_RETRIEVAL", "false")
    monkeypatch.setenv("ragspeed_upstreams", '["http://a:1"]')  # names match in any case
    monkeypatch.setenv("RAGSPEED_COMPRESSION_RATE", "0.75")  # the environment over the file
    settings = load_settings(config, engine="openai", served_model_name="m")
    assert (settings.compression.rate, settings.limits.max_documents) == (0.75, 8)
    assert settings.upstreams.config().urls == ("http://a:1",) and not settings.upstreams.affinity
    assert not settings.retrieval.enabled and settings.prompts.cache_dir is None
    assert (settings.engine.backend, settings.model_id, settings.experiments.path) == (
        "openai",
        "m",
        "arms.yaml",
    )
    assert settings.options()["compression_rate"] == 0.75 and len(settings.options()) == len(ENVIRONMENT)


def test_flat_and_sectioned_construction_agree():
    flat = Settings(compression_rate=0.5, block_size=32, upstream_max_retries=0)
    sectioned = Settings(compression={"rate": 0.5}, engine={"block_size": 32}, upstreams={"max_retries": 0})
    assert flat == sectioned and flat.with_options({"block_size": 64}).engine.block_size == 64
