"""The compression stage of the pipeline: the server's default method and rate, per-request
overrides (`ragspeed.compression`), the break-even policy and failing open.

Compressors are built on first use, one per method, and share one embedding cache. They run
in a worker thread (a compression takes tens to hundreds of milliseconds of CPU and must not
stall the event loop), one at a time.
"""

from __future__ import annotations

import threading
from typing import Any

from ragspeed.compression import CompressionError, CompressionPolicy, apply_policy, build_compressor
from ragspeed.compression.scoring.embedding_cache import EmbeddingCache
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prepare import CompressionReport
from ragspeed.gateway.prompt import Document, Segments
from ragspeed.gateway.protocol import CompressionOptions
from ragspeed.gateway.settings import Settings


class CompressionStage:
    def __init__(self, settings: Settings, tokenizer: Any):
        self._settings = settings
        self._tokenizer = tokenizer
        self._policy = CompressionPolicy(min_document_tokens=settings.compression_min_document_tokens)
        self._cache = EmbeddingCache(settings.compression_cache_entries)
        self._compressors: dict[str, Any] = {}
        self._lock = threading.Lock()

    def _compressor(self, method: str):
        if method not in self._compressors:
            try:
                self._compressors[method] = build_compressor(
                    method, cache=self._cache, order=self._settings.compression_order
                )
            except CompressionError as exc:
                raise APIError(400, exc.message, param="ragspeed.compression.method") from None
        return self._compressors[method]

    def warm(self) -> None:
        """Load the default method's models now rather than on the first request."""
        if self._settings.compression_method:
            with self._lock:
                self._compressor(self._settings.compression_method)

    def __call__(
        self, segments: Segments, documents: tuple[Document, ...], options: CompressionOptions | None
    ) -> tuple[tuple[Document, ...], CompressionReport | None]:
        method = (options and options.method) or self._settings.compression_method
        if not method or method == "none":
            return documents, None
        rate = options.rate if options else None
        target_tokens = options.target_tokens if options else None
        if rate is None and target_tokens is None:
            rate = self._settings.compression_rate
            target_tokens = self._settings.compression_target_tokens
        protected = sum(
            len(self._tokenizer.encode(text, add_special_tokens=False))
            for text in (
                segments.static_system_prompt,
                segments.question,
                *(t.content for t in segments.history),
            )
        )
        with self._lock:
            compressor = self._compressor(method)
            try:
                outcome = apply_policy(
                    self._policy,
                    compressor,
                    segments.question,
                    documents,
                    tokenizer=self._tokenizer,
                    rate=rate,
                    target_tokens=target_tokens,
                    protected_tokens=protected,
                )
            except CompressionError as exc:
                raise APIError(
                    400, exc.message, param=f"ragspeed.compression.{exc.param or 'rate'}"
                ) from None
        result = outcome.result
        kept = tuple(Document(id=d.id, text=d.text, title=d.title) for d in result.documents)
        report = CompressionReport(
            method=method,
            original_tokens=result.num_original_tokens,
            compressed_tokens=result.num_compressed_tokens,
            seconds=result.elapsed_s,
            failed=outcome.failed,
            skipped_reason=outcome.skipped_reason,
        )
        return (kept if outcome.compressed else documents), report
