"""The OpenAI request surface, field by field: every field of the openai SDK's chat-completions
and completions requests is honoured, refused with a 400 naming it, or named as ignored in
`x-ragspeed-ignored-fields`; never dropped in silence. In-process, over the fake engine (what
reaches the engine is what the gateway made of each field)."""

from __future__ import annotations

import json

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from ragspeed.engine.protocol import StructuredOutput
from ragspeed.gateway.protocol import IGNORED_FIELDS, REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest
from tests.gateway.fake_engine import Reply
from tests.gateway.inprocess import fake_settings, serve

pytestmark = pytest.mark.anyio

HI = [{"role": "user", "content": "hi"}]
# Fields refused by a check of their value rather than their presence (gateway.surface).
REFUSED_BY_VALUE = {"modalities", "echo"}


@pytest.mark.parametrize(
    "model, sdk_fields",
    [
        (ChatCompletionRequest, chat_create_params.CompletionCreateParamsBase.__annotations__),
        (CompletionRequest, completion_create_params.CompletionCreateParamsBase.__annotations__),
    ],
)
def test_every_field_of_the_sdk_is_honoured_refused_or_ignored(model, sdk_fields):
    declared = set(model.model_fields)
    unaccounted = set(sdk_fields) - declared - set(REFUSED_FIELDS) - IGNORED_FIELDS - REFUSED_BY_VALUE
    assert unaccounted == set()
    # A field is in one class only.
    assert declared & set(REFUSED_FIELDS) == set() and declared & IGNORED_FIELDS == set()


@pytest.mark.parametrize(
    "field, value",
    [
        ("audio", {"voice": "alloy", "format": "mp3"}),
        ("web_search_options", {}),
        ("verbosity", "low"),
        ("functions", [{"name": "f", "parameters": {}}]),
        ("function_call", "auto"),
        ("guided_whitespace_pattern", " *"),
        ("modalities", ["text", "audio"]),
    ],
)
async def test_a_field_that_cannot_be_honoured_is_refused_by_name(fake, field, value):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json={"messages": HI, field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and f"'{field}'" in error["message"]
    assert fake.engine.requests == []


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi", "suffix": "bye"}, "suffix"),
        ({"prompt": "hi", "best_of": 2}, "best_of"),
        ({"prompt": "hi", "echo": True}, "echo"),
    ],
)
async def test_completions_refuse_what_they_cannot_honour(fake, body, param):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_content_that_is_not_text_is_refused(fake):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.0.content"
    assert "image_url" in response.json()["error"]["message"]


async def test_fields_that_change_nothing_are_named_in_a_header(fake):
    body = {"messages": HI, "store": True, "metadata": {"a": "b"}, "acme_vendor_knob": 3, "seed": 1}
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json=body)
        plain = await client.post("/v1/chat/completions", json={"messages": HI})
    assert response.status_code == 200
    assert response.headers["x-ragspeed-ignored-fields"] == "acme_vendor_knob,metadata,store"
    assert "x-ragspeed-ignored-fields" not in plain.headers


async def test_a_field_name_outside_latin_1_is_named_percent_encoded(fake):
    """A header value is Latin-1 text: the name goes out percent-encoded, not as a 500."""
    body = {"messages": HI, "réglage_ß": 1, "温度": 0.5, "a,b": 2}
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-ragspeed-ignored-fields"] == "a%2Cb,r%C3%A9glage_%C3%9F,%E6%B8%A9%E5%BA%A6"


async def test_sampling_fields_reach_the_engine(fake):
    body = {
        "messages": HI,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.25,
        "repetition_penalty": 1.2,
        "logit_bias": {"7": -100, "3": 2.5},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object"}},
        },
    }
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    (request,) = fake.engine.requests
    sampling = request.sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) == (
        0.5,
        -0.25,
        1.2,
    )
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0))
    assert sampling.structured == StructuredOutput("json_schema", '{"type": "object"}')


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        ({"response_format": {"type": "text"}}, None),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput("regex", "[0-9]+")),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput("choice", '["yes", "no"]')),
        ({"structured_outputs": {"grammar": 'start: "a"'}}, StructuredOutput("grammar", 'start: "a"')),
        (
            {"structured_outputs": {"json": {"type": "integer"}}},
            StructuredOutput("json_schema", '{"type": "integer"}'),
        ),
        ({"guided_json": '{"type": "integer"}'}, StructuredOutput("json_schema", '{"type": "integer"}')),
        ({"guided_regex": "[a-z]"}, StructuredOutput("regex", "[a-z]")),
        ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
        ({"guided_grammar": 'start: "b"'}, StructuredOutput("grammar", 'start: "b"')),
        ({"guided_decoding_backend": "xgrammar", "guided_regex": "x"}, StructuredOutput("regex", "x")),
    ],
)
async def test_each_way_of_asking_for_a_constraint(fake, extra, expected):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json={"messages": HI, **extra})
    assert response.status_code == 200, response.text
    assert fake.engine.requests[0].sampling.structured == expected


async def test_tools_and_a_response_format_make_one_grammar(fake):
    """With `auto`, the answer that is not a call takes the response format (OpenAI allows
    both); a required call leaves the format nothing to hold."""
    clock = {"type": "function", "function": {"name": "now"}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with serve(fake_settings()) as client:
        for choice in ("auto", "required"):
            body = {"messages": HI, "tools": [clock], "tool_choice": choice, "response_format": fmt}
            response = await client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
    auto, required = (r.sampling.structured for r in fake.engine.requests)
    assert auto is not None and auto.kind == "grammar" and auto.spec.startswith("start: answer | call")
    assert required is not None and required.spec.startswith("start: call") and "answer" not in required.spec


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": {"type": "json_object"}, "guided_regex": "x"}, "guided_regex"),
        ({"structured_outputs": {"regex": "x", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"tool_choice": "required"}, None),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"n": 17}, "n"),
        ({"guided_json": "{not json"}, "structured_outputs.json"),
    ],
)
async def test_malformed_constraints_and_fields_get_a_400(fake, extra, param):
    async with serve(fake_settings()) as client:
        response = await client.post("/v1/chat/completions", json={"messages": HI, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert fake.engine.requests == []


async def test_n_choices_each_run_and_count_once_for_the_prompt(fake):
    async with serve(fake_settings()) as client:
        fake.engine.script(Reply(("a", "b")), Reply(("c",)), Reply(("d", "e", "f")))
        response = await client.post("/v1/chat/completions", json={"messages": HI, "n": 3, "seed": 10})
        body = response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert sorted(c["message"]["content"] for c in body["choices"]) == ["ab", "c", "def"]
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["prompt_tokens"] == len(fake.engine.requests[0].prompt_token_ids)
    seeds = sorted(r.sampling.seed for r in fake.engine.requests)
    assert seeds == [10, 11, 12]
    assert len({r.request_id for r in fake.engine.requests}) == 3


async def test_n_choices_stream_with_their_indexes(fake):
    async with serve(fake_settings()) as client:
        fake.engine.script(Reply(("a", "b")), Reply(("c",)))
        response = await client.post(
            "/v1/chat/completions",
            json={"messages": HI, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
        )
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    text: dict[int, str] = {0: "", 1: ""}
    finish = {}
    for event in events:
        for choice in event["choices"]:
            text[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert sorted(text.values()) == ["ab", "c"] and finish == {0: "stop", 1: "stop"}
    assert events[-1]["usage"]["completion_tokens"] == 3
    assert response.text.endswith("data: [DONE]\n\n")
