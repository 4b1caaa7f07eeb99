"""Reciprocal rank fusion (Cormack, Clarke and Buettcher, SIGIR 2009).

    score(d) = sum over rankings m of  weight_m / (k + rank_m(d)),   rank from 1

Only ranks matter, so a cosine similarity and a BM25 score (different scales) combine without
calibration; k (60 in the paper) damps the head so one ranker's first place cannot outvote
agreement further down. A document missing from a ranking adds nothing for it.
"""

from __future__ import annotations

from collections.abc import Sequence


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[int]], k: int = 60, weights: Sequence[float] | None = None
) -> list[tuple[int, float]]:
    """Fuse rankings of labels (best first) into [(label, score)], best first; ties keep the
    order of first appearance."""
    weights = [1.0] * len(rankings) if weights is None else list(weights)
    if len(weights) != len(rankings):
        raise ValueError(f"{len(weights)} weights for {len(rankings)} rankings")
    scores: dict[int, float] = {}
    for ranking, weight in zip(rankings, weights):
        for rank, label in enumerate(ranking, start=1):
            scores[label] = scores.get(label, 0.0) + weight / (k + rank)
    return sorted(scores.items(), key=lambda item: -item[1])
