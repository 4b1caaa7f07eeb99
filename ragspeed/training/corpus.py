"""Plain-text documents for the demo model: Wikipedia passages and WikiText-2 articles.

A *document* is one unit of language-modelling text (a passage, or an article of WikiText-2).
WikiText-2 ships tokenised ("film , television", "guest @-@ starring"); `detokenize_wikitext`
undoes the common cases so the model learns ordinary punctuation spacing, the spacing the
gateway's documents and questions use.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

PASSAGES_FILE = "wiki_passages.txt"
WIKITEXT_FILE = "wikitext2_raw_test.txt"

# (pattern, replacement) applied in order; WikiText's spaced punctuation back to prose.
_WIKITEXT_FIXES: tuple[tuple[str, str], ...] = (
    (r" @(.)@ ", r"\1"),  # "1 @,@ 000" -> "1,000", "guest @-@ starring" -> "guest-starring"
    (r" ([.,;:!?%)\]])", r"\1"),
    (r"([(\[$]) ", r"\1"),
    (r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1"),
    (r" ' s\b", "'s"),
    (r'" ([^"]*?) "', r'"\1"'),
)
# " = Title = " opens an article, " = = Section = = " a section (levels are spaced "= = ").
_HEADING = re.compile(r"^((?:= )+)(.*?)((?: =)+)$")


def detokenize_wikitext(line: str) -> str:
    text = line.strip()
    for pattern, replacement in _WIKITEXT_FIXES:
        text = re.sub(pattern, replacement, text)
    return text


def read_wikitext_articles(path: Path) -> list[str]:
    """Split WikiText-2 into articles at top-level headings (`= Title =`)."""
    articles: list[list[str]] = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        if not raw.strip():
            continue
        heading = _HEADING.match(raw.strip())
        if heading and heading.group(1) == "= ":
            articles.append([heading.group(2).strip()])
        elif heading:
            if articles:
                articles[-1].append("\n" + detokenize_wikitext(heading.group(2)))
        elif articles:
            articles[-1].append(detokenize_wikitext(raw))
    return ["\n".join(lines) for lines in articles if len(lines) > 1]


def read_passages(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@dataclass(frozen=True)
class Corpus:
    """Documents split once, seeded, into train and held-out parts."""

    train_passages: tuple[str, ...]
    heldout_passages: tuple[str, ...]
    train_articles: tuple[str, ...]
    heldout_articles: tuple[str, ...]

    @property
    def all_texts(self) -> tuple[str, ...]:
        return self.train_passages + self.heldout_passages + self.train_articles + self.heldout_articles


def load_corpus(data_dir: Path, *, heldout_fraction: float = 0.05, seed: int = 0) -> Corpus:
    data_dir = Path(data_dir)
    for name in (PASSAGES_FILE, WIKITEXT_FILE):
        if not (data_dir / name).is_file():
            raise FileNotFoundError(f"data_dir: {data_dir / name} not found")
    if not 0.0 < heldout_fraction < 0.5:
        raise ValueError(f"heldout_fraction must be in (0, 0.5), got {heldout_fraction}")
    rng = random.Random(seed)
    passages = read_passages(data_dir / PASSAGES_FILE)
    articles = read_wikitext_articles(data_dir / WIKITEXT_FILE)
    rng.shuffle(passages)
    rng.shuffle(articles)
    num_heldout_passages = max(1, int(len(passages) * heldout_fraction))
    num_heldout_articles = max(1, int(len(articles) * heldout_fraction))
    return Corpus(
        train_passages=tuple(passages[num_heldout_passages:]),
        heldout_passages=tuple(passages[:num_heldout_passages]),
        train_articles=tuple(articles[num_heldout_articles:]),
        heldout_articles=tuple(articles[:num_heldout_articles]),
    )
