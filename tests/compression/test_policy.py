import pytest

from ragspeed.compression import (
    Budget,
    CompressionError,
    CompressionPolicy,
    Document,
    apply_policy,
    break_even_tokens,
    build_compressor,
)

DOCS = [Document(str(i), f"Sentence number {i} is here. And another one follows it.") for i in range(10)]


class Broken:
    """A compressor whose backend fails (a real failure path, not a mock of ours)."""

    name = "broken"

    def compress(self, question, documents, budget):
        raise RuntimeError("model file truncated")


def test_below_break_even_passes_through(ws_tokenizer):
    out = apply_policy(
        CompressionPolicy(min_document_tokens=1000),
        build_compressor("bm25"),
        "q",
        DOCS,
        Budget(ws_tokenizer, rate=0.25),
    )
    assert not out.compressed and out.skipped_reason == "below_break_even" and not out.failed
    assert out.result.num_compressed_tokens == out.result.num_original_tokens == 100


def test_compresses_above_break_even(ws_tokenizer):
    out = apply_policy(
        CompressionPolicy(min_document_tokens=50),
        build_compressor("bm25"),
        "number 3",
        DOCS,
        Budget(ws_tokenizer, rate=0.25),
    )
    assert out.compressed and out.result.num_compressed_tokens <= 25


def test_fails_open_and_flags_it(ws_tokenizer):
    out = apply_policy(
        CompressionPolicy(min_document_tokens=0), Broken(), "q", DOCS, Budget(ws_tokenizer, rate=0.25)
    )
    assert out.failed and not out.compressed and out.skipped_reason == "compressor_error"
    assert out.error == "RuntimeError: model file truncated"
    assert [d.text for d in out.result.documents] == [d.text for d in DOCS]
    assert out.result.kept_documents == tuple(DOCS)
    with pytest.raises(RuntimeError):
        apply_policy(
            CompressionPolicy(min_document_tokens=0, fail_open=False),
            Broken(),
            "q",
            DOCS,
            Budget(ws_tokenizer),
        )


def test_bad_input_is_not_failed_open(ws_tokenizer):
    with pytest.raises(CompressionError) as err:
        apply_policy(CompressionPolicy(), Broken(), "q", DOCS, Budget(ws_tokenizer, rate=2.0))
    assert err.value.param == "rate"


def test_break_even_tokens():
    # 0.2 s of compression, 3.3 ms of prefill per token, keeping a quarter
    assert break_even_tokens(0.2, 0.0033, 0.25) == 81
    assert break_even_tokens(0.03, 0.0001, 0.25) == 400
