import json

from click.testing import CliRunner

from ragspeed.retrieval.cli import collection_stats, index_group, ingest_into_collection, query_collection
from ragspeed.retrieval.config import RetrievalConfig

runner = CliRunner()


def _corpus(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.md").write_text("# Nile\n\nThe Nile is a major river in northeastern Africa.")
    (corpus / "b.jsonl").write_text('{"id": "eiffel", "text": "The Eiffel Tower is in Paris."}\nnot json\n')
    return corpus


def test_index_build_command(tmp_path):
    corpus = _corpus(tmp_path)
    args = [
        "build",
        str(corpus),
        "--root",
        str(tmp_path / "store"),
        "-c",
        "kb",
        "--json",
        str(tmp_path / "b.json"),
    ]
    out = runner.invoke(index_group, args)
    assert out.exit_code == 0, out.output
    summary = json.loads((tmp_path / "b.json").read_text())
    assert (summary["num_added"], summary["num_skipped"], summary["num_documents"]) == (2, 1, 2)
    assert summary["skipped"] == [f"{corpus / 'b.jsonl'}:2: skipped, not JSON (Expecting value)"]
    assert "num_added       2" in out.output


def test_index_functions(tmp_path, embedder):
    corpus, root = _corpus(tmp_path), tmp_path / "store"
    config = RetrievalConfig()
    first = ingest_into_collection(
        [corpus], "kb", root, model=None, config=config, fresh=False, embedder=embedder
    )
    again = ingest_into_collection(
        [corpus], "kb", root, model=None, config=config, fresh=False, embedder=embedder
    )
    assert (first["num_added"], again["num_added"], again["num_duplicates"]) == (2, 0, 2)
    rebuilt = ingest_into_collection(
        [corpus / "a.md"], "kb", root, model=None, config=config, fresh=True, embedder=embedder
    )
    assert rebuilt["num_documents"] == 1
    ingest_into_collection([corpus], "kb", root, model=None, config=config, fresh=True, embedder=embedder)

    hits = query_collection(
        "Where is the Eiffel Tower?", "kb", root, top_k=1, mode="hybrid", model=None, embedder=embedder
    )
    assert [h["id"] for h in hits["hits"]] == ["eiffel"]
    stats = collection_stats(None, root, model=None, embedder=embedder)
    assert [(s["name"], s["num_documents"], s["index_kind"]) for s in stats["collections"]] == [
        ("kb", 2, "flat")
    ]
    assert stats["refused"] == {}
