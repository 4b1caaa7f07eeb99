"""The registry of engine backends; every one implements `engine.protocol.EngineClient`.

Backends are imported lazily: the vLLM one needs a GPU stack that most machines lack.
"""

from __future__ import annotations

import importlib

from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.protocol import EngineClient

# backend name -> "module:class"; each class is built as `cls(config)`, a remote one as
# `cls(config, upstream)`.
BACKENDS: dict[str, str] = {
    "native": "ragspeed.engine.backends.native:NativeEngine",
    "transformers": "ragspeed.engine.backends.transformers_backend:TransformersEngine",
    "openai": "ragspeed.engine.backends.remote.openai_backend:OpenAIEngine",
    "vllm": "ragspeed.engine.backends.vllm:VLLMEngine",
}

# Backends that implement EngineConfig.speculative (the others refuse it at start-up).
SPECULATIVE_BACKENDS = ("native", "vllm")
# Backends that serve through remote upstreams: they take an UpstreamConfig beside the config.
REMOTE_BACKENDS = ("openai",)


def build_engine(config: EngineConfig, upstream: UpstreamConfig | None = None) -> EngineClient:
    target = BACKENDS.get(config.backend)
    if target is None:
        raise ValueError(f"unknown engine backend {config.backend!r}; choose one of {', '.join(BACKENDS)}")
    if config.speculative is not None and config.backend not in SPECULATIVE_BACKENDS:
        raise ValueError(
            f"speculative={config.speculative!r} needs a backend with speculative decoding"
            f" ({', '.join(SPECULATIVE_BACKENDS)}); backend {config.backend!r} has none"
        )
    module_name, class_name = target.split(":")
    engine_cls = getattr(importlib.import_module(module_name), class_name)
    if config.backend in REMOTE_BACKENDS:
        return engine_cls(config, upstream or UpstreamConfig())
    return engine_cls(config)
