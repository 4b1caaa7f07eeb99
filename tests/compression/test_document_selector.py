"""top-docs: coarse-to-fine's scores, whole documents kept (their text unchanged) under the budget,
with literal token counts (one per word)."""

import pytest

from ragspeed.compression import COMPRESSORS, CompressionError, Document, build_compressor
from ragspeed.compression.budget import Budget
from ragspeed.compression.document_selector import DocumentSelector
from ragspeed.compression.scoring.embedding_cache import EmbeddingCache
from ragspeed.compression.scoring.minilm_encoder import MiniLMEncoder
from tests.compression.test_compressors import DOCS, QUESTION  # 13, 14, 13 and 12 words


@pytest.fixture(scope="module")
def models(static_encoder):
    cache = EmbeddingCache(1000)
    return {"static_encoder": static_encoder, "minilm_encoder": MiniLMEncoder(cache=cache), "cache": cache}


@pytest.fixture(scope="module")
def top_docs(models):
    return build_compressor("top-docs", **models)


def test_built_by_name(top_docs, models):
    assert "top-docs" in COMPRESSORS
    assert isinstance(top_docs, DocumentSelector) and top_docs.name == "top-docs"
    with pytest.raises(CompressionError) as err:
        build_compressor("top-docs", colour="red", **models)
    assert err.value.param == "options"
    with pytest.raises(CompressionError) as err:
        build_compressor("top-docs", order="sideways", **models)
    assert err.value.param == "order"


def test_keeps_the_relevant_document_whole(top_docs, ws_tokenizer):
    result = top_docs.compress(QUESTION, DOCS, Budget(ws_tokenizer, target_tokens=12))
    assert result.method == "top-docs"
    assert result.kept_document_ids == ("d3",)
    (doc,) = result.documents
    assert doc.text == DOCS[3].text and doc.title == "Python"
    assert doc.sentences == ("Python is a programming language.", "It was created by Guido van Rossum.")
    assert doc.sentence_indices == (0, 1)
    assert doc.num_kept_tokens == doc.num_original_tokens == 12
    assert result.num_compressed_tokens == 12 <= result.budget_tokens
    assert result.num_dropped_documents == 3


def test_text_is_unchanged_byte_for_byte(top_docs, ws_tokenizer):
    # Sentence compressors join kept sentences with one space; whole documents keep their layout.
    odd = Document("odd", "Python  was created\nby Guido van Rossum.\n\n  It is a programming language. ")
    docs = [odd, DOCS[0], DOCS[1]]
    result = top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, rate=0.5))
    assert "odd" in result.kept_document_ids
    by_id = {d.id: d for d in docs}
    assert all(kept.text == by_id[kept.id].text for kept in result.documents)


def test_rare_words_win_at_a_tight_budget(top_docs, ws_tokenizer):
    docs = [
        Document("weather", "It rained in the morning. The afternoon was sunny and warm."),
        Document("moss", "Zorblax Quentavian discovered the glowing moss of Vintermark in 1911."),
        Document("cooking", "Bread needs flour, water and yeast. It is baked in a hot oven."),
    ]
    result = top_docs.compress(
        "what did zorblax quentavian discover in vintermark", docs, Budget(ws_tokenizer, target_tokens=12)
    )
    assert result.kept_document_ids == ("moss",)
    assert result.documents[0].text == docs[1].text


@pytest.mark.parametrize("order", ["original", "edges"])
def test_budget_is_respected(models, ws_tokenizer, order):
    compressor = build_compressor("top-docs", order=order, **models)
    for rate in (0.2, 0.3, 0.5, 0.8):
        result = compressor.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=rate))
        assert result.num_compressed_tokens <= result.budget_tokens == int(rate * 52)
        assert sum(d.num_kept_tokens for d in result.documents) == result.num_compressed_tokens


def test_a_document_that_does_not_fit_is_skipped(top_docs, ws_tokenizer):
    long = Document(
        "long",
        "Guido van Rossum created the Python programming language. "
        + " ".join(f"Release {i} of Python added new features to the language." for i in range(6)),
        "Python",
    )
    short = Document("short", "Python is a popular programming language for scripting.", "Python")
    docs = [DOCS[0], long, DOCS[1], short]
    num_long = len(long.text.split())
    alone = top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, target_tokens=num_long))
    assert alone.kept_document_ids == ("long",)  # the most relevant, when it fits
    # One token short: it is skipped, not the end of the selection; the next best fits.
    result = top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, target_tokens=num_long - 1))
    assert result.kept_document_ids == ("d0", "d1", "short")
    tight = top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, target_tokens=20))
    assert tight.kept_document_ids == ("short",) and tight.num_compressed_tokens == 8


def test_duplicates_are_kept_once(top_docs, ws_tokenizer):
    copy = Document("copy", "  python is a programming language. It was CREATED by Guido van Rossum.")
    docs = [DOCS[3], copy, DOCS[0]]
    result = top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, rate=1.0))
    assert result.kept_document_ids == ("d3", "d0")
    assert result.num_compressed_tokens == 25


def test_protected_documents_are_kept(top_docs, ws_tokenizer):
    rules = Document("rules", "Always answer in English.\nCite the documents.", protected=True)
    docs = [DOCS[0], rules, *DOCS[1:]]
    result = top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, rate=0.5))
    assert result.kept_document_ids == ("rules", "d3")  # original order
    assert result.documents[0].text == rules.text
    assert result.kept_documents[0] is rules  # the document itself: whole, protected, as given
    assert result.budget_tokens == 29 - 7  # floor(0.5 * 59) less the protected document
    assert result.num_compressed_tokens - 7 <= result.budget_tokens
    # Protected documents are kept even when nothing else fits, and copies of them are dropped.
    copy = Document("copy", rules.text)
    tight = top_docs.compress(QUESTION, [*docs, copy], Budget(ws_tokenizer, target_tokens=7))
    assert tight.kept_document_ids == ("rules",) and tight.budget_tokens == 0
    with pytest.raises(CompressionError) as err:
        top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, target_tokens=5))
    assert err.value.param == "target_tokens"


def test_original_order_by_default(models, top_docs, ws_tokenizer):
    docs = [DOCS[2], DOCS[3], DOCS[0], DOCS[1]]
    result = top_docs.compress(QUESTION, docs, Budget(ws_tokenizer, rate=0.5))
    assert len(result.documents) == 2
    ids = [d.id for d in docs]
    positions = [ids.index(i) for i in result.kept_document_ids]
    assert positions == sorted(positions) and "d3" in result.kept_document_ids
    edges = build_compressor("top-docs", order="edges", **models)
    assert edges.compress(QUESTION, docs, Budget(ws_tokenizer, rate=0.5)).kept_document_ids[0] == "d3"


def test_rate_one_keeps_everything(top_docs, ws_tokenizer):
    result = top_docs.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=1.0))
    assert [d.text for d in result.documents] == [d.text for d in DOCS]
    assert result.num_compressed_tokens == result.num_original_tokens == 52


def test_empty_inputs(top_docs, ws_tokenizer):
    empty = top_docs.compress(QUESTION, [], Budget(ws_tokenizer, rate=0.25))
    assert (empty.documents, empty.num_original_tokens, empty.num_compressed_tokens) == ((), 0, 0)
    blank = top_docs.compress(
        QUESTION, [Document("e", ""), Document("f", "  "), DOCS[3]], Budget(ws_tokenizer, rate=1.0)
    )
    assert blank.kept_document_ids == ("d3",) and blank.num_dropped_documents == 2
    no_question = top_docs.compress("", DOCS, Budget(ws_tokenizer, rate=0.5))
    assert no_question.num_compressed_tokens <= 26


@pytest.mark.parametrize("rate", [0.0, -1.0, 1.5])
def test_bad_rate(top_docs, ws_tokenizer, rate):
    with pytest.raises(CompressionError) as err:
        top_docs.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=rate))
    assert err.value.param == "rate"


def test_clear_caches_runs_cold(top_docs, models, ws_tokenizer):
    first = top_docs.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=0.5))
    top_docs.clear_caches()
    assert len(models["cache"]) == 0
    again = top_docs.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=0.5))
    assert again.documents == first.documents
