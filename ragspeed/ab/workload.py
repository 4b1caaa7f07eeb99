"""Workloads: the requests an A/B run replays, read from JSONL.

Two line shapes are accepted, and may be mixed:

- a RAG QA record, as in `nq_dev.jsonl`: `{"question", "answers": [...],
  "documents": [{"title", "text"}, ...]}` → a chat request with `documents` and the question as
  the user turn, behind the static system prompt if one is given;
- an OpenAI chat request body (`{"messages": [...], ...}`), sent as is; an optional `answers`
  list beside it is taken as the gold answers and removed from the body.

A line that is neither is skipped; its line number and reason are kept for the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ragspeed.gateway.protocol import ChatCompletionRequest


@dataclass(frozen=True)
class WorkItem:
    line: int  # 1-based line in the workload file
    body: dict[str, Any]  # the chat request body, before the arm's overlay
    answers: tuple[str, ...] = ()  # gold answers; empty when unknown
    document_text: str = ""  # the documents' text, to tell whether an answer was in reach


@dataclass(frozen=True)
class SkippedLine:
    line: int
    reason: str


@dataclass(frozen=True)
class Workload:
    path: str
    items: tuple[WorkItem, ...]
    skipped: tuple[SkippedLine, ...] = field(default_factory=tuple)


def keep_documents(documents: list[Any], gold_index: Any, num_documents: int | None) -> list[Any]:
    """At most `num_documents`, always keeping the gold ones (`is_gold` or `gold_index`), in order."""
    if num_documents is None or len(documents) <= num_documents:
        return documents
    gold = {i for i, d in enumerate(documents) if isinstance(d, dict) and d.get("is_gold")}
    if isinstance(gold_index, int) and 0 <= gold_index < len(documents):
        gold.add(gold_index)
    others = [i for i in range(len(documents)) if i not in gold]
    keep = sorted(gold) + others[: max(0, num_documents - len(gold))]
    return [documents[i] for i in sorted(keep)]


def _rag_body(
    record: dict[str, Any], system_prompt: str | None, max_tokens: int, num_documents: int | None = None
) -> dict[str, Any]:
    question = record["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError("'question' must be a non-empty string")
    documents = record.get("documents") or []
    if not isinstance(documents, list):
        raise ValueError("'documents' must be a list")
    documents = keep_documents(documents, record.get("gold_index"), num_documents)
    docs = []
    for i, doc in enumerate(documents):
        if isinstance(doc, str):
            docs.append({"text": doc})
        elif isinstance(doc, dict) and isinstance(doc.get("text"), str):
            docs.append({"title": str(doc.get("title") or ""), "text": doc["text"]})
        else:
            raise ValueError(f"documents[{i}] must be a string or have a string 'text'")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": question})
    body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    if docs:
        body["documents"] = docs
    return body


def _answers(record: dict[str, Any]) -> tuple[str, ...]:
    answers = record.get("answers", [])
    if isinstance(answers, str):
        answers = [answers]
    if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
        raise ValueError("'answers' must be a list of strings")
    return tuple(answers)


def parse_line(
    text: str, line: int, system_prompt: str | None, max_tokens: int, num_documents: int | None = None
) -> WorkItem:
    """One JSONL line → a WorkItem; raises ValueError with the reason when it is not valid."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    answers = _answers(record)
    if "messages" in record:
        body = {k: v for k, v in record.items() if k not in ("answers", "id", "gold_index")}
        body.setdefault("max_tokens", max_tokens)
    elif "question" in record:
        body = _rag_body(record, system_prompt, max_tokens, num_documents)
    else:
        raise ValueError("neither a RAG QA record ('question') nor a chat request body ('messages')")
    body.pop("stream", None)
    try:
        ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ValueError(f"invalid chat request ({where}: {err['msg']})") from exc
    docs = body.get("documents") or []
    document_text = "\n".join(d if isinstance(d, str) else str(d.get("text", "")) for d in docs)
    return WorkItem(line=line, body=body, answers=answers, document_text=document_text)


def load_workload(
    path: str | Path,
    *,
    limit: int | None = None,
    system_prompt: str | None = None,
    max_tokens: int = 16,
    num_documents: int | None = None,
) -> Workload:
    """The first `limit` valid items of a JSONL file; invalid lines are skipped and listed."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data: workload file {path} not found")
    items: list[WorkItem] = []
    skipped: list[SkippedLine] = []
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, text in enumerate(lines, start=1):
            if limit is not None and len(items) >= limit:
                break
            if not text.strip():
                continue
            try:
                items.append(parse_line(text, number, system_prompt, max_tokens, num_documents))
            except (ValueError, KeyError, TypeError) as exc:
                skipped.append(SkippedLine(number, str(exc)))
    return Workload(str(path), tuple(items), tuple(skipped))
