"""The A/B report: a dict (written as JSON), a text table, and an HTML page with embedded plots.

The first arm is the *control*: top-level `ttft_ratio` and `e2e_ratio` are the control's median
over the last arm's (above 1: the last arm is faster), and `retention` is the last arm's.
"""

from __future__ import annotations

import base64
import html
import io
import itertools
import math
import statistics
from typing import Any

from ragspeed.ab.arms import Arm
from ragspeed.ab.runner import LoadShape, Observation, RunResult
from ragspeed.ab.stats import QUANTILES, bootstrap_median_difference, bootstrap_quantiles, mann_whitney_u
from ragspeed.ab.workload import Workload

LATENCY_METRICS = ("ttft_ms", "tpot_ms", "e2e_ms")
ALPHA = 0.05
# Per-stage times, in pipeline order, as the gateway reports them in `ragspeed.timings_ms`.
STAGE_ORDER = ("segments", "retrieval", "compression", "prompt", "engine_first_token", "decode")


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _pname(q: float) -> str:
    return f"p{round(q * 100)}"


def summarize_arm(
    arm: Arm, observations: list[Observation], busy_seconds: float, num_resamples: int
) -> dict[str, Any]:
    ok = [o for o in observations if o.ok]
    out: dict[str, Any] = {
        "source": arm.source,
        "settings": dict(arm.settings),
        "request": dict(arm.request),
        "num_requests": len(observations),
        "num_errors": len(observations) - len(ok),
        "errors": sorted({o.error for o in observations if not o.ok and o.error is not None})[:5],
    }
    for metric in LATENCY_METRICS:
        values = [getattr(o, metric) for o in ok if getattr(o, metric) is not None]
        estimates = bootstrap_quantiles(values, num_resamples=num_resamples)
        out[metric] = {_pname(q): e.as_dict() for q, e in estimates.items()}
        out[metric]["mean"] = _mean(values)
    completion = sum(o.completion_tokens for o in ok)
    out["requests_per_s"] = len(ok) / busy_seconds if busy_seconds > 0 else None
    out["output_tokens_per_s"] = completion / busy_seconds if busy_seconds > 0 else None
    out["prompt_tokens_mean"] = _mean([o.prompt_tokens for o in ok])
    out["cached_tokens_mean"] = _mean([o.cached_tokens for o in ok])
    out["completion_tokens_mean"] = _mean([o.completion_tokens for o in ok])
    out["document_tokens_mean"] = _mean([o.document_tokens for o in ok if o.document_tokens is not None])
    out["compressed_tokens_mean"] = _mean(
        [o.compressed_tokens for o in ok if o.compressed_tokens is not None]
    )
    judged = [float(o.answer_in_prompt) for o in ok if o.answer_in_prompt is not None]
    out["retention"] = _mean(judged)
    out["retention_n"] = len(judged)
    out["exact_match"] = _mean([o.exact_match for o in ok if o.exact_match is not None])
    out["f1"] = _mean([o.f1 for o in ok if o.f1 is not None])
    out["accuracy"] = _mean([o.accuracy for o in ok if o.accuracy is not None])
    stages = sorted({s for o in ok for s in o.timings_ms}, key=_stage_key)
    out["stage_ms_mean"] = {s: _mean([o.timings_ms.get(s, 0.0) for o in ok]) for s in stages}
    return out


def _stage_key(stage: str) -> tuple[int, str]:
    return (STAGE_ORDER.index(stage) if stage in STAGE_ORDER else len(STAGE_ORDER), stage)


def compare(a: str, b: str, by_arm: dict[str, list[Observation]], num_resamples: int) -> dict[str, Any]:
    out: dict[str, Any] = {"a": a, "b": b}
    for metric in LATENCY_METRICS:
        xa = [getattr(o, metric) for o in by_arm[a] if o.ok and getattr(o, metric) is not None]
        xb = [getattr(o, metric) for o in by_arm[b] if o.ok and getattr(o, metric) is not None]
        if not xa or not xb:
            out[metric] = None
            continue
        diff, ratio = bootstrap_median_difference(xa, xb, num_resamples=num_resamples)
        u, p = mann_whitney_u(xa, xb)
        out[metric] = {
            "median_difference": diff.as_dict(),
            "median_ratio": ratio.as_dict(),
            "mann_whitney_u": u,
            "p_value": p,
            "significant": bool(p < ALPHA),
        }
    return out


def build_report(
    arms: list[Arm], workload: Workload, shape: LoadShape, result: RunResult, *, num_resamples: int = 2000
) -> dict[str, Any]:
    by_arm = {arm.name: [o for o in result.observations if o.arm == arm.name] for arm in arms}
    summaries = {
        arm.name: summarize_arm(arm, by_arm[arm.name], result.busy_seconds[arm.name], num_resamples)
        for arm in arms
    }
    comparisons = [compare(a.name, b.name, by_arm, num_resamples) for a, b in itertools.combinations(arms, 2)]
    report: dict[str, Any] = {
        "data": workload.path,
        "mode": shape.mode,
        "concurrency": shape.concurrency if shape.rate is None else None,
        "rate": shape.rate,
        "block_size": shape.block_size,
        "warmup": shape.warmup,
        "num_items": len(workload.items),
        "num_skipped_lines": len(workload.skipped),
        "skipped_lines": [{"line": s.line, "reason": s.reason} for s in workload.skipped],
        "wall_seconds": result.wall_seconds,
        "control": arms[0].name,
        "treatment": arms[-1].name,
    }
    control, treatment = summaries[arms[0].name], summaries[arms[-1].name]
    report["ttft_ratio"] = _ratio(control, treatment, "ttft_ms")
    report["e2e_ratio"] = _ratio(control, treatment, "e2e_ms")
    report["retention"] = treatment["retention"]
    # Flat keys, one per arm and figure, for dashboards and diffs.
    for name, s in summaries.items():
        for metric in LATENCY_METRICS:
            for q in QUANTILES:
                est = s[metric].get(_pname(q))
                report[f"{name}_{metric.removesuffix('_ms')}_{_pname(q)}_ms"] = est["value"] if est else None
        for key in (
            "requests_per_s",
            "output_tokens_per_s",
            "retention",
            "exact_match",
            "f1",
            "accuracy",
            "num_errors",
            "prompt_tokens_mean",
            "cached_tokens_mean",
            "compressed_tokens_mean",
        ):
            report[f"{name}_{key}"] = s[key]
    report["arms"] = summaries
    report["comparisons"] = comparisons
    report["observations"] = [_observation_row(o) for o in result.observations]
    return report


def _ratio(a: dict[str, Any], b: dict[str, Any], metric: str) -> float | None:
    pa, pb = a[metric].get("p50"), b[metric].get("p50")
    if not pa or not pb or pb["value"] <= 0:
        return None
    return pa["value"] / pb["value"]


def _observation_row(o: Observation) -> dict[str, Any]:
    return {
        "arm": o.arm,
        "line": o.line,
        "ok": o.ok,
        "error": o.error,
        "ttft_ms": o.ttft_ms,
        "tpot_ms": o.tpot_ms,
        "e2e_ms": o.e2e_ms,
        "prompt_tokens": o.prompt_tokens,
        "cached_tokens": o.cached_tokens,
        "completion_tokens": o.completion_tokens,
        "compressed_tokens": o.compressed_tokens,
        "timings_ms": o.timings_ms,
        "answer_in_prompt": o.answer_in_prompt,
        "exact_match": o.exact_match,
        "f1": o.f1,
        "accuracy": o.accuracy,
        "text": o.text,
    }


# ---------------------------------------------------------------- text


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _ci(est: dict[str, float] | None, digits: int = 1) -> str:
    if not est:
        return "-"
    return f"{_fmt(est['value'], digits)} [{_fmt(est['ci_low'], digits)}, {_fmt(est['ci_high'], digits)}]"


def summary_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [
        (
            "arm",
            "n",
            "err",
            "TTFT p50 ms [95% CI]",
            "TTFT p90",
            "TTFT p99",
            "TPOT p50 ms",
            "e2e p50 ms [95% CI]",
            "e2e p99",
            "req/s",
            "tok/s",
            "prompt tok",
            "cached tok",
            "compressed",
            "retention",
            "EM",
            "F1",
            "acc",
        )
    ]
    for name, s in report["arms"].items():
        rows.append(
            (
                name,
                str(s["num_requests"]),
                str(s["num_errors"]),
                _ci(s["ttft_ms"].get("p50")),
                _fmt((s["ttft_ms"].get("p90") or {}).get("value")),
                _fmt((s["ttft_ms"].get("p99") or {}).get("value")),
                _ci(s["tpot_ms"].get("p50")),
                _ci(s["e2e_ms"].get("p50")),
                _fmt((s["e2e_ms"].get("p99") or {}).get("value")),
                _fmt(s["requests_per_s"], 2),
                _fmt(s["output_tokens_per_s"], 1),
                _fmt(s["prompt_tokens_mean"], 0),
                _fmt(s["cached_tokens_mean"], 0),
                _fmt(s["compressed_tokens_mean"], 0),
                _fmt(s["retention"], 3),
                _fmt(s["exact_match"], 3),
                _fmt(s["f1"], 3),
                _fmt(s["accuracy"], 3),
            )
        )
    return rows


def comparison_rows(report: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = [
        ("a → b", "metric", "median b - a ms [95% CI]", "ratio a / b [95% CI]", "p (Mann-Whitney)", "sig.")
    ]
    for c in report["comparisons"]:
        for metric in LATENCY_METRICS:
            m = c[metric]
            if m is None:
                continue
            rows.append(
                (
                    f"{c['a']} → {c['b']}",
                    metric.removesuffix("_ms"),
                    _ci(m["median_difference"]),
                    _ci(m["median_ratio"], 2),
                    _fmt_p(m["p_value"]),
                    "yes" if m["significant"] else "no",
                )
            )
    return rows


def _fmt_p(p: float | None) -> str:
    return "-" if p is None or math.isnan(p) else f"{p:.2g}"


def format_table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def format_text(report: dict[str, Any]) -> str:
    lines = [format_table(summary_rows(report)), "", format_table(comparison_rows(report)), ""]
    lines.append(
        f"ttft_ratio {_fmt(report['ttft_ratio'], 2)}  e2e_ratio {_fmt(report['e2e_ratio'], 2)}  "
        f"retention {_fmt(report['retention'], 3)}  ({report['control']} / {report['treatment']})"
    )
    if report["num_skipped_lines"]:
        lines.append(
            f"skipped {report['num_skipped_lines']} invalid workload line(s): "
            + ", ".join(f"{s['line']} ({s['reason']})" for s in report["skipped_lines"][:10])
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- html


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def require_matplotlib() -> None:
    """RuntimeError naming the extra unless matplotlib (the HTML report's plots) is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as error:
        raise RuntimeError("the HTML report needs matplotlib: pip install 'ragspeed[ab]'") from error


def plots(report: dict[str, Any]) -> dict[str, str]:
    """Base64 PNGs: latency CDFs, TTFT against prompt length, per-stage time breakdown."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    arms = list(report["arms"])
    rows = [r for r in report["observations"] if r["ok"]]
    colors = {name: f"C{i}" for i, name in enumerate(arms)}

    images = {
        "cdf": _cdf_plot(plt, np, arms, rows, colors),
        "ttft_vs_prompt": _ttft_plot(plt, arms, rows, colors),
        "stages": _stage_plot(plt, np, report, arms),
    }
    return images


def _cdf_plot(plt: Any, np: Any, arms: list[str], rows: list[dict], colors: dict[str, str]) -> str:
    """Latency CDFs per arm, one panel a latency metric."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, metric in zip(axes, LATENCY_METRICS):
        for name in arms:
            values = np.sort([r[metric] for r in rows if r["arm"] == name and r[metric] is not None])
            if values.size:
                ax.step(
                    values,
                    np.arange(1, values.size + 1) / values.size,
                    where="post",
                    label=name,
                    color=colors[name],
                )
        ax.set_xlabel(f"{metric.removesuffix('_ms').upper()} (ms)")
        ax.set_ylabel("share of requests")
        if all(r[metric] and r[metric] > 0 for r in rows if r[metric] is not None):
            ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("Latency CDFs per arm")
    image = _png(fig)
    plt.close(fig)
    return image


def _ttft_plot(plt: Any, arms: list[str], rows: list[dict], colors: dict[str, str]) -> str:
    """TTFT against the prompt tokens sent to the engine, per arm."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in arms:
        points = [(r["prompt_tokens"], r["ttft_ms"]) for r in rows if r["arm"] == name and r["ttft_ms"]]
        if points:
            x, y = zip(*points)
            ax.scatter(x, y, s=14, alpha=0.7, label=name, color=colors[name])
    ax.set_xlabel("prompt tokens sent to the engine")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("TTFT against prompt length")
    image = _png(fig)
    plt.close(fig)
    return image


def _stage_plot(plt: Any, np: Any, report: dict[str, Any], arms: list[str]) -> str:
    """Each arm's mean server-side time per stage, stacked."""
    fig, ax = plt.subplots(figsize=(9, 0.8 + 0.7 * len(arms)))
    stages = sorted({s for name in arms for s in report["arms"][name]["stage_ms_mean"]}, key=_stage_key)
    left = np.zeros(len(arms))
    for i, stage in enumerate(stages):
        widths = np.array([report["arms"][name]["stage_ms_mean"].get(stage) or 0.0 for name in arms])
        ax.barh(arms, widths, left=left, label=stage, color=plt.cm.tab10(i % 10))
        left += widths
    ax.set_xlabel("mean time per request (ms)")
    ax.set_title("Per-stage time breakdown (server side)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=max(1, len(stages)))
    image = _png(fig)
    plt.close(fig)
    return image


def _html_table(rows: list[tuple[str, ...]]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows[1:])
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: dict[str, Any]) -> str:
    images = plots(report)
    skipped = "".join(
        f"<li>line {s['line']}: {html.escape(s['reason'])}</li>" for s in report["skipped_lines"]
    )
    headline = (
        f"{html.escape(report['control'])} / {html.escape(report['treatment'])}: "
        f"TTFT ratio {_fmt(report['ttft_ratio'], 2)}, e2e ratio {_fmt(report['e2e_ratio'], 2)}, "
        f"retention {_fmt(report['retention'], 3)}"
    )
    load = (
        f"closed loop, concurrency {report['concurrency']}"
        if report["mode"] == "closed"
        else f"open loop, Poisson arrivals at {report['rate']} requests/s"
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>ragspeed A/B report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; color: #222; background: #fff; }}
table {{ border-collapse: collapse; margin: 1em 0; font-size: 0.9em; }}
th, td {{ border: 1px solid #bbb; padding: 4px 8px; text-align: right; }}
th {{ background: #e8eef7; }} td:first-child {{ text-align: left; }}
img {{ max-width: 100%; display: block; margin: 1em 0; }}
.headline {{ font-size: 1.2em; background: #f3f7e9; padding: 0.6em; border-left: 6px solid #6a3; }}
</style></head><body>
<h1>ragspeed A/B report</h1>
<p class="headline">{headline}</p>
<p>Workload {html.escape(report["data"])}: {report["num_items"]} requests per arm, {load},
blocks of {report["block_size"]} interleaved across arms, {report["warmup"]} warm-up request(s) per arm;
{report["num_skipped_lines"]} invalid line(s) skipped; {report["wall_seconds"]:.1f} s in all.</p>
<h2>Per arm</h2>{_html_table(summary_rows(report))}
<h2>Pairwise differences</h2>{_html_table(comparison_rows(report))}
<h2>Latency CDFs</h2><img alt="latency CDFs" src="data:image/png;base64,{images["cdf"]}">
<h2>TTFT against prompt length</h2><img alt="TTFT vs prompt length" src="data:image/png;base64,{images["ttft_vs_prompt"]}">
<h2>Per-stage time</h2><img alt="per-stage time" src="data:image/png;base64,{images["stages"]}">
{f"<h2>Skipped workload lines</h2><ul>{skipped}</ul>" if skipped else ""}
</body></html>
"""
