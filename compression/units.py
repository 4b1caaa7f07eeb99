"""The flat table of units (sentences) a sentence-level compressor scores and selects from."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ragspeed.compression.base import Document, Tokenizer, count_tokens_many
from ragspeed.compression.sentences import split_sentences


@dataclass(frozen=True)
class UnitTable:
    documents: tuple[Document, ...]
    texts: tuple[str, ...]  # [num_units] the units themselves
    doc_index: np.ndarray  # [num_units] int, which document each unit comes from
    position: np.ndarray  # [num_units] int, the unit's index inside its document
    num_tokens: np.ndarray  # [num_units] int, tokens in the target tokenizer
    doc_units: tuple[tuple[str, ...], ...]  # units of every document (protected ones too)
    doc_num_tokens: tuple[int, ...]  # tokens of every document's text

    @property
    def num_units(self) -> int:
        return len(self.texts)

    def titled(self) -> list[str]:
        """Units with their document's title in front: "Title. sentence" (for the scorers)."""
        return [_titled(self.documents[d].title, t) for d, t in zip(self.doc_index.tolist(), self.texts)]

    def titled_documents(self) -> list[str]:
        return [_titled(d.title, d.text) for d in self.documents]


def _titled(title: str, text: str) -> str:
    return f"{title}. {text}" if title else text


class TokenCounter:
    """Token counts in one target tokenizer, remembered by text (a bounded LRU): passages and
    their sentences repeat across requests, and counting is a large part of a warm request."""

    def __init__(self, tokenizer: Tokenizer, max_entries: int = 200_000):
        self.tokenizer = tokenizer
        self.max_entries = max_entries
        self._counts: OrderedDict[str, int] = OrderedDict()

    def count(self, texts: Sequence[str]) -> list[int]:
        missing = list(dict.fromkeys(t for t in texts if t not in self._counts))
        for text, n in zip(missing, count_tokens_many(self.tokenizer, missing)):
            self._counts[text] = n
        out = []
        for t in texts:
            out.append(self._counts[t])
            self._counts.move_to_end(t)
        while len(self._counts) > self.max_entries:
            self._counts.popitem(last=False)
        return out


def build_unit_table(documents: Sequence[Document], counter: TokenCounter) -> UnitTable:
    """Split every unprotected document into units and count their tokens."""
    texts: list[str] = []
    doc_index: list[int] = []
    position: list[int] = []
    doc_units: list[tuple[str, ...]] = []
    for i, doc in enumerate(documents):
        units = tuple(split_sentences(doc.text))
        doc_units.append(units)
        if doc.protected:
            continue
        for j, unit in enumerate(units):
            texts.append(unit)
            doc_index.append(i)
            position.append(j)
    doc_num_tokens = counter.count([d.text for d in documents])
    num_tokens = counter.count(texts)
    return UnitTable(
        documents=tuple(documents),
        texts=tuple(texts),
        doc_index=np.asarray(doc_index, dtype=np.int64),
        position=np.asarray(position, dtype=np.int64),
        num_tokens=np.asarray(num_tokens, dtype=np.int64),
        doc_units=tuple(doc_units),
        doc_num_tokens=tuple(doc_num_tokens),
    )
