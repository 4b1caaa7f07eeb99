"""Ingestion of files into documents: load (by file suffix), chunk, give stable ids, dedupe.

Loaders are chosen through `LOADERS`, keyed by suffix. A file that is not UTF-8 text, a file
of an unknown type, a JSONL line that is not a JSON object with a string `text`: each is
skipped with a message naming the file (and line), and the rest is ingested.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ragspeed.document import Document
from ragspeed.retrieval.chunking import chunk_text
from ragspeed.retrieval.documents import content_key, document_id

# Bytes sniffed for NUL, which UTF-8 text never contains but binary files nearly always do.
SNIFF_BYTES = 8192


@dataclass(frozen=True)
class SourceRecord:
    """One unchunked text from a file or a caller."""

    source: str
    text: str
    title: str = ""
    given_id: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class IngestReport:
    documents: tuple[Document, ...]
    skipped: tuple[str, ...]  # one human-readable message per skipped file or line
    num_duplicates: int
    num_files: int


class _NotText(Exception):
    """A file skipped as not UTF-8 text; the message says why."""


def _read_text(path: Path) -> str:
    """The file's text; raises `_NotText` for a binary or non-UTF-8 file."""
    data = path.read_bytes()
    if b"\x00" in data[:SNIFF_BYTES]:
        raise _NotText(f"{path}: skipped, not a text file (NUL byte in the first {SNIFF_BYTES} bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _NotText(f"{path}: skipped, not UTF-8 text (invalid byte at offset {exc.start})") from None


def load_plain_text(path: Path) -> tuple[list[SourceRecord], list[str]]:
    try:
        text = _read_text(path)
    except _NotText as exc:
        return [], [str(exc)]
    return [SourceRecord(source=str(path), text=text, title=path.stem)], []


def load_markdown(path: Path) -> tuple[list[SourceRecord], list[str]]:
    try:
        text = _read_text(path)
    except _NotText as exc:
        return [], [str(exc)]
    # The first level-1 heading is the title when there is one.
    title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), path.stem)
    return [SourceRecord(source=str(path), text=text, title=title)], []


def load_jsonl(path: Path) -> tuple[list[SourceRecord], list[str]]:
    try:
        text = _read_text(path)
    except _NotText as exc:
        return [], [str(exc)]
    records: list[SourceRecord] = []
    skipped: list[str] = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            skipped.append(f"{path}:{line_number}: skipped, not JSON ({exc.msg})")
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            skipped.append(f"{path}:{line_number}: skipped, not an object with a string 'text' field")
            continue
        given_id = obj.get("id")
        metadata = {k: v for k, v in obj.items() if k not in ("text", "title", "id")}
        metadata["line"] = line_number
        records.append(
            SourceRecord(
                source=str(path),
                text=obj["text"],
                title=str(obj.get("title") or ""),
                given_id=None if given_id is None else str(given_id),
                metadata=metadata,
            )
        )
    return records, skipped


LOADERS: dict[str, Callable[[Path], tuple[list[SourceRecord], list[str]]]] = {
    ".txt": load_plain_text,
    ".text": load_plain_text,
    ".md": load_markdown,
    ".markdown": load_markdown,
    ".jsonl": load_jsonl,
}


def _expand(paths: Iterable[str | Path]) -> tuple[list[Path], list[str]]:
    files: list[Path] = []
    skipped: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(p for p in sorted(path.rglob("*")) if p.is_file())
        elif path.is_file():
            files.append(path)
        else:
            skipped.append(f"{path}: skipped, no such file or directory")
    return files, skipped


def documents_from_records(
    records: Iterable[SourceRecord], tokenizer: Any, chunk_tokens: int, overlap_tokens: int
) -> list[Document]:
    """Chunk each record. A given id names a single chunk; chunks of a longer text get `id#i`."""
    documents = []
    for record in records:
        chunks = chunk_text(record.text, tokenizer, chunk_tokens, overlap_tokens)
        for index, chunk in enumerate(chunks):
            if record.given_id is not None:
                doc_id = record.given_id if len(chunks) == 1 else f"{record.given_id}#{index}"
            else:
                doc_id = document_id(record.source, chunk)
            metadata = {"source": record.source, "chunk": index, **record.metadata}
            documents.append(Document(id=doc_id, text=chunk, title=record.title, metadata=metadata))
    return documents


def drop_duplicates(
    documents: Sequence[Document], seen_ids: set[str] | None = None, seen_keys: set[str] | None = None
) -> tuple[list[Document], int]:
    """Keep the first document of each id and of each content key; updates the seen sets."""
    seen_ids = set() if seen_ids is None else seen_ids
    seen_keys = set() if seen_keys is None else seen_keys
    kept = []
    for doc in documents:
        key = content_key(doc.text)
        if doc.id in seen_ids or key in seen_keys:
            continue
        seen_ids.add(doc.id)
        seen_keys.add(key)
        kept.append(doc)
    return kept, len(documents) - len(kept)


def ingest_paths(
    paths: Iterable[str | Path], tokenizer: Any, chunk_tokens: int = 200, overlap_tokens: int = 40
) -> IngestReport:
    files, skipped = _expand(paths)
    records: list[SourceRecord] = []
    for path in files:
        loader = LOADERS.get(path.suffix.lower())
        if loader is None:
            skipped.append(
                f"{path}: skipped, unsupported file type {path.suffix!r} (supported: {', '.join(LOADERS)})"
            )
            continue
        file_records, file_skipped = loader(path)
        records.extend(file_records)
        skipped.extend(file_skipped)
    documents, num_duplicates = drop_duplicates(
        documents_from_records(records, tokenizer, chunk_tokens, overlap_tokens)
    )
    return IngestReport(
        documents=tuple(documents),
        skipped=tuple(skipped),
        num_duplicates=num_duplicates,
        num_files=len(files),
    )
