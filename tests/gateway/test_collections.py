"""Collections over HTTP and retrieval inside a chat request, on a real server with MiniLM."""

from __future__ import annotations

import httpx
import pytest

from ragspeed.bench.launcher import ServerProcess

PASSAGES = [
    {"id": "nobel", "title": "Nobel Prize in Physics",
     "text": "The first Nobel Prize in Physics was awarded in 1901 to Wilhelm Conrad Röntgen of Germany."},
    {"id": "eiffel", "title": "Eiffel Tower",
     "text": "The Eiffel Tower was built between 1887 and 1889 as the entrance arch of the World's Fair."},
    {"id": "canberra", "title": "Canberra",
     "text": "Canberra is the capital city of Australia, chosen as a compromise between Sydney and Melbourne."},
]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    collections_dir = tmp_path_factory.mktemp("collections")
    with ServerProcess(["--engine", "transformers", "--model", str(tiny_model),
                        "--collections-dir", str(collections_dir)]) as server:
        yield server


def test_collection_lifecycle_and_query(server):
    base = f"{server.url}/v1/collections"
    assert httpx.post(base, json={"name": "wiki"}).status_code == 201
    assert httpx.post(f"{base}/wiki/query", json={"query": "anything"}, timeout=60).json()["data"] == []
    added = httpx.post(f"{base}/wiki/documents", json={"documents": PASSAGES + PASSAGES[:1]}, timeout=60).json()
    assert (added["num_added"], added["num_duplicates"]) == (3, 1)
    hits = httpx.post(f"{base}/wiki/query", json={"query": "What is the capital of Australia?", "top_k": 2}).json()
    assert hits["data"][0]["id"] == "canberra" and len(hits["data"]) == 2
    assert httpx.get(f"{base}/wiki").json()["num_documents"] == 3
    assert [c["name"] for c in httpx.get(base).json()["data"]] == ["wiki"]
    assert httpx.post(f"{base}/wiki/delete", json={"ids": ["eiffel"]}).json()["num_deleted"] == 1
    assert httpx.get(f"{base}/wiki").json()["num_documents"] == 2


def test_chat_retrieves_before_the_prompt(server):
    httpx.post(f"{server.url}/v1/collections", json={"name": "facts"})
    httpx.post(f"{server.url}/v1/collections/facts/documents", json={"documents": PASSAGES}, timeout=60)
    body = {"messages": [{"role": "user", "content": "When was the Eiffel Tower built?"}], "max_tokens": 2,
            "ragspeed": {"retrieval": {"collection": "facts", "top_k": 1}, "return_prompt": True}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert "entrance arch of the World's Fair" in response["ragspeed"]["prompt"]
    assert "Röntgen" not in response["ragspeed"]["prompt"]
    assert "retrieval" in response["ragspeed"]["timings_ms"]


@pytest.mark.parametrize("method, path, body, status, param", [
    ("post", "/v1/collections/none-such/query", {"query": "x"}, 404, "collection"),
    ("get", "/v1/collections/none-such", None, 404, "collection"),
    ("post", "/v1/collections", {"name": "../etc"}, 400, "collection"),
    ("post", "/v1/collections/wiki/query", {"query": ""}, 400, "query"),
])
def test_collection_errors(server, method, path, body, status, param):
    response = httpx.request(method, f"{server.url}{path}", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_chat_with_unknown_collection_is_404(server):
    body = {"messages": [{"role": "user", "content": "Who?"}],
            "ragspeed": {"retrieval": {"collection": "missing"}}}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 404 and response.json()["error"]["param"] == "collection"
