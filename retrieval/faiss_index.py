"""Dense vector index over FAISS: plan (kind, cells, device), build, add, remove, search, serialise.

Vectors are L2-normalised, so the metric is inner product (= cosine similarity). Callers use
their own int64 *labels*, stable across removals: IVF stores them natively; flat and HNSW sit
inside an `IndexIDMap2`.

Kinds (see `config.IndexConfig`): `flat` is exact; `ivf` scans `nprobe` of `num_cells` k-means
cells (training on a seeded sample keeps the build cheap); `hnsw` walks a graph. An `auto`
index starts flat and is rebuilt as the large kind once it crosses `exact_max_vectors`. IVF
cells are planned at build time (about sqrt(n)); later adds go into the same cells.

IVF nprobe calibration: after a build, nprobe is doubled until recall@10 against exact search,
on a sample of perturbed indexed vectors, reaches `CALIBRATION_TARGET_RECALL`; so data whose
clusters do not match the cells gets a wider scan instead of silently lower recall.

Removal: flat and IVF remove vectors in place. HNSW cannot, so a removed label becomes a
*tombstone*: searches fetch extra results and drop tombstoned labels.

GPU: when faiss has GPU support and a CUDA device is visible (and the config allows it), a GPU
copy of a flat or IVF index serves searches; the CPU index stays the one that is mutated and
persisted, and the GPU copy is refreshed lazily after a mutation. FAISS has no GPU HNSW.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import faiss
import numpy as np

from ragspeed.retrieval.config import IndexConfig
from ragspeed.retrieval.errors import RetrievalError

GPU_KINDS = frozenset({"flat", "ivf"})
# Recall@10 that IVF calibration aims for on a sample of the indexed vectors.
CALIBRATION_TARGET_RECALL = 0.97
CALIBRATION_QUERIES = 256
# An HNSW index is rebuilt without its tombstones once they exceed this share (and count).
TOMBSTONE_MAX_FRACTION = 0.1
TOMBSTONE_MIN_COMPACT = 1000


@dataclass(frozen=True)
class IndexPlan:
    kind: str  # "flat" | "ivf" | "hnsw"
    num_cells: int  # IVF cells; 0 for other kinds
    device: str  # "cpu" | "gpu"


def choose_kind(num_vectors: int, config: IndexConfig) -> str:
    if config.kind != "auto":
        return config.kind
    return "flat" if num_vectors < config.exact_max_vectors else config.large_index_kind


def choose_num_cells(num_vectors: int, config: IndexConfig) -> int:
    cells = round(config.ivf_cells_per_sqrt_n * math.sqrt(max(num_vectors, 1)))
    cells = max(config.ivf_min_cells, min(config.ivf_max_cells, cells))
    # k-means needs points to cluster: never more cells than vectors / 8 (at least 1).
    return max(1, min(cells, num_vectors // 8))


def gpu_count() -> int:
    """CUDA devices faiss can use: 0 for faiss-cpu builds or without a device."""
    if not hasattr(faiss, "StandardGpuResources"):
        return 0
    try:
        return int(faiss.get_num_gpus())
    except RuntimeError:
        return 0


def choose_device(requested: str, kind: str, num_gpus: int) -> str:
    if requested == "cpu":
        return "cpu"
    if requested == "gpu":
        if num_gpus == 0:
            raise RetrievalError(
                "device 'gpu' needs faiss-gpu and a visible CUDA device; found none", "device"
            )
        if kind not in GPU_KINDS:
            raise RetrievalError(f"faiss has no GPU {kind} index; use flat or ivf on the GPU", "device")
        return "gpu"
    return "gpu" if num_gpus > 0 and kind in GPU_KINDS else "cpu"


def plan_index(num_vectors: int, config: IndexConfig, num_gpus: int | None = None) -> IndexPlan:
    kind = choose_kind(num_vectors, config)
    num_cells = choose_num_cells(num_vectors, config) if kind == "ivf" else 0
    device = choose_device(config.device, kind, gpu_count() if num_gpus is None else num_gpus)
    return IndexPlan(kind=kind, num_cells=num_cells, device=device)


def _build_flat(plan: IndexPlan, dim: int, vectors: np.ndarray, config: IndexConfig) -> faiss.Index:
    return faiss.IndexFlatIP(dim)


def _build_ivf(plan: IndexPlan, dim: int, vectors: np.ndarray, config: IndexConfig) -> faiss.Index:
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFFlat(quantizer, dim, plan.num_cells, faiss.METRIC_INNER_PRODUCT)
    index.own_fields = True
    # The IVF index frees its quantizer. SWIG's `this` is not in faiss's stubs.
    quantizer.this.disown()  # type: ignore[attr-defined]
    index.cp.niter = config.ivf_kmeans_iterations
    index.cp.spherical = True  # unit-norm centroids suit cosine similarity
    index.cp.seed = config.seed
    num_train = min(len(vectors), plan.num_cells * config.ivf_train_points_per_cell)
    index.cp.max_points_per_centroid = max(1, -(-num_train // plan.num_cells))
    rng = np.random.default_rng(config.seed)
    if num_train < len(vectors):
        vectors = vectors[np.sort(rng.choice(len(vectors), num_train, replace=False))]
    index.train(np.ascontiguousarray(vectors))  # [num_train, dim]
    index.nprobe = min(config.ivf_nprobe, plan.num_cells)
    return index


def _build_hnsw(plan: IndexPlan, dim: int, vectors: np.ndarray, config: IndexConfig) -> faiss.Index:
    index = faiss.IndexHNSWFlat(dim, config.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = config.hnsw_ef_construction
    index.hnsw.efSearch = config.hnsw_ef_search
    return index


INDEX_BUILDERS: dict[str, Callable[[IndexPlan, int, np.ndarray, IndexConfig], faiss.Index]] = {
    "flat": _build_flat,
    "ivf": _build_ivf,
    "hnsw": _build_hnsw,
}


def _check_vectors(vectors: np.ndarray, dim: int) -> np.ndarray:
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or vectors.shape[1] != dim:
        raise RetrievalError(f"vectors must have shape [n, {dim}], got {list(vectors.shape)}", "vectors")
    return vectors


class VectorIndex:
    """Labels -> vectors. IVF stores labels natively (and removes in place); flat and HNSW
    sit inside an `IndexIDMap2`, which maps their positions to labels."""

    def __init__(self, dim: int, config: IndexConfig | None = None) -> None:
        if dim < 1:
            raise RetrievalError(f"dim must be >= 1, got {dim}", "dim")
        self.dim = dim
        self.config = config or IndexConfig()
        self.plan: IndexPlan | None = None
        self._index: faiss.IndexIVF | faiss.IndexIDMap2 | None = None  # what is searched and persisted
        self._base: faiss.Index | None = None  # the flat / IVF / HNSW index, for its parameters
        self._tombstones: set[int] = set()
        self._gpu_index: faiss.Index | None = None  # search copy of self._base
        self._gpu_labels: np.ndarray | None = None  # [ntotal] position -> label, flat only
        self._gpu_resources: faiss.StandardGpuResources | None = None
        self._owner: faiss.Index | None = None  # keeps a deserialised index alive

    # ---- size and kind ----------------------------------------------------------------
    @property
    def num_vectors(self) -> int:
        """Live vectors: stored minus tombstoned."""
        return 0 if self._index is None else self._index.ntotal - len(self._tombstones)

    @property
    def kind(self) -> str:
        return "empty" if self.plan is None else self.plan.kind

    @property
    def device(self) -> str:
        return "cpu" if self.plan is None else self.plan.device

    @property
    def nprobe(self) -> int:
        return int(self._base.nprobe) if isinstance(self._base, faiss.IndexIVF) else 0

    def _wrap(self, base: faiss.Index) -> faiss.IndexIVF | faiss.IndexIDMap2:
        """Set `base` as the index and return what holds its labels (itself, or an id map)."""
        self._base = base
        if isinstance(base, faiss.IndexIVF):
            # A hash table from label to list position: reconstruct and remove by label.
            # faiss's stubs lack DirectMap.
            base.set_direct_map_type(faiss.DirectMap.Hashtable)  # type: ignore[attr-defined]
            self._index = base
        else:
            self._index = faiss.IndexIDMap2(base)
        return self._index

    # ---- mutation ---------------------------------------------------------------------
    def build(self, labels: np.ndarray, vectors: np.ndarray, *, calibrate: bool = True) -> None:
        """Replace the index with one planned for `len(vectors)` vectors."""
        vectors = _check_vectors(vectors, self.dim)
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        plan = plan_index(len(vectors), self.config)
        index = self._wrap(INDEX_BUILDERS[plan.kind](plan, self.dim, vectors, self.config))
        index.add_with_ids(vectors, labels)
        self.plan, self._tombstones = plan, set()
        if calibrate and isinstance(index, faiss.IndexIVF):
            calibrate_nprobe(index, labels, vectors, self.config.seed)
        self._invalidate_gpu()

    def add(self, labels: np.ndarray, vectors: np.ndarray) -> None:
        vectors = _check_vectors(vectors, self.dim)
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        if len(labels) != len(vectors):
            raise RetrievalError(f"{len(labels)} labels for {len(vectors)} vectors", "labels")
        if len(vectors) == 0:
            return
        total = self.num_vectors + len(vectors)
        outgrew_flat = (
            self.plan is not None and self.plan.kind == "flat" and choose_kind(total, self.config) != "flat"
        )
        if self._index is None or outgrew_flat:
            # First add, or a flat index outgrew exact search: rebuild with everything. A
            # loaded IVF or HNSW index keeps its kind whatever this process's config says.
            old_labels, old_vectors = self._live_contents()
            self.build(np.concatenate([old_labels, labels]), np.concatenate([old_vectors, vectors]))
            return
        self._index.add_with_ids(vectors, labels)
        self._invalidate_gpu()

    def remove(self, labels: np.ndarray) -> int:
        if self._index is None or len(labels) == 0:
            return 0
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        if self.kind == "hnsw":  # no in-place removal in HNSW graphs
            present = (set(labels.tolist()) & set(self.labels().tolist())) - self._tombstones
            self._tombstones |= present
            if len(self._tombstones) > max(
                TOMBSTONE_MIN_COMPACT, TOMBSTONE_MAX_FRACTION * self._index.ntotal
            ):
                # Searches over-fetch by the tombstone count: compact before that costs more
                # than a rebuild.
                self.build(*self._live_contents())
            return len(present)
        selector: faiss.IDSelector
        if isinstance(self._index, faiss.IndexIVF):
            # The label hash table (direct map) only takes an explicit array of labels.
            selector = faiss.IDSelectorArray(len(labels), faiss.swig_ptr(labels))
        else:
            selector = faiss.IDSelectorBatch(labels)
        removed = int(self._index.remove_ids(selector))
        self._invalidate_gpu()
        return removed

    def labels(self) -> np.ndarray:
        """Every stored label (tombstoned ones included), in storage order."""
        if self._index is None:
            return np.zeros(0, np.int64)
        if isinstance(self._index, faiss.IndexIVF):
            invlists = self._index.invlists
            assert invlists is not None  # an IVF index owns its inverted lists
            parts = [
                faiss.rev_swig_ptr(invlists.get_ids(cell), invlists.list_size(cell)).copy()
                for cell in range(self._index.nlist)
                if invlists.list_size(cell) > 0
            ]
            return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        return faiss.vector_to_array(self._index.id_map).astype(np.int64)

    def _live_contents(self) -> tuple[np.ndarray, np.ndarray]:
        if self._index is None or self._index.ntotal == 0:
            return np.zeros(0, np.int64), np.zeros((0, self.dim), np.float32)
        labels = np.array([x for x in self.labels().tolist() if x not in self._tombstones], dtype=np.int64)
        vectors = self._index.reconstruct_batch(labels)  # [num_live, dim]
        return labels, vectors

    # ---- search -----------------------------------------------------------------------
    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, labels), each [num_queries, <=k], best first; a slot with no result has
        label -1 (callers skip it)."""
        queries = _check_vectors(queries, self.dim)
        if k < 1:
            raise RetrievalError(f"k must be >= 1, got {k}", "top_k")
        if self._index is None or self.num_vectors == 0:
            empty = np.zeros((len(queries), 0))
            return empty.astype(np.float32), empty.astype(np.int64)
        fetch = min(k + len(self._tombstones), self._index.ntotal)
        if self.device == "gpu":
            scores, labels = self._gpu_search(queries, fetch)
        else:
            scores, labels = self._index.search(queries, fetch)
        if self._tombstones:
            scores, labels = self._drop_tombstones(scores, labels, k)
        return scores[:, :k], labels[:, :k]

    def _drop_tombstones(
        self, scores: np.ndarray, labels: np.ndarray, k: int
    ) -> tuple[np.ndarray, np.ndarray]:
        out_scores = np.full((len(labels), k), -np.inf, dtype=np.float32)
        out_labels = np.full((len(labels), k), -1, dtype=np.int64)
        for row in range(len(labels)):
            row_labels = labels[row].tolist()
            keep = [j for j, label in enumerate(row_labels) if label >= 0 and label not in self._tombstones][
                :k
            ]
            out_scores[row, : len(keep)] = scores[row, keep]
            out_labels[row, : len(keep)] = labels[row, keep]
        return out_scores, out_labels

    def _invalidate_gpu(self) -> None:
        self._gpu_index, self._gpu_labels = None, None

    def _gpu_search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self._gpu_index is None:
            assert self._base is not None  # searches of an empty index return before this
            if self._gpu_resources is None:
                self._gpu_resources = faiss.StandardGpuResources()
            self._gpu_index = faiss.index_cpu_to_gpu(self._gpu_resources, 0, self._base)
            if isinstance(self._index, faiss.IndexIDMap2):
                # A GPU flat index returns positions; id_map turns them into labels.
                self._gpu_labels = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        scores, found = self._gpu_index.search(queries, k)
        if self._gpu_labels is None:
            return scores, found
        return scores, np.where(found >= 0, self._gpu_labels[np.maximum(found, 0)], -1)

    # ---- persistence ------------------------------------------------------------------
    def to_state(self) -> tuple[dict, bytes]:
        """(JSON-able description, faiss bytes); bytes are empty for an empty index."""
        if self._index is None or self.plan is None:
            return {"kind": "empty"}, b""
        data = faiss.serialize_index(self._index).tobytes()
        state = {
            "kind": self.plan.kind,
            "num_cells": self.plan.num_cells,
            "nprobe": self.nprobe,
            "tombstones": sorted(self._tombstones),
        }
        return state, data

    @classmethod
    def from_state(cls, dim: int, config: IndexConfig, state: dict, data: bytes) -> VectorIndex:
        """Inverse of `to_state`; raises RuntimeError or ValueError on bytes faiss rejects."""
        index = cls(dim, config)
        kind = state["kind"]
        if kind == "empty":
            return index
        raw = faiss.deserialize_index(np.frombuffer(data, dtype=np.uint8))
        loaded = faiss.downcast_index(raw)  # a typed view; `raw` owns the memory
        index._owner = raw
        if loaded.d != dim:
            raise ValueError(f"index has dim {loaded.d}, expected {dim}")
        if isinstance(loaded, faiss.IndexIVF):
            index._base = index._index = loaded
            loaded.nprobe = int(state["nprobe"])
        elif isinstance(loaded, faiss.IndexIDMap2):
            base = faiss.downcast_index(loaded.index)
            if kind == "hnsw":
                if not isinstance(base, faiss.IndexHNSW):
                    raise ValueError(f"state says hnsw, but the index holds {type(base).__name__}")
                base.hnsw.efSearch = config.hnsw_ef_search
            index._index, index._base = loaded, base
        else:
            raise ValueError(f"unexpected faiss index type {type(loaded).__name__}")
        index.plan = IndexPlan(kind, int(state["num_cells"]), choose_device(config.device, kind, gpu_count()))
        index._tombstones = set(state["tombstones"])
        return index


def calibrate_nprobe(index: faiss.IndexIVF, labels: np.ndarray, vectors: np.ndarray, seed: int) -> int:
    """Raise `index.nprobe` (doubling) until recall@10 on a sample reaches the target.

    Queries are indexed vectors plus noise, so they sit where real queries do (inside the
    data's clusters, not on a stored point); the truth is exact search over `vectors`.
    Never lowers the configured nprobe. Returns the nprobe chosen.
    """
    rng = np.random.default_rng(seed + 1)
    num_queries = min(CALIBRATION_QUERIES, len(vectors))
    queries = vectors[rng.choice(len(vectors), num_queries, replace=False)].copy()  # [q, dim]
    queries += rng.normal(0.0, 0.5 / math.sqrt(vectors.shape[1]), queries.shape).astype(np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    k = min(10, len(vectors))
    _, truth_positions = faiss.knn(queries, vectors, k, metric=faiss.METRIC_INNER_PRODUCT)
    truth = labels[truth_positions]  # [q, k]
    while True:
        _, found = index.search(queries, k)
        recall = np.mean([len(set(t) & set(f)) / k for t, f in zip(truth.tolist(), found.tolist())])
        if recall >= CALIBRATION_TARGET_RECALL or index.nprobe >= index.nlist:
            return int(index.nprobe)
        index.nprobe = min(index.nlist, index.nprobe * 2)
