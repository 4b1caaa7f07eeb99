"""The compression stage of the pipeline: the server's default method and rate, per-request
overrides (`ragspeed.compression`), the break-even policy and failing open.

Every method the server offers (`compression_methods`: the compression section's `methods`) is built at start-up (`warm`, before
the app reports ready), one compressor per method sharing one embedding cache. They run
in a worker thread (a compression takes tens to hundreds of milliseconds of CPU and must not
stall the event loop), one at a time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from ragspeed.compression import (
    COMPRESSORS,
    Budget,
    CompressionError,
    CompressionPolicy,
    apply_policy,
    build_compressor,
)
from ragspeed.compression.base import count_tokens_many
from ragspeed.compression.scoring.embedding_cache import EmbeddingCache
from ragspeed.document import Document
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prompt import Segments
from ragspeed.gateway.protocol import CompressionOptions
from ragspeed.gateway.settings import CompressionSettings

# Weight of the latest compression in the running mean of seconds a document token.
SMOOTHING = 0.2


@dataclass(frozen=True)
class CompressionReport:
    method: str
    original_tokens: int
    compressed_tokens: int
    seconds: float
    failed: bool = False  # the compressor raised; the documents went through uncompressed
    skipped_reason: str | None = None  # e.g. below the break-even length


@dataclass(frozen=True)
class Forecast:
    """What compressing a request's documents will leave and take, known before it runs."""

    kept_tokens: int  # the document tokens left: their budget, or all of them where that is fewer
    seconds: float  # its expected wall time: the recent compressions' seconds a document token


class CompressionStage:
    def __init__(self, settings: CompressionSettings, tokenizer: Any):
        self._settings = settings
        self._tokenizer = tokenizer
        self._policy = CompressionPolicy(min_document_tokens=settings.min_document_tokens)
        self._cache = EmbeddingCache(settings.cache_entries)
        # Options that only some methods take, from the settings.
        self._method_options: dict[str, dict[str, Any]] = {
            "llmlingua2": {"model_path": settings.llmlingua2_model}
        }
        self._compressors: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.num_loads = 0  # compressors built, each loading its models: one per offered method
        self._seconds_per_token = 0.0  # running mean over the compressions so far (0: none yet)

    @property
    def loaded_methods(self) -> tuple[str, ...]:
        return tuple(self._compressors)

    def _load(self, method: str) -> None:
        self._compressors[method] = build_compressor(
            method,
            cache=self._cache,
            order=self._settings.order,
            **self._method_options.get(method, {}),
        )
        self.num_loads += 1

    def _compressor(self, method: str):
        if method not in COMPRESSORS:
            raise APIError(
                400,
                f"unknown compression method {method!r}; known: {sorted(COMPRESSORS)}",
                param="ragspeed.compression.method",
            )
        if method not in self._settings.methods:
            raise APIError(
                400,
                f"this server does not offer the compression method {method!r}; offered: "
                f"{list(self._settings.methods)} (compression_methods)",
                param="ragspeed.compression.method",
            )
        if method not in self._compressors:  # only before `warm` (the app warms before serving)
            self._load(method)
        return self._compressors[method]

    def warm(self) -> None:
        """Build every offered compressor now, loading its models, so that no request pays a
        load; thread-blocking, run it in a worker thread. A compressor that cannot be built
        (a missing model folder or package) raises: the server cannot offer it."""
        with self._lock:
            for method in self._settings.methods:
                if method not in self._compressors:
                    self._load(method)

    def method_for(self, options: CompressionOptions | None) -> str | None:
        """The method a request runs: the one it names; else, when it asks for compression
        (`ragspeed.compression` given, e.g. a rate alone), the server's compressor; else the
        server's every-request compressor, if any (None: no compression, "none" included)."""
        every_request = self._settings.method
        if every_request == "none":
            every_request = None
        method = every_request
        if options is not None:
            method = options.method or every_request or self._settings.default_method
        return None if method == "none" else method

    def runs(self, options: CompressionOptions | None) -> bool:
        """Whether a request with these options is compressed."""
        return self.method_for(options) is not None

    def _budget(self, segments: Segments, options: CompressionOptions | None) -> Budget:
        rate = options.rate if options else None
        target_tokens = options.target_tokens if options else None
        if rate is None and target_tokens is None:
            rate = self._settings.rate
            target_tokens = self._settings.target_tokens
        protected = sum(
            count_tokens_many(
                self._tokenizer,
                [segments.static_system_prompt, segments.question, *(t.content for t in segments.history)],
            )
        )
        return Budget(self._tokenizer, rate, target_tokens, protected)

    def forecast(
        self, segments: Segments, documents: tuple[Document, ...], options: CompressionOptions | None
    ) -> Forecast:
        """What compressing these documents will leave and take, before compressing them (0
        kept tokens for parameters the compression itself refuses with a 400). A few
        milliseconds of tokenization against the compression's tens to hundreds."""
        budget = self._budget(segments, options)
        num_tokens = sum(count_tokens_many(self._tokenizer, [d.text for d in documents]))
        try:
            kept = min(num_tokens, budget.document_tokens(num_tokens))
        except CompressionError:
            kept = 0
        return Forecast(kept, num_tokens * self._seconds_per_token)

    def _observe(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            rate = seconds / num_tokens
            previous = self._seconds_per_token
            self._seconds_per_token = rate if previous == 0.0 else previous + SMOOTHING * (rate - previous)

    def __call__(
        self, segments: Segments, documents: tuple[Document, ...], options: CompressionOptions | None
    ) -> tuple[tuple[Document, ...], CompressionReport | None]:
        method = self.method_for(options)
        if method is None:
            return documents, None
        budget = self._budget(segments, options)
        start = time.perf_counter()  # the wait for the lock is part of what a request waits
        with self._lock:
            compressor = self._compressor(method)
            try:
                outcome = apply_policy(self._policy, compressor, segments.question, documents, budget)
            except CompressionError as exc:
                raise APIError(
                    400, exc.message, param=f"ragspeed.compression.{exc.param or 'rate'}"
                ) from None
        result = outcome.result
        self._observe(result.num_original_tokens, time.perf_counter() - start)
        kept = result.kept_documents
        report = CompressionReport(
            method=method,
            original_tokens=result.num_original_tokens,
            compressed_tokens=result.num_compressed_tokens,
            seconds=result.elapsed_s,
            failed=outcome.failed,
            skipped_reason=outcome.skipped_reason,
        )
        return (kept if outcome.compressed else documents), report
