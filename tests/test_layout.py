"""The serving path stands without the tooling: no benchmark, evaluation, A/B runner or trainer,
and none of the optional extras, is imported to build and serve the app."""

import json
import subprocess
import sys

TOOLING = ("ragspeed.bench", "ragspeed.evals", "ragspeed.ab", "ragspeed.training")
EXTRAS = ("llmlingua", "matplotlib")


def _imported_after(code: str) -> list[str]:
    script = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({TOOLING + EXTRAS!r}))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_app_and_the_serve_command_import_no_tooling():
    code = (
        "from ragspeed.gateway.app import create_app\n"
        "from ragspeed.gateway.experiments import build_live_experiment\n"
        "from ragspeed.cli import cli\n"
        "cli.get_command(None, 'serve')"
    )
    assert _imported_after(code) == []


def test_cli_commands_load_when_asked_for():
    from ragspeed.cli import bench, cli

    assert sorted(cli.list_commands(None)) == [
        "ab",
        "bench",
        "chat",
        "eval",
        "index",
        "keys",
        "models",
        "serve",
        "train-demo",
        "train-draft",
        "train-rag",
    ]
    assert sorted(bench.list_commands(None)) == [
        "cache",
        "cache-manager",
        "documents",
        "engine",
        "gateway",
        "load",
        "quant",
        "restarts",
        "spec",
    ]
    assert cli.get_command(None, "nope") is None
