"""Document KV reuse in the native engine: keys moved exactly, degenerate repairs lossless,
documents computed once (across orders, concurrent requests and restarts), tenants apart, bad
store files never used, every block given back."""

from __future__ import annotations

import pytest
import torch

from ragspeed import environment
from ragspeed.engine.native.compute.cpu_kernels.placement import place_kernel_applies, place_kv
from ragspeed.engine.native.core import document_kv
from ragspeed.engine.native.models.rotary import apply_rotary
from ragspeed.engine.protocol import DocumentCacheOptions, EngineError, GenerationRequest, SamplingParams
from ragspeed.prompt_cache.document_store import DocumentKV
from tests.engine.conftest import FAMILIES, assert_all_blocks_free, make_engine
from tests.engine.tiny_models import build_tiny_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PREFIX = list(range(10, 30))  # 20 tokens: 2 full blocks of 8 and a partial one
DOCUMENTS = [list(range(100 + 12 * i, 100 + 12 * i + 7 + i)) for i in range(4)]  # 7..10 tokens
GLUE = [5, 6]  # the numbering between documents, computed in context
QUESTION = [7, 8, 9, 11]
LOSSLESS = {
    "sink": DocumentCacheOptions("sink", num_tokens=1000),
    "blend": DocumentCacheOptions("blend", ratio=1.0),
    "blend, glue reused": DocumentCacheOptions("blend", ratio=1.0, glue="reuse"),
}


def prompt(order: list[int]) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
    token_ids, spans = list(PREFIX), []
    for i in order:
        token_ids += GLUE
        spans.append((len(token_ids), len(token_ids) + len(DOCUMENTS[i])))
        token_ids += DOCUMENTS[i]
    return tuple(token_ids + QUESTION), tuple(spans)


def request(request_id, order, options=DocumentCacheOptions("reuse"), salt=None) -> GenerationRequest:
    token_ids, spans = prompt(order)
    return GenerationRequest(
        request_id, token_ids, GREEDY, cache_salt=salt, document_spans=spans, document_cache=options
    )


def run(engine, *requests: GenerationRequest) -> dict:
    return engine.generate(list(requests))


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """Full prefill of every prompt, on an engine of its own."""
    engine = make_engine(tiny_checkpoints["llama"])
    memo: dict = {}

    def greedy(order: list[int]) -> list[int]:
        key = tuple(order)
        if key not in memo:
            token_ids, _ = prompt(order)
            memo[key] = run(engine, GenerationRequest(f"ref-{len(memo)}", token_ids, GREEDY))[
                f"ref-{len(memo)}"
            ]
        return memo[key]["token_ids"]

    return greedy


@pytest.mark.parametrize("family", FAMILIES)
def test_shifted_keys_match_keys_rotated_at_their_new_place(tiny_checkpoints, family):
    rotary = make_engine(tiny_checkpoints[family], max_model_len=512).runner.rotary
    torch.manual_seed(0)
    keys = torch.randn(20, 2, 16)  # layer 0's keys before rotation do not depend on position
    at_5 = apply_rotary(keys, rotary.lookup(torch.arange(5, 25)))
    at_300 = apply_rotary(keys, rotary.lookup(torch.arange(300, 320)))
    assert torch.allclose(rotary.shift_keys(at_5, 295), at_300, atol=1e-5, rtol=0)
    assert rotary.shiftable


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16])
def test_the_placement_kernel_writes_what_torch_writes(tiny_checkpoints, pool_dtype):
    rotary = make_engine(tiny_checkpoints["llama"]).runner.rotary
    torch.manual_seed(0)
    kv = torch.randn(2, 3, 7, 2, 16).half()  # [2, layers, tokens, kv heads, head dim]
    slots = torch.tensor([9, 3, 30, 31, 4, 17, 0])
    pools = torch.zeros(2, 2, 3, 40, 2, 16, dtype=pool_dtype)
    if not place_kernel_applies(kv, pools[0]):
        pytest.skip("no CPU kernels on this machine")
    place_kv(kv, rotary.shift_rotation(57), slots, pools[0], num_threads=2)
    pools[1][0][:, slots] = rotary.shift_keys(kv[0], 57).to(pool_dtype)  # rounded once, to nearest
    pools[1][1][:, slots] = kv[1].to(pool_dtype)
    if pool_dtype == torch.float32:
        assert torch.allclose(pools[0], pools[1], atol=1e-6, rtol=0)
    else:  # the kernel's rotation and torch's differ by float rounding, at most a step of fp16
        assert torch.equal(pools[0][1], pools[1][1])
        torch.testing.assert_close(pools[0].float(), pools[1].float(), rtol=2**-10, atol=1e-6)


@pytest.mark.parametrize("storage", ["float16", "float32"])  # the kernel's placement, and torch's
@pytest.mark.parametrize("policy", sorted(LOSSLESS))
def test_recomputing_everything_gives_the_full_prefill_output(tiny_checkpoints, reference, policy, storage):
    engine = make_engine(tiny_checkpoints["llama"], document_cache_dtype=storage)
    first = run(engine, request("a", [0, 1, 2, 3], LOSSLESS[policy]))["a"]
    warm = run(engine, request("b", [3, 1, 0, 2], LOSSLESS[policy]))["b"]
    assert first["token_ids"] == reference([0, 1, 2, 3])
    assert warm["token_ids"] == reference([3, 1, 0, 2])
    assert engine.stats()["document_cache_documents_computed"] == 4
    assert_all_blocks_free(engine)


def test_documents_in_another_order_come_from_the_store(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    engine.add_request(request("a", [0, 1, 2, 3]))
    reports = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.delta.documents is not None:
                reports[out.request_id] = out.delta.documents
    engine.add_request(request("b", [3, 1, 0, 2], DocumentCacheOptions("sink", num_tokens=2)))
    while engine.has_unfinished():
        for out in engine.step():
            if out.delta.documents is not None:
                reports[out.request_id] = out.delta.documents
    assert (reports["a"].num_hit, reports["a"].num_computed) == (0, 4)
    assert (reports["b"].num_hit, reports["b"].num_computed) == (4, 0)
    # b's first 32 tokens (prefix, glue, document 3: 4 full blocks) are in the prefix cache,
    # from document 3's own prefill; b recomputes the 3 other glues (3 x 2), 2 tokens of each
    # other document and its question but the last token (3).
    assert reports["b"].num_recomputed_tokens == 3 * 2 + 3 * 2 + 3
    assert_all_blocks_free(engine)


def test_reused_glue_is_stored_once_and_leaves_only_the_question_fresh(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    glue = DocumentCacheOptions("reuse", glue="reuse")
    run(engine, request("a", [0, 1, 2, 3], glue))
    stats = engine.stats()
    assert stats["document_cache_entries"] == 5  # 4 documents, and the glue (the same each time)
    engine.add_request(request("b", [3, 1, 0, 2], glue))
    reports = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.delta.documents is not None:
                reports[out.request_id] = out.delta.documents
    # Documents are counted, glue is not; only the question but its last token is computed.
    assert (reports["b"].num_hit, reports["b"].num_computed) == (4, 0)
    assert reports["b"].num_recomputed_tokens == len(QUESTION) - 1
    assert engine.stats()["document_cache_documents_placed"] - stats["document_cache_documents_placed"] == 3
    assert_all_blocks_free(engine)


def test_concurrent_requests_compute_a_new_document_once(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    outputs = run(engine, request("a", [0, 1, 2]), request("b", [2, 1, 0]), request("c", [1, 3]))
    assert engine.stats()["document_cache_documents_computed"] == 4
    assert all(o["finish_reason"] == "length" for o in outputs.values())
    assert_all_blocks_free(engine)


def test_a_tenants_documents_are_never_served_to_another(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    run(engine, request("a", [0, 1], salt="tenant-a"))
    run(engine, request("b", [1, 0], salt="tenant-b"))
    run(engine, request("c", [1, 0], salt="tenant-a"))
    assert engine.stats()["document_cache_documents_computed"] == 4  # 2 for each tenant
    assert engine.stats()["document_cache_hits"] == 2


def test_assembled_blocks_are_found_by_a_repeat_assembled_alike_and_never_by_a_plain_prefill(
    tiny_checkpoints, reference
):
    engine = make_engine(tiny_checkpoints["llama"])
    run(engine, request("a", [0, 1, 2, 3]))
    b = run(engine, request("b", [3, 1, 0, 2]))["b"]
    # A plain request for b's prompt finds only what full prefills computed: from document 3's
    # own prefill its 32 first tokens (4 full blocks), none of b's assembled blocks after them.
    token_ids, _ = prompt([3, 1, 0, 2])
    plain = run(engine, GenerationRequest("plain", token_ids, GREEDY))["plain"]
    assert plain["num_cached_tokens"] == 32
    assert plain["token_ids"] == reference([3, 1, 0, 2])
    # b again, twice: its assembled blocks, all of them (its last partial block aside). The
    # repeats compute 2 tokens where b computed 23 in one chunk (other kernels, other rounding:
    # a random tiny model's greedy path may part later on), so b's first token, and each other.
    again = [run(engine, request(f"b-again-{i}", [3, 1, 0, 2]))[f"b-again-{i}"] for i in range(2)]
    assert [a["num_cached_tokens"] for a in again] == [len(token_ids) // 8 * 8] * 2
    assert again[0]["token_ids"][0] == b["token_ids"][0] and again[0]["token_ids"] == again[1]["token_ids"]
    # Assembled with other options, the blocks of an order assembled twice are not theirs.
    hits = [run(engine, request(f"c{i}", [2, 0, 1, 3]))[f"c{i}"]["num_cached_tokens"] for i in range(2)]
    sink = run(engine, request("c-sink", [2, 0, 1, 3], DocumentCacheOptions("sink", num_tokens=2)))
    assert hits[1] == 64 and sink["c-sink"]["num_cached_tokens"] == hits[0] < 64  # the plain hit
    assert_all_blocks_free(engine)


def test_an_abort_while_documents_are_in_flight_frees_everything(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    engine.add_request(request("a", [0, 1, 2, 3]))
    engine.step()  # the first document prefill runs; "a" waits on all four
    assert engine.abort("a") is not None
    assert engine.step() == [] and not engine.has_unfinished()  # its 3 other prefills aborted
    assert engine.stats()["document_cache_documents_computed"] == 1
    assert_all_blocks_free(engine)


def test_a_document_prefill_another_request_waits_for_outlives_an_abort(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    engine.add_request(request("a", [0, 1]))
    engine.add_request(request("b", [1, 2]))  # waits on a's prefill of document 1
    engine.abort("a")
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    assert set(outputs) == {"b"} and outputs["b"][-1].delta.finish_reason == "length"
    assert engine.stats()["document_cache_documents_computed"] == 2  # documents 1 and 2, not 0
    assert_all_blocks_free(engine)


def test_bad_document_spans_are_refused(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    token_ids, _ = prompt([0, 1])
    for spans in (((30, 25),), ((22, 29), (25, 31)), ((40, 60),)):
        bad = GenerationRequest(
            "bad", token_ids, GREEDY, document_spans=spans, document_cache=DocumentCacheOptions()
        )
        with pytest.raises(EngineError, match="document spans"):
            engine.add_request(bad)
    assert not engine.has_unfinished()


def test_the_disk_tier_serves_a_restarted_engine_and_never_a_corrupt_file(
    tiny_checkpoints, tmp_path, reference
):
    options = DocumentCacheOptions("sink", num_tokens=1000)  # lossless: any wrong KV would show
    first = make_engine(tiny_checkpoints["llama"], document_cache_dir=str(tmp_path))
    run(first, request("a", [0, 1, 2, 3], options))
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) == 4
    # Flip one payload byte of one file: that document is refused, recomputed and stored again.
    data = bytearray(files[0].read_bytes())
    data[-3] ^= 0xFF
    files[0].write_bytes(bytes(data))
    restarted = make_engine(tiny_checkpoints["llama"], document_cache_dir=str(tmp_path))
    out = run(restarted, request("b", [3, 1, 0, 2], options))["b"]
    stats = restarted.stats()
    assert (stats["document_cache_documents_computed"], stats["document_cache_rejected_files"]) == (1, 1)
    assert out["token_ids"] == reference([3, 1, 0, 2])
    assert_all_blocks_free(restarted)


def test_a_rope_that_cannot_be_shifted_prefills_in_full(tmp_path, caplog):
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    path = build_tiny_checkpoint("llama", tmp_path / "dynamic", seed=1, rope_parameters=rope)
    with caplog.at_level("INFO"):
        engine = make_engine(path)
    assert engine.documents is None
    assert "rope type 'dynamic' cannot be shifted" in caplog.text
    out = run(engine, request("a", [0, 1]))["a"]  # served, its documents prefilled in context
    token_ids, _ = prompt([0, 1])
    assert out["token_ids"] == run(engine, GenerationRequest("b", token_ids, GREEDY))["b"]["token_ids"]


def test_a_document_prefill_left_one_token_by_the_prefix_cache_finishes(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    document = list(range(300, 311))  # prefix (20) + glue (2) + 11 = 33 tokens: 4 full blocks + 1
    plain = PREFIX + GLUE + document + QUESTION
    run(engine, GenerationRequest("plain", tuple(plain), GREEDY))  # caches those 4 blocks
    token_ids = tuple(PREFIX + GLUE + document + QUESTION)
    spans = ((22, 33),)
    out = run(
        engine,
        GenerationRequest(
            "a", token_ids, GREEDY, document_spans=spans, document_cache=DocumentCacheOptions()
        ),
    )
    assert out["a"]["finish_reason"] == "length"
    assert engine.stats()["document_cache_documents_computed"] == 1
    assert_all_blocks_free(engine)


def run_with_report(engine, request: GenerationRequest):
    """(token ids, the request's DocumentReuse report)."""
    engine.add_request(request)
    token_ids, report = [], None
    while engine.has_unfinished():
        for out in engine.step():
            token_ids += out.delta.token_ids
            report = out.delta.documents if out.delta.documents is not None else report
    return token_ids, report


def test_documents_hit_from_disk_after_the_ram_tier_evicted_them(tiny_checkpoints, tmp_path, reference):
    options = DocumentCacheOptions("sink", num_tokens=1000)  # lossless: any wrong KV would show
    # [2, 2 layers, n, 2 KV heads, 16] in float16: 256 bytes a token; 2,600 bytes hold one document.
    engine = make_engine(
        tiny_checkpoints["llama"], document_cache_dir=str(tmp_path), document_cache_bytes=2600
    )
    _, first = run_with_report(engine, request("a", [0, 1, 2, 3], options))
    assert (first.num_hit, first.num_computed) == (0, 4)
    stats = engine.stats()
    assert (stats["document_cache_entries"], stats["document_cache_disk_entries"]) == (1, 4)
    assert stats["document_cache_evictions"] == 3
    token_ids, second = run_with_report(engine, request("b", [3, 1, 0, 2], options))
    assert token_ids == reference([3, 1, 0, 2])
    # Document 3 was the last stored, still in RAM; the other three come back from their files.
    assert (second.num_hit, second.num_computed, second.num_hit_ram, second.num_hit_disk) == (4, 0, 1, 3)
    sizes = [256 * len(DOCUMENTS[i]) for i in range(4)]
    assert (second.bytes_ram, second.bytes_disk) == (sizes[3], sizes[0] + sizes[1] + sizes[2])
    assert (second.by_tier["documents_hit_disk"], second.by_tier["hit_rate"]) == (3, 1.0)
    stats = engine.stats()
    assert (stats["document_cache_disk_hits"], stats["document_cache_ram_hits"]) == (3, 1)
    assert stats["document_cache_disk_hit_rate"] == 1.0
    assert stats["document_cache_capacity_bytes"] == 2600
    assert_all_blocks_free(engine)


def test_the_store_is_sized_and_placed_by_default(tiny_checkpoints, tmp_path, monkeypatch):
    monkeypatch.setattr(document_kv, "available_memory_bytes", lambda device: 8 * 2**30)
    assert document_kv.ram_budget(None) == 2 * 2**30 and document_kv.ram_budget(5) == 5
    monkeypatch.setattr(document_kv, "available_memory_bytes", lambda device: 64 * 2**30)
    assert document_kv.ram_budget(None) == 4 * 2**30  # capped
    environment.configure(environment.Environment(cache_dir=tmp_path / "models"))  # restored after
    engine = make_engine(
        tiny_checkpoints["llama"], document_cache_dir="auto", document_cache_disk_bytes=10**6
    )
    assert document_kv.document_folder("auto") == tmp_path / "models" / "documents"
    stats = engine.stats()
    assert (stats["document_cache_capacity_bytes"], stats["document_cache_disk_capacity_bytes"]) == (
        4 * 2**30,
        10**6,
    )
    assert (tmp_path / "models" / "documents" / "server.key").stat().st_mode & 0o777 == 0o600
    assert (
        make_engine(tiny_checkpoints["llama"]).stats()["document_cache_disk_capacity_bytes"] == 0
    )  # RAM only


def test_a_stored_file_of_a_wrong_layout_is_refused(tiny_checkpoints, tmp_path):
    engine = make_engine(tiny_checkpoints["llama"], document_cache_dir=str(tmp_path))
    run(engine, request("a", [0], DocumentCacheOptions("reuse")))
    store = engine.documents.store
    [key] = [path.stem for path in tmp_path.glob("*.kv")]
    entry = store.get(key, DOCUMENTS[0])
    assert entry.shape == (2, 2, 7, 2, 16) and entry.dtype == "float16"
    with pytest.raises(ValueError, match="is not the KV of 7 tokens"):
        store.put(
            DocumentKV(key, entry.token_ids, entry.start_position, "float16", (2, 2, 7, 1, 32), entry.data)
        )
