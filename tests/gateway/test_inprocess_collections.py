"""Collections over HTTP and retrieval inside a chat request, in-process: the fake engine, the
real collection store and the bundled MiniLM embedder."""

from __future__ import annotations

import pytest

from tests.gateway.inprocess import fake_settings, serve

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
