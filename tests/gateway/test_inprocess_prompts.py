"""The prompt registry's routes in-process, over the fake engine (which has no prefix cache, so
prompts are substituted as text and nothing is pinned): validation errors, register, use, list,
get, delete, and the errors of a chat request naming a prompt."""

from __future__ import annotations

import pytest

from tests.gateway.inprocess import fake_settings, serve

pytestmark = pytest.mark.anyio

SYSTEM = " ".join(
    [
        "You are the support assistant of the Example Company. Answer briefly, cite the "
        "documents you use, and say so when they do not hold the answer."
    ]
    * 6
)


async def _chat(client, question: str, *, prompt: str | None = None, system: str | None = None):
    body = {
        "max_tokens": 4,
        "messages": ([{"role": "system", "content": system}] if system else [])
        + [{"role": "user", "content": question}],
    }
    if prompt is not None:
        body["ragspeed"] = {"system_prompt": prompt}
    return await client.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    "body, param, message",
    [
        (
            {"name": "a", "text": ""},
            "text",
            "invalid value for 'text': String should have at least 1 character",
        ),
        ({"name": "a"}, "text", "missing required parameter 'text'"),
        ({"text": "t"}, "name", "missing required parameter 'name'"),
        (
            {"name": "a" * 65, "text": "t"},
            "name",
            "invalid value for 'name': String should have at most 64 characters",
        ),
        (
            {"name": "a", "text": "t", "tenant": "x", "cache_salt": "y"},
            None,
            "give either tenant or cache_salt, not both",
        ),
        (
            {"name": "a", "text": "t", "colour": "red"},
            "colour",
            "invalid value for 'colour': Extra inputs are not permitted",
        ),
        ({"name": "../x", "text": "t"}, "name", None),
        ({"name": "a", "text": " \n "}, "text", "text is only white space"),
    ],
)
async def test_bad_register_bodies_are_400(fake, body, param, message):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/prompts", json=body)
        listed = (await client.get("/v1/prompts")).json()
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    if message is not None:
        assert error["message"] == message
    assert listed == {"object": "list", "data": []}


async def test_engines_without_prefix_cache_substitute_text_and_pin_nothing(fake):
    async with serve(fake_settings()) as client:
        # Stripped like a system message: registered with white space around it, it renders
        # as the same text sent inline.
        text = f"  {SYSTEM}\n"
        created = await client.post("/v1/prompts", json={"name": "plain", "text": text, "tenant": "acme"})
        again = await client.post("/v1/prompts", json={"name": "plain", "text": "other"})
        used = await _chat(client, "Where is my parcel?", prompt="plain")
        inline = await _chat(client, "Where is my parcel?", system=SYSTEM)
        listed = (await client.get("/v1/prompts")).json()["data"]
        got = await client.get("/v1/prompts/plain")
        deleted = await client.delete("/v1/prompts/plain")
        after = await client.get("/v1/prompts/plain")
        deleted_again = await client.delete("/v1/prompts/plain")
    assert created.status_code == 201, created.text
    info = created.json()
    assert (info["object"], info["name"], info["pinned_tokens"], info["salted"], info["hit_count"]) == (
        "prompt",
        "plain",
        0,
        True,
        0,
    )
    assert info["num_tokens"] > 100
    assert again.status_code == 400 and again.json()["error"]["code"] == "prompt_exists"
    body = used.json()
    assert (used.status_code, inline.status_code) == (200, 200)
    assert body["ragspeed"]["num_static_tokens"] > 100
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The registered text became the static system prompt: the same prompt as sending it inline.
    by_name, by_text = fake.engine.requests
    assert by_name.prompt_token_ids == by_text.prompt_token_ids
    assert [(p["name"], p["hit_count"]) for p in listed] == [("plain", 1)]
    assert got.json()["hit_count"] == 1
    assert deleted.json() == {"object": "prompt.deleted", "name": "plain", "deleted": True}
    assert after.status_code == 404 and deleted_again.status_code == 404
    assert after.json()["error"] == {
        "message": "no prompt named 'plain' is registered",
        "type": "not_found_error",
        "param": "name",
        "code": "prompt_not_found",
    }


async def test_chat_naming_a_prompt_errors(fake):
    async with serve(fake_settings()) as client:
        await client.post("/v1/prompts", json={"name": "support", "text": SYSTEM})
        two = await _chat(client, "q", prompt="support", system="other")
        unknown = await _chat(client, "q", prompt="nope")
    assert two.status_code == 400
    assert (two.json()["error"]["param"], two.json()["error"]["code"]) == (
        "ragspeed.system_prompt",
        "two_system_prompts",
    )
    assert unknown.status_code == 400
    assert unknown.json()["error"] == {
        "message": "no prompt named 'nope' is registered",
        "type": "invalid_request_error",
        "param": "ragspeed.system_prompt",
        "code": "prompt_not_found",
    }
    assert fake.engine.requests == []
