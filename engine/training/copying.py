"""Rows that teach a small model to copy from its context: a curriculum for induction.

RAG answers quote their documents, and prompt-lookup speculation pays only when the model
copies. A tiny model trained for minutes on Wikipedia and chat examples does not learn to: the
demo model's base stage predicts 0.02 of repeated random tokens and 0.08 of a quoted passage's.
Copying is an *induction head* (attend to the token after the previous occurrence of the
current token, copy it), a two-head circuit: a previous-token head feeding the induction head.
Three kinds of rows teach it, mixed with language-modelling text so the model keeps its
language (engine.training.demo, stages copy and finetune):

- *patterns*: `bos` + a random pattern of frequent tokens repeated to fill the row, loss on the
  repeats: the next token is the one that followed the current token's last occurrence;
- *text patterns*: the same with a span of real text as the pattern;
- *repeats*: `bos` + a passage + `eos` + other text + the same passage again, loss on all.

What each taught, measured on the 2-core CPU (teacher-forced accuracy on held-out data):
- random patterns of period 8-32 (16 rows of 256 a step: 8 of them, 4 repeats, 4 language
  modelling; lr 2e-3, from the base model): 0.00-0.03 for ~1,800 steps, then a phase change
  (0.60 by ~2,700 steps) while language modelling held (held-out loss 5.7 -> 5.4). That
  induction reached ~32 tokens back only (patterns of period 100-300: 0.04);
- patterns of period 8-384 in rows of 768: period 100-300 went 0.08 -> 0.61 in 100 steps;
- but copying *text* stayed where language modelling alone puts it (a passage repeated: 0.15
  of the repeat; its tokens shuffled: 0.02): the model copied only in rows that look random;
- text patterns (3 rows in 10) made it copy text within 100 steps: a passage repeated 300
  tokens later 0.13 -> 0.65 (0.81 at 400 steps), a quoted passage in chat 0.15 -> 0.76.
Then, on the RAG prompts of `bench spec` (teacher-forced 0.86-0.89 of a quoted document), the
errors fell where the previous token recurs in the prompt ("]" of "[1] ", "[2] ", "[3] "; "memb"
of "membrane" and "membranes"): the model copies after the previous token's other occurrence.
- patterns drawn from 4-2048 symbols (log-uniform; 32 minutes of the finetune rows with them):
  patterns of 16 symbols, period 200: 0.56 -> 0.73, but bench-prompt quotes 0.86 -> 0.88 and
  free generation worse (prompt lookup 1.20x -> 1.02x). Dropped;
- the finetune rows with more chat and the learning rate decayed to ~0 (stage `anneal`, 24
  minutes): quotes 0.92 -> 0.95, greedy copied share 0.75 -> 0.83, prompt lookup 1.20x ->
  1.35-2.01x;
- then replies with copy errors in their input (8% of the targets of 70% of the pieces replaced
  by the token after another occurrence of the previous token, the next target kept; 24 minutes,
  learning rate 1e-3 decayed): copied share 0.83 -> 0.76, prompt lookup 1.14x. Dropped.
An earlier curriculum started with *pairs* rows (`bos a a b b ...`): the phase change came
sooner, but language modelling was lost (loss 16.6), and fine-tuning it back left a model whose
greedy replies repeat one token.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

from ragspeed.engine.training.trainer import Piece


def frequent_tokens(documents: Sequence[Sequence[int]], size: int, *, first_ordinary: int) -> list[int]:
    """The `size` most frequent token ids of `documents`, special ids (< first_ordinary) left out."""
    counts = Counter(t for ids in documents for t in ids if t >= first_ordinary)
    return [token for token, _ in counts.most_common(size)]


def _log_uniform(rng: random.Random, low: int, high: int) -> int:
    return round(math.exp(rng.uniform(math.log(low), math.log(high))))


def _repeated(pattern: Sequence[int], seq_len: int, bos_id: int) -> Piece:
    """bos + `pattern` repeated to fill the row; targets from the first repeat on."""
    ids = ([bos_id] + list(pattern) * (seq_len // len(pattern) + 1))[:seq_len]
    first_target = 1 + len(pattern)
    return Piece(tuple(ids), tuple(int(i >= first_target) for i in range(seq_len)))


def pattern_piece(
    alphabet: Sequence[int], seq_len: int, bos_id: int, rng: random.Random, *, min_len: int = 8, max_len: int = 32
) -> Piece:
    """bos + a random pattern repeated to fill the row; targets from the first repeat on. The
    pattern's length is log-uniform in [min_len, max_len]: as many short copies as long ones."""
    return _repeated([rng.choice(alphabet) for _ in range(_log_uniform(rng, min_len, max_len))], seq_len, bos_id)


def text_pattern_piece(
    document: Sequence[int], seq_len: int, bos_id: int, rng: random.Random, *, min_len: int = 8, max_len: int = 32
) -> Piece:
    """As pattern_piece, the pattern a span of real text (from `document`, at least 2 tokens)."""
    length = min(_log_uniform(rng, min_len, max_len), len(document))
    first = rng.randrange(len(document) - length + 1)
    return _repeated(document[first : first + length], seq_len, bos_id)


def repeat_piece(document: Sequence[int], seq_len: int, bos_id: int, eos_id: int, gap: Sequence[int] = ()) -> Piece:
    """bos + text + eos + `gap` (other text) + the same text again, the text cut so that it all
    fits `seq_len` (the gap too, as far as it goes); loss on all."""
    text = list(document[: max((seq_len - 2 - len(gap)) // 2, (seq_len - 2) // 4)])
    gap = list(gap[: seq_len - 2 - 2 * len(text)])
    ids = [bos_id, *text, eos_id, *gap, *text]
    return Piece(tuple(ids), (1,) * len(ids))
