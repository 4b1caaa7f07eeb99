"""Compression through the gateway, in-process over the fake engine (the demo tokenizer, as the
tiny Llama's): per-request options, the server's default compressor, models loaded before ready,
the README's examples, figures in the response, bad input."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from ragspeed.gateway.client import _body_kwargs, build_chat_body
from ragspeed.gateway.settings import CompressionSettings, Settings
from tests.gateway.inprocess import fake_settings, serve

ROOT = Path(__file__).resolve().parents[2]

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


async def test_document_metadata_reaches_the_prompt_through_compression(fake, documents, assembled_documents):
    docs, question = documents
    sent = [
        {**d, "id": f"d{i}", "metadata": {"url": f"https://example.org/{i}", "rank": i, "tags": ["nq"]}}
        for i, d in enumerate(docs)
    ]
    async with serve(fake_settings()) as client:
        body = (
            await chat(
                client,
                documents=sent,
                question=question,
                ragspeed={"compression": {"method": "bm25", "rate": 0.25}},
            )
        ).json()
    assert body["ragspeed"]["compression"]["skipped_reason"] is None
    (kept,) = assembled_documents
    by_id = {d["id"]: d for d in sent}
    assert 0 < len(kept) <= len(sent)
    assert sum(len(d.text) for d in kept) < 0.5 * sum(len(d["text"]) for d in sent)  # compressed
    for doc in kept:
        assert doc.metadata == by_id[doc.id]["metadata"]
        assert doc.title == by_id[doc.id]["title"]


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


@pytest.mark.parametrize(
    "compression",
    [{"method": "fast", "rate": 0.5}, {"method": "llmlingua2", "rate": 0.5}],
)
async def test_a_method_the_server_does_not_offer_is_a_400(fake, documents, compression):
    async with serve(fake_settings()) as client:
        response = await chat(client, documents=documents[0], ragspeed={"compression": compression})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "ragspeed.compression.method"
    assert error["message"] == (
        f"this server does not offer the compression method {compression['method']!r}; "
        "offered: ['bm25', 'first-docs', 'identity'] (compression_methods)"
    )


def shipped_settings(**overrides):
    """The fake engine with compression as shipped: every offered compressor loaded at start-up,
    coarse-to-fine for a request that names no method."""
    shipped = CompressionSettings()
    return fake_settings(
        compression_methods=shipped.methods, compression_default_method=shipped.default_method, **overrides
    )


def test_the_shipped_default_compressor_is_coarse_to_fine():
    settings = Settings()
    compression = settings.compression
    assert compression.default_method == "coarse-to-fine" and compression.method is None
    assert compression.methods == [
        "coarse-to-fine",
        "fast",
        "bm25",
        "top-docs",
        "first-docs",
        "identity",
    ]
    assert settings.retrieval.enabled


async def test_a_rate_or_target_alone_runs_the_servers_compressor(fake, documents):
    docs, question = documents
    async with serve(shipped_settings()) as client:

        async def ask(compression):
            extra = {} if compression is None else {"ragspeed": {"compression": compression}}
            response = await chat(client, documents=docs, question=question, **extra)
            assert response.status_code == 200, response.text
            return response.json()

        plain, by_rate, by_target, by_method = [
            await ask(c)
            for c in (None, {"rate": 0.25}, {"target_tokens": 600}, {"method": "bm25", "rate": 0.25})
        ]
    assert "compression" not in plain["ragspeed"]  # a request that does not ask is not compressed
    full = plain["usage"]["prompt_tokens"]
    rate, target, method = (b["ragspeed"]["compression"] for b in (by_rate, by_target, by_method))
    assert (rate["method"], target["method"], method["method"]) == (
        "coarse-to-fine",
        "coarse-to-fine",
        "bm25",
    )
    for report in (rate, target, method):
        assert not report["failed"] and report["skipped_reason"] is None
    assert 0.2 <= rate["compressed_tokens"] / rate["original_tokens"] <= 0.27
    assert target["compressed_tokens"] <= 600
    # What the engine received is shorter by about what the compressor dropped.
    for body, report in ((by_rate, rate), (by_target, target)):
        saved = full - body["usage"]["prompt_tokens"]
        assert saved >= 0.7 * (report["original_tokens"] - report["compressed_tokens"])
    assert [len(r.prompt_token_ids) for r in fake.engine.requests] == [
        full,
        *(b["usage"]["prompt_tokens"] for b in (by_rate, by_target, by_method)),
    ]


async def test_a_rate_alone_runs_the_compressor_the_settings_name(fake, documents):
    docs, question = documents
    async with serve(fake_settings(compression_default_method="first-docs")) as client:
        body = (
            await chat(client, documents=docs, question=question, ragspeed={"compression": {"rate": 0.5}})
        ).json()
    assert body["ragspeed"]["compression"]["method"] == "first-docs"


async def test_every_model_is_loaded_before_ready_and_no_request_loads_one(fake, documents, tmp_path):
    docs, question = documents
    settings = shipped_settings(enable_retrieval=True, collections_dir=str(tmp_path / "collections"))
    async with serve(settings) as client:  # returns once /healthz is 200
        health = (await client.get("/healthz")).json()
        state = client.app.state.services
        loads_when_ready = state.compression.num_loads
        response = await chat(
            client, documents=docs, question=question, ragspeed={"compression": {"rate": 0.25}}
        )
        loads_after_request = state.compression.num_loads
    assert (health["compressors"], health["retrieval"]) == (
        ["coarse-to-fine", "fast", "bm25", "top-docs", "first-docs", "identity"],
        True,
    )
    assert state.retrieval.loaded
    assert (loads_when_ready, loads_after_request) == (6, 6)  # one per offered method, at start-up
    assert response.json()["ragspeed"]["compression"]["method"] == "coarse-to-fine"


def _evaluate(expr: ast.expr, names: dict) -> object:
    return eval(compile(ast.Expression(expr), "README.md", "eval"), names)


def readme_calls() -> dict[str, dict]:
    """The keyword arguments of the README's `client.chat.completions.create(...)` (openai) and
    `client.chat(...)` (ragspeed SDK) calls, evaluated as the README's code would, from the
    checkout: with the `documents` that its block loads."""
    calls: dict[str, dict] = {}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for block in re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL):
        tree = ast.parse(block)
        names = {"json": json, "open": lambda path: open(ROOT / path, encoding="utf-8")}
        for node in tree.body:
            if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["documents"]:
                exec(compile(ast.Module([node], []), "README.md", "exec"), names)
        for node in ast.walk(tree):
            name = ast.unparse(node.func) if isinstance(node, ast.Call) else None
            if name in ("client.chat.completions.create", "client.chat"):
                kwargs = {kw.arg: _evaluate(kw.value, names) for kw in node.keywords}
                if node.args:
                    kwargs["question"] = _evaluate(node.args[0], names)
                calls[name] = kwargs
    return calls


def test_the_readme_examples_ask_for_compression_without_a_method():
    calls = readme_calls()
    openai_body = calls["client.chat.completions.create"]
    assert openai_body["extra_body"]["ragspeed"] == {"compression": {"rate": 0.5}}
    assert len(openai_body["extra_body"]["documents"]) == 5
    assert calls["client.chat"]["compression"] == {"rate": 0.25}


async def test_the_readme_examples_compress(fake):
    calls = readme_calls()
    create = dict(calls["client.chat.completions.create"])
    # What the openai SDK sends: its arguments, and `extra_body` merged into the body.
    openai_body = {**create, **create.pop("extra_body")}
    sdk = dict(calls["client.chat"])
    sdk_body = build_chat_body(sdk.pop("question"), stream=False, **_body_kwargs(sdk))
    async with serve(shipped_settings(served_model_name="smollm2-135m-instruct")) as client:
        responses = [await client.post("/v1/chat/completions", json=b) for b in (openai_body, sdk_body)]
    for response, rate in zip(responses, (0.5, 0.25)):
        assert response.status_code == 200, response.text
        report = response.json()["ragspeed"]["compression"]
        assert report["method"] == "coarse-to-fine" and report["skipped_reason"] is None
        assert report["original_tokens"] == 800  # the demo tokenizer's count of the five passages
        assert report["compressed_tokens"] <= rate * report["original_tokens"]
