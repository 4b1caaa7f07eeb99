"""Document collections for gateway-side retrieval (admin endpoints)."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ragspeed.document import Document
from ragspeed.gateway.cpu_jobs import CpuJobs
from ragspeed.gateway.dependencies import app_state, ready_state, retrieval_service
from ragspeed.gateway.protocol import DocumentIn
from ragspeed.gateway.security import TenantSalt

router = APIRouter(prefix="/v1/collections")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateCollection(_Body):
    name: str = Field(..., min_length=1, max_length=64)


class DocumentBody(DocumentIn):
    """A document added to a collection: the wire's one document (a chat request's `documents`
    item), its unknown keys refused as in every admin body."""

    model_config = ConfigDict(extra="forbid")


class PrecomputeKV(TenantSalt):
    """Store each added document's KV (the document cache) for requests with this system prompt."""

    system_prompt: str = Field(
        ..., min_length=1, description="The static system prompt of the requests that will retrieve them."
    )


class AddDocuments(_Body):
    documents: list[DocumentBody] = Field(..., min_length=1)
    chunk: bool = True
    precompute: PrecomputeKV | None = Field(
        None,
        description="Prefill the added documents' KV in the background (see the collection's document_kv).",
    )


class DeleteDocuments(_Body):
    ids: list[str] = Field(..., min_length=1)


class Query(_Body):
    query: str = Field(..., min_length=1)
    top_k: int = Field(5, ge=1, le=100)
    mode: Literal["dense", "bm25", "hybrid"] = "hybrid"


async def _run(request: Request, name: str, *args: Any, **kwargs: Any) -> Any:
    """A store method off the event loop, as a CPU job (its embedding within the engine's threads)."""
    service = retrieval_service(request)
    jobs = CpuJobs(app_state(request).engine)
    return await jobs.run(lambda: service.call(getattr(service.store, name), *args, **kwargs))


def _stats(request: Request, stats: Any) -> dict[str, Any]:
    out = {"object": "collection", **dataclasses.asdict(stats)}
    precompute = app_state(request).precompute
    progress = precompute.progress.get(stats.name) if precompute is not None else None
    if progress is not None:
        out["document_kv"] = progress.as_dict()
    return out


@router.get("")
async def list_collections(request: Request):
    return {"object": "list", "data": [_stats(request, s) for s in await _run(request, "list")]}


@router.post("", status_code=201)
async def create_collection(body: CreateCollection, request: Request):
    return _stats(request, await _run(request, "create", body.name))


@router.get("/{name}")
async def get_collection(name: str, request: Request):
    return _stats(request, await _run(request, "stats", name))


@router.delete("/{name}")
async def delete_collection(name: str, request: Request):
    await _run(request, "delete", name)
    precompute = app_state(request).precompute
    if precompute is not None:
        precompute.forget(name)
    return {"object": "collection.deleted", "name": name, "deleted": True}


@router.post("/{name}/documents")
async def add_documents(name: str, body: AddDocuments, request: Request):
    # Checked before anything is added: a refused request changes nothing.
    precompute = ready_state(request).precompute if body.precompute is not None else None
    documents = [
        Document(id=d.id or "", text=d.text, title=d.title, metadata=d.metadata) for d in body.documents
    ]
    result = await _run(request, "add_documents", name, documents, chunk=body.chunk)
    out = {
        "object": "collection.add",
        "num_added": result.num_added,
        "num_duplicates": result.num_duplicates,
        "ids": list(result.ids),
    }
    if precompute is not None and body.precompute is not None:
        added = set(result.ids)
        collection = await _run(request, "get", name)
        chunks = [d for d in collection.documents() if d.id in added]
        out["document_kv"] = precompute.submit(
            name, chunks, body.precompute.system_prompt, body.precompute.salt
        ).as_dict()
    return out


@router.post("/{name}/delete")
async def delete_documents(name: str, body: DeleteDocuments, request: Request):
    return {"object": "collection.delete", "num_deleted": await _run(request, "delete_ids", name, body.ids)}


@router.post("/{name}/query")
async def query_collection(name: str, body: Query, request: Request):
    hits = await _run(request, "query", name, body.query, body.top_k, body.mode)
    return {
        "object": "list",
        "data": [
            {
                "rank": h.rank,
                "score": h.score,
                "id": h.document.id,
                "title": h.document.title,
                "text": h.document.text,
                "metadata": h.document.metadata,
            }
            for h in hits
        ],
    }
