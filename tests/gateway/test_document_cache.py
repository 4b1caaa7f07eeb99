"""Document KV reuse end to end: the real server on the default model, the official openai
client. Documents seen in one order are found in the store in another, also after a restart on
the same folder, and with their glue reused; a bad option is a 400 naming it."""

from __future__ import annotations

import json

import openai
import pytest

from ragspeed.bench.launcher import ServerProcess
from ragspeed.document import Document
from ragspeed.engine.native.loading.model_zoo import DEFAULT_MODEL_NAME
from ragspeed.gateway.prompt import Segments, assemble_prompt
from tests.real_model import NOBEL_DOCUMENT, NOBEL_MESSAGES, default_model_cache

DOCUMENTS = [
    {"title": "Physics", "text": NOBEL_DOCUMENT},
    {"title": "Chemistry", "text": "The first Nobel Prize in Chemistry went to Jacobus van 't Hoff in 1901."},
    {"title": "Peace", "text": "Henry Dunant and Frédéric Passy shared the first Nobel Peace Prize in 1901."},
]


def ask(client, documents, document_cache=True):
    completion = client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=NOBEL_MESSAGES,
        max_tokens=24,
        temperature=0,
        extra_body={"documents": documents, "ragspeed": {"document_cache": document_cache}},
    )
    return completion.choices[0].message.content, completion.model_extra["ragspeed"]["document_cache"]


def test_documents_reused_in_another_order_and_after_a_restart(tmp_path_factory, tmp_path):
    env = {"RAGSPEED_CACHE_DIR": str(default_model_cache(tmp_path_factory))}
    args = ["--document-cache", "on", "--document-cache-dir", str(tmp_path / "documents")]
    with ServerProcess(args, env=env) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        _, first = ask(client, DOCUMENTS)
        _, warm = ask(client, DOCUMENTS[::-1], {"policy": "sink", "tokens": 4})
        with pytest.raises(openai.BadRequestError) as bad:
            ask(client, DOCUMENTS, {"policy": "everything"})
    assert (first["documents_hit"], first["documents_computed"]) == (0, 3)
    assert (warm["documents_hit"], warm["documents_computed"]) == (3, 0)
    assert warm["policy"] == "sink" and warm["recomputed_tokens"] > 3 * 4
    assert "ragspeed.document_cache.policy" in json.dumps(bad.value.body)
    assert len(list((tmp_path / "documents").glob("*.kv"))) == 5  # 3 documents, 2 glues ("[2]", "[3]")
    with ServerProcess(args, env=env) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        answer, restarted = ask(client, DOCUMENTS[1:] + DOCUMENTS[:1])
        ask(client, DOCUMENTS, {"glue": "reuse"})  # stores the glue between documents
        _, glued = ask(client, DOCUMENTS[2:] + DOCUMENTS[:2], {"glue": "reuse"})
    assert (restarted["documents_hit"], restarted["documents_computed"]) == (3, 0)
    assert glued["documents_hit"] == 3 and glued["recomputed_tokens"] < restarted["recomputed_tokens"]
    assert answer
    assert restarted["policy"] == "reuse"  # the server's default policy


class _Tokenizer:
    """Characters as token ids; no chat template (a plain transcript)."""

    chat_template = None

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_document_bodies_are_tokenized_on_their_own_and_the_text_is_unchanged():
    segments = Segments("Be brief.", (), (), "Who?")
    documents = (Document("a", "First text.", "One"), Document("b", "Second text."))
    whole = assemble_prompt(_Tokenizer(), segments, documents)
    split = assemble_prompt(_Tokenizer(), segments, documents, document_spans=True)
    assert split.text == whole.text and whole.document_spans == ()
    bodies = ["".join(map(chr, split.token_ids[s:e])) for s, e in split.document_spans]
    assert bodies == [" One\nFirst text.", "\nSecond text."]
    assert "[1] One\nFirst text.\n\n[2]\nSecond text." in split.text


@pytest.mark.anyio
async def test_without_a_measured_policy_requests_get_exact_prefill_unless_they_ask(fake):
    from tests.gateway.inprocess import SERVED_MODEL, fake_settings, serve

    body = {
        "model": SERVED_MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "Who won?"}],
        "documents": [{"title": "Physics", "text": NOBEL_DOCUMENT}],
    }
    async with serve(fake_settings()) as client:
        models = (await client.get("/v1/models")).json()
        await client.post("/v1/chat/completions", json=body)
        await client.post("/v1/chat/completions", json={**body, "ragspeed": {"document_cache": True}})
    # The fake engine reuses no document KV: the gate's choice is exact prefill, and says why.
    assert models["data"][0]["ragspeed"]["document_cache"] == {
        "policy": "exact",
        "reason": "this engine does not reuse document KV",
        "figures": {},
    }
    default, asked = fake.engine.requests
    assert default.document_cache is None and default.document_spans == ()
    assert asked.document_cache is not None and asked.document_cache.policy == "reuse"
