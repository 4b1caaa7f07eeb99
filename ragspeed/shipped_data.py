"""The small public data shipped in `ragspeed/data` (licenses in its README), so that the
documented `eval`, `bench` and `train-*` commands run from a fresh clone by default."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

DATA_DIR = Path(str(resources.files("ragspeed") / "data"))
NQ_QUESTIONS = DATA_DIR / "nq_dev100.jsonl"  # 100 questions, 20 passages each
HOTPOT_QUESTIONS = DATA_DIR / "hotpot_dev100.jsonl"  # 100 multi-hop questions, 10 passages each
WIKITEXT = DATA_DIR / "wikitext2_raw_test.txt"
PASSAGES = DATA_DIR / "wiki_passages.txt"
