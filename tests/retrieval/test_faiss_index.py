import numpy as np
import pytest

from ragspeed.retrieval.config import IndexConfig
from ragspeed.retrieval.errors import RetrievalError
from ragspeed.retrieval.faiss_index import (
    IndexPlan,
    VectorIndex,
    choose_device,
    choose_kind,
    choose_num_cells,
    plan_index,
)


def _unit_vectors(n, dim=16, seed=0):
    x = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ---- the choice logic ---------------------------------------------------------------------
def test_kind_is_chosen_by_size():
    config = IndexConfig(exact_max_vectors=1000)
    assert choose_kind(999, config) == "flat"
    assert choose_kind(1000, config) == "ivf"
    assert choose_kind(1000, IndexConfig(exact_max_vectors=1000, large_index_kind="hnsw")) == "hnsw"
    assert choose_kind(5, IndexConfig(kind="hnsw")) == "hnsw"


def test_ivf_cells_follow_sqrt_n_and_clamps():
    config = IndexConfig()
    assert choose_num_cells(1_000_000, config) == 1000
    assert choose_num_cells(10_000, config) == 100
    assert choose_num_cells(400, config) == 20  # ivf_min_cells 16 < sqrt(400)=20
    assert choose_num_cells(100, config) == 12  # at most n / 8 so k-means has points
    assert choose_num_cells(10**10, config) == 16_384


def test_device_choice():
    assert choose_device("auto", "flat", num_gpus=1) == "gpu"
    assert choose_device("auto", "ivf", num_gpus=2) == "gpu"
    assert choose_device("auto", "hnsw", num_gpus=1) == "cpu"  # faiss has no GPU HNSW
    assert choose_device("auto", "ivf", num_gpus=0) == "cpu"
    assert choose_device("cpu", "ivf", num_gpus=1) == "cpu"
    assert choose_device("gpu", "ivf", num_gpus=1) == "gpu"
    with pytest.raises(RetrievalError, match="needs faiss-gpu") as info:
        choose_device("gpu", "ivf", num_gpus=0)
    assert info.value.param == "device"
    with pytest.raises(RetrievalError, match="no GPU hnsw"):
        choose_device("gpu", "hnsw", num_gpus=1)


def test_plan_index():
    config = IndexConfig(exact_max_vectors=100)
    assert plan_index(50, config, num_gpus=0) == IndexPlan("flat", 0, "cpu")
    assert plan_index(10_000, config, num_gpus=0) == IndexPlan("ivf", 100, "cpu")
    assert plan_index(10_000, config, num_gpus=1) == IndexPlan("ivf", 100, "gpu")


def test_bad_config_is_named():
    with pytest.raises(RetrievalError) as info:
        IndexConfig(kind="annoy")
    assert info.value.param == "index_kind"
    with pytest.raises(RetrievalError) as info:
        IndexConfig(device="tpu")
    assert info.value.param == "device"


# ---- behaviour of each kind -----------------------------------------------------------------
@pytest.mark.parametrize("kind", ["flat", "ivf", "hnsw"])
def test_add_search_remove_roundtrip(kind):
    x = _unit_vectors(2000)
    index = VectorIndex(16, IndexConfig(kind=kind, device="cpu"))
    index.add(np.arange(100, 2100), x)
    assert index.kind == kind
    _, labels = index.search(x[:3], 1)
    assert labels[:, 0].tolist() == [100, 101, 102]
    assert index.remove(np.array([100, 101, 99_999])) == 2
    assert index.remove(np.array([100])) == 0
    assert index.num_vectors == 1998
    _, labels = index.search(x[:3], 3)
    assert 100 not in labels and 101 not in labels
    assert labels[2, 0] == 102

    state, data = index.to_state()
    loaded = VectorIndex.from_state(16, index.config, state, data)
    assert loaded.num_vectors == 1998
    assert loaded.kind == kind
    assert np.array_equal(loaded.search(x[:50], 5)[1], index.search(x[:50], 5)[1])
    loaded.add(np.array([5000]), x[:1])
    assert loaded.search(x[:1], 1)[1].tolist() == [[5000]]


def test_state_whose_kind_does_not_match_the_bytes_is_a_value_error():
    # The store reports ValueError as a corrupt collection; an AttributeError would escape it.
    index = VectorIndex(16, IndexConfig(kind="flat"))
    index.add(np.arange(10), _unit_vectors(10))
    state, data = index.to_state()
    with pytest.raises(ValueError, match="state says hnsw, but the index holds IndexFlatIP"):
        VectorIndex.from_state(16, index.config, {**state, "kind": "hnsw"}, data)


def test_auto_index_upgrades_to_ivf_when_it_grows():
    x = _unit_vectors(3000)
    index = VectorIndex(16, IndexConfig(exact_max_vectors=1000, ivf_nprobe=4))
    index.add(np.arange(500), x[:500])
    assert index.kind == "flat"
    index.remove(np.array([0]))
    index.add(np.arange(500, 3000), x[500:])
    assert (index.kind, index.num_vectors, index.plan.num_cells) == ("ivf", 2999, 55)  # round(sqrt(2999))
    assert index.nprobe >= 4  # calibration only raises it
    _, labels = index.search(x[1:2], 1)
    assert labels.tolist() == [[1]]


def test_empty_index_and_bad_input():
    index = VectorIndex(16)
    scores, labels = index.search(_unit_vectors(2), 5)
    assert scores.shape == (2, 0) and labels.shape == (2, 0)
    with pytest.raises(RetrievalError) as info:
        index.add(np.arange(2), np.zeros((2, 8), np.float32))
    assert info.value.param == "vectors"
    with pytest.raises(RetrievalError) as info:
        index.search(_unit_vectors(1), 0)
    assert info.value.param == "top_k"


def test_ivf_recall_on_clustered_data():
    from ragspeed.evals.retrieval import gaussian_mixture

    x = gaussian_mixture(20_000, 64, num_clusters=50, seed=3)
    q = gaussian_mixture(200, 64, num_clusters=50, seed=3, first=10**9)
    index = VectorIndex(64, IndexConfig(kind="ivf", ivf_nprobe=4))
    index.build(np.arange(20_000), x)
    exact = VectorIndex(64, IndexConfig(kind="flat"))
    exact.build(np.arange(20_000), x)
    found, truth = index.search(q, 10)[1], exact.search(q, 10)[1]
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(found.tolist(), truth.tolist())])
    assert recall >= 0.95


def test_hnsw_tombstones_are_compacted(monkeypatch):
    import ragspeed.retrieval.faiss_index as faiss_index

    monkeypatch.setattr(faiss_index, "TOMBSTONE_MIN_COMPACT", 5)
    x = _unit_vectors(100)
    index = VectorIndex(16, IndexConfig(kind="hnsw"))
    index.add(np.arange(100), x)
    assert index.remove(np.arange(5)) == 5
    assert (index.num_vectors, len(index._tombstones), index._index.ntotal) == (95, 5, 100)
    assert index.remove(np.arange(5, 11)) == 6  # 11 tombstones > 10% of 100: rebuilt
    assert (index.num_vectors, len(index._tombstones), index._index.ntotal) == (89, 0, 89)
    assert index.search(x[11:12], 1)[1].tolist() == [[11]]


def test_loaded_index_keeps_its_kind_on_add():
    x = _unit_vectors(300)
    built = VectorIndex(16, IndexConfig(kind="hnsw"))
    built.add(np.arange(200), x[:200])
    state, data = built.to_state()
    loaded = VectorIndex.from_state(16, IndexConfig(), state, data)  # an "auto" config now
    loaded.add(np.arange(200, 300), x[200:])
    assert (loaded.kind, loaded.num_vectors) == ("hnsw", 300)
