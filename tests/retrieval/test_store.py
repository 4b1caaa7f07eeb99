import pytest

from ragspeed.document import Document
from ragspeed.retrieval.config import IndexConfig, RetrievalConfig
from ragspeed.retrieval.errors import CollectionNotFound, CorruptCollectionError, RetrievalError
from ragspeed.retrieval.store import CollectionStore

DOCS = [
    Document("eiffel", "The Eiffel Tower is a wrought-iron tower in Paris, France.", "Eiffel Tower"),
    Document("nile", "The Nile is a major river in northeastern Africa.", "Nile"),
    Document("cat", "Cats purr when they are content.", "Cat"),
]


@pytest.fixture
def store(tmp_path, embedder):
    return CollectionStore(tmp_path, embedder)


def test_collections_lifecycle(store, tmp_path):
    assert store.list() == []
    stats = store.create("kb")
    assert (stats.name, stats.num_documents, stats.dim, stats.index_kind) == ("kb", 0, 384, "empty")
    assert store.query("kb", "anything") == []  # an empty collection: no hits, no error
    assert (tmp_path / "kb.ragcoll").is_file()
    with pytest.raises(RetrievalError, match="already exists"):
        store.create("kb")
    assert store.create("kb", exist_ok=True).name == "kb"
    store.delete("kb")
    assert store.list() == []
    assert not (tmp_path / "kb.ragcoll").exists()


def test_unknown_collection_is_not_found(store):
    for call in (
        lambda: store.get("nope"),
        lambda: store.query("nope", "q"),
        lambda: store.add_documents("nope", DOCS),
        lambda: store.delete_ids("nope", ["a"]),
        lambda: store.stats("nope"),
        lambda: store.delete("nope"),
    ):
        with pytest.raises(CollectionNotFound, match="collection 'nope' not found"):
            call()


@pytest.mark.parametrize("name", ["", "../etc", "a/b", "-x", "x" * 65, "a..b"])
def test_bad_names_are_refused(store, name):
    with pytest.raises(RetrievalError) as info:
        store.create(name)
    assert info.value.param == "collection"


def test_add_query_delete_and_reload(store, tmp_path, embedder):
    store.create("kb")
    result = store.add_documents("kb", DOCS + [Document("dup", "Cats  purr when they are content.")])
    assert (result.num_added, result.num_duplicates, result.ids) == (3, 1, ("eiffel", "nile", "cat"))
    assert store.add_documents("kb", DOCS[:1]).num_added == 0
    for mode in ("dense", "bm25", "hybrid"):
        hits = store.query("kb", "Which river flows through Africa?", top_k=2, mode=mode)
        assert hits[0].document.id == "nile", mode
        assert hits[0].rank == 1
    assert [h.document.id for h in store.query("kb", "Where is the Eiffel Tower?", top_k=1)] == ["eiffel"]
    assert len(store.query("kb", "tower", top_k=10, mode="dense")) == 3
    assert store.delete_ids("kb", ["nile", "missing"]) == 1
    assert "nile" not in [h.document.id for h in store.query("kb", "river in Africa", top_k=3, mode="dense")]

    reloaded = CollectionStore(tmp_path, embedder)
    assert [s.num_documents for s in reloaded.list()] == [2]
    hits = reloaded.query("kb", "purring cats", top_k=1)
    assert (hits[0].document.id, hits[0].document.title) == ("cat", "Cat")


def test_long_documents_are_chunked_with_derived_ids(tmp_path, embedder):
    store = CollectionStore(tmp_path, embedder, RetrievalConfig(chunk_tokens=8, chunk_overlap_tokens=2))
    store.create("kb")
    result = store.add_documents(
        "kb", [Document("long", "one two three four five six seven eight nine ten eleven twelve")]
    )
    assert result.ids == ("long#0", "long#1")
    anonymous = store.add_documents("kb", [Document("", "a short note")])
    assert len(anonymous.ids[0]) == 16  # content-hash id


def test_unchunked_documents_without_ids_get_content_hash_ids(store):
    store.create("kb")
    result = store.add_documents("kb", [Document("", "cats purr"), Document("", "dogs bark")], chunk=False)
    assert result.num_added == 2 and len(set(result.ids)) == 2
    assert all(len(i) == 16 for i in result.ids)
    again = store.add_documents("kb", [Document("", "cats purr")], chunk=False)
    assert (again.num_added, again.num_duplicates) == (0, 1)  # the same text, the same id


def test_bad_queries_are_named(store):
    store.create("kb")
    store.add_documents("kb", DOCS)
    cases = [
        ({"text": "  "}, "query"),
        ({"text": "q", "top_k": 0}, "top_k"),
        ({"text": "q", "mode": "fuzzy"}, "mode"),
    ]
    for kwargs, param in cases:
        with pytest.raises(RetrievalError) as info:
            store.query("kb", **kwargs)
        assert info.value.param == param
    with pytest.raises(RetrievalError) as info:
        store.add_documents("kb", [Document("x", " ")])
    assert info.value.param == "documents[0].text"
    with pytest.raises(RetrievalError) as info:
        store.add_documents("kb", [Document("x", "text", metadata={"when": object()})])
    assert info.value.param == "documents[0].metadata"


def test_corrupt_collection_is_refused_at_load(tmp_path, embedder):
    store = CollectionStore(tmp_path, embedder)
    store.create("good")
    store.create("bad")
    store.add_documents("bad", DOCS)
    path = tmp_path / "bad.ragcoll"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    reloaded = CollectionStore(tmp_path, embedder)
    assert [s.name for s in reloaded.list()] == ["good"]
    assert list(reloaded.refused()) == ["bad"]
    with pytest.raises(CorruptCollectionError, match="checksum mismatch"):
        reloaded.query("bad", "Eiffel")
    reloaded.delete("bad")  # a refused collection can be deleted and rebuilt
    reloaded.create("bad")


def test_ivf_collection_persists(tmp_path, embedder):
    config = RetrievalConfig(index=IndexConfig(kind="ivf", ivf_min_cells=1))
    store = CollectionStore(tmp_path, embedder, config)
    store.create("kb")
    store.add_documents(
        "kb", [Document(f"d{i}", f"Document number {i} about topic {i % 7}.") for i in range(40)]
    )
    assert store.stats("kb").index_kind == "ivf"
    store.delete_ids("kb", ["d0"])
    reloaded = CollectionStore(tmp_path, embedder, config)
    assert reloaded.stats("kb").num_documents == 39
    assert (
        reloaded.query("kb", "Document number 5 about topic 5", top_k=1, mode="dense")[0].document.id == "d5"
    )
