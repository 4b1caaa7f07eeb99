"""Collections over HTTP and retrieval inside a chat request, in-process: the fake engine, the
real collection store and the bundled MiniLM embedder."""

from __future__ import annotations

import pytest

from tests.gateway.inprocess import fake_settings, serve, wait_for

pytestmark = pytest.mark.anyio

PASSAGES = [
    {
        "id": "nobel",
        "title": "Nobel Prize in Physics",
        "text": "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen of Germany.",
    },
    {
        "id": "eiffel",
        "title": "Eiffel Tower",
        "text": "The Eiffel Tower was built between 1887 and 1889 as the entrance arch of the World's Fair.",
    },
    {
        "id": "canberra",
        "title": "Canberra",
        "text": "Canberra is the capital city of Australia, chosen as a compromise between Sydney and Melbourne.",
    },
]


async def test_collection_lifecycle_query_and_retrieval_in_chat(fake, tmp_path):
    base = "/v1/collections"
    async with serve(
        fake_settings(collections_dir=str(tmp_path / "collections"), enable_retrieval=True)
    ) as client:
        assert (await client.post(base, json={"name": "wiki"})).status_code == 201
        assert (await client.post(f"{base}/wiki/query", json={"query": "anything"})).json()["data"] == []
        added = (
            await client.post(f"{base}/wiki/documents", json={"documents": PASSAGES + PASSAGES[:1]})
        ).json()
        assert (added["num_added"], added["num_duplicates"]) == (3, 1)
        hits = (
            await client.post(
                f"{base}/wiki/query", json={"query": "What is the capital of Australia?", "top_k": 2}
            )
        ).json()
        assert hits["data"][0]["id"] == "canberra" and len(hits["data"]) == 2
        assert (await client.get(f"{base}/wiki")).json()["num_documents"] == 3
        assert [c["name"] for c in (await client.get(base)).json()["data"]] == ["wiki"]

        chat = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "When was the Eiffel Tower built?"}],
                "max_tokens": 2,
                "ragspeed": {"retrieval": {"collection": "wiki", "top_k": 1}, "return_prompt": True},
            },
        )
        assert chat.status_code == 200, chat.text
        prompt = chat.json()["ragspeed"]["prompt"]
        assert "entrance arch of the World's Fair" in prompt and "Röntgen" not in prompt
        assert "retrieval" in chat.json()["ragspeed"]["timings_ms"]
        assert fake.engine.requests[0].prompt == prompt

        assert (await client.post(f"{base}/wiki/delete", json={"ids": ["eiffel"]})).json()["num_deleted"] == 1
        assert (await client.get(f"{base}/wiki")).json()["num_documents"] == 2


async def test_retrieved_documents_keep_their_metadata_through_compression(
    fake, tmp_path, assembled_documents
):
    passages = [
        {**p, "metadata": {"source": f"wiki/{p['id']}", "year": 2000 + i}} for i, p in enumerate(PASSAGES)
    ]
    settings = fake_settings(
        collections_dir=str(tmp_path / "collections"),
        enable_retrieval=True,
        compression_min_document_tokens=0,
    )
    async with serve(settings) as client:
        assert (await client.post("/v1/collections", json={"name": "wiki"})).status_code == 201
        await client.post("/v1/collections/wiki/documents", json={"documents": passages})
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "When was the Eiffel Tower built?"}],
                "max_tokens": 2,
                "ragspeed": {
                    "retrieval": {"collection": "wiki", "top_k": 2},
                    "compression": {"method": "bm25", "rate": 0.5},
                },
            },
        )
    assert chat.status_code == 200, chat.text
    assert chat.json()["ragspeed"]["compression"]["skipped_reason"] is None
    (kept,) = assembled_documents
    assert [d.id for d in kept][:1] == ["eiffel"]
    years = {p["id"]: 2000 + i for i, p in enumerate(PASSAGES)}
    for doc in kept:  # the caller's metadata, and the chunk's number that ingestion adds
        assert doc.metadata == {"source": f"wiki/{doc.id}", "year": years[doc.id], "chunk": 0}


async def test_collection_errors(fake, tmp_path):
    cases = [
        ("post", "/v1/collections/none-such/query", {"query": "x"}, 404, "collection"),
        ("get", "/v1/collections/none-such", None, 404, "collection"),
        ("post", "/v1/collections", {"name": "../etc"}, 400, "collection"),
        ("post", "/v1/collections/wiki/query", {"query": ""}, 400, "query"),
        (
            "post",
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Who?"}],
                "ragspeed": {"retrieval": {"collection": "missing"}},
            },
            404,
            "collection",
        ),
    ]
    async with serve(
        fake_settings(collections_dir=str(tmp_path / "collections"), enable_retrieval=True)
    ) as client:
        await client.post("/v1/collections", json={"name": "wiki"})
        for method, path, body, status, param in cases:
            response = await client.request(method, path, json=body)
            assert response.status_code == status, (path, response.text)
            assert response.json()["error"]["param"] == param, path
    assert fake.engine.requests == []


async def _precomputed(client, name: str) -> dict:
    status: dict = {}

    async def done() -> bool:
        status.update((await client.get(f"/v1/collections/{name}")).json()["document_kv"])
        return status["queued"] == 0

    await wait_for(done, "precomputed")
    return status


async def test_added_documents_are_precomputed_and_a_retrieval_request_finds_their_kv(tiny_model, tmp_path):
    settings = fake_settings(
        engine="native",
        model=str(tiny_model),
        max_model_len=2048,
        num_threads=1,
        collections_dir=str(tmp_path / "collections"),
        enable_retrieval=True,
        document_cache="on",
    )
    precompute = {"system_prompt": "Answer briefly.", "cache_salt": "acme"}
    async with serve(settings) as client:
        await client.post("/v1/collections", json={"name": "wiki"})
        added = await client.post(
            "/v1/collections/wiki/documents",
            json={"documents": PASSAGES, "chunk": False, "precompute": precompute},
        )
        assert added.status_code == 200 and added.json()["document_kv"]["queued"] == 3
        status = await _precomputed(client, "wiki")
        assert (status["computed"], status["found"], status["failed"]) == (3, 0, 0)
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "messages": [
                    {"role": "system", "content": "Answer briefly."},
                    {"role": "user", "content": "When was the Eiffel Tower built?"},
                ],
                "max_tokens": 2,
                "cache_salt": "acme",
                "ragspeed": {"retrieval": {"collection": "wiki", "top_k": 2}},
            },
        )
        assert chat.status_code == 200, chat.text
        reuse = chat.json()["ragspeed"]["document_cache"]
        assert (reuse["documents_hit"], reuse["documents_computed"]) == (2, 0)
        metrics = (await client.get("/metrics")).text
        assert (
            'ragspeed_collection_precomputed_documents_total{collection="wiki",outcome="computed"} 3.0'
            in metrics
        )


async def test_a_precompute_the_engine_cannot_serve_is_reported_and_a_bad_one_adds_nothing(fake, tmp_path):
    async with serve(
        fake_settings(collections_dir=str(tmp_path / "collections"), enable_retrieval=True)
    ) as client:
        await client.post("/v1/collections", json={"name": "wiki"})
        both = {"system_prompt": "Be brief.", "tenant": "acme", "cache_salt": "x"}
        refused = await client.post(
            "/v1/collections/wiki/documents", json={"documents": PASSAGES, "precompute": both}
        )
        assert refused.status_code == 400 and "either tenant or cache_salt" in refused.text
        assert (await client.get("/v1/collections/wiki")).json()["num_documents"] == 0
        added = await client.post(
            "/v1/collections/wiki/documents",
            json={"documents": PASSAGES, "chunk": False, "precompute": {"system_prompt": "Be brief."}},
        )
        assert added.status_code == 200
        status = await _precomputed(client, "wiki")
        assert status["failed"] == 3 and "keeps no document KV" in status["error"]
        await client.delete("/v1/collections/wiki")
        await client.post("/v1/collections", json={"name": "wiki"})
        assert "document_kv" not in (await client.get("/v1/collections/wiki")).json()
