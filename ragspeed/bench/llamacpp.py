"""llama.cpp (through llama-cpp-python) as a contender of `ragspeed bench engine`.

Not a dependency: it compiles llama.cpp from source (about ten minutes on two cores), so it
runs only where `llama_cpp` imports, and the bench prints one line saying how to install it
otherwise. It runs on the GGUF file the model comes from (the zoo's packaged file, or the
`--model` .gguf path) and, since its speed depends on the quant type, on copies of that file in
other types written once into the model cache (`requantized_copy`): F16 and Q8_0 everywhere,
BF16 where the CPU computes in bf16 (elsewhere llama.cpp converts it to fp32 on the fly).
`--llamacpp-gguf PATH` names the files instead. Each figure reports llama.cpp's fastest type.

Figures match the native and transformers ones of bench engine: TTFT is the arrival of the
first token of a `ttft_prompt_len`-token prompt, TPOT the median gap between the output tokens
of one request (after a short prompt, and after that long one), throughput the output tokens
of `llamacpp_requests` requests over their wall time. The requests run one after another, as
transformers' do: llama-cpp-python's `Llama` serves one sequence, so its rate does not depend
on how many wait.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragspeed.bench.common import TokenTimes
from ragspeed.engine.native.compute.cpu_features import CpuFeatures

INSTALL_COMMAND = "pip install 'ragspeed[llamacpp]'  (llama-cpp-python; compiles llama.cpp, about 10 minutes)"
# Types the copies are written in; BF16 only where the CPU has bf16 (`copy_types`).
COPY_TYPES = ("F16", "Q8_0")


def import_llama_cpp():
    """The `llama_cpp` module, or None where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    return llama_cpp


def skip_line(reason: str) -> str:
    return f"llama.cpp: skipped ({reason})"


def model_gguf(model: str) -> Path | None:
    """The GGUF file a `--model` value comes from: a zoo model's packaged file or a .gguf path;
    None for an HF folder or hub id (nothing for llama.cpp to load)."""
    from ragspeed.engine.native.loading.model_zoo import ZOO, PackagedGgufModel

    entry = ZOO.get(model)
    if isinstance(entry, PackagedGgufModel):
        return entry.source_file()
    path = Path(model).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return path.resolve()
    return None


def gguf_type(path: Path) -> str:
    """The quant type most of a GGUF file's matrices are stored in, e.g. "Q4_1"."""
    import gguf

    reader = gguf.GGUFReader(path)
    counts = Counter(t.tensor_type.name for t in reader.tensors if len(t.shape) > 1)
    if not counts:
        raise ValueError(f"{path}: no matrices in the GGUF file")
    return counts.most_common(1)[0][0]


def copy_types(cpu: CpuFeatures) -> tuple[str, ...]:
    return COPY_TYPES + (("BF16",) if cpu.has_bf16 else ())


def requantized_copy(source: Path, type_name: str, cache_dir: Path) -> Path:
    """`source` with every matrix dequantized and stored as `type_name` (F16, BF16, Q8_0, ...),
    vectors (norms) kept, written once into <cache_dir>/llamacpp. The name holds a digest of the
    source's path, size and mtime, so a changed source gets a new copy."""
    stat = source.stat()
    key = f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    out = cache_dir / "llamacpp" / f"{source.stem}-{digest}.{type_name}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        write_requantized(source, Path(staging), type_name)
        os.replace(staging, out)  # readers never see a half-written file
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return out


def write_requantized(source: Path, out: Path, type_name: str) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    file_type = gguf.LlamaFileType[f"MOSTLY_{type_name}"]
    reader = gguf.GGUFReader(source)
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    if arch_field is None:
        raise ValueError(f"{source} has no {gguf.Keys.General.ARCHITECTURE} field: not a model GGUF")
    arch = arch_field.contents()
    writer = gguf.GGUFWriter(out, arch)
    # GGUF.* are the reader's virtual fields; the writer adds the architecture itself.
    skipped = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in skipped:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(int(file_type))
    for tensor in reader.tensors:
        if len(tensor.shape) == 1 or tensor.tensor_type == qtype:
            writer.add_tensor(tensor.name, tensor.data, raw_dtype=tensor.tensor_type)
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@dataclass(frozen=True)
class LlamaCppSettings:
    """What `llama_cpp.Llama` is built with."""

    threads: int
    n_ctx: int
    n_batch: int = 512
    n_ubatch: int = 512
    flash_attn: bool = True
    # llama.cpp's extra buffer types (weights repacked for AMX, or interleaved for AVX2) stay
    # on, except where the CPU has AMX: there its AMX path crashes in ggml_backend_amx_mul_mat.
    use_extra_bufts: bool = True

    def describe(self) -> str:
        return (
            f"{self.threads} threads (batch too), n_ctx {self.n_ctx}, n_batch {self.n_batch}, "
            f"n_ubatch {self.n_ubatch}, flash attention {'on' if self.flash_attn else 'off'}, "
            f"extra buffer types {'on' if self.use_extra_bufts else 'off'}"
        )


def llama_settings(threads: int, n_ctx: int, cpu: CpuFeatures) -> LlamaCppSettings:
    has_amx = bool(cpu.flags & {"amx_bf16", "amx_int8"})
    return LlamaCppSettings(threads=threads, n_ctx=n_ctx, use_extra_bufts=not has_amx)


class LlamaCppContender(TokenTimes):
    """One GGUF file in llama-cpp-python's `Llama`, greedy, one request at a time."""

    def __init__(self, llama_cpp, path: Path, settings: LlamaCppSettings):
        self.path = path
        self.settings = settings
        self.version = getattr(llama_cpp, "__version__", "unknown version")
        with _model_params(llama_cpp, use_extra_bufts=settings.use_extra_bufts):
            self.llm = llama_cpp.Llama(
                model_path=str(path),
                n_gpu_layers=0,
                n_ctx=settings.n_ctx,
                n_batch=settings.n_batch,
                n_ubatch=settings.n_ubatch,
                n_threads=settings.threads,
                n_threads_batch=settings.threads,
                flash_attn=settings.flash_attn,
                verbose=False,
            )

    def _generate(self, prompt: tuple[int, ...], max_tokens: int) -> list[float]:
        """Times (from the start) at which each of `max_tokens` greedy tokens arrived."""
        self.llm.reset()  # no prefix reuse between requests: every prompt is prefilled whole
        times: list[float] = []
        start = time.perf_counter()
        # `generate` yields without end (it checks no EOS): the bench's ignore_eos.
        for _ in self.llm.generate(list(prompt), temp=0.0, reset=True):
            times.append(time.perf_counter() - start)
            if len(times) == max_tokens:
                break
        return times

    def throughput(self, prompts, max_tokens) -> float:
        start = time.perf_counter()
        num_tokens = sum(len(self._generate(p, max_tokens)) for p in prompts)
        return num_tokens / (time.perf_counter() - start)

    def arrivals(self, prompt, max_tokens) -> list[float]:
        return self._generate(prompt, max_tokens)


@contextlib.contextmanager
def _model_params(llama_cpp, *, use_extra_bufts: bool):
    """A context in which `llama_cpp.Llama(...)` builds its model with `use_extra_bufts` off.

    `Llama.__init__` takes no such argument: it fills the bindings' (`llama_cpp.llama_cpp`)
    `llama_model_default_params()` and loads the model at once, so for the constructor's
    duration the defaults carry the value. Nothing changes when the value is the default (on)
    or the field is absent (a llama.cpp without it)."""
    bindings = llama_cpp.llama_cpp
    defaults = bindings.llama_model_default_params
    if use_extra_bufts or "use_extra_bufts" not in {name for name, *_ in defaults()._fields_}:
        yield
        return

    def without_extra_bufts():
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_bufts
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


def build_contenders(
    model: str,
    gguf_paths: Sequence[str],
    threads: int,
    n_ctx: int,
    *,
    cpu: CpuFeatures | None = None,
    cache_dir: Path | None = None,
) -> dict[str, LlamaCppContender] | str:
    """llama.cpp's contenders by type label (`type_labels`), or why there are none."""
    llama_cpp = import_llama_cpp()
    if llama_cpp is None:
        return f"llama-cpp-python is not installed; install it with {INSTALL_COMMAND}"
    if cpu is None:
        from ragspeed.engine.native.compute.cpu_features import read_cpu_features

        cpu = read_cpu_features()
    files = gguf_files(model, gguf_paths, cpu, cache_dir)
    if isinstance(files, str):
        return files
    settings = llama_settings(threads, n_ctx, cpu)
    return {label: LlamaCppContender(llama_cpp, path, settings) for label, path in type_labels(files).items()}


def gguf_files(
    model: str, gguf_paths: Sequence[str], cpu: CpuFeatures, cache_dir: Path | None = None
) -> list[Path] | str:
    """The files llama.cpp runs: `gguf_paths` when given, else the model's GGUF and its copies
    in `copy_types` (written into the cache on first use); a string says why there are none."""
    if gguf_paths:
        paths = [Path(p).expanduser() for p in gguf_paths]
        for path in paths:
            if not path.is_file() or path.suffix.lower() != ".gguf":
                raise ValueError(f"--llamacpp-gguf {path}: not a .gguf file")
        return paths
    source = model_gguf(model)
    if source is None:
        return f"model {model!r} comes from no GGUF file; name one with --llamacpp-gguf PATH"
    if cache_dir is None:
        from ragspeed.engine.native.loading.model_zoo import default_cache_dir

        cache_dir = default_cache_dir()
    source_type = gguf_type(source)
    copies = [requantized_copy(source, t, cache_dir) for t in copy_types(cpu) if t != source_type]
    return [source, *copies]


def summary(
    results: Mapping[str, Any], contenders: Mapping[str, LlamaCppContender], requests: int, ttft_len: int
) -> dict[str, Any]:
    """The JSON figures besides the per-type ones the bench measured: files, settings, the
    fastest type per figure and the ratios to native."""
    first = next(iter(contenders.values()))
    out: dict[str, Any] = {
        "llamacpp_version": first.version,
        "llamacpp_settings": first.settings.describe(),
        "llamacpp_requests": requests,
    }
    out.update({f"llamacpp_{label}_file": str(c.path) for label, c in contenders.items()})
    out.update(fastest(results, list(contenders), ttft_len))
    out.update(comparison({**results, **out}, ttft_len))
    return out


def type_labels(paths: Sequence[Path], type_of=gguf_type) -> dict[str, Path]:
    """Label -> file: the type name in lower case, "_2", "_3"... after a type seen before."""
    labels: dict[str, Path] = {}
    for path in paths:
        base = type_of(path).lower()
        label, n = base, 1
        while label in labels:
            n += 1
            label = f"{base}_{n}"
        labels[label] = path
    return labels


def figure_keys(ttft_len: int) -> dict[str, bool]:
    """The per-type figures (`llamacpp_<label>_<key>`), each with whether larger is faster."""
    return {
        "tokens_per_s": True,
        "tpot_ms": False,
        f"ttft_{ttft_len}_ms": False,
        f"tpot_{ttft_len}_ms": False,
    }


def fastest(results: Mapping[str, Any], labels: Sequence[str], ttft_len: int) -> dict[str, Any]:
    """Per figure, llama.cpp's best value over its types and the type that gave it:
    `llamacpp_<key>` and `llamacpp_<key>_type`."""
    if not labels:
        raise ValueError("no llama.cpp types measured")
    out: dict[str, Any] = {}
    for key, larger_is_faster in figure_keys(ttft_len).items():
        values = {label: results[f"llamacpp_{label}_{key}"] for label in labels}
        best = (max if larger_is_faster else min)(values, key=values.__getitem__)
        out[f"llamacpp_{key}"] = values[best]
        out[f"llamacpp_{key}_type"] = best
    return out


@dataclass(frozen=True)
class Target:
    """native against llama.cpp's fastest type on one figure: `ratio_key` in the JSON is
    native/llama.cpp (or llama.cpp/native for a speed-up), and meets the issue's target when
    it is at least (or at most) `bound`."""

    figure: str  # the table's row name
    native_key: str
    llama_key: str
    ratio_key: str
    speedup: bool  # ratio = llama.cpp / native (how many times native is faster)
    at_least: bool = False
    bound: float | None = None  # None: a figure shown beside the targets, with none of its own

    def ratio(self, results: Mapping[str, Any]) -> float:
        native, llama = results[self.native_key], results[self.llama_key]
        return llama / native if self.speedup else native / llama

    def meets(self, ratio: float) -> str:
        if self.bound is None:
            return "-"
        return "yes" if (ratio >= self.bound if self.at_least else ratio <= self.bound) else "no"

    def describe(self) -> str:
        return "-" if self.bound is None else f"{'>=' if self.at_least else '<='} {self.bound:g}x"


def targets(ttft_len: int) -> tuple[Target, ...]:
    """The targets: throughput >= 3x llama.cpp's, TPOT <= 0.4x at batch 1 and after the TTFT
    prompt (a RAG request's decoding); TTFT shown beside them, without a target."""
    return (
        Target("throughput (tok/s)", "native_tokens_per_s", "llamacpp_tokens_per_s",
               "llamacpp_throughput_ratio", speedup=False, at_least=True, bound=3.0),
        Target("TPOT batch 1 (ms)", "tpot_ms", "llamacpp_tpot_ms",
               "llamacpp_tpot_ratio", speedup=False, at_least=False, bound=0.4),
        Target(f"TTFT {ttft_len} (ms)", f"ttft_{ttft_len}_ms", f"llamacpp_ttft_{ttft_len}_ms",
               "llamacpp_ttft_speedup", speedup=True),
        Target(f"TPOT after {ttft_len} (ms)", f"tpot_{ttft_len}_ms", f"llamacpp_tpot_{ttft_len}_ms",
               f"llamacpp_tpot_{ttft_len}_ratio", speedup=False, at_least=False, bound=0.4),
    )  # fmt: skip


def comparison(results: Mapping[str, Any], ttft_len: int) -> dict[str, float]:
    """The JSON ratios of native against llama.cpp's fastest type (`targets`)."""
    return {t.ratio_key: t.ratio(results) for t in targets(ttft_len)}


def print_comparison(results: Mapping[str, Any], labels: Sequence[str], ttft_len: int, echo=print) -> None:
    """The llama.cpp block of the bench's table: per type, the fastest, and the targets."""
    echo(f"llama.cpp {results['llamacpp_version']} ({results['llamacpp_settings']}), per type:")
    header = f"{'figure':<22}" + "".join(f"{label:>10}" for label in labels)
    echo(header + f"{'native':>10}{'ratio':>8}{'target':>9}  met")
    for target in targets(ttft_len):
        key = target.llama_key.removeprefix("llamacpp_")
        cells = "".join(f"{results[f'llamacpp_{label}_{key}']:>10,.1f}" for label in labels)
        ratio = results[target.ratio_key]
        met = target.meets(ratio)
        echo(
            f"{target.figure:<22}{cells}{results[target.native_key]:>10,.1f}{ratio:>7.2f}x"
            f"{target.describe():>9}  {met} (best {results[target.llama_key + '_type']})"
        )
    echo("ratio: native/llama.cpp's fastest type for throughput and TPOT; llama.cpp/native for TTFT")
