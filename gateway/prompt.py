"""Segments of a RAG request and the prompt layout of docs/architecture.md (contract 1).

A request is split into four segments:

- *static system prompt*: the system messages, minus any documents found in them. It is the same
  for every request of an application, so it goes first and its KV blocks are reused.
- *documents*: the `documents` field, plus any text between the document markers in a message.
  Only this segment is ever compressed.
- *history*: earlier turns of the conversation.
- *question*: the last user message, minus its documents.

The prompt is `[static system prompt][documents][history][question]`, rendered through the
model's chat template; documents are appended to the system turn so that any template works.
Each document is rendered as its number `[i]`, then its *body* (title and text); for document
KV reuse the bodies are tokenized on their own and their token spans go to the engine, while
the text stays the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ragspeed.document import Document
from ragspeed.gateway.protocol import ChatMessage, DocumentIn
from ragspeed.gateway.tools import PastCall, past_calls, render_past_calls, template_calls, tool_format


@dataclass(frozen=True)
class Turn:
    role: str
    content: str
    tool_calls: tuple[PastCall, ...] = ()  # an assistant turn's calls


@dataclass(frozen=True)
class Segments:
    static_system_prompt: str
    documents: tuple[Document, ...]
    history: tuple[Turn, ...]
    question: str
    tools: str = ""  # the request's tools for a chat template that renders them (JSON text)


@dataclass(frozen=True)
class Prompt:
    text: str
    token_ids: tuple[int, ...]
    num_static_tokens: int  # leading tokens shared with the static system prompt alone
    # With `document_spans=True`: each document's [start, end) in token_ids, tokenized on its own.
    document_spans: tuple[tuple[int, int], ...] = ()


def _document(
    text: str, title: str = "", doc_id: str | None = None, metadata: dict[str, Any] | None = None
) -> Document:
    doc_id = doc_id or hashlib.sha1(f"{title}\n{text}".encode()).hexdigest()[:16]
    return Document(id=doc_id, text=text.strip(), title=title.strip(), metadata=metadata or {})


def extract_documents(text: str, start: str, end: str) -> tuple[str, list[Document]]:
    """Cut every `start ... end` span out of `text`; an unclosed start runs to the end."""
    documents, rest, pos = [], [], 0
    while (i := text.find(start, pos)) >= 0:
        rest.append(text[pos:i])
        j = text.find(end, i + len(start))
        body_end, pos = (len(text), len(text)) if j < 0 else (j, j + len(end))
        body = text[i + len(start) : body_end]
        if body.strip():
            documents.append(_document(body))
    rest.append(text[pos:])
    return "".join(rest).strip(), documents


def split_segments(
    messages: Sequence[ChatMessage],
    documents: Sequence[str | DocumentIn] | None,
    *,
    start_marker: str,
    end_marker: str,
) -> Segments:
    # The wire's documents become `Document`s here, once; everything after takes this type.
    docs = [
        _document(d) if isinstance(d, str) else _document(d.text, d.title, d.id, d.metadata)
        for d in documents or ()
    ]
    system_parts: list[str] = []
    turns: list[Turn] = []
    for message in messages:
        text, found = extract_documents(message.text, start_marker, end_marker)
        docs.extend(found)
        if message.role in ("system", "developer") and not turns:
            if text:
                system_parts.append(text)
        else:
            role = "system" if message.role == "developer" else message.role
            turns.append(Turn(role=role, content=text, tool_calls=past_calls(message)))
    question = ""
    if turns and turns[-1].role == "user":
        question = turns.pop().content
    unique = {d.id: d for d in docs if d.text}
    return Segments(
        static_system_prompt="\n\n".join(system_parts),
        documents=tuple(unique.values()),
        history=tuple(turns),
        question=question,
    )


def _numbered(index: int) -> str:
    return f"[{index}]"


def _document_body(doc: Document) -> str:
    """What follows a document's number: the same text wherever the document stands, so that
    its tokens (and its stored KV) do not depend on its place."""
    return f" {doc.title}\n{doc.text}" if doc.title else f"\n{doc.text}"


def render_documents(documents: Sequence[Document]) -> str:
    blocks = [_numbered(i) + _document_body(doc) for i, doc in enumerate(documents, start=1)]
    return "Documents:\n\n" + "\n\n".join(blocks)


def system_text(static_system_prompt: str, documents: Sequence[Document]) -> str:
    """The system turn: the static system prompt, then the documents (either may be empty)."""
    if not documents:
        return static_system_prompt
    rendered = render_documents(documents)
    return f"{static_system_prompt}\n\n{rendered}" if static_system_prompt else rendered


def _turn(turn: Turn, in_template: bool) -> dict[str, Any]:
    """A history turn as the chat template reads it: its calls in the template's own format,
    or written into its text in the generic one."""
    if not turn.tool_calls:
        return {"role": turn.role, "content": turn.content}
    if in_template:
        return {"role": turn.role, "content": turn.content, "tool_calls": template_calls(turn.tool_calls)}
    calls = render_past_calls(turn.tool_calls)
    return {"role": turn.role, "content": f"{turn.content}\n{calls}" if turn.content else calls}


def _render(tokenizer: Any, turns: list[dict[str, Any]], add_generation_prompt: bool, tools: str = "") -> str:
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": json.loads(tools)} if tools else {}
        return tokenizer.apply_chat_template(
            turns, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
        )
    # A model without a chat template (a base model): a plain transcript.
    lines = [f"{t['role'].capitalize()}: {t['content']}" for t in turns]
    if add_generation_prompt:
        lines.append("Assistant:")
    return "\n\n".join(lines)


def _encode(tokenizer: Any, text: str) -> list[int]:
    # The chat template already holds any BOS token, so none is added again.
    return tokenizer.encode(text, add_special_tokens=False)


def static_prefix_token_ids(tokenizer: Any, static_system_prompt: str) -> tuple[int, ...]:
    """The static system prompt rendered alone (a system turn, no generation prompt), as token
    ids: the prefix the whole prompt shares with every prompt of its application."""
    text = _render(tokenizer, [{"role": "system", "content": static_system_prompt}], False)
    return tuple(_encode(tokenizer, text))


def assemble_prompt(
    tokenizer: Any,
    segments: Segments,
    documents: Sequence[Document],
    *,
    document_spans: bool = False,
    static_token_ids: Callable[[Any, str], Sequence[int]] = static_prefix_token_ids,
) -> Prompt:
    """The prompt of `segments` with `documents`; `static_token_ids` is `static_prefix_token_ids`
    or a cache of it (the gateway's, by tokenizer and text)."""
    system = system_text(segments.static_system_prompt, documents)
    turns = [{"role": "system", "content": system}] if system else []
    in_template = tool_format(tokenizer).in_template
    turns += [_turn(t, in_template) for t in segments.history]
    if segments.question or not segments.history:
        turns.append({"role": "user", "content": segments.question})
    text = _render(tokenizer, turns, add_generation_prompt=True, tools=segments.tools)
    spans: tuple[tuple[int, int], ...] = ()
    pieces = _document_pieces(text, documents) if document_spans and documents else None
    if pieces is None:
        token_ids = _encode(tokenizer, text)
    else:
        token_ids, spans = _encode_pieces(tokenizer, text, pieces)
    num_static = 0
    if segments.static_system_prompt:
        static_ids = static_token_ids(tokenizer, segments.static_system_prompt)
        num_static = _common_prefix_length(static_ids, token_ids)
    return Prompt(text=text, token_ids=tuple(token_ids), num_static_tokens=num_static, document_spans=spans)


def _document_pieces(text: str, documents: Sequence[Document]) -> list[tuple[int, int]] | None:
    """Each document body's [start, end) in the rendered text, in order; None when the chat
    template changed a body (then the prompt is tokenized whole)."""
    pieces, pos = [], 0
    for i, doc in enumerate(documents, start=1):
        body = _document_body(doc)
        found = text.find(_numbered(i) + body, pos)
        if found < 0:
            return None
        start = found + len(_numbered(i))
        pieces.append((start, start + len(body)))
        pos = start + len(body)
    return pieces


def _encode_pieces(
    tokenizer: Any, text: str, pieces: list[tuple[int, int]]
) -> tuple[list[int], tuple[tuple[int, int], ...]]:
    """Token ids of `text` with each piece tokenized on its own, and the pieces' token spans."""
    token_ids: list[int] = []
    spans = []
    pos = 0
    for start, end in pieces:
        token_ids += _encode(tokenizer, text[pos:start])
        body = _encode(tokenizer, text[start:end])
        spans.append((len(token_ids), len(token_ids) + len(body)))
        token_ids += body
        pos = end
    token_ids += _encode(tokenizer, text[pos:])
    return token_ids, tuple(spans)


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
