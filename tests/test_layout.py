"""The serving path stands without the tooling: no benchmark, evaluation, A/B runner or trainer,
and none of the optional extras, is imported to build and serve the app."""

import json
import subprocess
import sys

TOOLING = ("ragspeed.bench", "ragspeed.evals", "ragspeed.ab", "ragspeed.training")
EXTRAS = ("llmlingua", "matplotlib")


def _imported_after(code: str, prefixes: tuple[str, ...] = TOOLING + EXTRAS) -> list[str]:
    script = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))"
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


def test_the_loader_imports_no_precision_plan():
    """Loading comes first; the prefill plan and the quality gate are chosen after it, so the
    loader (and the quant package it reads) imports neither."""
    prefixes = (
        "ragspeed.engine.native.core.precision",
        "ragspeed.engine.native.core.quality",
        "ragspeed.engine.native.core.quality_gate",
    )
    assert _imported_after("import ragspeed.engine.native.loading.loader", prefixes) == []


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
        "fidelity",
        "gateway",
        "grammar",
        "kquant",
        "load",
        "prefill",
        "quant",
        "restarts",
        "spec",
    ]
    assert cli.get_command(None, "nope") is None


def test_no_command_or_page_names_a_path_outside_the_repository():
    """A user's clone has no `../shared`: defaults are the shipped data (ragspeed/data)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pages = [root / "README.md", *(root / "docs").rglob("*.md"), *(root / "examples").rglob("*")]
    sources = [
        p
        for package in ("ragspeed", "engine", "gateway", "compression", "prompt_cache", "retrieval")
        for p in (root / package).rglob("*.py")
    ]
    naming = [
        str(p.relative_to(root))
        for p in pages + sources
        if p.is_file() and "../shared" in p.read_text(errors="ignore")
    ]
    assert naming == []


def test_the_data_commands_default_to_the_shipped_data():
    from click.testing import CliRunner

    from ragspeed.cli import cli
    from ragspeed.shipped_data import NQ_QUESTIONS, PASSAGES, WIKITEXT

    assert NQ_QUESTIONS.is_file() and PASSAGES.is_file() and WIKITEXT.is_file()

    def help_of(*command: str) -> str:
        return " ".join(CliRunner().invoke(cli, [*command, "--help"]).output.split())

    for command in (["eval", "rag"], ["eval", "compression"], ["eval", "retrieval"], ["bench", "spec"]):
        assert "default: (the shipped 100 NQ questions" in help_of(*command), command
    assert "default: (the shipped WikiText-2 test text" in help_of("bench", "quant")
    for command in ("train-demo", "train-draft"):
        assert "default: (the shipped data" in help_of(command), command


def test_no_source_or_page_tells_the_story_of_an_issue():
    """Issue numbers and run histories belong in commit messages and the tracker."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    files = [root / "README.md", *(root / "docs").rglob("*.md")]
    for package in ("ragspeed", "engine", "gateway", "compression", "prompt_cache", "retrieval", "examples"):
        files += [p for p in (root / package).rglob("*") if p.suffix in (".py", ".c", ".md")]
    pattern = re.compile(r"\bissues? #?\d+|development CPU", re.IGNORECASE)
    naming = [str(p.relative_to(root)) for p in files if pattern.search(p.read_text(errors="ignore"))]
    assert naming == []


def test_only_the_settings_read_the_environment():
    """gateway.settings and ragspeed.environment read it; the gateway's other modules and the
    packages beneath it take what they hand down. Allowed: the native engine's default for the
    tokenizers' own thread pool."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    reading = re.compile(r"os\.environ|getenv")
    allowed = 'os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")'
    found = [
        f"{path.relative_to(root)}:{number}: {line.strip()}"
        for package in ("gateway", "engine", "compression", "retrieval", "prompt_cache")
        for path in sorted((root / package).rglob("*.py"))
        if path != root / "gateway" / "settings.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if reading.search(line) and line.strip() != allowed
    ]
    assert found == []


def test_the_environment_is_read_once_and_handed_down(monkeypatch, tmp_path):
    from pathlib import Path

    from ragspeed import environment
    from ragspeed.compression.scoring import static_encoder
    from ragspeed.engine.native.compute.cpu_kernels import build
    from ragspeed.engine.native.loading import model_zoo

    values = {"RAGSPEED_CACHE_DIR": str(tmp_path / "c"), "RAGSPEED_KERNEL_CACHE": str(tmp_path / "k")}
    read = environment.read_environment(
        {**values, "RAGSPEED_CPU_KERNELS": "0", "CC": "clang", "RAGSPEED_CPU_ISA": "avx2"}
    )
    assert read == environment.Environment(
        tmp_path / "c", tmp_path / "k", cpu_kernels=False, compiler="clang", cpu_isa="avx2"
    )
    assert environment.read_environment({}) == environment.Environment()
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    environment.configure()
    assert model_zoo.default_cache_dir() == tmp_path / "c"
    assert static_encoder.cache_dir() == tmp_path / "c"
    assert build.cache_dir() == tmp_path / "k"
    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path / "later"))  # read at start-up only
    assert model_zoo.default_cache_dir() == tmp_path / "c"
    environment.configure(environment.Environment())
    assert model_zoo.default_cache_dir() == Path.home() / ".cache" / "ragspeed" / "models"
    assert static_encoder.cache_dir() == Path.home() / ".cache" / "ragspeed"
    assert build.cache_dir() == Path.home() / ".cache" / "ragspeed" / "kernels"


def test_a_program_that_never_configures_gets_the_process_environment(monkeypatch, tmp_path):
    from ragspeed import environment

    monkeypatch.setenv("RAGSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(environment, "_current", None)
    assert environment.current().cache_dir == tmp_path


def _engine_imports(package: str = "engine") -> dict[str, set[str]]:
    """The native engine's modules (as installed: `ragspeed.engine.x`) and the engine modules
    each one imports, anywhere in it: at the top, in a function, under TYPE_CHECKING; the same
    for another of the serving packages (`package`: its folder)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / package
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(("ragspeed", package, *parts))
        modules[name.removesuffix(".__init__")] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            imported |= {t for t in targets if t in modules and t != name}
        graph[name] = imported
    return graph


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()]:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def test_the_engine_modules_import_in_no_loop():
    """Each import loop was cut by moving a definition below both ends (the scheduler's output
    types, a request's document plan, the weight counts, the proposer registry, a prefill path
    below its table and its probe)."""
    graph = _engine_imports()
    assert sorted(name for name in graph if name in _reaches(graph, name)) == []


# The native engine's layers, top to bottom (engine/native/<layer>/).
NATIVE_LAYERS = ("core", "loading", "models", "compute")
# What every layer may read: the engine's seam.
SEAM = ("ragspeed.engine.protocol", "ragspeed.engine.config")


def _layer(name: str) -> int | None:
    """The rank of a module's layer (0: core, the top), None outside the native engine's layers."""
    parts = name.split(".")
    if parts[:3] != ["ragspeed", "engine", "native"] or len(parts) < 4:
        return None
    assert parts[3] in NATIVE_LAYERS, f"{name} is in no layer of {NATIVE_LAYERS}"
    return NATIVE_LAYERS.index(parts[3])


def test_each_layer_of_the_native_engine_imports_only_the_layers_below_it():
    """engine.native is four layers: core (requests, the scheduler, the runner, the KV and
    document caches, speculation, the precision stage), loading (weight formats, the zoo),
    models, compute (the kernels, the quantized linears, attention). A module imports its own
    layer, the layers below it and the seam (engine.protocol, engine.config), never a layer above
    nor a backend; every import counts (at the top, in a function, under TYPE_CHECKING). The
    seam imports nothing of the native engine."""
    from pathlib import Path

    native = Path(__file__).resolve().parents[1] / "engine" / "native"
    assert sorted(p.name for p in native.iterdir() if (p / "__init__.py").is_file()) == sorted(NATIVE_LAYERS)
    graph = _engine_imports()
    layered = sorted(name for name in graph if _layer(name) is not None)
    assert len(layered) > 60  # the scan found the modules
    upward = [
        f"{name} -> {target}"
        for name in layered
        for target in sorted(graph[name])
        if _layer(target) is not None and _layer(target) < _layer(name)
    ]
    outside = [
        f"{name} -> {target}"
        for name in layered
        for target in sorted(graph[name])
        if _layer(target) is None and target not in SEAM
    ]
    assert upward == []
    assert outside == []
    assert {name: sorted(t for t in graph[name] if _layer(t) is not None) for name in SEAM} == {
        name: [] for name in SEAM
    }


def test_the_quality_figures_and_the_scheduler_output_stand_below_the_runner():
    graph = _engine_imports()
    below_runner = (
        "ragspeed.engine.native.core.quality",  # figures over logits; engine.native.core.window_logits runs the model
        "ragspeed.engine.native.core.scheduler_output",
        "ragspeed.engine.native.core.request",
        "ragspeed.engine.native.core.document_plan",
        "ragspeed.engine.native.models.memory",
    )
    assert {
        name: sorted(
            _reaches(graph, name)
            & {"ragspeed.engine.native.core.model_runner", "ragspeed.engine.native.core.scheduler"}
        )
        for name in below_runner
    } == {name: [] for name in below_runner}
    assert _reaches(graph, "ragspeed.engine.native.core.quality") == set()
    assert "ragspeed.engine.native.core.scheduler" not in _reaches(
        graph, "ragspeed.engine.native.core.model_runner"
    )


def test_only_the_runner_and_the_models_run_the_model():
    """One compute path: the document cache, the quality windows and the draft proposer go
    through engine.native.core.model_runner.ModelRunner, never the model's layers, head or fused kernels."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "engine"
    forward = re.compile(
        r"\.(run_layers|compute_logits|sample_logits|greedy_steps|decode_logits|_fused_decoder)\("
    )
    found = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        if path.parent.name not in ("models", "cpu_kernels") and path.name != "model_runner.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if forward.search(line) and "self.runner." not in line
    ]
    assert found == []


def test_the_gateway_modules_import_in_no_loop_and_the_pipeline_reads_no_app_state():
    """The request path's parts take the services they use (built in stages by
    gateway.pipeline.build_pipeline), not the app's state: only the app, its dependencies and
    the routes read `AppState`, and no gateway module reaches itself again."""
    graph = _engine_imports("gateway")
    assert sorted(name for name in graph if name in _reaches(graph, name)) == []
    readers = sorted(name for name, imported in graph.items() if "ragspeed.gateway.state" in imported)
    assert readers == [
        "ragspeed.gateway.app",
        "ragspeed.gateway.dependencies",
        "ragspeed.gateway.routes.openai",
        "ragspeed.gateway.routes.ops",
    ]
    request_path = ("prepare", "prepared", "pipeline", "run", "document_stage", "compress")
    for name in request_path:
        assert "ragspeed.gateway.state" not in _reaches(graph, f"ragspeed.gateway.{name}"), name


def test_every_gateway_module_serves():
    """Tooling lives beside the serving packages (ragspeed.bench, ragspeed.evals): each module of
    the gateway is imported to serve (the app) or by the SDK (gateway.client)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "gateway"
    modules = {
        ".".join(("ragspeed", "gateway", *p.relative_to(root).with_suffix("").parts))
        for p in root.rglob("*.py")
    }
    modules = {name.removesuffix(".__init__") for name in modules}
    imported = _imported_after("import ragspeed.gateway.app, ragspeed.gateway.client", ("ragspeed.gateway",))
    assert sorted(modules - set(imported)) == []


def test_the_engine_holds_no_command():
    """The engine serves; its commands (`ragspeed models`: build a benchmark model, list the zoo)
    live with the tooling, in ragspeed.bench."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "engine"
    importing_click = re.compile(r"^\s*(import click|from click\b)", re.MULTILINE)
    assert (
        sorted(str(p.relative_to(root)) for p in root.rglob("*.py") if importing_click.search(p.read_text()))
        == []
    )
