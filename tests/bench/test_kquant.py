import json

import pytest
from click.testing import CliRunner

from ragspeed.bench import kquant
from ragspeed.engine.native.compute.cpu_kernels import load_library

pytestmark = pytest.mark.skipif(
    load_library() is None, reason="ragspeed's CPU kernels could not be built here"
)


@pytest.fixture
def small_probe(monkeypatch):
    """A bandwidth probe of 16 MiB, so the test stays light."""
    monkeypatch.setattr(
        "ragspeed.bench.engine.read_bandwidth_samples",
        lambda: [16 * 2**20 / 1e-3] * 3,
    )


def test_bench_returns_a_flat_dict_of_numbers(small_probe):
    result = kquant.bench_k_quants(((64, 32),), (1, 3), footprint=2**14, repeats=1)
    assert all(isinstance(value, (int, float)) for value in result.values())
    assert result["q4k_64x32_q4k_bytes"] == 32 * 64 // 2 + 32 * 2 * 2 * 4  # nibbles, fp32 steps, offsets
    assert result["q6k_64x32_q6k_bytes"] == 32 * 64 + 32 * 4 * 4  # int8, an fp32 step per 16
    assert result["q6k_64x32_fp32_bytes"] == 32 * 64 * 4
    assert result["kmix_64x32_kmix_bytes"] == 32 * 64 + 32 * 2 * 3 * 4  # int8, two steps and an offset per 32
    for key in ("q4k_64x32_r1", "q6k_64x32_r3", "kmix_64x32_r3"):
        assert result[f"{key}_speedup"] > 0 and result[f"{key}_torch_us"] > 0
    assert result["read_bandwidth_gb_s"] == pytest.approx(16 * 2**20 / 1e-3 / 1e9)


def test_cli_prints_a_table_and_writes_json(tmp_path, monkeypatch, small_probe):
    monkeypatch.setattr(kquant, "SHAPES", ((64, 32),))
    path = tmp_path / "kquant.json"
    outcome = CliRunner().invoke(
        kquant.bench_kquant, ["--footprint-mib", "1", "--repeats", "1", "--threads", "1", "--json", str(path)]
    )
    assert outcome.exit_code == 0, outcome.output
    assert "q6k        64x32    1" in outcome.output and "machine:" in outcome.output
    assert json.loads(path.read_text())["footprint_bytes"] == 2**20
    one = CliRunner().invoke(
        kquant.bench_kquant,
        ["--footprint-mib", "1", "--repeats", "1", "--shape", "64x32", "--shape", "64x32"],
    )
    assert one.exit_code == 0 and one.output.count("64x32") == 2 * len(kquant.KINDS), one.output
    unknown = CliRunner().invoke(kquant.bench_kquant, ["--shape", "7x7"])
    assert unknown.exit_code == 2 and "unknown shape 7x7; these run: 64x32" in unknown.output
    bad = CliRunner().invoke(kquant.bench_kquant, ["--footprint-mib", "0"])
    assert bad.exit_code == 2 and "footprint, repeats and threads must be >= 1" in bad.output
