"""Quality of a quantized model against its unquantized twin, on real text.

Both models score the same windows of token ids (each window one prefill from position 0, through
the model runner: engine.native.core.window_logits); this module holds the figures, over any logits:
- *perplexity*: `exp(mean NLL)` of every next token of every window;
- *ppl increase*: `ppl_quantized / ppl_reference - 1` (a fraction: 0.02 is 2%);
- *top-1 agreement*: the fraction of positions where both models' argmax next token is the same;
- *logit RMS error*: the root mean square of the quantized minus the reference logits, over every
  position and vocabulary entry. Top-1 agreement also depends on how close the reference's top
  two logits are; this is the noise itself. Session 8 measured it on the gate's windows: the
  bundled demo 0.034 (agreement 98.3%), a copy-trained demo 0.10 with margins as wide (93.8%).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class QualityReport:
    num_windows: int
    num_predictions: int  # next tokens scored per model
    ppl_reference: float
    ppl_quantized: float
    ppl_increase: float
    top1_agreement: float
    logit_rms_error: float


def text_windows(
    tokenizer, text_path: str | Path, *, window: int, num_windows: int, max_chars: int = 400_000
) -> list[list[int]]:
    """`num_windows` consecutive windows of `window` token ids from the start of a text file."""
    if window < 2 or num_windows < 1:
        raise ValueError(f"window must be >= 2 and num_windows >= 1, got {window}, {num_windows}")
    text = Path(text_path).read_text(encoding="utf-8")[:max_chars]
    ids = tokenizer.encode(text, add_special_tokens=False, verbose=False)  # no length warning
    if len(ids) < window * num_windows:
        raise ValueError(f"{text_path} gives {len(ids)} tokens, fewer than {num_windows} windows of {window}")
    return [ids[i * window : (i + 1) * window] for i in range(num_windows)]


def compare_logits(
    reference: Callable[[list[int]], torch.Tensor],
    quantized: Callable[[list[int]], torch.Tensor],
    windows: list[list[int]],
) -> QualityReport:
    """The report of two functions from a window to its logits [n, vocab] (the reference's and the
    quantized model's: engine.native.core.window_logits), over `windows`."""
    nll_ref = nll_quant = 0.0
    agree = total = 0
    squared_error = 0.0
    for ids in windows:
        targets = torch.tensor(ids[1:])
        ref = reference(ids)[:-1]  # [n - 1, vocab]: predictions of ids[1:]
        quant = quantized(ids)[:-1].to(ref.device)
        nll_ref += F.cross_entropy(ref, targets.to(ref.device), reduction="sum").item()
        nll_quant += F.cross_entropy(quant, targets.to(ref.device), reduction="sum").item()
        agree += int((ref.argmax(-1) == quant.argmax(-1)).sum().item())
        squared_error += (quant - ref).double().square().sum().item()
        total += len(ids) - 1
    ppl_ref, ppl_quant = math.exp(nll_ref / total), math.exp(nll_quant / total)
    return QualityReport(
        num_windows=len(windows),
        num_predictions=total,
        ppl_reference=ppl_ref,
        ppl_quantized=ppl_quant,
        ppl_increase=ppl_quant / ppl_ref - 1,
        top1_agreement=agree / total,
        logit_rms_error=math.sqrt(squared_error / (total * ref.shape[-1])),
    )
