"""Tool calls on the native engine: the model's own format where its chat template takes
`tools`, else a generic format that any chat template can carry.

- *generic* (a template that knows no tools, SmolLM2's among them): the tools are rendered as
  text after the static system prompt (the same text whatever the request's `tool_choice`, so
  that it stays in the cached static prefix), and a turn's calls are written as the SmolLM2 and
  Hermes-style models were taught:

      <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

- *hermes* (Qwen2.5, Hermes 2/3: the template holds `<tool_call>`): the template renders the
  tools and past calls; each call is its own block,
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`.
- *llama3-json* (Llama 3.1 and later: the template speaks of `"parameters"`): the template
  renders the tools; a call is the whole output, `{"name": ..., "parameters": {...}}`.

The output is constrained by a grammar (engine.native.core.structured) built from the tools' schemas (an
arguments object takes only its declared keys unless its schema says otherwise): `required`
and a named choice allow calls and nothing else; `auto` allows an answer in text (one that
cannot begin a call), or in the JSON of the request's `response_format`, or calls; `none`
constrains nothing. `parallel_tool_calls` absent takes the format's own answer, as llama.cpp's
server does: several calls where the template writes several (hermes), one where it does not
(generic, llama3-json); llama3-json never writes more than one. `ToolCallParser` turns the
text into OpenAI's `tool_calls`, each complete call at once (gateway.streaming sends its head,
then its arguments).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ragspeed.engine.native.core.structured import JSON_LAYOUT
from ragspeed.engine.protocol import StructuredOutput
from ragspeed.gateway.protocol import ChatMessage, NamedToolChoice, ToolDefinition


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes its tool calls."""

    name: str
    open: str  # the text before a call ("": the call is the whole output)
    close: str
    arguments_key: str  # the key of a call's arguments
    listed: bool  # all calls in one JSON array inside open/close; else one object per block
    several: bool  # the format can write several calls in a turn
    parallel: bool  # parallel_tool_calls' default: the chat template writes several calls
    in_template: bool  # the chat template renders the tools and past calls


GENERIC = ToolFormat(
    "generic",
    "<tool_call>",
    "</tool_call>",
    "arguments",
    listed=True,
    several=True,
    parallel=False,
    in_template=False,
)
HERMES = ToolFormat(
    "hermes",
    "<tool_call>\n",
    "\n</tool_call>",
    "arguments",
    listed=False,
    several=True,
    parallel=True,
    in_template=True,
)
LLAMA3_JSON = ToolFormat(
    "llama3-json", "", "", "parameters", listed=False, several=False, parallel=False, in_template=True
)


def tool_format(tokenizer: Any) -> ToolFormat:
    """The format of the model's chat template: its own where the template takes `tools` and
    writes a known format, else the generic one (the tools are then rendered by ragspeed)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str) or not re.search(r"\btools\b", template):
        return GENERIC
    if "<tool_call>" in template:
        return HERMES
    if '"parameters"' in template:
        return LLAMA3_JSON
    return GENERIC


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
    f'{GENERIC.open}[{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}}]{GENERIC.close}'
)


def render_tools(tools: list[ToolDefinition]) -> str:
    """The generic format's tools block of the system prompt."""
    specs = json.dumps([tool.function.model_dump(exclude_none=True) for tool in tools], ensure_ascii=False)
    return f"{_INSTRUCTIONS}\n\nYou have access to the following tools:\n<tools>{specs}</tools>\n\n{_FORMAT}"


def template_tools(tools: list[ToolDefinition]) -> str:
    """The tools as a chat template takes them (`tools=`), as JSON text."""
    return json.dumps([tool.model_dump(exclude_none=True) for tool in tools], ensure_ascii=False)


@dataclass(frozen=True)
class PastCall:
    """A call of an assistant turn in the conversation's history."""

    name: str
    arguments: str  # JSON text, as the client sent it

    @property
    def parsed_arguments(self) -> Any:
        try:
            return json.loads(self.arguments or "{}")
        except ValueError:
            return self.arguments  # as sent: the model sees what it (or a client) wrote


def past_calls(message: ChatMessage) -> tuple[PastCall, ...]:
    return tuple(PastCall(call.function.name, call.function.arguments) for call in message.tool_calls or ())


def render_past_calls(calls: tuple[PastCall, ...]) -> str:
    """A turn's calls as the generic format writes them."""
    listed = [{"name": call.name, "arguments": call.parsed_arguments} for call in calls]
    return f"{GENERIC.open}{json.dumps(listed, ensure_ascii=False)}{GENERIC.close}" if calls else ""


def template_calls(calls: tuple[PastCall, ...]) -> list[dict[str, Any]]:
    """A turn's calls as chat templates read them (`message["tool_calls"]`)."""
    return [
        {"type": "function", "function": {"name": call.name, "arguments": call.parsed_arguments}}
        for call in calls
    ]


def _call_schema(tool: ToolDefinition, fmt: ToolFormat) -> dict[str, Any]:
    # Arguments are the parameters declared, as OpenAI's strict mode and llama.cpp's tool
    # grammar take them: a schema that says nothing of other keys admits none (else a small
    # model fills the call with keys it copies from the schema).
    parameters = {"additionalProperties": False, **(tool.function.parameters or {"type": "object"})}
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, fmt.arguments_key: parameters},
        "required": ["name", fmt.arguments_key],
        "additionalProperties": False,
    }


def _literal(text: str) -> str:
    return json.dumps(text) + " " if text else ""  # a Lark string; "" writes nothing


def tool_call_grammar(
    tools: list[ToolDefinition],
    choice: str | NamedToolChoice,
    parallel: bool,
    fmt: ToolFormat = GENERIC,
    answer: StructuredOutput | None = None,
) -> StructuredOutput | None:
    """The constraint of a request with tools (None for `tool_choice: none`). With `auto`, the
    answer in text is free, or held to `answer` (the request's JSON `response_format`)."""
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        tools = [t for t in tools if t.function.name == choice.function.name]
    one = {"anyOf": [_call_schema(t, fmt) for t in tools], "x-guidance": JSON_LAYOUT}
    parallel = parallel and fmt.several  # parallel calls are allowed, never required
    if fmt.listed:
        calls = {"type": "array", "items": one, "minItems": 1, "x-guidance": JSON_LAYOUT}
        if not parallel:
            calls["maxItems"] = 1
        rules = f"call: {_literal(fmt.open)}calls {_literal(fmt.close)}\ncalls: %json {json.dumps(calls)}"
    else:
        more = ' ("\\n" block)*' if parallel else ""
        rules = (
            f"call: block{more}\nblock: {_literal(fmt.open)}one {_literal(fmt.close)}\n"
            f"one: %json {json.dumps(one)}"
        )
    if choice != "auto":
        return StructuredOutput("grammar", f"start: call\n{rules}")
    if answer is not None:
        schema = json.loads(answer.spec) if answer.kind == "json_schema" else {"type": "object"}
        answer_rule = f"answer: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"
        return StructuredOutput("grammar", f"start: answer | call\n{answer_rule}\n{rules}")
    # An answer in text may not begin as a call does.
    first = re.escape(_call_start(fmt)[0])
    return StructuredOutput("grammar", f"start: ANSWER | call\nANSWER: /[^{first}](.|\\n)*/\n{rules}")


def _call_start(fmt: ToolFormat) -> str:
    """The text a call begins with, after any white space."""
    return fmt.open.strip() or "{"


@dataclass(frozen=True)
class ToolCalls:
    """The tools of one request as the native engine serves them."""

    tools: list[ToolDefinition]
    choice: str | NamedToolChoice
    parallel: bool
    format: ToolFormat = GENERIC
    answer: StructuredOutput | None = None  # the JSON an answer that is not a call must be

    @property
    def grammar(self) -> StructuredOutput | None:
        return tool_call_grammar(self.tools, self.choice, self.parallel, self.format, self.answer)


class ToolCallParser:
    """Splits a stream of output text into content and tool calls. Text that may still begin a
    call is held back until it is known either way; a call is held until its close (or, in a
    format without one, until the end)."""

    def __init__(self, fmt: ToolFormat = GENERIC) -> None:
        self._format = fmt
        self._start, self._close = _call_start(fmt), fmt.close.strip()
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
            if stripped.startswith(self._start):
                self._mode = "call"
            elif not self._start.startswith(stripped):
                self._mode, content, self._held = "content", self._held, ""
                return content, []
            else:
                return "", []
        content, calls = "", []
        while self._close and (end := self._held.find(self._close)) >= 0:
            whole = self._held[: end + len(self._close)]
            self._held = self._held[end + len(self._close) :]
            more = self._calls(whole.strip()[len(self._start) : -len(self._close)])
            if more:
                calls += more
            else:
                content += whole  # a call that does not parse stays text
        return content, calls

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left at the end: a call without a close is parsed whole; held text that
        never became a call goes out as content (white space between calls is dropped)."""
        held, self._held = self._held, ""
        if self._mode == "call" and not self._close:
            calls = self._calls(held)
            return ("", calls) if calls else (held, [])
        return ("" if self._mode == "call" and not held.strip() else held), []

    def _calls(self, body: str) -> list[dict[str, Any]]:
        try:
            calls = json.loads(body)
        except ValueError:
            return []
        deltas = []
        for call in calls if isinstance(calls, list) else [calls]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                continue
            arguments = call.get(self._format.arguments_key, {})
            deltas.append(
                {
                    "index": self.num_calls,
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {
                        "name": call["name"],
                        "arguments": json.dumps(arguments, ensure_ascii=False),
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
