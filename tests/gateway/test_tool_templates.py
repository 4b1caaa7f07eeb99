"""Tools through a chat template that takes them: a real server on a tiny seeded Llama whose
template is Qwen2.5's layout (hermes calls). The template renders the tools and the history's
calls and tool results; the output is held to the hermes format, and the calls come back as
OpenAI's `tool_calls`, whole and streamed."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from ragspeed.bench.launcher import ServerProcess
from tests.gateway.conftest import build_tiny_llama

# Qwen2.5's layout, shortened: the tools in the system turn, each call its own <tool_call>
# block, a tool's result in a user turn.
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% if message.content %}{{ message.content }}
{% endif %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% if not loop.last %}
{% endif %}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# The city is an enum: a random model would fill a free string to max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
        },
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-hermes")
    (model / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    with ServerProcess(["--model", str(model), "--served-model-name", "tiny"]) as server:
        yield OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def _valid(name: str, arguments: str) -> bool:
    args = json.loads(arguments)
    return (name, args) in [
        ("now", {}),
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]


def test_a_named_choice_gives_that_call(client):
    response = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=100,
        seed=1,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls or []
    assert [c.function.name for c in calls] == ["get_weather"] * len(calls) and calls
    assert all(_valid(c.function.name, c.function.arguments) and c.id.startswith("call_") for c in calls)


def test_streamed_calls_arrive_whole_in_openais_chunks(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Weather in Oslo, and the time?"}],
        tools=[WEATHER, CLOCK],
        tool_choice="required",
        max_tokens=200,
        seed=2,
        stream=True,
    )
    calls: dict[int, dict] = {}
    pieces: dict[int, list] = {}
    finish = None
    for chunk in stream:
        for delta in chunk.choices[0].delta.tool_calls or []:
            assert delta.function is not None
            pieces.setdefault(delta.index, []).append(
                (delta.id, delta.function.name, delta.function.arguments)
            )
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    assert all(_valid(c["name"], c["arguments"]) for c in calls.values())
    for index, (head, *rest) in pieces.items():  # OpenAI's chunking: the head, then arguments
        assert head[0].startswith("call_") and head[1] == calls[index]["name"] and not head[2]
        assert rest and all(piece_id is None and name is None for piece_id, name, _ in rest)


def test_the_template_renders_the_tools_and_the_historys_calls(client):
    response = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
        ],
        tools=[WEATHER],
        max_tokens=2,
        extra_body={"ragspeed": {"return_prompt": True}},
    )
    prompt = (response.model_extra or {})["ragspeed"]["prompt"]
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in prompt  # the template's own rendering of `tools`
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
