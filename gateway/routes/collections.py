"""Document collections for gateway-side retrieval (admin endpoints)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ragspeed.gateway.dependencies import retrieval_service

router = APIRouter(prefix="/v1/collections")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class CreateCollection(_Body):
    name: str = Field(..., min_length=1, max_length=64)


class DocumentBody(_Body):
    text: str
    title: str = ""
    id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class AddDocuments(_Body):
    documents: list[DocumentBody] = Field(..., min_length=1)
    chunk: bool = True


class DeleteDocuments(_Body):
    ids: list[str] = Field(..., min_length=1)


class Query(_Body):
    query: str = Field(..., min_length=1)
    top_k: int = Field(5, ge=1, le=100)
    mode: Literal["dense", "bm25", "hybrid"] = "hybrid"


async def _run(request: Request, name: str, *args: Any, **kwargs: Any) -> Any:
    service = retrieval_service(request)
    return await asyncio.to_thread(lambda: service.call(getattr(service.store, name), *args, **kwargs))


def _stats(stats: Any) -> dict[str, Any]:
    return {"object": "collection", **dataclasses.asdict(stats)}


@router.get("")
async def list_collections(request: Request):
    return {"object": "list", "data": [_stats(s) for s in await _run(request, "list")]}


@router.post("", status_code=201)
async def create_collection(body: CreateCollection, request: Request):
    return _stats(await _run(request, "create", body.name))


@router.get("/{name}")
async def get_collection(name: str, request: Request):
    return _stats(await _run(request, "stats", name))


@router.delete("/{name}")
async def delete_collection(name: str, request: Request):
    await _run(request, "delete", name)
    return {"object": "collection.deleted", "name": name, "deleted": True}


@router.post("/{name}/documents")
async def add_documents(name: str, body: AddDocuments, request: Request):
    from ragspeed.retrieval import Document

    documents = [
        Document(id=d.id or "", text=d.text, title=d.title, metadata=d.metadata) for d in body.documents
    ]
    result = await _run(request, "add_documents", name, documents, chunk=body.chunk)
    return {
        "object": "collection.add",
        "num_added": result.num_added,
        "num_duplicates": result.num_duplicates,
        "ids": list(result.ids),
    }


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
