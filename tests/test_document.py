"""The one document type: its checks, its hash, and JSON as saved collections hold it."""

import dataclasses
import json

import pytest

from ragspeed.compression import Document as CompressionDocument
from ragspeed.document import Document
from ragspeed.retrieval import Document as RetrievalDocument


def test_one_type_everywhere():
    assert CompressionDocument is Document
    assert RetrievalDocument is Document


def test_json_as_written_before_reads_and_writes_back_the_same():
    # A document of a collection file saved before the types were merged.
    saved = {"id": "kb#0", "text": "Cats purr.", "title": "Cat", "metadata": {"page": 3}}
    doc = Document.from_json(json.loads(json.dumps(saved)))
    assert doc == Document("kb#0", "Cats purr.", "Cat", {"page": 3})
    assert not doc.protected
    assert doc.to_json() == saved
    assert Document.from_json({"id": "x", "text": "t"}) == Document("x", "t")


def test_protected_round_trips_and_is_written_only_when_set():
    doc = Document("rules", "Answer in English.", protected=True)
    assert doc.to_json() == {
        "id": "rules",
        "text": "Answer in English.",
        "title": "",
        "metadata": {},
        "protected": True,
    }
    assert Document.from_json(doc.to_json()) == doc


def test_hashable_despite_metadata_and_frozen():
    a = Document("a", "text", metadata={"source": "x"})
    assert hash(a) == hash(Document("a", "text", metadata={"source": "y"}))
    assert a != Document("a", "text", metadata={"source": "y"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.text = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"id": 1, "text": "t"}, "Document.id must be a string, not int"),
        ({"id": "a", "text": None}, "Document.text must be a string, not NoneType"),
        ({"id": "a", "text": "t", "title": None}, "Document.title must be a string, not NoneType"),
        ({"id": "a", "text": "t", "metadata": [1]}, "Document.metadata must be a dict, not list"),
        ({"id": "a", "text": "t", "protected": "yes"}, "Document.protected must be a bool, not str"),
    ],
)
def test_bad_fields_are_refused(kwargs, message):
    with pytest.raises(TypeError, match=message):
        Document(**kwargs)
