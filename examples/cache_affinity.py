"""Cache-aware routing, shown: two local upstreams (ragspeed native servers, each with its own
prefix cache) behind a ragspeed gateway with `--engine openai`, with and without affinity.

Workload: `num_prompts` distinct static system prompts, `num_questions` questions each, sent
interleaved (prompt 0 q0, prompt 1 q0, ..., prompt 0 q1, ...), one at a time. The figure is the
upstreams' combined prefix-cache hit rate (hit tokens / query tokens, from their /metrics),
counted over this workload only; each mode uses its own prompts, so neither warms the other.

    python examples/cache_affinity.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json

import httpx

from ragspeed.bench.launcher import ServerProcess
from ragspeed.engine.native.loading.model_zoo import resolve_model

TOPICS = ("billing", "shipping", "accounts", "returns", "security", "hardware")


def metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def system_prompt(mode: str, topic: str) -> str:
    rule = (
        f"You answer questions about {topic} for the Example Company ({mode} deployment). "
        "Be brief, cite the documents you use, and say so when they do not hold the answer. "
    )
    return rule * 8


def run_mode(
    upstreams: list[ServerProcess], model: str, affinity: bool, num_prompts: int, num_questions: int
) -> dict[str, float]:
    mode = "affinity" if affinity else "round-robin"
    flags = [
        "--engine",
        "openai",
        "--model",
        model,
        "--served-model-name",
        "gw",
        "--upstream-model",
        "up",
        "--block-size",
        "16",
        "--upstream-affinity" if affinity else "--no-upstream-affinity",
    ]
    for upstream in upstreams:
        flags += ["--upstream", upstream.url]
    before = [
        (
            metric(u.url, "ragspeed_prefix_cache_hits_total"),
            metric(u.url, "ragspeed_prefix_cache_queries_total"),
        )
        for u in upstreams
    ]
    with ServerProcess(flags) as gateway:
        for q in range(num_questions):
            for p in range(num_prompts):
                body = {
                    "model": "gw",
                    "max_tokens": 2,
                    "temperature": 0,
                    "messages": [
                        {"role": "system", "content": system_prompt(mode, TOPICS[p % len(TOPICS)] + str(p))},
                        {
                            "role": "user",
                            "content": f"Question {q}: what should I do about case {q * 7 + p}?",
                        },
                    ],
                }
                response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=120)
                response.raise_for_status()
    after = [
        (
            metric(u.url, "ragspeed_prefix_cache_hits_total"),
            metric(u.url, "ragspeed_prefix_cache_queries_total"),
        )
        for u in upstreams
    ]
    hits = sum(a[0] - b[0] for a, b in zip(after, before))
    queries = sum(a[1] - b[1] for a, b in zip(after, before))
    per_upstream = [a[1] - b[1] for a, b in zip(after, before)]
    return {
        "hit_rate": hits / queries,
        "hit_tokens": hits,
        "query_tokens": queries,
        "query_tokens_per_upstream": per_upstream,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--num-questions", type=int, default=6)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    model = resolve_model("ragspeed-demo")
    upstream_flags = [
        "--engine",
        "native",
        "--model",
        model,
        "--served-model-name",
        "up",
        "--block-size",
        "16",
        "--num-kv-cache-tokens",
        "65536",
    ]
    with ServerProcess(upstream_flags) as first, ServerProcess(upstream_flags) as second:
        results = {}
        for affinity in (False, True):
            figures = run_mode([first, second], model, affinity, args.num_prompts, args.num_questions)
            key = "affinity" if affinity else "round_robin"
            for name, value in figures.items():
                results[f"{key}_{name}"] = value
    results["hit_rate_gain"] = results["affinity_hit_rate"] - results["round_robin_hit_rate"]
    print(f"{args.num_prompts} system prompts x {args.num_questions} questions over 2 upstreams")
    for key in ("round_robin", "affinity"):
        print(
            f"  {key:12s} combined prefix-cache hit rate {results[key + '_hit_rate']:.3f}"
            f"  (query tokens per upstream {results[key + '_query_tokens_per_upstream']})"
        )
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
