import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_prompt_cache_never_imports_torch():
    code = (
        "import sys, ragspeed.prompt_cache, ragspeed.prompt_cache.registry,"
        " ragspeed.prompt_cache.store, ragspeed.bench.cache_manager; print('torch' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    assert result.stdout.strip() == "False"
