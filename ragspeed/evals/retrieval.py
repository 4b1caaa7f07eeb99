"""`ragspeed eval retrieval`: recall and latency on NQ passages, and a synthetic scale run.

Quality: one collection of the distinct passages of `nq_dev.jsonl` (optionally plus extra
distractor passages); each question's gold passage should be retrieved. recall@k is the
fraction of questions whose gold passage is among the first k hits, for dense, BM25 and hybrid.
Query latency is end to end (embedding the question included) for one question at a time.

Scale: n synthetic 384-d unit vectors from a seeded Gaussian mixture (clustered, as real
embeddings are), indexed by the large-collection index; build time, resident memory added,
query p50/p99 for one query at a time (embedding excluded), and recall@10 against exact search.
Exact (flat) search runs on the same queries side by side, for the speed ratio.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ragspeed.document import Document
from ragspeed.retrieval.collection import Collection
from ragspeed.retrieval.config import IndexConfig, RetrievalConfig
from ragspeed.retrieval.documents import content_key, document_id
from ragspeed.retrieval.embedders import Embedder
from ragspeed.retrieval.errors import RetrievalError

RECALL_KS = (1, 5, 20)
MODES = ("dense", "bm25", "hybrid")
EMBED_TIMED_QUESTIONS = 50


def load_nq(path: Path) -> tuple[list[Document], list[tuple[str, str]]]:
    """(distinct passages as documents, [(question, gold document id)]). Passages whose texts
    differ only in white space are one document (the collection would drop the second)."""
    documents: dict[str, Document] = {}  # content key -> document
    questions = []
    with open(path, encoding="utf-8") as lines:
        for line_number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RetrievalError(f"{path}:{line_number}: not JSON ({exc.msg})", "data") from exc
            gold_id = None
            for passage in record["documents"]:
                doc = documents.setdefault(
                    content_key(passage["text"]),
                    Document(
                        id=document_id(passage["title"], passage["text"]),
                        text=passage["text"],
                        title=passage["title"],
                    ),
                )
                if passage.get("is_gold"):
                    gold_id = doc.id
            if gold_id is not None:
                questions.append((record["question"], gold_id))
    return list(documents.values()), questions


def load_lines(path: Path) -> list[Document]:
    texts = [line.strip() for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Document(id=document_id(str(path), text), text=text) for text in texts]


def _percentile_ms(seconds: list[float], q: float) -> float:
    return float(np.percentile(np.array(seconds) * 1e3, q))


def evaluate_quality(
    data_path: Path, embedder: Embedder, config: RetrievalConfig, distractors_path: Path | None = None
) -> dict[str, Any]:
    passages, questions = load_nq(Path(data_path))
    distractors = load_lines(distractors_path) if distractors_path else []
    collection = Collection("eval", embedder, config)
    start = time.perf_counter()
    texts = [f"{d.title}\n{d.text}" if d.title else d.text for d in passages + distractors]
    vectors = embedder.embed(texts)  # [num_docs, dim]
    embed_s = time.perf_counter() - start
    added = collection.add(passages + distractors, vectors)
    collection.bm25.search("warm up", 1)  # builds the lazily built BM25 index
    build_s = time.perf_counter() - start

    for mode in MODES:  # warm-up: first calls pay one-off costs
        collection.query(questions[0][0], max(RECALL_KS), mode)
    max_k = max(RECALL_KS)
    ranks: dict[str, list[int | None]] = {mode: [] for mode in MODES}
    latencies: dict[str, list[float]] = {mode: [] for mode in MODES}
    for question, gold_id in questions:
        for mode in MODES:
            t0 = time.perf_counter()
            hits = collection.query(question, max_k, mode)
            latencies[mode].append(time.perf_counter() - t0)
            ids = [hit.document.id for hit in hits]
            ranks[mode].append(ids.index(gold_id) + 1 if gold_id in ids else None)

    # The share of dense/hybrid latency that is embedding the question (the rest is search).
    embed_latencies = []
    for question, _ in questions[:EMBED_TIMED_QUESTIONS]:
        t0 = time.perf_counter()
        embedder.embed([question])
        embed_latencies.append(time.perf_counter() - t0)

    result: dict[str, Any] = {
        "num_passages": len(passages),
        "num_distractors": added.num_added - len(passages),
        "num_documents": len(collection),
        "num_questions": len(questions),
        "embedder": embedder.name,
        "index_kind": collection.vectors.kind,
        "rrf_k": config.rrf_k,
        "rrf_weights_dense_bm25": [config.dense_weight, config.bm25_weight],
        "embed_time_s": round(embed_s, 3),
        "build_time_s": round(build_s, 3),
    }
    for mode in MODES:
        for k in RECALL_KS:
            found = sum(1 for rank in ranks[mode] if rank is not None and rank <= k)
            result[f"recall_at_{k}_{mode}"] = round(found / len(questions), 4)
    for mode in MODES:
        result[f"query_p50_ms_{mode}"] = round(_percentile_ms(latencies[mode], 50), 3)
        result[f"query_p99_ms_{mode}"] = round(_percentile_ms(latencies[mode], 99), 3)
    result["query_embed_p50_ms"] = round(_percentile_ms(embed_latencies, 50), 3)
    result["query_embed_p99_ms"] = round(_percentile_ms(embed_latencies, 99), 3)
    result["hybrid_beats_best_single_at_5"] = result["recall_at_5_hybrid"] >= max(
        result["recall_at_5_dense"], result["recall_at_5_bm25"]
    )
    return result


# ---- scale run --------------------------------------------------------------------------
def gaussian_mixture(
    num_vectors: int, dim: int, num_clusters: int, seed: int, spread: float = 1.0, first: int = 0
) -> np.ndarray:
    """Rows `first .. first+num_vectors` of an endless seeded mixture: unit vectors, each a
    random cluster centre plus isotropic noise of norm ~`spread`, normalised. With spread 1 a
    point has cosine ~0.7 to its centre and ~0.5 to its cluster-mates, ~0 to other clusters.
    Generated in blocks so memory stays at the output size."""
    centres = np.random.default_rng(seed).standard_normal((num_clusters, dim), dtype=np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)  # [num_clusters, dim]
    out = np.empty((num_vectors, dim), dtype=np.float32)
    block = 65_536
    for start in range(0, num_vectors, block):
        rows = min(block, num_vectors - start)
        rng = np.random.default_rng([seed, first + start])
        assign = rng.integers(0, num_clusters, rows)
        noise = rng.standard_normal((rows, dim), dtype=np.float32) * (spread / math.sqrt(dim))
        chunk = centres[assign] + noise
        chunk /= np.linalg.norm(chunk, axis=1, keepdims=True)
        out[start : start + rows] = chunk
    return out


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        import os

        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _time_single_queries(
    search: Callable[[np.ndarray], Any], queries: np.ndarray, warmup: int = 20
) -> list[float]:
    for row in range(min(warmup, len(queries))):
        search(queries[row : row + 1])
    times = []
    for row in range(len(queries)):
        t0 = time.perf_counter()
        search(queries[row : row + 1])
        times.append(time.perf_counter() - t0)
    return times


def _exact_query_times(vectors: np.ndarray, queries: np.ndarray, k: int) -> list[float]:
    """The contender's single-query times: brute force over the same vectors."""
    import faiss

    exact = faiss.IndexFlatIP(vectors.shape[1])
    exact.add(vectors)
    times = _time_single_queries(lambda q: exact.search(q, k), queries, warmup=2)
    exact.reset()  # frees its copy of the vectors
    return times


def evaluate_scale(
    num_vectors: int,
    index_config: IndexConfig,
    *,
    dim: int = 384,
    num_clusters: int = 4096,
    num_queries: int = 1000,
    num_exact_timed: int = 50,
    seed: int = 0,
) -> dict[str, Any]:
    import faiss

    from ragspeed.retrieval.faiss_index import VectorIndex

    if num_vectors < 100:
        raise RetrievalError(f"scale size must be >= 100 vectors, got {num_vectors}", "scale_n")
    t0 = time.perf_counter()
    vectors = gaussian_mixture(num_vectors, dim, num_clusters, seed)  # [n, dim]
    queries = gaussian_mixture(num_queries, dim, num_clusters, seed, first=num_vectors + 1_000_000_000)
    generate_s = time.perf_counter() - t0

    k = 10
    t0 = time.perf_counter()
    _, truth = faiss.knn(queries, vectors, k, metric=faiss.METRIC_INNER_PRODUCT)  # [q, k] positions
    truth_s = time.perf_counter() - t0

    gc.collect()
    rss_before = _rss_bytes()
    index = VectorIndex(dim, index_config)
    t0 = time.perf_counter()
    index.build(np.arange(num_vectors, dtype=np.int64), vectors)
    build_s = time.perf_counter() - t0
    memory_bytes = _rss_bytes() - rss_before

    times = _time_single_queries(lambda q: index.search(q, k), queries)
    _, found = index.search(queries, k)
    recall = float(np.mean([len(set(t) & set(f)) / k for t, f in zip(truth.tolist(), found.tolist())]))

    exact_times = _exact_query_times(vectors, queries[:num_exact_timed], k)
    p50 = _percentile_ms(times, 50)
    exact_p50 = _percentile_ms(exact_times, 50)
    return {
        "scale_n": num_vectors,
        "scale_dim": dim,
        "scale_num_clusters": num_clusters,
        "scale_num_queries": num_queries,
        "scale_index_kind": index.kind,
        "scale_num_cells": index.plan.num_cells if index.plan is not None else 0,
        "scale_nprobe": index.nprobe,
        "scale_generate_time_s": round(generate_s, 2),
        "scale_exact_truth_time_s": round(truth_s, 2),
        "scale_build_time_s": round(build_s, 2),
        "scale_memory_mb": round(memory_bytes / 2**20, 1),
        "scale_vectors_mb": round(vectors.nbytes / 2**20, 1),
        "scale_query_p50_ms": round(p50, 3),
        "scale_query_p99_ms": round(_percentile_ms(times, 99), 3),
        "scale_recall_at_10": round(recall, 4),
        "scale_exact_query_p50_ms": round(exact_p50, 3),
        "scale_speedup_vs_exact_p50": round(exact_p50 / p50, 1),
    }
