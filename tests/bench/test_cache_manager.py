import json

from click.testing import CliRunner

from ragspeed.bench.cache_manager import bench_cache_manager, bench_manager


def test_bench_manager_returns_a_flat_dict_of_numbers():
    result = bench_manager(num_tokens=64, block_size=16, num_requests=3, rounds=1)
    assert {key: result[key] for key in ("num_tokens", "block_size", "num_requests")} == {
        "num_tokens": 64,
        "block_size": 16,
        "num_requests": 3,
    }
    for name in ("off", "miss", "hit"):
        assert result[f"{name}_total_us"] > 0
    assert result["off_cache_blocks_us"] < result["miss_cache_blocks_us"]
    assert all(isinstance(value, (int, float)) for value in result.values())


def test_cli_prints_a_table_and_writes_json(tmp_path):
    path = tmp_path / "bench.json"
    outcome = CliRunner().invoke(
        bench_cache_manager,
        ["--num-tokens", "64", "--num-requests", "2", "--rounds", "1"] + ["--json", str(path)],
    )
    assert outcome.exit_code == 0, outcome.output
    assert "no-hit overhead" in outcome.output
    assert json.loads(path.read_text())["num_tokens"] == 64
