"""Collections' documents prefilled into the engine's document KV store as they are added
(docs/architecture.md, contract 8), so that a retrieval request finds every document's KV.

`POST /v1/collections/{name}/documents` with `precompute` queues the added documents here. A
background task sends them to the engine a batch at a time (`EngineClient.store_documents`),
each batch rendered as a request with that system prompt renders its documents
(gateway.prompt): a stored document's key is its tokens after the prompt's prefix, so the KV is
found only by requests with the same system prompt (and tenant salt). One batch is in the
engine at a time, whatever the number of collections, so live requests wait at most one batch.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ragspeed.document import Document
from ragspeed.engine.protocol import DocumentCacheOptions, EngineClient, GenerationRequest, SamplingParams
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.prompt import Segments, assemble_prompt

logger = logging.getLogger(__name__)

BATCH_SIZE = 8
# The glue between documents is stored too: it is the same for every request.
_OPTIONS = DocumentCacheOptions("reuse", glue="reuse")
_ids = itertools.count()


@dataclass
class PrecomputeProgress:
    """One collection's precompute, since the server started."""

    queued: int = 0  # documents waiting or in the engine
    computed: int = 0  # prefilled and stored
    found: int = 0  # already in the store
    failed: int = 0
    error: str | None = None  # the last failure

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class DocumentPrecompute:
    def __init__(self, engine: EngineClient, tokenizer: Any, metrics: GatewayMetrics):
        self._engine = engine
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._turn = asyncio.Lock()  # one batch in the engine at a time
        self._tasks: set[asyncio.Task] = set()
        self.progress: dict[str, PrecomputeProgress] = {}

    def submit(
        self, collection: str, documents: Sequence[Document], system_prompt: str, cache_salt: str | None
    ) -> PrecomputeProgress:
        """Queue `documents` of `collection`; returns at once with its progress."""
        progress = self.progress.setdefault(collection, PrecomputeProgress())
        progress.queued += len(documents)
        self._metrics.precompute_queued.labels(collection=collection).set(progress.queued)
        task = asyncio.create_task(
            self._run(collection, progress, list(documents), system_prompt, cache_salt)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return progress

    def forget(self, collection: str) -> None:
        """A deleted collection: its progress goes (documents already queued are still stored)."""
        self.progress.pop(collection, None)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _run(
        self,
        collection: str,
        progress: PrecomputeProgress,
        documents: list[Document],
        system_prompt: str,
        cache_salt: str | None,
    ) -> None:
        for start in range(0, len(documents), BATCH_SIZE):
            batch = documents[start : start + BATCH_SIZE]
            try:
                async with self._turn:
                    report = await self._engine.store_documents(
                        self._request(batch, system_prompt, cache_salt)
                    )
                if report is None:
                    raise RuntimeError(
                        "this engine keeps no document KV (a remote or transformers engine, or a "
                        "rope that cannot be shifted) or the chat template changes the documents' text"
                    )
                self._count(collection, progress, computed=report.num_computed, found=report.num_hit)
            except Exception as exc:  # an engine error, a prompt too long, an engine gone
                logger.warning("precompute of %d document(s) of %r failed: %s", len(batch), collection, exc)
                progress.error = f"{type(exc).__name__}: {exc}"
                self._count(collection, progress, failed=len(batch))
            finally:
                progress.queued -= len(batch)
                self._metrics.precompute_queued.labels(collection=collection).set(progress.queued)

    def _request(
        self, batch: list[Document], system_prompt: str, cache_salt: str | None
    ) -> GenerationRequest:
        segments = Segments(system_prompt, tuple(batch), (), "")
        prompt = assemble_prompt(self._tokenizer, segments, batch, document_spans=True)
        return GenerationRequest(
            f"precompute-{next(_ids)}",
            prompt.token_ids,
            SamplingParams(max_tokens=1),
            cache_salt=cache_salt,
            document_spans=prompt.document_spans,
            document_cache=_OPTIONS,
        )

    def _count(self, collection: str, progress: PrecomputeProgress, **outcomes: int) -> None:
        for outcome, n in outcomes.items():
            setattr(progress, outcome, getattr(progress, outcome) + n)
            if n:
                self._metrics.precomputed_documents.labels(collection=collection, outcome=outcome).inc(n)
