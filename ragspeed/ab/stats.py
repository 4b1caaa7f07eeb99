"""Statistics for A/B runs: percentiles with bootstrap CIs, paired differences, Mann-Whitney U.

Terms: a *percentile CI* is the 2.5th..97.5th percentile of the statistic over `num_resamples`
bootstrap resamples (draws with replacement of the observations). The *difference* of two arms is
`b - a` of their medians (negative: b is faster); the *ratio* is `a / b` (above 1: b is faster).
A *paired* difference resamples items, not observations: `b[i] - a[i]` stays one draw.
The significance test is the two-sided Mann-Whitney U test (normal approximation with the tie
correction), which assumes nothing about the shape of latency distributions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float  # 95% CI
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "ci_low": self.low, "ci_high": self.high}


def quantile(values: np.ndarray, q: float) -> float:
    return float(np.quantile(values, q, method="linear"))


def bootstrap_quantiles(
    values: list[float], quantiles: tuple[float, ...] = QUANTILES, *, num_resamples: int = 2000, seed: int = 0
) -> dict[float, Estimate]:
    """Each quantile of `values` with its 95% bootstrap CI; empty input → {}."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return {}
    rng = np.random.default_rng(seed)
    resamples = x[rng.integers(0, x.size, size=(num_resamples, x.size))]  # [num_resamples, n]
    out = {}
    for q in quantiles:
        stats = np.quantile(resamples, q, axis=1)  # [num_resamples]
        out[q] = Estimate(quantile(x, q), float(np.quantile(stats, 0.025)), float(np.quantile(stats, 0.975)))
    return out


def bootstrap_median_difference(
    a: list[float], b: list[float], *, num_resamples: int = 2000, seed: int = 0
) -> tuple[Estimate, Estimate]:
    """(median(b) - median(a), median(a) / median(b)), each with a 95% bootstrap CI."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    rng = np.random.default_rng(seed)
    ma = np.median(xa[rng.integers(0, xa.size, size=(num_resamples, xa.size))], axis=1)
    mb = np.median(xb[rng.integers(0, xb.size, size=(num_resamples, xb.size))], axis=1)
    diff = mb - ma
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(mb > 0, ma / mb, np.inf)
    med_a, med_b = float(np.median(xa)), float(np.median(xb))
    return (
        Estimate(med_b - med_a, float(np.quantile(diff, 0.025)), float(np.quantile(diff, 0.975))),
        Estimate(
            med_a / med_b if med_b > 0 else math.inf,
            float(np.quantile(ratio, 0.025)),
            float(np.quantile(ratio, 0.975)),
        ),
    )


def paired_bootstrap_difference(
    a: list[float], b: list[float], *, num_resamples: int = 2000, seed: int = 0
) -> Estimate:
    """mean(b) - mean(a) of paired observations (a[i] and b[i] measured on the same item i), with
    its 95% percentile CI: the items are resampled, each keeping its pair together."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if xa.shape != xb.shape or xa.size == 0:
        raise ValueError(f"need two equally long, non-empty lists of pairs, got {xa.size} and {xb.size}")
    diff = xb - xa  # [n]
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, diff.size, size=(num_resamples, diff.size))].mean(axis=1)
    return Estimate(float(diff.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975)))


def _rank(values: np.ndarray) -> np.ndarray:
    """Average ranks (1-based), ties sharing the mean of their ranks."""
    order = np.argsort(values, kind="mergesort")
    ranks = np.empty(values.size, dtype=np.float64)
    sorted_values = values[order]
    i = 0
    while i < values.size:
        j = i
        while j + 1 < values.size and sorted_values[j + 1] == sorted_values[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def mann_whitney_u(a: list[float], b: list[float]) -> tuple[float, float]:
    """(U of `a`, two-sided p-value) by the normal approximation with tie and continuity corrections."""
    xa, xb = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n1, n2 = xa.size, xb.size
    if n1 == 0 or n2 == 0:
        return math.nan, math.nan
    both = np.concatenate([xa, xb])
    ranks = _rank(both)
    u1 = float(ranks[:n1].sum() - n1 * (n1 + 1) / 2)
    mean = n1 * n2 / 2
    _, counts = np.unique(both, return_counts=True)
    n = n1 + n2
    tie_term = float((counts**3 - counts).sum()) / (n * (n - 1)) if n > 1 else 0.0
    variance = n1 * n2 / 12 * ((n + 1) - tie_term)
    if variance <= 0:
        return u1, 1.0
    z = (abs(u1 - mean) - 0.5) / math.sqrt(variance)
    p = math.erfc(max(z, 0.0) / math.sqrt(2))
    return u1, min(1.0, p)
