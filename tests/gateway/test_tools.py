"""Tool calls: the format of a chat template, the generic format's tools block, the grammar of
a call in each format, the parser that turns streamed text into OpenAI's `tool_calls`, and the
merge of streamed call deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from ragspeed.engine.protocol import GenerationRequest, SamplingParams, StructuredOutput
from ragspeed.gateway.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from ragspeed.gateway.tools import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    ToolCallParser,
    merge_tool_calls,
    past_calls,
    render_past_calls,
    render_tools,
    tool_call_grammar,
    tool_format,
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
        render_past_calls(past_calls(message))
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


class _Tokenizer:
    def __init__(self, chat_template: str | None):
        self.chat_template = chat_template


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (None, GENERIC),
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", GENERIC),  # knows no tools
        ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>", HERMES),
        ('{% if tools %}{"name": ..., "parameters": ...}{% endif %}', LLAMA3_JSON),
        ("{% if tools %}{{ tools | tojson }}{% endif %}", GENERIC),  # takes tools, format unknown
    ],
)
def test_the_format_is_read_from_the_chat_template(template, expected):
    assert tool_format(_Tokenizer(template)) is expected


def test_hermes_blocks_are_parsed_one_by_one():
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    )
    parser = ToolCallParser(HERMES)
    first_content, first = parser.feed(text[:80])
    assert first_content == "" and [c["function"]["name"] for c in first] == ["get_weather"]
    content, calls = _feed_all(parser, [text[80:]])
    assert content == "" and [(c["index"], c["function"]["name"]) for c in calls] == [(1, "now")]


def test_a_llama3_call_is_the_whole_output_and_names_its_arguments_parameters():
    text = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, calls = _feed_all(ToolCallParser(LLAMA3_JSON), [text[:5], text[5:]])
    assert content == ""
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert _feed_all(ToolCallParser(LLAMA3_JSON), ["Oslo is cold."]) == ("Oslo is cold.", [])


def test_each_format_constrains_calls_in_its_own_shape():
    hermes = tool_call_grammar([WEATHER], "required", parallel=True, fmt=HERMES)
    single = tool_call_grammar([WEATHER], "required", parallel=False, fmt=HERMES)
    llama = tool_call_grammar([WEATHER], "auto", parallel=False, fmt=LLAMA3_JSON)
    assert hermes is not None and '("\\n" block)*' in hermes.spec and '"<tool_call>\\n"' in hermes.spec
    assert single is not None and "block)*" not in single.spec
    assert llama is not None and '"parameters"' in llama.spec and "ANSWER: /[^\\{]" in llama.spec


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    from tests.engine.conftest import make_engine

    return make_engine(tiny_model)


def _sampled(engine, grammar: StructuredOutput | None, num_seeds: int, max_tokens: int) -> list[dict]:
    """The engine's outputs under `grammar`, sampled at temperature 1 with seeds 0, 1, ..."""
    requests = [
        GenerationRequest(
            f"r{seed}",
            (5, 9, 12, 40, 7),
            SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, structured=grammar),
        )
        for seed in range(num_seeds)
    ]
    outputs = list(engine.generate(requests).values())
    for out in outputs:
        assert out["finish_reason"] == "stop", out["text"]
    return outputs


@pytest.mark.parametrize("fmt", [GENERIC, HERMES, LLAMA3_JSON], ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True])
def test_a_random_model_held_to_each_format_writes_calls_its_parser_reads(tiny_engine, fmt, parallel):
    """Whatever the random weights prefer, the grammar leaves only calls of the declared tools
    with arguments of their schema, in the shape the format's parser reads."""
    # The city is an enum: a random model would fill a free string to max_tokens.
    weather = WEATHER.model_copy(deep=True)
    assert weather.function.parameters is not None
    weather.function.parameters["properties"]["city"] = {"enum": ["Paris", "Oslo"]}
    grammar = tool_call_grammar([weather, CLOCK], "required", parallel=parallel, fmt=fmt)
    for out in _sampled(tiny_engine, grammar, num_seeds=4, max_tokens=200):
        content, calls = _feed_all(ToolCallParser(fmt), [out["text"]])
        assert content == "" and calls, out["text"]
        assert parallel or len(calls) == 1
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert arguments in ({"city": "Paris"}, {"city": "Oslo"})
            else:
                assert call["function"]["name"] == "now" and arguments == {}


def test_with_auto_an_answer_that_is_not_a_call_takes_the_response_format(tiny_engine):
    """tools with `auto` beside a JSON response_format: every output is a call or that JSON."""
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    answer = StructuredOutput("json_schema", json.dumps(schema))
    grammar = tool_call_grammar([CLOCK], "auto", parallel=False, answer=answer)
    assert grammar is not None and grammar.spec.startswith("start: answer | call")
    for out in _sampled(tiny_engine, grammar, num_seeds=6, max_tokens=60):
        content, calls = _feed_all(ToolCallParser(), [out["text"]])
        if calls:
            assert content == "" and [c["function"]["name"] for c in calls] == ["now"]
        else:
            jsonschema.validate(json.loads(content), schema)
