import json

from ragspeed.document import Document
from ragspeed.retrieval.documents import document_id
from ragspeed.retrieval.ingest import drop_duplicates, ingest_paths


def _write_corpus(tmp_path):
    (tmp_path / "notes.txt").write_text("Paris is the capital of France.")
    (tmp_path / "guide.md").write_text("# Travel Guide\n\nRome is the capital of Italy.")
    lines = [
        json.dumps(
            {"id": "b1", "title": "Berlin", "text": "Berlin is the capital of Germany.", "lang": "en"}
        ),
        "{not json",
        "",
        json.dumps({"title": "no text"}),
        json.dumps({"text": "Paris is the capital   of France."}),  # duplicate of notes.txt
    ]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    (tmp_path / "report.pdf").write_bytes(b"%PDF-1.4")


def test_ingest_skips_bad_parts_with_line_numbers(tmp_path, tokenizer):
    _write_corpus(tmp_path)
    report = ingest_paths([tmp_path, tmp_path / "missing.txt"], tokenizer, chunk_tokens=50, overlap_tokens=5)
    assert report.num_files == 5
    assert sorted(report.skipped) == sorted(
        [
            f"{tmp_path / 'missing.txt'}: skipped, no such file or directory",
            f"{tmp_path / 'docs.jsonl'}:2: skipped, not JSON (Expecting property name enclosed in double quotes)",
            f"{tmp_path / 'docs.jsonl'}:4: skipped, not an object with a string 'text' field",
            f"{tmp_path / 'image.txt'}: skipped, not a text file (NUL byte in the first 8192 bytes)",
            f"{tmp_path / 'report.pdf'}: skipped, unsupported file type '.pdf'"
            " (supported: .txt, .text, .md, .markdown, .jsonl)",
        ]
    )
    by_text = {doc.text: doc for doc in report.documents}
    assert set(by_text) == {
        "Berlin is the capital of Germany.",
        "# Travel Guide\n\nRome is the capital of Italy.",
        "Paris is the capital   of France.",  # docs.jsonl sorts before notes.txt: first kept
    }
    assert report.num_duplicates == 1
    berlin = by_text["Berlin is the capital of Germany."]
    assert berlin.id == "b1"
    assert berlin.title == "Berlin"
    assert berlin.metadata == {"source": str(tmp_path / "docs.jsonl"), "chunk": 0, "lang": "en", "line": 1}
    assert by_text["# Travel Guide\n\nRome is the capital of Italy."].title == "Travel Guide"
    paris = by_text["Paris is the capital   of France."]
    assert paris.title == ""
    assert paris.id == document_id(str(tmp_path / "docs.jsonl"), "Paris is the capital   of France.")


def test_ids_are_stable_and_long_texts_chunked(tmp_path, whitespace_tokenizer):
    (tmp_path / "a.jsonl").write_text(json.dumps({"id": "long", "text": "w1 w2 w3 w4 w5 w6 w7"}) + "\n")
    (tmp_path / "b.txt").write_text("x1 x2 x3 x4 x5")
    first = ingest_paths([tmp_path], whitespace_tokenizer, chunk_tokens=4, overlap_tokens=1)
    second = ingest_paths([tmp_path], whitespace_tokenizer, chunk_tokens=4, overlap_tokens=1)
    assert [d.id for d in first.documents] == [d.id for d in second.documents]
    assert [(d.id, d.text) for d in first.documents[:3]] == [
        ("long#0", "w1 w2 w3 w4"),
        ("long#1", "w4 w5 w6 w7"),
        (document_id(str(tmp_path / "b.txt"), "x1 x2 x3 x4"), "x1 x2 x3 x4"),
    ]
    assert [d.metadata["chunk"] for d in first.documents] == [0, 1, 0, 1]


def test_drop_duplicates_by_id_and_by_content():
    docs = [Document("a", "one"), Document("a", "two"), Document("b", " one "), Document("c", "three")]
    kept, num_duplicates = drop_duplicates(docs)
    assert [d.id for d in kept] == ["a", "c"]
    assert num_duplicates == 2
