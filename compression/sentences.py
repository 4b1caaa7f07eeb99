"""Split a document into units: sentences, or pieces of sentences too long to keep whole.

A unit is what selection keeps or drops whole. A sentence ends at ., !, ? (or their CJK
forms) followed by white space, or at a line break; common abbreviations and initials do not end
one. A "sentence" longer than `max_unit_chars` (a table, a log line, text without
punctuation) would make a document all-or-nothing, so it alone is split: at clause marks
(; : ,) first, then at white space, never inside a word.
"""

from __future__ import annotations

import re

MAX_UNIT_CHARS = 600  # about 150 tokens of English

_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e no fig al approx inc ltd co corp jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k".split()
)
# A candidate boundary: terminal punctuation (and closing quotes/brackets) then white space,
# a CJK terminator, or a line break.
_BOUNDARY = re.compile(r"(?<=[.!?])[\"')\]]*\s+|(?<=[。！？])\s*|\n+")


def _ends_with_abbreviation(text: str) -> bool:
    word = text.rstrip().rsplit(None, 1)[-1] if text.strip() else ""
    word = word.rstrip(".").lstrip("(\"'").lower()
    # initials ("J.", "J.K.") and listed abbreviations
    return len(word) == 1 and word.isalpha() or word in _ABBREVIATIONS


def _split_long(unit: str, max_chars: int) -> list[str]:
    if len(unit) <= max_chars:
        return [unit]
    for pattern in (r"(?<=[;:])\s+", r"(?<=,)\s+", r"\s+"):
        parts = re.split(pattern, unit)
        if len(parts) > 1:
            break
    else:
        # one word longer than max_chars: keep it whole rather than cut a word
        return [unit]
    pieces: list[str] = []
    current = ""
    for part in parts:
        candidate = f"{current} {part}" if current else part
        if len(candidate) <= max_chars or not current:
            current = candidate
        else:
            pieces.append(current)
            current = part
    if current:
        pieces.append(current)
    return [p for piece in pieces for p in _split_long(piece, max_chars)]


def split_sentences(text: str, max_unit_chars: int = MAX_UNIT_CHARS) -> list[str]:
    """Units of `text`, stripped, in order; "" gives []."""
    sentences: list[str] = []
    start = 0
    pending = ""
    for m in _BOUNDARY.finditer(text):
        piece = text[start : m.end()]
        start = m.end()
        if "\n" not in m.group(0) and _ends_with_abbreviation(piece):
            pending += piece
            continue
        sentences.append(pending + piece)
        pending = ""
    sentences.append(pending + text[start:])
    units = [s.strip() for s in sentences]
    return [u for s in units if s for u in _split_long(s, max_unit_chars)]
