"""Answer quality: SQuAD-style exact match and token F1, substring accuracy, and answer retention.

*Retention* asks whether compression kept the answer within reach: of the requests whose
documents contain a gold answer, the share whose prompt as sent to the engine (after
compression) still contains one. Texts are compared after `normalize`.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces (the SQuAD evaluation's rule)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION))
    return " ".join(text.split())


def exact_match(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    pred = normalize(prediction)
    return float(any(pred == normalize(a) for a in answers))


def f1(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    pred_tokens = normalize(prediction).split()
    best = 0.0
    for answer in answers:
        gold_tokens = normalize(answer).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def accuracy(prediction: str, answers: tuple[str, ...] | list[str]) -> float:
    """The "Lost in the Middle" score: 1 when a normalised answer is a substring of the normalised text."""
    pred = normalize(prediction)
    return float(any(normalize(a) and normalize(a) in pred for a in answers))


def contains_answer(text: str, answers: tuple[str, ...] | list[str]) -> bool:
    haystack = f" {normalize(text)} "
    return any(normalize(a) and f" {normalize(a)} " in haystack for a in answers)
