"""Every `ragspeed ...` command the README and docs/*.md show runs from a fresh clone: its
command path exists (`--help` exits 0), every option the documented line names is one of that
command's options, and every repository path it hands an option (a value under one of the
repository's folders, such as `ragspeed/data/nq_dev100.jsonl`) is in the checkout. A bare file
name (`--data nq_dev.jsonl`, `--doc passage1.txt`) is the reader's own file and is not checked.

Commands are read from fenced code blocks (a line that starts with `ragspeed`, or a
`ragspeed` after `&&`, `|` or a `#` comment mark, with backslash continuations joined) and from
inline code that starts with `ragspeed `. The few documented commands that finish in a second
run for real."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ragspeed.cli import cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`(ragspeed [^`]+)`")
IN_BLOCK = re.compile(r"(?:^|&&|\|)\s*(?:\$\s+|#\s*)?(ragspeed\s.*)$")
SHELL_ENDS = ("&&", "||", "|", ";", ">", "#")
# Commands that take a second or less: run for real, not only with --help.
RUN_FOR_REAL = ("keys generate", "keys hash")


def _block_commands(block: str) -> list[str]:
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        match = IN_BLOCK.search(line.strip())
        if match:
            commands.append(match.group(1))
    return commands


def documented_commands() -> list[tuple[str, str]]:
    """(page name, command line) of every documented `ragspeed` command, in page order."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        found += [(page.name, c) for block in FENCE.findall(text) for c in _block_commands(block)]
        prose = FENCE.sub("", text).replace("\n", " ")
        found += [(page.name, m) for m in INLINE.findall(prose)]
    return found


def _words(command: str) -> list[str]:
    words = []
    for word in shlex.split(command, comments=False)[1:]:
        if word in SHELL_ENDS:
            break
        if word != "...":
            words.append(word)
    return words


def _resolve(words: list[str]) -> tuple[list[str], click.Command, list[str]]:
    """The sub-command path, its command, and the words after it."""
    command: click.Command = cli
    path: list[str] = []
    while isinstance(command, click.Group) and words and not words[0].startswith("-"):
        sub = command.get_command(click.Context(command), words[0])
        if sub is None:
            break
        path.append(words.pop(0))
        command = sub
    return path, command, words


def _options(command: click.Command) -> dict[str, click.Parameter]:
    return {
        name: param
        for param in command.get_params(click.Context(command, info_name=command.name))
        for name in (*param.opts, *param.secondary_opts)
        if name.startswith("-")
    }


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_kind():
    lines = {command for _, command in COMMANDS}
    assert len(lines) > 40
    for prefix in (
        "ragspeed serve",
        "ragspeed bench engine",
        "ragspeed eval rag",
        "ragspeed ab",
        "ragspeed keys",
    ):
        assert any(line.startswith(prefix) for line in lines), prefix


@pytest.mark.parametrize(("page", "line"), COMMANDS, ids=[f"{p}:{c[:60]}" for p, c in COMMANDS])
def test_a_documented_command_exists_with_the_options_it_names(page, line):
    path, command, rest = _resolve(_words(line))
    result = CliRunner().invoke(cli, [*path, "--help"], prog_name="ragspeed")
    assert result.exit_code == 0, f"{page}: `ragspeed {' '.join(path)} --help` failed: {result.output}"
    if isinstance(command, click.Group) and rest and not rest[0].startswith("-"):
        raise AssertionError(
            f"{page}: `{line}` names {rest[0]}, which is no command of `ragspeed {' '.join(path)}`"
        )
    options = _options(command)
    for i, word in enumerate(rest):
        if not word.startswith("--"):
            continue
        name, _, value = word.partition("=")
        assert name in options, f"{page}: `{line}` names {name}, which `ragspeed {' '.join(path)}` lacks"
        param = options[name]
        if isinstance(param, click.Option) and param.is_flag:
            continue
        if not value and i + 1 < len(rest):
            value = rest[i + 1]
        if "/" in value and (ROOT / value.split("/")[0]).is_dir():  # a path into the repository
            assert (ROOT / value).exists(), f"{page}: `{line}` names {value}, which a clone lacks"


def test_a_command_that_names_a_removed_option_or_command_fails_the_check():
    with pytest.raises(AssertionError, match="names --no-such-flag"):
        test_a_documented_command_exists_with_the_options_it_names(
            "x.md", "ragspeed bench cache --no-such-flag"
        )
    with pytest.raises(AssertionError, match="names no-such-bench, which is no command"):
        test_a_documented_command_exists_with_the_options_it_names("x.md", "ragspeed bench no-such-bench")
    with pytest.raises(AssertionError, match="names ragspeed/data/nq_dev300.jsonl, which a clone lacks"):
        test_a_documented_command_exists_with_the_options_it_names(
            "x.md", "ragspeed eval rag --data ragspeed/data/nq_dev300.jsonl"
        )


@pytest.mark.parametrize(
    "line", sorted({c for _, c in COMMANDS if c.removeprefix("ragspeed ").startswith(RUN_FOR_REAL)})
)
def test_a_documented_command_that_takes_a_second_runs(line):
    result = CliRunner().invoke(cli, _words(line), input="rs-example\n", prog_name="ragspeed")
    assert result.exit_code == 0, result.output
    assert "sha256:" in result.output
