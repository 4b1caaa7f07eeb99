"""The one frozen config of the retrieval package, built at the edge (CLI, gateway settings).

Index kinds: `flat` is exact inner-product search (brute force); `ivf` is an inverted file
(k-means cells, `nprobe` of them scanned per query); `hnsw` is a navigable small-world graph.
`auto` picks flat below `exact_max_vectors` and `large_index_kind` at or above it.
"""

from __future__ import annotations

from dataclasses import dataclass

from ragspeed.retrieval.errors import RetrievalError

INDEX_KINDS = ("auto", "flat", "ivf", "hnsw")
QUERY_MODES = ("dense", "bm25", "hybrid")


@dataclass(frozen=True)
class IndexConfig:
    kind: str = "auto"
    # Exact search of 100k 384-d vectors reads about 150 MB per query (~8 ms at 21 GB/s):
    # below this size exact search is fast enough and has perfect recall.
    exact_max_vectors: int = 100_000
    large_index_kind: str = "ivf"
    # IVF: cells = ivf_cells_per_sqrt_n * sqrt(n), clamped; trained on a sample of
    # `ivf_train_points_per_cell` points per cell (k-means cost grows with the sample).
    ivf_cells_per_sqrt_n: float = 1.0
    ivf_min_cells: int = 16
    ivf_max_cells: int = 16_384
    ivf_train_points_per_cell: int = 64
    ivf_nprobe: int = 32
    ivf_kmeans_iterations: int = 10
    hnsw_m: int = 32
    hnsw_ef_construction: int = 80
    hnsw_ef_search: int = 128
    # "auto": a GPU copy for search when faiss has GPU support and a CUDA device is visible.
    device: str = "auto"  # "auto" | "cpu" | "gpu"
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise RetrievalError(f"index kind must be one of {INDEX_KINDS}, got {self.kind!r}", "index_kind")
        if self.large_index_kind not in ("ivf", "hnsw", "flat"):
            raise RetrievalError(
                f"large_index_kind must be ivf, hnsw or flat, got {self.large_index_kind!r}",
                "large_index_kind",
            )
        if self.device not in ("auto", "cpu", "gpu"):
            raise RetrievalError(f"device must be auto, cpu or gpu, got {self.device!r}", "device")
        for name in ("exact_max_vectors", "ivf_nprobe", "hnsw_m", "hnsw_ef_search", "ivf_min_cells"):
            if getattr(self, name) < 1:
                raise RetrievalError(f"{name} must be >= 1, got {getattr(self, name)}", name)


@dataclass(frozen=True)
class RetrievalConfig:
    # Chunks stay under MiniLM's 256-token window (254 after [CLS]/[SEP]) with room to spare.
    chunk_tokens: int = 200
    chunk_overlap_tokens: int = 40
    embed_batch_size: int = 64
    # A progress bar appears when one call embeds at least this many texts.
    progress_min_texts: int = 512
    # Weighted reciprocal rank fusion: score(d) = sum_m w_m / (rrf_k + rank_m(d)), rank from 1.
    # k = 60 (Cormack et al. 2009) was set for fusing many TREC runs 1,000 deep; with two
    # rankers and a top-k of 5-20, a small k keeps a first place decisive (fusion studies,
    # e.g. Bruch et al. 2023, find RRF sensitive to k and better with small k). The dense
    # ranker, a retriever trained on question-passage pairs, outweighs unsupervised BM25 3:1
    # (the 0.75 vector share of common hybrid-search defaults); BM25 still rescues exact-term
    # matches. Checked on nq_dev (dense-favoured) and hotpot_dev100 (BM25 >= dense): the fused
    # recall@5 is at least the better single ranker's on both; equal weights with k = 60 fall
    # 2 points below dense on nq_dev.
    rrf_k: int = 10
    dense_weight: float = 3.0
    bm25_weight: float = 1.0
    # Each ranker contributes this many candidates (times top_k, at least `fusion_min_depth`).
    fusion_depth_factor: int = 4
    fusion_min_depth: int = 50
    default_mode: str = "hybrid"
    index: IndexConfig = IndexConfig()

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise RetrievalError(f"chunk_tokens must be >= 1, got {self.chunk_tokens}", "chunk_tokens")
        if not 0 <= self.chunk_overlap_tokens < self.chunk_tokens:
            raise RetrievalError(
                f"chunk_overlap_tokens must be in [0, chunk_tokens), got {self.chunk_overlap_tokens}",
                "chunk_overlap_tokens",
            )
        if self.embed_batch_size < 1:
            raise RetrievalError(
                f"embed_batch_size must be >= 1, got {self.embed_batch_size}", "embed_batch_size"
            )
        if self.rrf_k < 0:
            raise RetrievalError(f"rrf_k must be >= 0, got {self.rrf_k}", "rrf_k")
        if self.dense_weight < 0 or self.bm25_weight < 0 or self.dense_weight + self.bm25_weight == 0:
            raise RetrievalError("dense_weight and bm25_weight must be >= 0, not both 0", "dense_weight")
        if self.default_mode not in QUERY_MODES:
            raise RetrievalError(f"mode must be one of {QUERY_MODES}, got {self.default_mode!r}", "mode")
