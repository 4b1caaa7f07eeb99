"""Write the tables of docs/benchmarks.md from the runs in docs/benchmarks/*.json.

    python docs/gen_benchmarks.py           # rewrite the tables in docs/benchmarks.md
    python docs/gen_benchmarks.py --check   # exit 1 when a table differs from its JSON

Each docs/benchmarks/NAME.json holds one table of the page, written between the marker lines
`<!-- table: NAME -->` and `<!-- end table -->`; the prose around the markers is written by
hand. A file has:

- `header`: the table's column names;
- `rows`: one list of cell templates per row. A template is text with `str.format` fields named
  after the run's figures (`"{tpot_ms:.1f}"`, `"{throughput_ratio:.2f}x"`); a cell whose figure
  the run lacks reads `-`. The conversion `!m` writes a negative number with a minus sign (−)
  instead of a hyphen: `"{accuracy_delta!m:+.3f}"`;
- `runs`: newest first, each with `date`, `machine`, `command` (one command or a list), an
  optional `setup` (what the run configured, in a sentence) and `figures`, the flat JSON the
  command writes with `--json` (or the subset the page quotes). The page shows the first run;
  the others are its history. Other keys (`note`: how the run went, `commit`) are kept for the
  record and not shown.

tests/test_docs.py fails when the committed page differs from what this script writes.
"""

from __future__ import annotations

import json
import re
import string
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
PAGE = DOCS / "benchmarks.md"
TABLES = DOCS / "benchmarks"
COMMAND = "python docs/gen_benchmarks.py"
WIDTH = 100  # the prose's line length
MISSING = "-"

_BLOCK = re.compile(r"^<!-- table: ([\w-]+) -->\n.*?^<!-- end table -->$", re.MULTILINE | re.DOTALL)


class _Minus:
    """A number whose formatted text says − where Python writes -."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec).replace("-", "−")


class _CellFormatter(string.Formatter):
    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion == "m":
            return _Minus(value)
        return super().convert_field(value, conversion)


_FORMATTER = _CellFormatter()


def cell(template: str, figures: Mapping[str, Any]) -> str:
    """One cell: the template filled from the figures, `-` when one of its figures is absent."""
    try:
        text = _FORMATTER.format(template, **figures)
    except (KeyError, IndexError):
        return MISSING
    return text.replace("|", "\\|")


def render_table(table: Mapping[str, Any]) -> str:
    """The block between the markers: when, where and how the first run was taken, then its table."""
    run = table["runs"][0]
    sentence = f"Measured {run['date']} on {run['machine']}."
    if run.get("setup"):
        sentence += f" {run['setup']}"
    commands = run["command"] if isinstance(run["command"], list) else [run["command"]]
    header = table["header"]
    lines = [
        textwrap.fill(sentence, WIDTH, break_on_hyphens=False, break_long_words=False),
        "",
        "```bash",
        *commands,
        "```",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in table["rows"]:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row}")
        lines.append("| " + " | ".join(cell(template, run["figures"]) for template in row) + " |")
    return "\n".join(lines)


def load_tables(folder: Path = TABLES) -> dict[str, dict[str, Any]]:
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(folder.glob("*.json"))}


def render(page: str, tables: Mapping[str, Mapping[str, Any]]) -> str:
    """The page with every marked block rewritten from its table; every table must be marked."""
    used: list[str] = []

    def block(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in tables:
            raise KeyError(f"{PAGE.name} marks a table {name!r} that {TABLES.name}/ does not have")
        used.append(name)
        return f"<!-- table: {name} -->\n{render_table(tables[name])}\n<!-- end table -->"

    text = _BLOCK.sub(block, page)
    unused = sorted(set(tables) - set(used))
    if unused:
        raise KeyError(f"{TABLES.name}/ has tables that {PAGE.name} does not mark: {', '.join(unused)}")
    return text


def main(argv: list[str]) -> int:
    committed = PAGE.read_text(encoding="utf-8")
    text = render(committed, load_tables())
    if argv == ["--check"]:
        if committed != text:
            print(f"{PAGE} is out of date with {TABLES}/; run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(f"usage: {COMMAND} [--check]", file=sys.stderr)
        return 2
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
