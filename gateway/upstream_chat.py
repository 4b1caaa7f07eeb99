"""The chat body the openai backend forwards to an upstream chat server (its chat mode).

The proxy changes only what ragspeed exists to change: the documents. They are cut out of the
request (the `documents` field and the spans between the document markers in messages),
compressed, and rendered into the prompt's fixed place, where `assemble_prompt` puts them: the
leading system message(s) become one system message, the static system prompt first and the
documents after it, so that the static prompt is the same leading bytes of every request and
the upstream's prefix cache hits. Every other message and field goes upstream as the client
sent it (tools, tool_choice, response_format, penalties, vendor fields...), less what the
gateway consumes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ragspeed.document import Document
from ragspeed.gateway.prompt import Segments, extract_documents, system_text
from ragspeed.gateway.protocol import ChatCompletionRequest

# Fields the gateway consumes: the documents and its own options; `stream` and `stream_options`
# (the backend always streams from the upstream); `model` (the backend names the upstream's);
# `n` (the gateway fans n out into n requests of one choice each).
CONSUMED_FIELDS = frozenset({"documents", "ragspeed", "stream", "stream_options", "model", "n"})

_SYSTEM_ROLES = ("system", "developer")


def upstream_chat_body(
    req: ChatCompletionRequest,
    segments: Segments,
    documents: Sequence[Document],
    *,
    start_marker: str,
    end_marker: str,
) -> dict[str, Any]:
    """The upstream chat request of `req`: `segments` as `split_segments` made them (its static
    system prompt may be a registered prompt's), `documents` the final (compressed) ones, the
    markers those `split_segments` cut documents out of messages with."""
    # exclude_unset: a field the client did not send is not invented (an upstream's defaults
    # may differ from ours); by_alias: `schema`, `json` as on the wire.
    body = req.model_dump(exclude_unset=True, by_alias=True, exclude=set(CONSUMED_FIELDS))
    messages: list[dict[str, Any]] = body["messages"]
    num_leading_system = 0
    while num_leading_system < len(messages) and messages[num_leading_system]["role"] in _SYSTEM_ROLES:
        num_leading_system += 1
    rest = [_without_documents(m, start_marker, end_marker) for m in messages[num_leading_system:]]

    system = system_text(segments.static_system_prompt, documents)  # assemble_prompt's, byte for byte
    body["messages"] = ([{"role": "system", "content": system}] if system else []) + rest
    return body


def _without_documents(message: dict[str, Any], start_marker: str, end_marker: str) -> dict[str, Any]:
    """`message` with its document spans cut out of its text (as split_segments cut them), or
    `message` itself when it holds none."""
    content = message.get("content")
    if isinstance(content, str) and start_marker in content:
        return {**message, "content": extract_documents(content, start_marker, end_marker)[0]}
    if isinstance(content, list) and any(
        part.get("type") == "text" and start_marker in part.get("text", "") for part in content
    ):
        parts = [
            {**part, "text": extract_documents(part["text"], start_marker, end_marker)[0]}
            if part.get("type") == "text" and start_marker in part.get("text", "")
            else part
            for part in content
        ]
        return {**message, "content": parts}
    return message
