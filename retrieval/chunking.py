"""Token-window chunking with overlap.

A chunk is at most `chunk_tokens` tokens; consecutive chunks share `overlap_tokens` tokens so
a fact cut by a boundary is whole in one of them. Chunks are cut from the original text at
token character offsets when the tokenizer reports them (HF fast tokenizers), so casing and
spacing survive (MiniLM's tokenizer is uncased: decoding would lower-case the text); other
tokenizers (anything with `encode` and `decode`) are decoded.
"""

from __future__ import annotations

from typing import Any, Protocol

from ragspeed.retrieval.errors import RetrievalError


class Tokenizer(Protocol):
    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]: ...

    def decode(self, token_ids: list[int], *args: Any, **kwargs: Any) -> str: ...


def _window_starts(num_tokens: int, chunk_tokens: int, overlap_tokens: int) -> list[int]:
    stride = chunk_tokens - overlap_tokens
    starts = [0]
    while starts[-1] + chunk_tokens < num_tokens:
        starts.append(starts[-1] + stride)
    return starts


def _token_spans(tokenizer: Any, text: str) -> list[tuple[int, int]] | None:
    """Character span of each token, or None when the tokenizer cannot report them."""
    if not getattr(tokenizer, "is_fast", False):
        return None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    return [tuple(span) for span in enc["offset_mapping"]]


def _encode(tokenizer: Any, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without HF keyword arguments
        return list(tokenizer.encode(text))


def chunk_text(text: str, tokenizer: Any, chunk_tokens: int = 200, overlap_tokens: int = 40) -> list[str]:
    """Split `text` into overlapping token windows; empty or blank text gives []."""
    if chunk_tokens < 1:
        raise RetrievalError(f"chunk_tokens must be >= 1, got {chunk_tokens}", "chunk_tokens")
    if not 0 <= overlap_tokens < chunk_tokens:
        raise RetrievalError(
            f"overlap_tokens must be in [0, chunk_tokens), got {overlap_tokens}", "overlap_tokens"
        )
    if not text.strip():
        return []
    spans = _token_spans(tokenizer, text)
    if spans is not None:
        if len(spans) <= chunk_tokens:
            return [text.strip()]
        chunks = []
        for start in _window_starts(len(spans), chunk_tokens, overlap_tokens):
            end = min(start + chunk_tokens, len(spans))
            chunks.append(text[spans[start][0] : spans[end - 1][1]].strip())
        return chunks
    token_ids = _encode(tokenizer, text)
    if len(token_ids) <= chunk_tokens:
        return [text.strip()]
    return [
        tokenizer.decode(token_ids[start : start + chunk_tokens]).strip()
        for start in _window_starts(len(token_ids), chunk_tokens, overlap_tokens)
    ]
