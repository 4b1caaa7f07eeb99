"""The RAG adapter's training: its mask is what the document cache computes, its prompts are the
gateway's, and its adapter file merges into a checkpoint that answers as the adapted model."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ragspeed.engine.native.core.document_kv import placed_spans
from ragspeed.engine.native.loading.adapter import merge_adapter, merged_is_current, read_adapter
from ragspeed.engine.native.loading.model_zoo import DEMO_MODEL_NAME, ZOO, AdaptedModel
from ragspeed.engine.protocol import DocumentCacheOptions, GenerationRequest, SamplingParams
from ragspeed.evals.rag import Passage, RagExample
from ragspeed.shipped_data import DATA_DIR
from ragspeed.training.block_attention import (
    DEV_DATA,
    SHIPPED_DATA,
    BlockExample,
    QuestionLines,
    Recipe,
    adapters_off,
    add_adapters,
    block_mask,
    greedy,
    make_example,
    rag_data,
    read_records,
    save_adapter,
    train_rag_adapter,
)
from tests.engine.conftest import make_engine
from tests.engine.tiny_models import build_tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=1)


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_placed_span_sees_the_prefix_and_itself_and_the_rest_sees_everything():
    mask = block_mask(10, 2, [(2, 5), (5, 6), (6, 8)])
    assert mask[4, :5].tolist() == [True] * 5 and not mask[4, 5:].any()
    assert mask[7].tolist() == [True, True, False, False, False, False, True, True, False, False]
    assert mask[5].tolist()[:6] == [True, True, False, False, False, True]
    assert mask[9].all() and mask[1, :2].all() and not mask[1, 2:].any()


def test_the_training_mask_is_what_the_document_cache_computes(tiny_llama):
    prefix, glue, question = list(range(10, 30)), [5, 6], [7, 8, 9, 11]
    documents = [list(range(100 + 12 * i, 107 + 13 * i)) for i in range(3)]

    def prompt(order):
        token_ids, spans = list(prefix), []
        for i in order:
            token_ids += glue
            spans.append((len(token_ids), len(token_ids) + len(documents[i])))
            token_ids += documents[i]
        return tuple(token_ids + question), tuple(spans)

    engine = make_engine(tiny_llama)
    options = DocumentCacheOptions("reuse", glue="reuse")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = {}
    for request_id, order in (("first", [0, 1, 2]), ("warm", [2, 0, 1])):
        token_ids, spans = prompt(order)
        request = GenerationRequest(
            request_id, token_ids, params, document_spans=spans, document_cache=options
        )
        outputs.update(engine.generate([request]))

    model = hf_model(tiny_llama)
    for request_id, order in (("first", [0, 1, 2]), ("warm", [2, 0, 1])):
        token_ids, spans = prompt(order)
        example = BlockExample(token_ids, spans[0][0], placed_spans(spans, "reuse")[0])
        blocked, _, blocked_logits = greedy(model, example, blocked=True, max_new_tokens=8, stop_ids=set())
        _, _, full_logits = greedy(model, example, blocked=False, max_new_tokens=1, stop_ids=set())
        assert blocked == outputs[request_id]["token_ids"]
        assert not torch.allclose(blocked_logits[0], full_logits[0], atol=1e-4)  # the mask matters


def test_an_example_holds_the_gateways_prompt_with_its_documents_and_glue_placed():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ZOO[DEMO_MODEL_NAME].materialize(Path("unused")))
    passages = tuple(Passage(f"Title {i}", f"passage number {i} about the topic") for i in range(6))
    record = RagExample(1, "q1", "what is passage three about", ("topic",), passages, 3)
    recipe = Recipe(min_documents=3, max_documents=3, gold_share=1.0)
    for seed in range(5):
        example = make_example(tokenizer, record, random.Random(seed), recipe)
        assert example is not None
        documents = [tokenizer.decode(example.token_ids[s:e]) for s, e in example.placed[::2]]
        assert len(documents) == 3 and any("number 3" in d for d in documents)  # the gold one
        assert all(d.strip().startswith("Title") for d in documents)
        assert all(a[1] == b[0] for a, b in zip(example.placed, example.placed[1:]))  # glue between
        assert example.prefix_len == example.placed[0][0]
        assert "what is passage three about" in tokenizer.decode(example.token_ids[example.fresh_start :])


def test_a_saved_adapter_merges_into_a_checkpoint_that_answers_as_the_adapted_model(tiny_llama, tmp_path):
    model = hf_model(tiny_llama)
    reference = model(torch.tensor([[3, 14, 15, 92, 65]])).logits
    adapters = add_adapters(model, rank=4, alpha=8.0, seed=0)
    with torch.no_grad():
        for adapter in adapters.values():
            adapter.lora_b.normal_(std=0.5)
            adapter.lora_b.copy_(adapter.lora_b.half().float())  # as saved: fp16
            adapter.lora_a.copy_(adapter.lora_a.half().float())
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    with adapters_off(adapters):
        assert torch.equal(model(ids).logits, reference)
    adapted = model(ids).logits
    assert not torch.allclose(adapted, reference, atol=1e-3)

    save_adapter(adapters, tmp_path / "adapter.safetensors", {"base": "tiny"})
    merged = merge_adapter(tiny_llama, tmp_path / "adapter.safetensors", tmp_path / "merged")
    assert torch.allclose(hf_model(merged)(ids).logits, adapted, atol=1e-4)
    assert merged_is_current(merged, tiny_llama, tmp_path / "adapter.safetensors")
    assert not (tmp_path / "merged.tmp").exists()


def test_a_malformed_or_misfit_adapter_is_refused(tiny_llama, tmp_path):
    a, b = torch.zeros(4, 64), torch.zeros(64, 4)
    name = "model.layers.0.self_attn.q_proj.weight"
    save_file({name + ".lora_a": a, name + ".lora_b": b}, str(tmp_path / "no_scale.safetensors"))
    with pytest.raises(ValueError, match="scale"):
        read_adapter(tmp_path / "no_scale.safetensors")
    save_file({name + ".lora_a": a}, str(tmp_path / "unpaired.safetensors"), metadata={"scale": "2.0"})
    with pytest.raises(ValueError, match="lora_b"):
        read_adapter(tmp_path / "unpaired.safetensors")
    wide = {name + ".lora_a": torch.zeros(4, 65), name + ".lora_b": b}
    save_file(wide, str(tmp_path / "wide.safetensors"), metadata={"scale": "2.0"})
    with pytest.raises(ValueError, match="does not fit"):
        merge_adapter(tiny_llama, tmp_path / "wide.safetensors", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_zoo_merges_an_adapted_model_once_and_again_when_its_adapter_changes(tmp_path):
    from transformers import AutoModelForCausalLM

    base = ZOO[DEMO_MODEL_NAME]
    model = AutoModelForCausalLM.from_pretrained(base.materialize(tmp_path), dtype=torch.float32)
    adapters = add_adapters(model, rank=2, alpha=2.0, seed=0)
    adapter_file = tmp_path / "adapter.safetensors"
    save_adapter(adapters, adapter_file, {})
    entry = AdaptedModel("demo-rag", DEMO_MODEL_NAME, adapter_file, "test")
    merged = entry.materialize(tmp_path / "cache")
    assert (merged / "config.json").is_file() and (merged / "tokenizer.json").is_file()
    written = (merged / "model.safetensors").stat().st_mtime_ns
    stamp = json.loads((merged / "ragspeed_adapter.json").read_text())
    assert entry.materialize(tmp_path / "cache") == merged
    assert (merged / "model.safetensors").stat().st_mtime_ns == written
    with torch.no_grad():
        next(iter(adapters.values())).lora_b.fill_(0.01)
    save_adapter(adapters, adapter_file, {})
    entry.materialize(tmp_path / "cache")
    assert json.loads((merged / "ragspeed_adapter.json").read_text()) != stamp
    assert (merged / "model.safetensors").stat().st_mtime_ns != written


def test_training_writes_an_adapter_its_card_and_held_out_figures(shared_data, tmp_path):
    figures = train_rag_adapter(
        tmp_path / "out",
        shared_data,
        base=DEMO_MODEL_NAME,
        minutes=5,
        max_steps=2,
        threads=1,
        recipe=Recipe(max_documents=3, max_answer_tokens=3),
        log=lambda line: None,
    )
    assert figures["steps"] == 2 and figures["examples"] == 4
    assert figures["held_out"]["questions"] == 20
    assert figures["held_out"]["stock_full"]["same_as_stock_full"] == 1.0
    pairs, scale = read_adapter(tmp_path / "out" / "adapter.safetensors")
    assert scale == 2.0 and len(pairs) == 7 * 8  # seven projections of each of the demo's 8 layers
    assert "| adapted_blocked |" in (tmp_path / "out" / "README.md").read_text()


def test_train_rag_defaults_to_the_shipped_data_which_holds_its_questions():
    from ragspeed.training.cli import train_rag

    (data_dir,) = [p.default for p in train_rag.params if p.name == "data_dir"]
    assert data_dir == DATA_DIR
    assert rag_data(DATA_DIR) == SHIPPED_DATA
    assert SHIPPED_DATA.file_names() == ["hotpot_dev100.jsonl", "nq_dev100.jsonl"]
    assert all((DATA_DIR / name).is_file() for name in SHIPPED_DATA.file_names())
    train = [r for q in SHIPPED_DATA.train for r in read_records(DATA_DIR, q.lines, q.file_name)]
    held = SHIPPED_DATA.held_out
    assert (len(train), len(read_records(DATA_DIR, held.lines, held.file_name))) == (100, 20)
    assert held.describe() == "lines 81-100 of `nq_dev100.jsonl`"
    # a few MB at most in all
    assert sum(p.stat().st_size for p in DATA_DIR.iterdir()) < 5_000_000


def test_train_rag_reads_the_dev_data_where_the_folder_has_it_and_names_what_is_missing(tmp_path):
    for name in ("nq_dev.jsonl", "hotpot_dev100.jsonl"):
        (tmp_path / name).write_text("")
    assert rag_data(tmp_path) == DEV_DATA
    assert DEV_DATA.train == (
        QuestionLines("nq_dev.jsonl", range(201, 281)),
        QuestionLines("hotpot_dev100.jsonl"),
    )
    (tmp_path / "hotpot_dev100.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="has no hotpot_dev100.jsonl"):
        rag_data(tmp_path)
    (tmp_path / "nq_dev.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="has no hotpot_dev100.jsonl and no nq_dev100.jsonl"):
        rag_data(tmp_path)


@pytest.mark.slow
def test_train_rag_runs_on_the_shipped_data_by_default(tmp_path):
    """`ragspeed train-rag --out DIR` from a fresh clone: HotpotQA trains, 20 shipped NQ
    questions are held out (the demo model as the base, two steps)."""
    from click.testing import CliRunner

    from ragspeed.training.cli import train_rag

    out = tmp_path / "adapter"
    args = ["--base", DEMO_MODEL_NAME, "--out", str(out), "--max-steps", "2", "--threads", "1"]
    result = CliRunner().invoke(train_rag, args)
    assert result.exit_code == 0, result.output
    figures = json.loads((out / "figures.json").read_text())
    assert figures["steps"] == 2 and figures["held_out"]["questions"] == 20
    assert figures["data"] == {
        "train": ["the questions of `hotpot_dev100.jsonl`"],
        "held_out": "lines 81-100 of `nq_dev100.jsonl`",
    }
    assert "lines 81-100 of `nq_dev100.jsonl`" in (out / "README.md").read_text()
