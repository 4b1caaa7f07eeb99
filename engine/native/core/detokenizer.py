"""Incremental detokenisation that never emits a split UTF-8 character, in time linear in the
output.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
yields U+FFFD. Each step decodes a short window of tokens twice (vLLM's scheme): once up to
the tokens already emitted, once with the new ones; the difference is the new text. The window
starts a few tokens back (at first in the prompt), so SentencePiece-style leading spaces come
out right; it moves up once the new text is complete, and while that text ends in U+FFFD it is
held back until the next token completes it. (Decoding the whole output at every token would
cost time quadratic in its length.) A transformers tokenizer whose `decode` is its `tokenizers`
backend's, with no space clean-up, is decoded by the backend directly (`text_decoder`): the same
text, without transformers' Python layers twice a token.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

_REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int]):
        self._decode_ids = text_decoder(tokenizer)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # the decoded window starts here
        self._read_offset = len(self._ids)  # tokens before this one are emitted
        self.text = ""  # everything emitted so far

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_ids(token_ids)

    def _new_text(self) -> str:
        """The text of the tokens past the read offset, in the window's context."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        return full[len(prefix) :]

    def _emit(self, text: str) -> str:
        self.text += text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly complete text (possibly empty)."""
        self._ids.extend(token_ids)
        new_text = self._new_text()
        if not new_text or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """At the end of generation: emit whatever is held back, replacement chars included."""
        return self._emit(self._new_text())


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """`tokenizer.decode(token_ids, skip_special_tokens=True)` as a function of the ids: the
    `tokenizers` backend's own decode where transformers' would only call it (a backend
    tokenizer whose class keeps transformers' `decode` and `_decode`, cleaning up no spaces)."""
    try:
        from transformers import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # a transformers without that class: its decode, as it is
        return functools.partial(tokenizer.decode, skip_special_tokens=True)
    cls = type(tokenizer)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and tokenizer.clean_up_tokenization_spaces is False
    ):
        return functools.partial(tokenizer.backend_tokenizer.decode, skip_special_tokens=True)
    return functools.partial(tokenizer.decode, skip_special_tokens=True)
