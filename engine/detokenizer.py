"""Incremental detokenisation that never emits a split UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
yields U+FFFD. We decode the output together with a few prompt tokens of left context (so
SentencePiece-style leading spaces come out right), emit only the text past what was already
emitted, and hold back a tail that ends in U+FFFD until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int]):
        self._tokenizer = tokenizer
        self._context_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._context_text = self._decode(self._context_ids)
        self._output_ids: list[int] = []
        self.text = ""  # everything emitted so far

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=True)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self._output_ids.extend(token_ids)
        full = self._decode(self._context_ids + self._output_ids)
        new_text = full[len(self._context_text) + len(self.text):]
        if new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """At the end of generation: emit whatever is held back, replacement chars included."""
        full = self._decode(self._context_ids + self._output_ids)
        rest = full[len(self._context_text) + len(self.text):]
        self.text += rest
        return rest
