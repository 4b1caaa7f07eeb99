"""`ragspeed bench restarts` on the tiny model: one kill of each kind, and every registered
prompt answers alike after each restart, with no temporary file left."""

from __future__ import annotations

import json

from click.testing import CliRunner

from ragspeed.bench.restarts import KINDS, bench_restarts


def test_every_prompt_survives_a_kill_of_each_kind(tiny_model, tmp_path):
    out = tmp_path / "restarts.json"
    args = ["--model", str(tiny_model), "--kills", str(len(KINDS)), "--max-tokens", "4", "--json", str(out)]
    args += ["--server-args", "--block-size 16 --max-model-len 1024 --num-kv-cache-tokens 4096"]
    result = CliRunner().invoke(bench_restarts, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("machine: ") and "kill 4/4 (prefill-again)" in result.stderr
    report = json.loads(out.read_text())
    assert report["by_kind"] == dict.fromkeys(KINDS, 1)
    assert [r["kind"] for r in report["rounds"]] == list(KINDS)
    # The write kinds stop the server inside the write they wait for, unless it was too quick
    # to be seen (the tiny model's KV is 130 KB).
    record_write, kv_write, again = (r["left"] for r in report["rounds"][1:])
    assert {record_write, kv_write} <= {"mid-write", "record", "complete"}
    assert again in ("mid-write", "outside-write")
    assert report["restarts_checked"] == len(KINDS)  # after the 3 registration kills, and at the end
    # At the end at least the first prompt and the one killed while its KV was written (its
    # record was complete): prefilled again, pinned, answering as when it was registered.
    assert report["prompts_at_end"] >= 2 and report["prompts_checked"] >= 1 + 1 + 1 + 2
    assert report["prompts_missing"] == report["answers_changed"] == 0
    assert report["prompts_unpinned"] == report["temporaries_left"] == 0
