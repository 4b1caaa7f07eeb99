"""What becomes of each field of a request beyond plain chat: the output constraint it asks for
(`response_format`, vLLM's `structured_outputs` and `guided_*`, tools), and the fields the native
engine refuses or ignores (gateway.protocol's REFUSED_FIELDS and IGNORED_FIELDS).
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from ragspeed.engine.protocol import StructuredOutput
from ragspeed.gateway.errors import APIError
from ragspeed.gateway.prompt import Segments
from ragspeed.gateway.protocol import (
    REFUSED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingFields,
)
from ragspeed.gateway.tools import GENERIC, ToolCalls, ToolFormat, render_tools, template_tools

# vLLM's `guided_*` names and the `structured_outputs` key each stands for.
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def unhonoured_fields(req: _SamplingFields) -> tuple[str, ...]:
    """The fields the native engine does not honour: a 400 for the first one that would change
    the output (REFUSED_FIELDS, content that is not text), else their names, to be reported as
    ignored (gateway.protocol's IGNORED_FIELDS and unknown vendor fields)."""
    extra = req.extra_fields
    for name, reason in REFUSED_FIELDS.items():
        if name in extra and extra[name] is not False:
            raise APIError(
                400, f"'{name}' cannot be honoured: {reason}", param=name, code="unsupported_parameter"
            )
    modalities = extra.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise APIError(400, "'modalities' cannot be honoured: the model writes text only", param="modalities")
    if isinstance(req, CompletionRequest) and extra.get("echo"):
        raise APIError(400, "'echo' cannot be honoured: the prompt is not echoed", param="echo")
    if isinstance(req, ChatCompletionRequest):
        for i, message in enumerate(req.messages):
            if message.non_text_parts:
                raise APIError(
                    400,
                    f"messages[{i}] has content of type {message.non_text_parts[0]!r}; the model reads text only",
                    param=f"messages.{i}.content",
                    code="unsupported_content",
                )
    return tuple(sorted(name for name in extra if name not in ("modalities", "echo")))


def tool_calls(req: ChatCompletionRequest, fmt: ToolFormat = GENERIC) -> ToolCalls | None:
    """The request's tools as the native engine serves them, in the model's tool format `fmt`;
    None without tools (or `none`). Parallel calls unless the request or the format says not."""
    if not req.tools or req.tool_choice == "none":
        return None
    choice = req.tool_choice or "auto"
    parallel = fmt.parallel if req.parallel_tool_calls is None else req.parallel_tool_calls
    return ToolCalls(req.tools, choice, parallel=parallel, format=fmt)


def output_constraint(req: _SamplingFields, tools: ToolCalls | None = None) -> StructuredOutput | None:
    """The one constraint on the output the request asks for; a 400 where it asks for two."""
    asked: list[tuple[str, StructuredOutput]] = []
    answer = _response_format(req) if isinstance(req, ChatCompletionRequest) else None
    if tools is not None and (grammar := replace(tools, answer=answer).grammar) is not None:
        asked.append(("tools", grammar))  # with tools, response_format is what an answer must be
        answer = None
    if answer is not None:
        asked.append(("response_format", answer))
    if isinstance(req, ChatCompletionRequest):
        if req.structured_outputs is not None:
            asked.append(("structured_outputs", _structured_outputs(req)))
        for name, key in _GUIDED.items():
            value = getattr(req, name)
            if value is not None:
                asked.append((name, _constraint(key, value)))
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(400, f"give one constraint on the output, not several ({names})", param=asked[1][0])
    return asked[0][1] if asked else None


def _response_format(req: ChatCompletionRequest) -> StructuredOutput | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object")
    assert fmt.json_schema is not None, "validated: json_schema comes with its object"
    schema = fmt.json_schema.schema_ or {}
    return StructuredOutput("json_schema", json.dumps(schema))


def _structured_outputs(req: ChatCompletionRequest) -> StructuredOutput:
    options = req.structured_outputs
    assert options is not None
    if options.given("json_object"):
        return StructuredOutput("json_object")
    key = next(k for k in ("json", "regex", "choice", "grammar") if options.given(k))
    return _constraint(key, options.json_ if key == "json" else getattr(options, key))


def _constraint(key: str, value: Any) -> StructuredOutput:
    if key == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except ValueError as exc:
            raise APIError(
                400, f"the JSON Schema is not valid JSON: {exc}", param="structured_outputs.json"
            ) from None
        return StructuredOutput("json_schema", json.dumps(schema))
    if key == "choice":
        return StructuredOutput("choice", json.dumps(value))
    return StructuredOutput(key, value)


def with_tools(segments: Segments, tools: ToolCalls) -> Segments:
    """`segments` with the request's tools: in the system prompt they follow (generic format:
    static, so they stay in the cached prefix) or for the chat template to render."""
    if tools.format.in_template:
        return replace(segments, tools=template_tools(tools.tools))
    system, rendered = segments.static_system_prompt, render_tools(tools.tools)
    return replace(segments, static_system_prompt=f"{system}\n\n{rendered}" if system else rendered)
