"""Suite-wide setup: offline, deterministic, heavy checks opt-in."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from ragspeed import environment  # noqa: E402

# What `ragspeed` does at start-up: RAGSPEED_CACHE_DIR, RAGSPEED_KERNEL_CACHE, ... of the run.
SESSION_ENVIRONMENT = environment.configure()

REPO_ROOT = Path(__file__).resolve().parent.parent
# The QA and text data: ../shared/data beside the checkout, or where RAGSPEED_DATA_DIR says.
SHARED_DATA = Path(os.environ.get("RAGSPEED_DATA_DIR") or REPO_ROOT.parent / "shared" / "data")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("RAGSPEED_SLOW") == "1":
        return
    skip_slow = pytest.mark.skip(reason="slow: set RAGSPEED_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip_slow)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} not found (../shared/data beside the checkout, or set RAGSPEED_DATA_DIR)")
    return SHARED_DATA


@pytest.fixture(autouse=True)
def session_environment():
    """A test that configures its own environment (ragspeed.environment) leaves the run's."""
    yield
    environment.configure(SESSION_ENVIRONMENT)


@pytest.fixture(autouse=True)
def exact_prefill_paths(monkeypatch):
    """Engines of the suite prefill on their exact fp32 paths on any CPU: their outputs are
    compared with fp32 references. The read CPU loses the flags that open a faster path (bf16,
    VNNI); a test of those paths injects its own `CpuFeatures` (tests/engine/test_precision.py,
    test_int8_paths.py)."""
    from ragspeed.engine.native.compute import cpu_features

    read = cpu_features.read_cpu_features
    faster = {"avx512_bf16", "amx_bf16", "avx512_vnni", "avx_vnni"}

    def read_without_faster_paths(*args, **kwargs):
        features = read(*args, **kwargs)
        return cpu_features.CpuFeatures(
            features.model_name, features.flags - faster, features.torch_capability
        )

    monkeypatch.setattr(cpu_features, "read_cpu_features", read_without_faster_paths)
