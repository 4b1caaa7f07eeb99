"""Prefill precision by the CPU's capability: what `--dtype` admits, and which path serves.

On CPU the model's weights, norms, residual stream, KV cache and logits are fp32, and decode
steps read ragspeed's blocked fp32 or int8 kernels (activations fp32). Only the packed copy of
each weight that prefill products read (many rows: bound by arithmetic) has a choice of
precision: a *prefill path* (engine.native.compute.quant.prefill.PrefillPath; the dense kind's in
engine.native.models.linear.DENSE_PREFILL_PATHS, the int8 kind's in engine.native.compute.quant.prefill).

`DTYPES` is the policy: each `--dtype` admits some path precisions (fp32, bf16, int8
activations) and may require one. `plan_prefill` keeps the admitted paths this CPU runs
(`CpuFeatures`, injected in tests), fastest first as measured on this machine
(engine.native.compute.quant.probe, injected in tests), the exact fp32 one last; `auto` thus takes bf16
(oneDNN on AMX or AVX512-BF16) where the CPU has it and it measures faster than fp32, and fp32
elsewhere (without those flags bf16 is emulated and ~30x slower). The model loads on the last;
`choose_prefill` then measures the faster ones against it on a few calibration windows of a
text shipped with the package (engine.native.core.quality_gate: top-1 agreement and perplexity), keeps the
first that passes, logs why each one before it fell back, and logs the chosen path beside the
CPU's capabilities. Under `auto`, on a CPU with AVX2, the prefill attention kernel's integer
products (`INT16_ATTENTION`: scores and weighted sums on int16, prefill_attention.c) are gated
the same way, on the chosen path.

`choose_precision` is the engine's precision stage, run on a model the loader has loaded
(engine.native.core.factory): under `--quantization auto` the int8 weights first pass their own gate
(`gate_weights`, else fp32 is reloaded), then the prefill path is chosen as above.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import torch

from ragspeed.engine.config import EngineConfig
from ragspeed.engine.native.compute import cpu_features
from ragspeed.engine.native.compute.cpu_features import CpuFeatures
from ragspeed.engine.native.compute.cpu_kernels.attention import prefill_kernel_fits
from ragspeed.engine.native.compute.quant.prefill import PREFILL_PATHS, PrefillPath, runnable_paths
from ragspeed.engine.native.compute.quant.probe import PrefillProbe, machine_probe
from ragspeed.engine.native.compute.threads import cpu_threads
from ragspeed.engine.native.core.quality import QualityReport, compare_logits
from ragspeed.engine.native.core.quality_gate import QualityGate, gate_prefill, use_prefill_path
from ragspeed.engine.native.core.window_logits import decode_window_logits, window_logits
from ragspeed.engine.native.loading.dtypes import DtypeUnavailableError, dtype_choice
from ragspeed.engine.native.loading.loader import LoadedModel
from ragspeed.engine.native.models.linear import DENSE_PREFILL_PATHS, GGUF_PREFILL_PATHS

logger = logging.getLogger(__name__)

CALIBRATION_WINDOW = 128  # tokens per window; each window is one prefill per path measured
CALIBRATION_WINDOWS = 4
INT16_ATTENTION = "int16-attention"  # the gate's name for the prefill attention's integer products


@dataclass(frozen=True)
class PrefillPlan:
    """The prefill paths a CPU model may use, fastest first; the last is the exact one."""

    dtype: str
    kind: str  # "dense", "gguf" (dense prefill paths, decode on the file's blocks) or "int8"
    features: CpuFeatures
    candidates: tuple[PrefillPath, ...]
    unavailable: dict[str, str] = field(default_factory=dict)  # admitted path -> why not here
    int16_attention: bool = False  # whether to gate the prefill attention's integer products

    @property
    def exact(self) -> PrefillPath:
        return self.candidates[-1]


def _kind_paths(quantization: str | None) -> tuple[str, tuple[PrefillPath, ...]]:
    if quantization == "int8":
        return "int8", PREFILL_PATHS
    if quantization == "gguf":
        return "gguf", GGUF_PREFILL_PATHS
    return "dense", DENSE_PREFILL_PATHS


def plan_prefill(
    dtype: str,
    quantization: str | None,
    device: str | torch.device,
    features: CpuFeatures | None,  # None only off CPU
    probe: PrefillProbe,
    attention_kernel: bool = True,  # whether the prefill attention kernel runs the model here
) -> PrefillPlan | None:
    """The plan for a model on `device` (None off CPU: one dtype serves everything there), its
    paths ordered by the rates `probe` measures; raises DtypeUnavailableError for an unknown
    dtype or one this CPU cannot run."""
    choice = dtype_choice(dtype)
    if torch.device(device).type != "cpu":
        return None
    assert features is not None, "a CPU plan reads the CPU's features"
    kind, paths = _kind_paths(quantization)
    admitted = tuple(p for p in paths if p.precision in choice.admits)
    unavailable = {p.name: why for p in admitted[:-1] if (why := p.missing(features)) is not None}
    if choice.requires is not None and not any(
        p.precision == choice.requires and p.name not in unavailable for p in admitted
    ):
        have = ", ".join(sorted(features.flags)) or "none of the tracked flags"
        raise DtypeUnavailableError(
            f"{choice.name} prefill needs AMX-BF16 or AVX512-BF16 (amx_bf16 / avx512_bf16); this CPU "
            f"({features.model_name}) has {have}: use --dtype auto or float32"
        )
    candidates = runnable_paths(admitted, features, probe, choice.requires)
    int16_attention = choice.int16_attention and "avx2" in features.flags and attention_kernel
    if choice.int16_attention and not int16_attention:
        unavailable[INT16_ATTENTION] = (
            "needs AVX2" if attention_kernel else "the prefill attention kernel does not run this model"
        )
    return PrefillPlan(dtype, kind, features, tuple(candidates), unavailable, int16_attention)


@dataclass(frozen=True)
class PrefillChoice:
    """What `choose_prefill` chose, for logs and benches."""

    plan: PrefillPlan
    path: PrefillPath
    reports: dict[str, QualityReport] = field(default_factory=dict)  # path -> vs the exact path
    rejected: dict[str, str] = field(default_factory=dict)  # path -> why the gate refused it
    int16_attention: bool = False  # the prefill attention's products on int16 (ModelRunner.int16_attention)

    @property
    def name(self) -> str:
        """The prefill's arithmetic in a word: its path, and the attention's if not fp32."""
        return self.path.name + (f"+{INT16_ATTENTION}" if self.int16_attention else "")

    def describe(self) -> str:
        """The start-up line: path, activations, decode kernel, what else ran or could not."""
        plan = self.plan
        decode = {"int8": "blocked int8", "gguf": "the file's blocks"}.get(plan.kind, "blocked fp32")
        attention = "int16 scores and sums" if self.int16_attention else "fp32"
        line = (
            f"prefill {self.path.name} (activations {self.path.activations}, attention {attention}), "
            f"decode {decode}, dtype {plan.dtype} on {plan.features.describe()}"
        )
        if self.rejected:
            line += "; failed the quality gate: " + "; ".join(f"{n} ({w})" for n, w in self.rejected.items())
        if plan.unavailable:
            line += "; not here: " + "; ".join(f"{n}: {w}" for n, w in plan.unavailable.items())
        return line


def calibration_windows(
    tokenizer: Any, window: int = CALIBRATION_WINDOW, num_windows: int = CALIBRATION_WINDOWS
) -> list[list[int]]:
    """`num_windows` windows of `window` token ids of the calibration text (engine/native/loading/assets)."""
    text = (
        resources.files("ragspeed.engine.native.loading")
        .joinpath("assets/calibration.txt")
        .read_text(encoding="utf-8")
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < window * num_windows:
        raise ValueError(f"the calibration text gives {len(ids)} tokens, fewer than {num_windows} x {window}")
    return [ids[i * window : (i + 1) * window] for i in range(num_windows)]


# Stricter than the weights' gate: a prefill's rounding goes into the KV that every later token
# reads. bf16 prefill of the default model at 97.8% top-1 agreement (AVX512-BF16) changed the
# README question's answer from the document's name to another. Perplexity within +0.1% of the
# exact path's: `bench quant`'s prefill gate, against the fp32 model of the same weights. The
# agreement's 95% lower bound must clear 99%: on the start-up windows' 508 predictions, every
# one must agree (bf16 agreed on 506 of them, and on 97.8% of bench quant's 2,032).
PREFILL_GATE = QualityGate(max_ppl_increase=0.001, min_top1_agreement=0.99, confidence=0.95)


# What int8 weights must keep of the model's answers to serve under `--quantization auto`,
# against the same model in fp32: bench quant's int8 figures, on the start-up calibration text.
WEIGHTS_GATE = QualityGate()


def gate_weights(
    loaded: LoadedModel,
    load_reference: Callable[[], LoadedModel],
    windows: Callable[[], list[list[int]]],
    gate: QualityGate = WEIGHTS_GATE,
) -> LoadedModel:
    """Under `--quantization auto`, an int8 model (decode kernels, teacher-forced) against its
    fp32 reference from `load_reference()`: the int8 model where `gate` passes, else the
    reference, with a log line naming the figures either way."""
    reference = load_reference()
    ids = windows()
    report = compare_logits(
        lambda w: window_logits(reference, w), lambda w: decode_window_logits(loaded, w), ids
    )
    figures = f"perplexity {report.ppl_increase:+.2%}, top-1 agreement {report.top1_agreement:.2%}"
    missed = gate.failures(report)
    if missed:
        logger.warning("int8 weights fail the quality gate (%s): serving fp32", "; ".join(missed))
        return reference
    logger.info("int8 weights pass the quality gate (%s against fp32)", figures)
    return loaded


def choose_prefill(
    loaded: LoadedModel,
    plan: PrefillPlan,
    windows: Callable[[], list[list[int]]],
    *,
    gate: QualityGate = PREFILL_GATE,
    measure: Callable[[PrefillPath, bool], QualityReport] | None = None,
) -> PrefillChoice:
    """Gate `plan`'s faster paths against its exact one (on `windows()`, computed only where
    there is something to gate, or by `measure(path, int16_attention)`, tests); move the model to
    the first that passes; then, where the plan offers it, gate the attention's integer products
    on that path; log the choice."""
    exact = plan.exact
    use_prefill_path(loaded.model, exact)
    if len(plan.candidates) == 1 and not plan.int16_attention:
        choice = PrefillChoice(plan, exact)
        logger.info(choice.describe())
        return choice
    if measure is None:
        ids = windows()
        reference = {tuple(w): window_logits(loaded, w) for w in ids}

        def measure(path: PrefillPath, int16_attention: bool) -> QualityReport:
            use_prefill_path(loaded.model, path)
            if path is exact and not int16_attention:
                return compare_logits(lambda w: reference[tuple(w)], lambda w: reference[tuple(w)], ids)
            return compare_logits(
                lambda w: reference[tuple(w)],
                lambda w: window_logits(loaded, w, int16_attention=int16_attention),
                ids,
            )

    chosen, reports, rejected = exact, {}, {}
    if len(plan.candidates) > 1:
        outcome = gate_prefill(list(plan.candidates), lambda path: measure(path, False), gate)
        chosen, reports, rejected = outcome.path or exact, dict(outcome.reports), dict(outcome.rejected)
    int16_attention = False
    if plan.int16_attention:
        report = reports[INT16_ATTENTION] = measure(chosen, True)
        missed = gate.failures(report)
        if missed:
            rejected[INT16_ATTENTION] = "; ".join(missed)
            logger.warning(
                "%s fails the quality gate (%s): attention in fp32",
                INT16_ATTENTION,
                rejected[INT16_ATTENTION],
            )
        int16_attention = not missed
    use_prefill_path(loaded.model, chosen)
    choice = PrefillChoice(plan, chosen, reports, rejected, int16_attention)
    logger.info(choice.describe())
    return choice


@dataclass(frozen=True)
class PrecisionChoice:
    """What the precision stage settled for a loaded model."""

    loaded: LoadedModel  # the model to serve: as loaded, or fp32 where auto's int8 failed its gate
    prefill: PrefillChoice | None  # None off CPU


def choose_precision(
    loaded: LoadedModel,
    config: EngineConfig,
    tokenizer: Any,
    load_unquantized: Callable[[], LoadedModel],
    *,
    num_threads: int,
    features: CpuFeatures | None = None,  # default: this CPU's (engine.native.compute.cpu_features)
    prefill_probe: PrefillProbe
    | None = None,  # default: measured here, cached (engine.native.compute.quant.probe)
) -> PrecisionChoice:
    """The precision stage: `gate_weights` where `--quantization auto` loaded int8 (its fp32
    reference from `load_unquantized()`), then `plan_prefill` and `choose_prefill` on CPU; both
    measure on calibration windows of `tokenizer`, on `num_threads` threads."""
    # The windows fit the rotation table: a --max-model-len under 128 shortens them.
    window = min(CALIBRATION_WINDOW, loaded.max_model_len)

    def windows() -> list[list[int]]:
        return calibration_windows(tokenizer, window)

    if config.quantization == "auto" and loaded.quantization == "int8":
        # auto's int8 serves only where the model's answers survive it (else fp32)
        with cpu_threads(num_threads):
            loaded = gate_weights(loaded, load_unquantized, windows)
    if features is None and torch.device(config.device).type == "cpu":
        features = cpu_features.read_cpu_features()  # through the module: tests replace it
    if prefill_probe is None:
        prefill_probe = machine_probe(loaded.arch.hidden_size, num_threads)
    arch = loaded.arch
    attention_kernel = prefill_kernel_fits(arch.num_heads, arch.num_kv_heads, arch.head_dim)
    plan = plan_prefill(
        config.dtype, loaded.quantization, config.device, features, prefill_probe, attention_kernel
    )
    prefill = None
    if plan is not None:
        with cpu_threads(num_threads):
            prefill = choose_prefill(loaded, plan, windows)
    return PrecisionChoice(loaded, prefill)
