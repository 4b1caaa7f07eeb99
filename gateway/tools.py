"""Tool calls on the native engine, in a generic format for any chat template.

The tools are rendered as text after the static system prompt (the same text whatever the
request's `tool_choice`, so that it stays in the cached static prefix), and a call is written
as the SmolLM2 and Hermes-style models were taught:

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

The output is constrained by a grammar (engine.structured) built from the tools' schemas (an
arguments object takes only its declared keys unless its schema says otherwise):
`required` and a named choice allow a call and nothing else; `auto` allows an answer in text
(one that does not begin with `<`) or a call; `none` renders no tools and constrains nothing.
`parallel_tool_calls: false` allows one call. `ToolCallParser` turns the text into OpenAI's
`tool_calls`, each streamed as one delta once its call is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ragspeed.engine.protocol import StructuredOutput
from ragspeed.engine.structured import JSON_LAYOUT
from ragspeed.gateway.protocol import ChatMessage, NamedToolChoice, ToolDefinition

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

# The instructions SmolLM2-Instruct was taught tools with (its model card), less the empty list
# for "no call": here an answer in text says that.
_INSTRUCTIONS = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls to "
    "achieve the purpose. If none of the functions can be used, point it out and answer in text. "
    "If the given question lacks the parameters required by the function, also point it out."
)
_FORMAT = (
    "The output MUST strictly adhere to the following format, and NO other text MUST be included. "
    "Please make sure the parameter type is correct.\n"
    f'{CALL_OPEN}[{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}}]{CALL_CLOSE}'
)


def render_tools(tools: list[ToolDefinition]) -> str:
    """The tools block of the system prompt."""
    specs = json.dumps([tool.function.model_dump(exclude_none=True) for tool in tools], ensure_ascii=False)
    return f"{_INSTRUCTIONS}\n\nYou have access to the following tools:\n<tools>{specs}</tools>\n\n{_FORMAT}"


def render_tool_calls(message: ChatMessage) -> str:
    """An assistant turn's calls as the model writes them (for the conversation's history)."""
    calls = []
    for call in message.tool_calls or ():
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except ValueError:
            arguments = call.function.arguments  # as sent: the model sees what it (or a client) wrote
        calls.append({"name": call.function.name, "arguments": arguments})
    return f"{CALL_OPEN}{json.dumps(calls, ensure_ascii=False)}{CALL_CLOSE}" if calls else ""


def _call_schema(tool: ToolDefinition) -> dict[str, Any]:
    # Arguments are the parameters declared, as OpenAI's strict mode and llama.cpp's tool
    # grammar take them: a schema that says nothing of other keys admits none (else a small
    # model fills the call with keys it copies from the schema).
    parameters = {"additionalProperties": False, **(tool.function.parameters or {"type": "object"})}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def tool_call_grammar(
    tools: list[ToolDefinition], choice: str | NamedToolChoice, parallel: bool
) -> StructuredOutput | None:
    """The constraint of a request with tools (None for `tool_choice: none`)."""
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    calls: dict[str, Any] = {
        "type": "array",
        "items": {"anyOf": [_call_schema(t) for t in tools]},
        "minItems": 1,
        "x-guidance": JSON_LAYOUT,
    }
    if not parallel:
        calls["maxItems"] = 1
    call = f'call: "{CALL_OPEN}" calls "{CALL_CLOSE}"\ncalls: %json {json.dumps(calls)}'
    if choice == "auto":
        # An answer in text may not begin with "<", which would be the start of a call.
        return StructuredOutput("grammar", f"start: ANSWER | call\nANSWER: /[^<](.|\\n)*/\n{call}")
    return StructuredOutput("grammar", f"start: call\n{call}")


@dataclass(frozen=True)
class ToolCalls:
    """The tools of one request as the native engine serves them."""

    tools: list[ToolDefinition]
    choice: str | NamedToolChoice
    parallel: bool

    @property
    def grammar(self) -> StructuredOutput | None:
        return tool_call_grammar(self.tools, self.choice, self.parallel)


class ToolCallParser:
    """Splits a stream of output text into content and tool calls. Text that may still become
    `<tool_call>` is held back until it is known either way; a call is held until its close."""

    def __init__(self) -> None:
        self._held = ""
        self._mode = "undecided"  # then "content" or "call"
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, tool-call deltas) that `text` completes."""
        if self._mode == "content":
            return text, []
        self._held += text
        if self._mode == "undecided":
            stripped = self._held.lstrip()
            if stripped.startswith(CALL_OPEN):
                self._mode = "call"
            elif not CALL_OPEN.startswith(stripped):
                self._mode, content, self._held = "content", self._held, ""
                return content, []
            else:
                return "", []
        end = self._held.find(CALL_CLOSE)
        if end < 0:
            return "", []
        whole, self._held = self._held[: end + len(CALL_CLOSE)], self._held[end + len(CALL_CLOSE) :]
        calls = self._calls(whole.lstrip()[len(CALL_OPEN) : -len(CALL_CLOSE)])
        return ("", calls) if calls else (whole, [])  # a call that does not parse stays text

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end: held text that never became a call goes out as content."""
        held, self._held = self._held, ""
        return held, []

    def _calls(self, body: str) -> list[dict[str, Any]]:
        try:
            calls = json.loads(body)
        except ValueError:
            return []
        deltas = []
        for call in calls if isinstance(calls, list) else [calls]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            deltas.append(
                {
                    "index": self.num_calls,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(call.get("arguments", {}), ensure_ascii=False),
                    },
                }
            )
            self.num_calls += 1
        return deltas


def merge_tool_calls(
    calls: list[dict[str, Any]], deltas: tuple[dict[str, Any], ...] | list[dict[str, Any]]
) -> None:
    """Merge streamed `tool_calls` deltas into whole calls, by index (OpenAI's chunking: the
    first delta of a call has its id, type and name; the arguments come in pieces)."""
    for delta in deltas:
        index = delta.get("index", 0)
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        call["id"] = delta.get("id") or call["id"]
        call["type"] = delta.get("type") or call["type"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""
