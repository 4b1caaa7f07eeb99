"""Compression through the gateway, in-process over the fake engine (the demo tokenizer, as the
tiny Llama's): per-request options, figures in the response, bad input."""

from __future__ import annotations

import json

import pytest

from tests.gateway.inprocess import fake_settings, serve

pytestmark = pytest.mark.anyio

QUESTION = "Who received the first Nobel Prize in Physics?"


@pytest.fixture(scope="module")
def documents(shared_data):
    with open(shared_data / "nq_dev.jsonl", encoding="utf-8") as f:
        example = json.loads(f.readline())
    return [{"title": d["title"], "text": d["text"]} for d in example["documents"][:8]], example["question"]


async def chat(client, **body):
    return await client.post(
        "/v1/chat/completions",
        json={
            "messages": [
                {"role": "system", "content": "Answer from the documents."},
                {"role": "user", "content": body.pop("question", QUESTION)},
            ],
            "max_tokens": 2,
            "temperature": 0,
            **body,
        },
    )


async def test_per_request_compression_shrinks_the_prompt(fake, documents):
    docs, question = documents
    async with serve(fake_settings()) as client:
        plain = (await chat(client, documents=docs, question=question)).json()
        squeezed = (
            await chat(
                client,
                documents=docs,
                question=question,
                ragspeed={"compression": {"method": "bm25", "rate": 0.25}},
            )
        ).json()
    report = squeezed["ragspeed"]["compression"]
    assert report["method"] == "bm25" and not report["failed"] and report["skipped_reason"] is None
    assert report["original_tokens"] > 1000
    assert 0.2 <= report["compressed_tokens"] / report["original_tokens"] <= 0.27
    saved = plain["usage"]["prompt_tokens"] - squeezed["usage"]["prompt_tokens"]
    assert saved >= 0.7 * (report["original_tokens"] - report["compressed_tokens"])
    assert "compression" in squeezed["ragspeed"]["timings_ms"]
    assert "compression" not in plain["ragspeed"]  # the server default is off


async def test_short_documents_skip_compression(fake):
    async with serve(fake_settings()) as client:
        body = (
            await chat(
                client,
                documents=["Röntgen won it in 1901."],
                ragspeed={"compression": {"method": "bm25", "rate": 0.5}},
            )
        ).json()
    assert body["ragspeed"]["compression"]["skipped_reason"] == "below_break_even"


@pytest.mark.parametrize(
    "compression, param",
    [
        ({"method": "zip", "rate": 0.5}, "ragspeed.compression.method"),
        ({"method": "bm25", "target_tokens": 3}, "ragspeed.compression.target_tokens"),
        ({"method": "bm25", "rate": 0}, "ragspeed.compression.rate"),
    ],
)
async def test_bad_compression_options(fake, documents, compression, param):
    async with serve(fake_settings()) as client:
        response = await chat(client, documents=documents[0], ragspeed={"compression": compression})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
