"""The prefill paths ordered by a measurement on the machine (engine.native.compute.quant.probe), with the
measurement injected: the order follows the given times, the times are kept on disk and read
back instead of measured, a corrupt file is measured again, and on either CPU branch only
runnable paths are candidates with the exact one last. No test here depends on a timing."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ragspeed.engine.native.compute.quant.prefill import PREFILL_PATHS, prefill_candidates, runnable_paths
from ragspeed.engine.native.compute.quant.probe import (
    Measurement,
    PrefillProbe,
    ProbeGemm,
    machine_probe,
    time_products,
)
from ragspeed.engine.native.core.precision import plan_prefill
from ragspeed.engine.native.models.linear import DENSE_PREFILL_PATHS
from tests.engine.conftest import AMX, AVX2, AVX512_BF16

GEMM = ProbeGemm(in_features=64, num_threads=2, rows=8, out_features=32)  # 32,768 FLOPs


class Times:
    """An injected measurement: seconds by path name, and the names it was asked for."""

    def __init__(self, seconds: dict[str, float], cpu_share: float = 1.0):
        self.seconds = seconds
        self.cpu_share = cpu_share
        self.calls: list[str] = []

    def __call__(self, paths, gemm) -> Measurement:
        assert gemm == GEMM
        self.calls.extend(p.name for p in paths)
        return Measurement({p.name: self.seconds[p.name] for p in paths}, self.cpu_share)


def _probe(seconds: dict[str, float], folder=None, cpu_share: float = 1.0) -> tuple[PrefillProbe, Times]:
    times = Times(seconds, cpu_share)
    return PrefillProbe(GEMM, times, folder), times


def _names(paths) -> list[str]:
    return [p.name for p in paths]


@pytest.mark.parametrize(
    "seconds, order",
    [
        # bf16 fastest, then fbgemm
        ({"fbgemm-u8": 2e-6, "bf16-dequantized": 1e-6, "fp32-dequantized": 4e-6},
         ["bf16-dequantized", "fbgemm-u8", "fp32-dequantized"]),
        # the other way round
        ({"fbgemm-u8": 1e-6, "bf16-dequantized": 3e-6, "fp32-dequantized": 4e-6},
         ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]),
        # a tie keeps the table's order
        ({"fbgemm-u8": 2e-6, "bf16-dequantized": 2e-6, "fp32-dequantized": 4e-6},
         ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]),
        # measured no faster than the exact path: not a candidate; the exact one stays last
        ({"fbgemm-u8": 4e-6, "bf16-dequantized": 1e-6, "fp32-dequantized": 4e-6},
         ["bf16-dequantized", "fp32-dequantized"]),
        ({"fbgemm-u8": 5e-6, "bf16-dequantized": 8e-6, "fp32-dequantized": 4e-6}, ["fp32-dequantized"]),
    ],
)  # fmt: skip
def test_order_follows_the_measured_rates(seconds, order, caplog):
    probe, times = _probe(seconds)
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.probe"):
        assert _names(prefill_candidates(AMX, probe)) == order
    assert times.calls == ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]  # each once
    assert len(caplog.messages) == 1  # the start-up line


def test_the_start_up_line_names_rates_and_order(caplog):
    probe, _ = _probe({"fbgemm-u8": 2e-6, "bf16-dequantized": 1e-6, "fp32-dequantized": 1.6384e-6})
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.probe"):
        prefill_candidates(AMX, probe)
    # 32,768 FLOPs in 1 us: 33 GFLOP/s
    assert caplog.messages == [
        "prefill paths on Intel Xeon, 8x64 -> 32 on 2 threads (measured): bf16-dequantized 33, "
        "fbgemm-u8 16, fp32-dequantized 20 GFLOP/s; order bf16-dequantized > fp32-dequantized; "
        "not faster than fp32-dequantized: fbgemm-u8"
    ]


def test_times_are_kept_and_read_instead_of_measured(tmp_path, caplog):
    seconds = {"bf16": 1e-6, "fp32": 4e-6}
    first, first_times = _probe(seconds, tmp_path)
    assert _names(runnable_paths(DENSE_PREFILL_PATHS, AMX, first)) == ["bf16", "fp32"]
    assert first_times.calls == ["bf16", "fp32"]
    [file] = tmp_path.glob("prefill-paths-*.json")
    assert file == first.cache_file(["bf16", "fp32"], AMX)
    stored = json.loads(file.read_text())
    assert stored["seconds"] == seconds and stored["cpu_share"] == 1.0
    assert stored["key"]["paths"] == ["bf16", "fp32"] and stored["key"]["torch"] == torch.__version__
    # a later start-up: the file, no measurement (even one that would order otherwise)
    later, later_times = _probe({"bf16": 9e-6, "fp32": 4e-6}, tmp_path)
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.probe"):
        assert _names(runnable_paths(DENSE_PREFILL_PATHS, AMX, later)) == ["bf16", "fp32"]
    assert later_times.calls == []
    assert f"(read from {file})" in caplog.messages[0]
    # another CPU, path set or shape is another file, measured
    other, other_times = _probe(
        {**seconds, "fbgemm-u8": 2e-6, "bf16-dequantized": 1e-6, "fp32-dequantized": 4e-6}, tmp_path
    )
    runnable_paths(DENSE_PREFILL_PATHS, AVX512_BF16, other)
    prefill_candidates(AMX, other)
    assert other_times.calls == ["bf16", "fp32", "fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]
    assert len(list(tmp_path.glob("prefill-paths-*.json"))) == 3
    assert PrefillProbe(ProbeGemm(65, 2), time_products, tmp_path).cache_file(["bf16", "fp32"], AMX) != file
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        "",
        "[1, 2]",
        '{"key": null, "seconds": {"bf16": 1e-6, "fp32": 4e-6}}',  # written for another key
        None,  # the right key, a path missing
        "NEGATIVE",  # the right key, a time that is no time
    ],
)
def test_a_corrupt_file_is_measured_again(tmp_path, caplog, content):
    seconds = {"bf16": 1e-6, "fp32": 4e-6}
    probe, times = _probe(seconds, tmp_path)
    file = probe.cache_file(["bf16", "fp32"], AMX)
    key = probe._key(["bf16", "fp32"], AMX)
    if content is None:
        content = json.dumps({"key": key, "seconds": {"bf16": 1e-6}, "cpu_share": 1.0})
    elif content == "NEGATIVE":
        content = json.dumps({"key": key, "seconds": {"bf16": -1.0, "fp32": 4e-6}, "cpu_share": 1.0})
    file.write_text(content)
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.probe"):
        assert _names(runnable_paths(DENSE_PREFILL_PATHS, AMX, probe)) == ["bf16", "fp32"]
    assert times.calls == ["bf16", "fp32"]
    assert json.loads(file.read_text()) == {"key": key, "seconds": seconds, "cpu_share": 1.0}  # rewritten
    assert "(measured)" in caplog.messages[-1]


def test_an_unreadable_or_unwritable_folder_costs_a_measurement_not_a_start_up(tmp_path, caplog):
    (tmp_path / "file").write_text("")
    probe, times = _probe({"bf16": 1e-6, "fp32": 4e-6}, tmp_path / "file")  # a file, not a folder
    with caplog.at_level(logging.WARNING, logger="ragspeed.engine.native.compute.quant.probe"):
        assert _names(runnable_paths(DENSE_PREFILL_PATHS, AMX, probe)) == ["bf16", "fp32"]
        assert _names(runnable_paths(DENSE_PREFILL_PATHS, AMX, probe)) == ["bf16", "fp32"]
    assert times.calls == ["bf16", "fp32", "bf16", "fp32"]
    assert any(m.startswith("could not keep the prefill path times in ") for m in caplog.messages)
    folder = tmp_path / "folder"
    probe, times = _probe({"bf16": 1e-6, "fp32": 4e-6}, folder)
    folder.mkdir()
    probe.cache_file(["bf16", "fp32"], AMX).mkdir()  # a folder where the file goes
    assert _names(runnable_paths(DENSE_PREFILL_PATHS, AMX, probe)) == ["bf16", "fp32"]
    assert times.calls == ["bf16", "fp32"]


def test_a_busy_machine_orders_this_start_up_drops_nothing_and_keeps_nothing(tmp_path, caplog):
    """Measured while other work had the cores (the probe's threads got 30% of their time):
    the order is the measurement's, but bf16, measured slower than fp32, stays a candidate, and
    no file is written, so the next start-up measures again."""
    seconds = {"fbgemm-u8": 1e-6, "bf16-dequantized": 8e-6, "fp32-dequantized": 4e-6}
    probe, times = _probe(seconds, tmp_path, cpu_share=0.3)
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.probe"):
        order = _names(prefill_candidates(AMX, probe))
        assert _names(prefill_candidates(AMX, probe)) == order
    assert order == ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]
    assert times.calls == 2 * ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]
    assert not list(tmp_path.iterdir())
    assert caplog.messages[0] == (
        "prefill paths on Intel Xeon, 8x64 -> 32 on 2 threads (measured on a busy machine, got 30% of "
        "the CPU time of 2 threads: not kept): fbgemm-u8 33, bf16-dequantized 4, fp32-dequantized 8 GFLOP/s; "
        "order fbgemm-u8 > bf16-dequantized > fp32-dequantized"
    )
    # an undisturbed start-up later: kept, and bf16 dropped
    quiet, _ = _probe(seconds, tmp_path, cpu_share=0.9)
    assert _names(prefill_candidates(AMX, quiet)) == ["fbgemm-u8", "fp32-dequantized"]
    assert len(list(tmp_path.glob("prefill-paths-*.json"))) == 1


def test_a_path_slower_than_fp32_stays_where_the_dtype_asks_for_its_precision(caplog):
    """`--dtype bfloat16` keeps bf16 a candidate though it measured slower than fp32 (the gate
    may still refuse it); `auto` drops it."""
    probe, _ = _probe({"bf16": 8e-6, "fp32": 4e-6})
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.probe"):
        assert _names(plan_prefill("bfloat16", None, "cpu", AMX, probe).candidates) == ["bf16", "fp32"]
        assert _names(plan_prefill("auto", None, "cpu", AMX, probe).candidates) == ["fp32"]
    assert caplog.messages[0].endswith("order bf16 > fp32; not faster than fp32 but asked for: bf16")
    assert caplog.messages[1].endswith("order fp32; not faster than fp32: bf16")


# Every path measured faster than fp32, in reverse table order: the probe's order shows.
FAST = {
    "fbgemm-u8": 3e-6,
    "bf16-dequantized": 2e-6,
    "fp32-dequantized": 4e-6,
    "bf16": 2e-6,
    "fp32": 4e-6,
}


@pytest.mark.parametrize(
    "dtype, quantization, features, names, measured",
    [
        ("auto", None, AVX2, ["fp32"], []),
        ("auto", None, AMX, ["bf16", "fp32"], ["bf16", "fp32"]),
        ("auto", None, AVX512_BF16, ["bf16", "fp32"], ["bf16", "fp32"]),
        ("float32", None, AMX, ["fp32"], []),
        ("auto", "int8", AVX2, ["fp32-dequantized"], []),
        ("auto", "int8", AMX, ["bf16-dequantized", "fbgemm-u8", "fp32-dequantized"],
         ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]),
        ("auto", "int8", AVX512_BF16, ["bf16-dequantized", "fbgemm-u8", "fp32-dequantized"],
         ["fbgemm-u8", "bf16-dequantized", "fp32-dequantized"]),
        ("float32", "int8", AMX, ["fbgemm-u8", "fp32-dequantized"], ["fbgemm-u8", "fp32-dequantized"]),
    ],
)  # fmt: skip
def test_either_cpu_branch_offers_only_runnable_paths_the_exact_one_last(
    dtype, quantization, features, names, measured
):
    """With and without the bf16 flags: a path the CPU does not run is neither measured nor a
    candidate, and the exact fp32 path is the last resort (nothing to measure where it is the
    only one)."""
    probe, times = _probe(FAST)
    plan = plan_prefill(dtype, quantization, "cpu", features, probe)
    assert _names(plan.candidates) == names
    assert times.calls == measured
    assert plan.exact.precision == "fp32" and plan.exact in (DENSE_PREFILL_PATHS[-1], PREFILL_PATHS[-1])
    assert all(p.missing(features) is None for p in plan.candidates)


def test_time_products_runs_each_path_here():
    """The machine's measurement on a small product: a positive time for each path (fbgemm's
    where this torch has it; the values are not asserted)."""
    gemm = ProbeGemm(in_features=64, num_threads=1, rows=4, out_features=32, min_rounds=1, max_rounds=2)
    paths = (*PREFILL_PATHS[1:], *DENSE_PREFILL_PATHS)
    measured = time_products(paths, gemm)
    assert list(measured.seconds) == ["bf16-dequantized", "fp32-dequantized", "bf16", "fp32"]
    assert all(0 < s < 1 for s in measured.seconds.values()) and measured.cpu_share > 0
    assert machine_probe(576, 2).gemm == ProbeGemm(576, 2, 256, 2048, 3, 20, 0.2)


def test_an_engine_measures_at_start_up_once_per_machine(tiny_checkpoints, tmp_path, monkeypatch, caplog):
    """The engine's default probe: the model's hidden size and the engine's threads, its times
    kept in the kernel cache (ragspeed.environment), read by the next engine on this machine."""
    from ragspeed import environment
    from ragspeed.engine.native.compute.quant import probe
    from tests.engine.conftest import make_engine

    environment.configure(environment.Environment(kernel_cache=tmp_path))
    measured = []

    def measure(paths, gemm):
        measured.append(([p.name for p in paths], gemm))
        return Measurement({"bf16": 1e-6, "fp32": 4e-6}, 1.0)

    monkeypatch.setattr(probe, "time_products", measure)
    with caplog.at_level(logging.INFO, logger="ragspeed.engine.native.compute.quant.probe"):
        for _ in range(2):
            make_engine(
                tiny_checkpoints["llama"],
                dtype="auto",
                features=AMX,
                num_threads=1,
                max_model_len=40,  # short calibration windows: a quick quality gate
                num_kv_cache_tokens=40,
            )
    assert measured == [(["bf16", "fp32"], ProbeGemm(64, 1))]
    assert len(list(tmp_path.glob("prefill-paths-*.json"))) == 1
    lines = [r.getMessage() for r in caplog.records if r.name == "ragspeed.engine.native.compute.quant.probe"]
    assert lines[0].startswith("prefill paths on Intel Xeon, 256x64 -> 2048 on 1 thread (measured): ")
    assert lines[1].startswith("prefill paths on Intel Xeon, 256x64 -> 2048 on 1 thread (read from ")
    assert len(lines) == 2
