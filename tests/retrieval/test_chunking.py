import pytest

from ragspeed.retrieval.chunking import chunk_text
from ragspeed.retrieval.errors import RetrievalError


def test_short_text_is_one_chunk(tokenizer):
    assert chunk_text("  The Eiffel Tower.  ", tokenizer, chunk_tokens=10, overlap_tokens=2) == [
        "The Eiffel Tower."
    ]


def test_blank_text_gives_no_chunks(tokenizer):
    assert chunk_text(" \n ", tokenizer) == []


def test_windows_overlap_and_keep_original_casing(tokenizer):
    text = "Alpha Beta Gamma Delta Epsilon Zeta Eta Theta"  # one MiniLM token per word
    assert chunk_text(text, tokenizer, chunk_tokens=4, overlap_tokens=1) == [
        "Alpha Beta Gamma Delta",
        "Delta Epsilon Zeta Eta",
        "Eta Theta",
    ]


def test_tokenizer_without_offsets_is_decoded(whitespace_tokenizer):
    text = "a b c d e f g"
    assert chunk_text(text, whitespace_tokenizer, chunk_tokens=3, overlap_tokens=0) == ["a b c", "d e f", "g"]
    assert chunk_text(text, whitespace_tokenizer, chunk_tokens=5, overlap_tokens=2) == [
        "a b c d e",
        "d e f g",
    ]


@pytest.mark.parametrize(
    ("chunk_tokens", "overlap", "param"),
    [(0, 0, "chunk_tokens"), (4, 4, "overlap_tokens"), (4, -1, "overlap_tokens")],
)
def test_bad_parameters_are_named(whitespace_tokenizer, chunk_tokens, overlap, param):
    with pytest.raises(RetrievalError) as info:
        chunk_text("a b", whitespace_tokenizer, chunk_tokens, overlap)
    assert info.value.param == param
