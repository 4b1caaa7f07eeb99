"""blend on a request whose prefix-cache hit reaches its last prompt token (a repeat of a prompt
of one token past a block boundary): nothing is left between the hit and the last token, and
the request is served as its first run was (it once failed in scattered_metadata)."""

from __future__ import annotations

from ragspeed.engine.protocol import DocumentCacheOptions
from tests.engine.conftest import assert_all_blocks_free, make_engine
from tests.engine.test_document_kv import prompt, request, run

BLEND = DocumentCacheOptions("blend", ratio=0.5)


def test_a_blend_repeat_whose_cached_prefix_reaches_its_last_token(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    token_ids, _ = prompt([1, 2, 3])
    assert len(token_ids) == 57  # 7 full blocks of 8 and the last token
    run(engine, request("store", [3, 2, 1], BLEND))
    first = run(engine, request("first", [1, 2, 3], BLEND))["first"]
    again = run(engine, request("again", [1, 2, 3], BLEND))["again"]
    assert again["num_cached_tokens"] == 56
    assert again["token_ids"][0] == first["token_ids"][0]
    assert_all_blocks_free(engine)
