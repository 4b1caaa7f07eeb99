"""The stream's text chunks: the same bytes as encoding the whole chunk, for any text."""

from __future__ import annotations

import pytest

from ragspeed.gateway.streaming import CHAT, TEXT, TextChunks, _sse

BASE = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1, "model": "m"}


@pytest.mark.parametrize("shape", [CHAT, TEXT])
@pytest.mark.parametrize("text", [" tok", 'quote " and \\ slash', "é ü 中文 🙂", "line\nbreak\x00"])
def test_text_chunks_are_the_bytes_of_the_whole_chunk(shape, text):
    whole = _sse({**BASE, "choices": [{"index": 0, **shape.content(text), "finish_reason": None}]})
    assert TextChunks(BASE, shape)(text) == whole


def test_a_chat_text_chunk_literally():
    assert TextChunks(BASE, CHAT)("hi") == (
        b'data: {"id":"chatcmpl-abc","object":"chat.completion.chunk","created":1,"model":"m",'
        b'"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\n'
    )
