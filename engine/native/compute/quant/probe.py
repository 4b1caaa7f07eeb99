"""Which prefill path is fastest on this CPU: measured once, at start-up, and kept on disk.

The prefill paths (engine.native.compute.quant.prefill.PrefillPath: the int8 kind's table there, the dense
kind's in engine.native.models.linear) differ in speed from one CPU to the next by more than any
table typed in from one machine can say: bf16 runs several times fp32's rate on AMX tiles, less
on AVX512-BF16 alone; fbgemm's int8 depends on VNNI and on the shape. So the candidates are
ordered by a measurement on the machine that serves.

- A *product* is one prefill GEMM of a path: `ProbeGemm.rows` rows of `in_features` (the
  model's hidden size) into `out_features`, on the engine's threads, the weight packed as the
  path packs it (its `prepare`, then its `build`).
- A *round* runs each path's product once, one path after the other. Its time is the minimum
  over the rounds (at least `min_rounds`, then more while the probe's `budget_s` lasts, at most
  `max_rounds`), after two warm-up rounds (oneDNN's primitives, fbgemm's packing). The paths
  take turns so that a machine shared with other work slows each of them alike: the minimum is
  each path's time in the quietest moment it saw.
- A path's *rate* is the product's FLOPs (2 x rows x in x out) over that time.
- The *CPU share* is the CPU time the process got during the timed rounds over their wall time
  times the threads: about 1 on a quiet machine. On a machine shared with other work the
  threads of a product wait for each other at every parallel region, so a path of more regions
  (bf16's casts, fbgemm's activation quantization) measures several times slower than it runs
  on a quiet one, and the minimum over rounds does not recover. A measurement below
  `MIN_CPU_SHARE` orders this start-up's paths but drops none and is not kept.

`PrefillProbe.fastest_first` orders the faster paths by rate, drops any measured no faster
than the exact path (slower and less precise: never worth gating), keeps the exact path last
and logs the order in one line. Undisturbed times go to a JSON file beside the compiled kernels
(engine.native.compute.cpu_kernels.build.cache_dir), named by a hash of what they depend on: the CPU (model
name, tracked flags, torch's capability: engine.native.compute.cpu_features), torch's version, the product's
shape and threads, and the path names. A later start-up reads the file instead of measuring; a
file that cannot be read, or that lacks a path, is measured again and rewritten; delete the file
to measure again.

The measurement is injected (`measure`), as `CpuFeatures` are: tests order paths by given times
and count the calls; `time_products` is the one that reads the machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ragspeed.engine.native.compute.cpu_features import CpuFeatures

if TYPE_CHECKING:
    from ragspeed.engine.native.compute.quant.prefill_path import PrefillPath

logger = logging.getLogger(__name__)

PROBE_ROWS = 256  # a prefill chunk's rows: oneDNN's packing hint (engine.native.compute.packed)
PROBE_OUT_FEATURES = 2048
WARM_UP_ROUNDS = 2
# A measurement during which the probe's threads got less of their time than this is used for
# this start-up but not kept: other work on the machine disturbed it.
MIN_CPU_SHARE = 0.8


@dataclass(frozen=True)
class ProbeGemm:
    """The product each path is timed on: [rows, in_features] x [in_features, out_features]."""

    in_features: int  # the model's hidden size
    num_threads: int
    rows: int = PROBE_ROWS
    out_features: int = PROBE_OUT_FEATURES
    min_rounds: int = 3
    max_rounds: int = 20
    budget_s: float = 0.2  # timed rounds past `min_rounds` start only within this

    @property
    def flops(self) -> int:
        return 2 * self.rows * self.in_features * self.out_features


@dataclass(frozen=True)
class Measurement:
    seconds: dict[str, float]  # path name -> one product's time
    cpu_share: float  # the CPU time the probe's threads got over their wall time (1.0: all of it)

    @property
    def undisturbed(self) -> bool:
        return self.cpu_share >= MIN_CPU_SHARE


# (paths, gemm) -> each path's product time: time_products on the machine, a table in tests.
Measure = Callable[[Sequence["PrefillPath"], ProbeGemm], Measurement]


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def time_products(paths: Sequence[PrefillPath], gemm: ProbeGemm) -> Measurement:
    """Each path's product time on `gemm`: the minimum over rounds in which the paths take
    turns, and the share of its threads' time the process got meanwhile (module docstring)."""
    from ragspeed.engine.native.compute.threads import (
        cpu_threads,  # engine.native.compute.threads imports the kernels
    )

    generator = torch.Generator().manual_seed(0)
    # [out_features, in_features], scaled as a trained layer's (the int8 paths quantize it)
    weight = torch.randn(gemm.out_features, gemm.in_features, generator=generator) / math.sqrt(
        gemm.in_features
    )
    x = torch.randn(gemm.rows, gemm.in_features, generator=generator)  # [rows, in_features]
    prepared: dict[Callable[[torch.Tensor], Any], Any] = {}  # one int8 weight for its paths
    kernels = {}
    for path in paths:
        if path.prepare not in prepared:
            prepared[path.prepare] = path.prepare(weight)
        kernels[path.name] = path.build(prepared[path.prepare], None)
    best = dict.fromkeys(kernels, math.inf)
    with torch.inference_mode(), cpu_threads(gemm.num_threads):
        for _ in range(WARM_UP_ROUNDS):
            for kernel in kernels.values():
                kernel.forward(x)
        started, cpu_started = time.perf_counter(), time.process_time()
        for round_ in range(gemm.max_rounds):
            if round_ >= gemm.min_rounds and time.perf_counter() - started > gemm.budget_s:
                break
            for name, kernel in kernels.items():
                start = time.perf_counter()
                kernel.forward(x)
                best[name] = min(best[name], time.perf_counter() - start)
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    return Measurement(best, cpu / (wall * min(gemm.num_threads, _usable_cpus())))


class PrefillProbe:
    """Orders prefill paths by their measured rates on `gemm`; keeps the times in `folder`
    (None: measures every time, nothing written)."""

    def __init__(self, gemm: ProbeGemm, measure: Measure = time_products, folder: Path | None = None):
        self.gemm = gemm
        self.measure = measure
        self.folder = folder

    def cache_file(self, names: Sequence[str], features: CpuFeatures) -> Path | None:
        if self.folder is None:
            return None
        digest = hashlib.sha256(json.dumps(self._key(names, features)).encode()).hexdigest()[:16]
        return self.folder / f"prefill-paths-{digest}.json"

    def _key(self, names: Sequence[str], features: CpuFeatures) -> dict[str, object]:
        return {
            "cpu": features.model_name,
            "flags": sorted(features.flags),
            "torch_capability": features.torch_capability,
            "torch": torch.__version__,
            "gemm": asdict(self.gemm),
            "paths": list(names),
        }

    def measurement(self, paths: Sequence[PrefillPath], features: CpuFeatures) -> tuple[Measurement, str]:
        """Each path's product time, and where it came from (for the log line): the file, or
        measured now and kept there unless the machine was busy."""
        names = [p.name for p in paths]
        file = self.cache_file(names, features)
        key = self._key(names, features)
        cached = None if file is None else _read(file, key, names)
        if cached is not None:
            return cached, f"read from {file}"
        measured = self.measure(paths, self.gemm)
        assert set(measured.seconds) == set(names), f"measured {sorted(measured.seconds)}, not {names}"
        if not measured.undisturbed:
            share = f"{measured.cpu_share:.0%} of the CPU time of {_threads(self.gemm.num_threads)}"
            return measured, f"measured on a busy machine, got {share}: not kept"
        if file is not None:
            _write(file, {"key": key, "seconds": measured.seconds, "cpu_share": measured.cpu_share})
        return measured, "measured"

    def fastest_first(
        self,
        faster: Sequence[PrefillPath],
        exact: PrefillPath,
        features: CpuFeatures,
        required: Collection[str] = (),
    ) -> list[PrefillPath]:
        """`faster` by measured rate, highest first (ties keep their order), without those no
        faster than `exact` but for the `required` names (a `--dtype` asked for their
        precision), and dropping nothing where the machine was busy; then `exact`. Logs the
        rates and the order."""
        measured, source = self.measurement([*faster, exact], features)
        seconds = measured.seconds
        ordered = sorted(faster, key=lambda p: seconds[p.name])
        kept = [
            p
            for p in ordered
            if seconds[p.name] < seconds[exact.name] or p.name in required or not measured.undisturbed
        ]
        gemm = self.gemm
        rates = ", ".join(f"{p.name} {gemm.flops / seconds[p.name] / 1e9:,.0f}" for p in [*ordered, exact])
        line = (
            f"prefill paths on {features.model_name}, {gemm.rows}x{gemm.in_features} -> "
            f"{gemm.out_features} on {_threads(gemm.num_threads)} ({source}): {rates} GFLOP/s; "
            f"order {' > '.join(p.name for p in [*kept, exact])}"
        )
        slower = [p.name for p in ordered if p not in kept]
        if slower:
            line += f"; not faster than {exact.name}: {', '.join(slower)}"
        asked = [p.name for p in kept if measured.undisturbed and seconds[p.name] >= seconds[exact.name]]
        if asked:
            line += f"; not faster than {exact.name} but asked for: {', '.join(asked)}"
        logger.info(line)
        return [*kept, exact]


def _threads(num_threads: int) -> str:
    return "1 thread" if num_threads == 1 else f"{num_threads} threads"


def machine_probe(hidden_size: int, num_threads: int) -> PrefillProbe:
    """The probe a model's engine starts with: this machine's products, cached beside the
    compiled kernels."""
    from ragspeed.engine.native.compute.cpu_kernels.build import cache_dir

    return PrefillProbe(ProbeGemm(hidden_size, num_threads), time_products, cache_dir())


def _read(file: Path, key: Mapping[str, object], names: Sequence[str]) -> Measurement | None:
    """The times in `file` when it was written for `key` and holds a positive time for each of
    `names`; else None (missing, unreadable, another key, or corrupt: measured again)."""
    try:
        stored = json.loads(file.read_text())
        seconds = {name: float(stored["seconds"][name]) for name in names}
        measured = Measurement(seconds, float(stored["cpu_share"]))
        if stored["key"] != key or not all(math.isfinite(s) and s > 0 for s in seconds.values()):
            return None
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
        logger.warning("prefill path times in %s unreadable (%s): measuring again", file, error)
        return None
    return measured


def _write(file: Path, content: Mapping[str, object]) -> None:
    """Write to a temporary name and rename: processes starting at once never read half a
    file. A folder that cannot be written costs a measurement at the next start-up only."""
    staged: Path | None = None
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as out:
            staged = Path(out.name)
            json.dump(content, out, indent=1)
        os.replace(staged, file)
    except OSError as error:
        logger.warning("could not keep the prefill path times in %s: %s", file, error)
        if staged is not None:
            staged.unlink(missing_ok=True)
