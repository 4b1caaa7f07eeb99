"""Tool calls in the generic format: the tools block, the grammar of a call, the parser that
turns streamed text into OpenAI's `tool_calls`, and the merge of streamed call deltas."""

from __future__ import annotations

import json

import pytest

from ragspeed.gateway.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from ragspeed.gateway.tools import (
    ToolCallParser,
    merge_tool_calls,
    render_tool_calls,
    render_tools,
    tool_call_grammar,
)

WEATHER = ToolDefinition.model_validate(
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
)
CLOCK = ToolDefinition.model_validate({"type": "function", "function": {"name": "now"}})


def test_the_tools_block_lists_each_tool_as_json():
    block = render_tools([WEATHER, CLOCK])
    listed = json.loads(block.split("<tools>")[1].split("</tools>")[0])
    assert [t["name"] for t in listed] == ["get_weather", "now"]
    assert listed[0]["parameters"]["required"] == ["city"]
    assert "<tool_call>" in block


def test_history_calls_are_rendered_as_the_model_writes_them():
    message = ChatMessage.model_validate(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        }
    )
    assert (
        render_tool_calls(message)
        == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
    )


def test_the_grammar_follows_tool_choice():
    assert tool_call_grammar([WEATHER], "none", parallel=True) is None
    auto = tool_call_grammar([WEATHER, CLOCK], "auto", parallel=True)
    required = tool_call_grammar([WEATHER, CLOCK], "required", parallel=False)
    named = tool_call_grammar(
        [WEATHER, CLOCK],
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "now"}}),
        parallel=True,
    )
    assert auto is not None and auto.spec.startswith("start: ANSWER | call")
    assert (
        required is not None and required.spec.startswith("start: call") and '"maxItems": 1' in required.spec
    )
    assert named is not None and '"const": "now"' in named.spec and "get_weather" not in named.spec


def _feed_all(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list[dict]]:
    content, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, calls = content + text, calls + new
    text, new = parser.finish()
    return content + text, calls + new


@pytest.mark.parametrize("cut", [1, 3, 11, 20, 60])
def test_a_call_split_anywhere_is_parsed_whole(cut):
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]</tool_call>'
    content, calls = _feed_all(ToolCallParser(), [text[:cut], text[cut:]])
    assert content == ""
    assert [(c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        (0, "get_weather", {"city": "Paris"}),
        (1, "now", {}),
    ]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)


def test_text_is_content_as_soon_as_it_cannot_be_a_call():
    parser = ToolCallParser()
    assert parser.feed("<to") == ("", [])  # may still become a call
    assert parser.feed("ast is nice") == ("<toast is nice", [])
    assert parser.feed(" <tool_call>") == (" <tool_call>", [])  # once content, always content
    assert parser.num_calls == 0


def test_a_call_cut_short_comes_back_as_text():
    content, calls = _feed_all(ToolCallParser(), ['<tool_call>[{"name": "get_wea'])
    assert content == '<tool_call>[{"name": "get_wea' and calls == []


def test_streamed_call_deltas_merge_by_index():
    calls: list[dict] = []
    merge_tool_calls(
        calls, [{"index": 0, "id": "a", "type": "function", "function": {"name": "f", "arguments": ""}}]
    )
    merge_tool_calls(
        calls,
        [
            {"index": 0, "function": {"arguments": '{"x": '}},
            {"index": 1, "id": "b", "function": {"name": "g"}},
        ],
    )
    merge_tool_calls(calls, [{"index": 0, "function": {"arguments": "1}"}}])
    assert calls == [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
    ]


def test_a_closed_call_that_does_not_parse_stays_text():
    content, calls = _feed_all(ToolCallParser(), ["<tool_call>[{oops}]</tool_call>"])
    assert content == "<tool_call>[{oops}]</tool_call>" and calls == []
