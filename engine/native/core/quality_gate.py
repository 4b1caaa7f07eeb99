"""The int8 quality gate: a prefill path serves a model only if it keeps the model's answers.

A path passes when, against the reference (fp32 weights and activations), the quantized model's
perplexity rises by at most `max_ppl_increase` and its top-1 next token agrees at
`min_top1_agreement` of the positions (engine.native.core.quality defines both). `gate_prefill`
measures the candidates this CPU runs (engine.native.compute.quant.prefill), fastest first, stops at the first
that passes, and logs why each one before it fell back; the model's int8 layers are moved to
the path it returns. No passing path means int8 itself fails: the next precision is fp32.

Two references: `bench quant` measures against the fp32 model (weights and activations), which
gates the int8 weights too; engine.native.core.precision's start-up gate, cheap enough for start-up,
measures against the same model on its most precise path (the same weights, activations in
fp32), which gates what a faster path does to the activations.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from ragspeed.engine.native.compute.quant.prefill_path import PrefillPath
from ragspeed.engine.native.core.quality import QualityReport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QualityGate:
    max_ppl_increase: float = 0.01  # a fraction: +1%
    min_top1_agreement: float = 0.97
    # None: the measured agreement must reach min_top1_agreement; else the lower bound of its
    # interval at this confidence (Wilson), so that a few hundred predictions that happen to
    # agree do not pass a path that disagrees more often on other text.
    confidence: float | None = None

    def failures(self, report: QualityReport) -> list[str]:
        """What `report` misses, in words; empty when it passes."""
        missed = []
        if report.ppl_increase > self.max_ppl_increase:
            missed.append(f"perplexity {report.ppl_increase:+.2%} > +{self.max_ppl_increase * 100:g}%")
        top1, bound = report.top1_agreement, f"{report.top1_agreement:.2%}"
        if self.confidence is not None:
            top1 = wilson_lower_bound(report.top1_agreement, report.num_predictions, self.confidence)
            bound += f" ({self.confidence:.0%} lower bound {top1:.2%} of {report.num_predictions})"
        if top1 < self.min_top1_agreement:
            missed.append(f"top-1 agreement {bound} < {self.min_top1_agreement:.0%}")
        return missed


def wilson_lower_bound(share: float, n: int, confidence: float) -> float:
    """The lower end of the Wilson score interval of a share measured on `n` trials."""
    z = statistics.NormalDist().inv_cdf(0.5 + confidence / 2)
    centre = share + z * z / (2 * n)
    margin = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
    return (centre - margin) / (1 + z * z / n)


@dataclass(frozen=True)
class GateOutcome:
    path: PrefillPath | None  # the first passing path; None: int8 fails, serve fp32
    reports: dict[str, QualityReport]  # path name -> its measurement, in the order measured
    rejected: dict[str, str] = field(default_factory=dict)  # path name -> why it failed


def gate_prefill(
    candidates: list[PrefillPath],
    measure: Callable[[PrefillPath], QualityReport],
    gate: QualityGate = QualityGate(),
    after_last: str = "fp32 (no int8)",
) -> GateOutcome:
    """Measure `candidates` in order until one passes `gate`; log each fallback (to the next
    candidate, or to `after_last`)."""
    if not candidates:
        raise ValueError("gate_prefill needs at least one candidate path")
    reports: dict[str, QualityReport] = {}
    rejected: dict[str, str] = {}
    for i, path in enumerate(candidates):
        report = reports[path.name] = measure(path)
        missed = gate.failures(report)
        if not missed:
            return GateOutcome(path, reports, rejected)
        rejected[path.name] = "; ".join(missed)
        after = candidates[i + 1].name if i + 1 < len(candidates) else after_last
        logger.warning(
            "prefill path %s fails the quality gate (%s): falling back to %s",
            path.name,
            rejected[path.name],
            after,
        )
    return GateOutcome(None, reports, rejected)


def int8_kernels(model: nn.Module) -> list:
    """The CPU int8 kernels of a model's linear layers (those with a prefill path)."""
    return [m.kernel for m in model.modules() if hasattr(getattr(m, "kernel", None), "use_prefill")]


def prefill_layers(model: nn.Module) -> list:
    """Whatever holds a prefill path in `model`'s linear layers: the CPU int8 kernels, and
    the dense layers that keep a packed copy (engine.native.models.linear)."""
    dense = [m for m in model.modules() if hasattr(m, "use_prefill") and getattr(m, "path", None)]
    return int8_kernels(model) + dense


def use_prefill_path(model: nn.Module, path: PrefillPath) -> int:
    """Move every CPU layer of `model` with a prefill path to `path`; returns how many moved."""
    layers = prefill_layers(model)
    for layer in layers:
        if layer.path is not path:
            layer.use_prefill(path)
    return len(layers)
