"""What every compressor takes and returns.

Terms used across `compression/`:

- *document*: `ragspeed.document.Document`; a compressor returns each kept one with its text
  shortened and everything else (title, metadata, `protected`) carried over.
- *document tokens*: tokens of the documents' text in the target model's tokenizer (titles are
  passed through untouched and not counted).
- *unit*: the smallest piece a compressor keeps or drops: a sentence, or a piece of an over-long
  sentence (see `sentences.py`). Nothing is ever cut inside a unit.
- *rate*: the fraction of document tokens to keep, in (0, 1]; 0.25 asks for 4x.
- *ratio*: what was achieved, original tokens / compressed tokens (4.0 for 4x).
- *protected tokens*: tokens the compressor must not touch (system prompt, question, documents the
  caller marks `protected`); they count against `target_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ragspeed.document import Document

if TYPE_CHECKING:
    from ragspeed.compression.budget import Budget


class CompressionError(ValueError):
    """Bad input for a compressor; `param` names the offending parameter (for a 400 body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@runtime_checkable
class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class CompressedDocument:
    """One kept document and the record of what was kept: `document` is the input document
    with its text replaced by the kept units, in their original order, joined by a space (id,
    title, metadata and `protected` carried over)."""

    document: Document
    sentences: tuple[str, ...]
    sentence_indices: tuple[int, ...]  # positions of the kept units in the document's units
    num_original_tokens: int
    num_kept_tokens: int

    @property
    def id(self) -> str:
        return self.document.id

    @property
    def title(self) -> str:
        return self.document.title

    @property
    def text(self) -> str:
        return self.document.text


@dataclass(frozen=True)
class CompressionResult:
    method: str
    documents: tuple[CompressedDocument, ...]  # kept documents, in output order
    num_original_tokens: int  # document tokens before compression (target tokenizer)
    num_compressed_tokens: int  # document tokens after compression (target tokenizer)
    elapsed_s: float
    budget_tokens: int  # the document-token budget the selection worked to
    num_dropped_documents: int = 0

    @property
    def kept_documents(self) -> tuple[Document, ...]:
        """The kept documents, in output order, as the prompt takes them."""
        return tuple(d.document for d in self.documents)

    @property
    def kept_document_ids(self) -> tuple[str, ...]:
        return tuple(d.id for d in self.documents)

    @property
    def kept_sentences(self) -> tuple[tuple[str, str], ...]:
        """(document id, sentence) for every kept unit, in output order."""
        return tuple((d.id, s) for d in self.documents for s in d.sentences)

    @property
    def text(self) -> str:
        return "\n\n".join(d.text for d in self.documents)

    @property
    def ratio(self) -> float:
        if self.num_compressed_tokens == 0:
            return float("inf") if self.num_original_tokens else 1.0
        return self.num_original_tokens / self.num_compressed_tokens


class Compressor(Protocol):
    name: str

    def compress(
        self,
        question: str,
        documents: Sequence[Document],
        budget: Budget,
    ) -> CompressionResult: ...


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Tokens of `text` alone: without the special tokens an HF tokenizer adds by default."""
    if not text:
        return 0
    try:
        return len(tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]
    except TypeError:
        return len(tokenizer.encode(text))


def count_tokens_many(tokenizer: Tokenizer, texts: Sequence[str]) -> list[int]:
    """`count_tokens` for many texts; one batched call when the tokenizer is an HF tokenizer
    (its Rust batch encoder is several times faster than one call per text)."""
    if not texts:
        return []
    if callable(tokenizer) and hasattr(tokenizer, "batch_decode"):
        try:
            # verbose=False: counting a long document is not feeding it to a model
            ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
            return [len(x) if t else 0 for x, t in zip(ids, texts)]
        except (TypeError, KeyError):
            pass
    return [count_tokens(tokenizer, t) for t in texts]


def as_documents(documents: Sequence[object]) -> list[Document]:
    """Accept `Document`s, or dicts / objects with id, text and optionally title, metadata and
    protected (a library caller's records); check the fields."""
    if isinstance(documents, (str, bytes)):
        raise CompressionError("documents must be a sequence of documents, not a string", "documents")
    out: list[Document] = []
    for i, d in enumerate(documents):
        if isinstance(d, Document):
            out.append(d)
            continue
        get = d.get if isinstance(d, dict) else (lambda k, default=None, _d=d: getattr(_d, k, default))
        text = get("text")
        if not isinstance(text, str):
            raise CompressionError(f"documents[{i}].text must be a string", "documents")
        metadata = get("metadata") or {}
        if not isinstance(metadata, dict):
            raise CompressionError(f"documents[{i}].metadata must be a dict", "documents")
        doc_id = get("id")
        title = get("title", "") or ""
        out.append(
            Document(
                id=str(doc_id) if doc_id is not None else str(i),
                text=text,
                title=str(title),
                metadata=metadata,
                protected=bool(get("protected", False)),
            )
        )
    return out
