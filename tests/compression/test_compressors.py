"""The sentence compressors on small hand-made documents, with literal token counts."""

import dataclasses

import pytest

from ragspeed.compression import CompressionError, Document, build_compressor
from ragspeed.compression.budget import Budget

DOCS = [
    Document("d0", "Paris is the capital of France. It is known for the Eiffel Tower.", "Paris"),
    Document("d1", "The Nile is a river in Africa. It flows north into the Mediterranean Sea.", "Nile"),
    Document("d2", "Mount Everest is the highest mountain on Earth. It lies in the Himalayas.", "Everest"),
    Document("d3", "Python is a programming language. It was created by Guido van Rossum.", "Python"),
]
QUESTION = "who created the python programming language"


@pytest.fixture(scope="module")
def fast(static_encoder):
    return build_compressor("fast", static_encoder=static_encoder)


@pytest.fixture(scope="module", params=["fast", "bm25", "first-docs"])
def compressor(request, static_encoder):
    if request.param == "fast":
        return build_compressor("fast", static_encoder=static_encoder)
    return build_compressor(request.param)


def test_keeps_the_answer_sentence_under_budget(fast, ws_tokenizer):
    result = fast.compress(QUESTION, DOCS, Budget(ws_tokenizer, target_tokens=12))
    assert result.num_original_tokens == 13 + 14 + 13 + 12
    assert result.budget_tokens == 12
    assert result.num_compressed_tokens <= 12
    assert "It was created by Guido van Rossum." in result.text
    assert result.kept_document_ids == ("d3",)
    assert result.documents[0].title == "Python"
    assert result.method == "fast"
    assert result.elapsed_s > 0


def test_whole_sentences_in_document_order(compressor, ws_tokenizer):
    result = compressor.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=0.5))
    assert result.num_compressed_tokens <= 26
    all_units = {s for d in DOCS for s in d.text.replace(". ", ".\n").split("\n")}
    for doc in result.documents:
        assert all(s in all_units for s in doc.sentences)  # never cut inside a sentence
        assert list(doc.sentence_indices) == sorted(doc.sentence_indices)
    ids = list(result.kept_document_ids)
    assert ids == sorted(ids)  # "original" order


def test_rate_one_keeps_everything(compressor, ws_tokenizer):
    result = compressor.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=1.0))
    assert result.num_compressed_tokens == result.num_original_tokens == 52
    assert [d.text for d in result.documents] == [d.text for d in DOCS]


def test_kept_documents_carry_metadata(compressor, ws_tokenizer):
    docs = [
        dataclasses.replace(d, metadata={"source": f"wiki/{d.id}", "page": i}) for i, d in enumerate(DOCS)
    ]
    result = compressor.compress(QUESTION, docs, Budget(ws_tokenizer, rate=0.5))
    by_id = {d.id: d for d in docs}
    kept = result.kept_documents
    assert [d.id for d in kept] == list(result.kept_document_ids) != []
    for doc, record in zip(kept, result.documents):
        assert isinstance(doc, Document)
        assert doc.metadata == by_id[doc.id].metadata
        assert doc.title == by_id[doc.id].title
        assert doc.text == record.text


def test_result_is_frozen(fast, ws_tokenizer):
    result = fast.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=0.5))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.num_compressed_tokens = 0


@pytest.mark.parametrize("rate", [0.0, -1.0, 1.5])
def test_bad_rate(compressor, ws_tokenizer, rate):
    with pytest.raises(CompressionError) as err:
        compressor.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=rate))
    assert err.value.param == "rate"


def test_target_below_protected(compressor, ws_tokenizer):
    with pytest.raises(CompressionError) as err:
        compressor.compress(QUESTION, DOCS, Budget(ws_tokenizer, target_tokens=10, protected_tokens=11))
    assert err.value.param == "target_tokens"


def test_empty_inputs(compressor, ws_tokenizer):
    empty = compressor.compress(QUESTION, [], Budget(ws_tokenizer, rate=0.25))
    assert (empty.documents, empty.num_original_tokens, empty.num_compressed_tokens) == ((), 0, 0)
    blank = compressor.compress(
        QUESTION, [Document("e", ""), Document("f", "  ")], Budget(ws_tokenizer, rate=0.5)
    )
    assert blank.documents == () and blank.num_dropped_documents == 2
    no_question = compressor.compress("", DOCS, Budget(ws_tokenizer, rate=0.5))
    assert no_question.num_compressed_tokens <= 26


def test_duplicated_documents_are_kept_once(fast, ws_tokenizer):
    docs = [DOCS[3], Document("copy", DOCS[3].text, "Python"), DOCS[0]]
    result = fast.compress(QUESTION, docs, Budget(ws_tokenizer, rate=0.5))
    kept = [s for _, s in result.kept_sentences]
    assert len(kept) == len(set(kept))
    assert "copy" not in result.kept_document_ids


def test_one_huge_sentence_document(fast, ws_tokenizer):
    huge = Document("huge", ", ".join(f"clause {i} about rivers and mountains" for i in range(300)))
    result = fast.compress("which clause mentions rivers", [huge, DOCS[1]], Budget(ws_tokenizer, rate=0.1))
    assert 0 < result.num_compressed_tokens <= result.budget_tokens
    assert result.budget_tokens == int(0.1 * result.num_original_tokens)


def test_non_english_text(fast, minilm_tokenizer):
    docs = [
        Document("de", "Berlin ist die Hauptstadt von Deutschland. Die Stadt hat viele Museen.", "Berlin"),
        Document("zh", "北京是中国的首都。长城很长。", "北京"),
        Document("ru", "Москва — столица России. Город стоит на реке Москве.", "Москва"),
    ]
    result = fast.compress("was ist die Hauptstadt von Deutschland", docs, Budget(minilm_tokenizer, rate=0.5))
    assert 0 < result.num_compressed_tokens <= result.budget_tokens
    assert all(s in d.text for d in docs for doc in result.documents if doc.id == d.id for s in doc.sentences)


def test_protected_document_is_kept_whole(fast, ws_tokenizer):
    docs = [Document("rules", "Always answer in English. Cite the documents.", protected=True)] + DOCS
    result = fast.compress(QUESTION, docs, Budget(ws_tokenizer, rate=0.5))
    assert result.documents[0].id == "rules"
    assert result.documents[0].text == docs[0].text
    assert result.num_compressed_tokens <= 29  # floor(0.5 * 59): the 7 protected tokens count too
    with pytest.raises(CompressionError) as err:
        fast.compress(QUESTION, docs, Budget(ws_tokenizer, target_tokens=5))
    assert err.value.param == "target_tokens"  # 7 protected document tokens > 5


def test_accepts_any_document_like(fast, ws_tokenizer):
    @dataclasses.dataclass
    class RetrievedDoc:
        id: str
        text: str
        title: str
        score: float

    docs = [RetrievedDoc(d.id, d.text, d.title, 0.5) for d in DOCS] + [
        {"id": "x", "text": "A dict works too.", "metadata": {"url": "x.html"}}
    ]
    result = fast.compress(QUESTION, docs, Budget(ws_tokenizer, target_tokens=12))
    assert result.kept_document_ids == ("d3",)
    everything = fast.compress(QUESTION, docs, Budget(ws_tokenizer, rate=1.0))
    assert everything.kept_documents[-1].metadata == {"url": "x.html"}
    with pytest.raises(CompressionError) as err:
        fast.compress(
            QUESTION, [{"id": "y", "text": "t", "metadata": "x.html"}], Budget(ws_tokenizer, rate=0.5)
        )
    assert err.value.param == "documents"
    with pytest.raises(CompressionError) as err:
        fast.compress(QUESTION, [{"id": "y", "text": None}], Budget(ws_tokenizer, rate=0.5))
    assert err.value.param == "documents"


def test_edges_order_puts_the_best_document_first(static_encoder, ws_tokenizer):
    edges = build_compressor("fast", static_encoder=static_encoder, order="edges")
    result = edges.compress(QUESTION, DOCS, Budget(ws_tokenizer, rate=0.6))
    assert result.kept_document_ids[0] == "d3"


def test_registry_errors():
    with pytest.raises(CompressionError) as err:
        build_compressor("nope")
    assert err.value.param == "method"
    with pytest.raises(CompressionError) as err:
        build_compressor("bm25", colour="red")
    assert err.value.param == "options"
    with pytest.raises(CompressionError) as err:
        build_compressor("bm25", order="sideways")
    assert err.value.param == "order"
