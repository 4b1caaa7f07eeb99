"""The distribution: one `ragspeed` namespace, a complete package list, a true requires-python."""

import ast
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
SERVING_FOLDERS = ("gateway", "engine", "compression", "retrieval", "prompt_cache")


def _source_packages() -> set[str]:
    """Every package of the source tree, named as it installs."""
    found = set()
    for name, folder in PACKAGE_DIRS.items():
        for init in (REPO_ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(REPO_ROOT / folder)
            found.add(".".join((name, *relative.parts)))
    return found


def test_the_serving_folders_install_beneath_ragspeed():
    assert PACKAGE_DIRS == {"ragspeed": "ragspeed", **{f"ragspeed.{f}": f for f in SERVING_FOLDERS}}


def test_the_package_list_names_every_package_of_the_tree():
    assert set(PYPROJECT["tool"]["setuptools"]["packages"]) == _source_packages()


def test_requires_python_is_what_the_tools_and_the_sources_assume():
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"
    assert PYPROJECT["tool"]["mypy"]["python_version"] == "3.11"
    # Grammar newer than 3.11 (PEP 695 type parameters, PEP 701 f-strings...) fails to parse.
    sources = [p for folder in PACKAGE_DIRS.values() for p in (REPO_ROOT / folder).rglob("*.py")]
    assert len(sources) > 100
    for path in sources:
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, 11))


def test_the_wheel_holds_only_the_ragspeed_namespace(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(REPO_ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("ragspeed-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert {t for t in top_level if not t.endswith(".dist-info")} == {"ragspeed"}
    assert {
        "ragspeed/engine/native/compute/cpu_kernels/gemv.c",
        "ragspeed/engine/native/compute/cpu_kernels/kernels.h",
    } <= set(names)
    assert {
        f"ragspeed/{p.replace('ragspeed.', '').replace('.', '/')}/__init__.py"
        for p in _source_packages()
        if p != "ragspeed"
    } <= set(names)


def test_the_sdk_is_the_top_level_import_and_bare_packages_are_gone(tmp_path):
    # Run from an empty folder, so the checkout's own folders are not on sys.path.
    code = (
        "import importlib.util as u, ragspeed; from ragspeed import RagspeedClient, AsyncRagspeedClient;"
        f"print(RagspeedClient.__module__, [n for n in {SERVING_FOLDERS!r} if u.find_spec(n)])"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert result.stdout.split(maxsplit=1) == ["ragspeed.gateway.client", "[]\n"]
