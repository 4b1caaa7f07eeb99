"""Offline latency A/B experiments: `ragspeed ab --arm a.yaml --arm b.yaml --data nq_dev.jsonl`.

An *arm* is one named configuration of `ragspeed serve` (a YAML file of Settings keys, or a
section of one) plus optional per-request options. The runner starts one real server per arm,
replays one workload against all of them interleaved in time, and reports latency percentiles
with bootstrap confidence intervals, pairwise differences with a significance test, and answer
quality (exact match, F1, compression answer retention).
"""
