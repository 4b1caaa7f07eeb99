"""The documents of a request, between its segments and its prompt: the retrieved ones added
(`ragspeed.retrieval`), their number checked (`max_documents`), compressed (gateway.compress), and
the document KV reuse they get (gateway.fidelity_gate.RequestDocumentCache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ragspeed.document import Document
from ragspeed.engine.protocol import DocumentCacheOptions
from ragspeed.gateway.compress import CompressionReport, CompressionStage
from ragspeed.gateway.cpu_jobs import CpuJobs
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.fidelity_gate import RequestDocumentCache
from ragspeed.gateway.prepared import StageTimer
from ragspeed.gateway.prompt import Segments
from ragspeed.gateway.protocol import RagspeedOptions
from ragspeed.gateway.retrieval_service import RetrievalService
from ragspeed.gateway.run import Recorder


@dataclass(frozen=True)
class PreparedDocuments:
    """A request's documents as its prompt places them, and what was done to them."""

    documents: tuple[Document, ...]
    compression: CompressionReport | None = None  # None: not compressed
    judged_before_compression: bool = False  # `check_work` ran, with the compression's forecast
    document_cache: DocumentCacheOptions | None = None  # None: exact prefill


@dataclass(frozen=True)
class DocumentStage:
    retrieval: RetrievalService
    compression: CompressionStage | None  # None: this server compresses nothing
    reuse: RequestDocumentCache
    recorder: Recorder  # counts the compressed tokens
    jobs: CpuJobs  # retrieval's embedding and the compression run there, off the event loop
    max_documents: int

    async def prepare(
        self,
        segments: Segments,
        options: RagspeedOptions | None,
        timer: StageTimer,
        *,
        arm: str,
        check_work: Callable[[int, float], object] | None = None,
    ) -> PreparedDocuments:
        """`check_work(tokens, seconds)` (the admission's check, which raises 429) runs before
        compression, with the compressed documents' budget and the compression's expected
        time: a request that will miss its deadline is refused before its most expensive
        stage, not after it."""
        documents = segments.documents
        if options and options.retrieval:
            if not self.retrieval.enabled:
                raise APIError(400, "retrieval is not enabled on this server", param="ragspeed.retrieval")
            with timer.stage("retrieval"):
                retrieved = await self.jobs.run(self.retrieval, segments.question, options.retrieval)
                documents = documents + tuple(retrieved)
        if len(documents) > self.max_documents:
            raise APIError(
                400,
                f"the request has {len(documents)} documents; the limit is {self.max_documents} (max_documents)",
                param="documents",
                code="too_many_documents",
            )
        report, judged = None, False
        asked = options.compression if options else None
        compress = self.compression
        if documents and compress is not None and asked is not False and compress.runs(asked):
            if check_work is not None:
                forecast = compress.forecast(segments, documents, asked)
                check_work(forecast.kept_tokens, forecast.seconds)
                judged = True
            with timer.stage("compression"):
                documents, report = await self.jobs.run(compress, segments, documents, asked)
            if report is not None:
                self.recorder.compressed(report, arm)
        compressed = report is not None and not report.failed and report.skipped_reason is None
        document_cache = self.reuse.document_cache(options, compressed=compressed)
        return PreparedDocuments(documents, report, judged, document_cache)
