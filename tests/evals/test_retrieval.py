import numpy as np
from click.testing import CliRunner

from ragspeed.evals.cli import eval_group
from ragspeed.evals.retrieval import evaluate_scale, gaussian_mixture, load_nq
from ragspeed.retrieval.config import IndexConfig


def test_gaussian_mixture_is_seeded_unit_and_clustered():
    a = gaussian_mixture(1000, 32, num_clusters=4, seed=7)
    assert a.shape == (1000, 32) and a.dtype == np.float32
    assert np.allclose(np.linalg.norm(a, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(a, gaussian_mixture(1000, 32, num_clusters=4, seed=7))
    assert not np.array_equal(a[:10], gaussian_mixture(10, 32, num_clusters=4, seed=8))
    # Any row range is the same rows of the endless stream.
    assert np.array_equal(
        gaussian_mixture(10, 32, 4, seed=7, first=65_536), gaussian_mixture(65_546, 32, 4, seed=7)[65_536:]
    )
    # Four clusters: a point's best neighbour is far closer than a random pair.
    sims = a[:100] @ a.T
    np.fill_diagonal(sims[:, :100], -1)
    assert sims.max(axis=1).mean() > 0.4 > abs(sims.mean())


def test_load_nq_passages_and_gold(shared_data):
    passages, questions = load_nq(shared_data / "nq_dev.jsonl")
    assert (len(passages), len(questions)) == (1239, 300)  # 1,247 distinct, 8 differ only in white space
    ids = {p.id for p in passages}
    assert all(gold in ids for _, gold in questions)
    assert questions[0][0] == "who sings for the beast in the new movie"


def test_scale_run_at_10k():
    result = evaluate_scale(
        10_000, IndexConfig(kind="ivf"), dim=64, num_clusters=100, num_queries=200, num_exact_timed=10
    )
    assert (result["scale_n"], result["scale_index_kind"], result["scale_num_cells"]) == (10_000, "ivf", 100)
    assert result["scale_recall_at_10"] >= 0.95
    assert result["scale_query_p99_ms"] > 0
    assert set(result) >= {"scale_build_time_s", "scale_memory_mb", "scale_query_p50_ms", "scale_nprobe"}


def test_evaluate_quality_on_a_tiny_file(tmp_path, embedder):
    import json

    from ragspeed.evals.retrieval import evaluate_quality
    from ragspeed.retrieval.config import RetrievalConfig

    passages = [
        ("Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris."),
        ("Nile", "The Nile is the longest river in Africa."),
        ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level."),
    ]
    questions = [
        "in which city is the eiffel tower",
        "what is the longest river in africa",
        "what is the highest mountain",
    ]
    with open(tmp_path / "qa.jsonl", "w") as out:
        for gold, question in enumerate(questions):
            docs = [{"title": t, "text": x, "is_gold": i == gold} for i, (t, x) in enumerate(passages)]
            out.write(json.dumps({"question": question, "answers": ["x"], "documents": docs}) + "\n")
    (tmp_path / "more.txt").write_text("Cats purr.\n\nThe Nile is the longest river in Africa.\n")
    result = evaluate_quality(tmp_path / "qa.jsonl", embedder, RetrievalConfig(), tmp_path / "more.txt")
    assert (result["num_passages"], result["num_distractors"], result["num_questions"]) == (3, 1, 3)
    for mode in ("dense", "bm25", "hybrid"):
        assert result[f"recall_at_1_{mode}"] == 1.0
    assert result["hybrid_beats_best_single_at_5"] is True
    assert result["query_p99_ms_hybrid"] > 0


def test_eval_rejects_missing_data(tmp_path):
    out = CliRunner().invoke(
        eval_group, ["retrieval", "--data", str(tmp_path / "none.jsonl"), "--scale-n", "0"]
    )
    assert out.exit_code == 2
    assert out.output == f"error: --data {tmp_path / 'none.jsonl'} is not a file\n"
