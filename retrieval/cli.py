"""CLI: `ragspeed index build|add|query|stats` (index_app) and `ragspeed eval retrieval` (eval_app).

Command logic lives in plain functions returning dicts; the typer commands print them.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import typer

from ragspeed.retrieval.config import IndexConfig, RetrievalConfig
from ragspeed.retrieval.errors import CollectionNotFound, RetrievalError

DEFAULT_ROOT = Path(".ragspeed") / "collections"

index_app = typer.Typer(help="Build, update, query and inspect retrieval collections.", no_args_is_help=True)
eval_app = typer.Typer(help="Quality and speed evaluations.", no_args_is_help=True)


def _store(root: Path, model: str | None, config: RetrievalConfig, embedder=None):
    """A store over `root`; `embedder` (already loaded) wins over `model`."""
    from ragspeed.retrieval.embedders import SentenceTransformerEmbedder
    from ragspeed.retrieval.store import CollectionStore

    if embedder is None:
        embedder = SentenceTransformerEmbedder(
            model, batch_size=config.embed_batch_size, progress_min_texts=config.progress_min_texts
        )
    return CollectionStore(root, embedder, config)


def _config(chunk_tokens: int, chunk_overlap: int, index_kind: str) -> RetrievalConfig:
    return RetrievalConfig(
        chunk_tokens=chunk_tokens, chunk_overlap_tokens=chunk_overlap, index=IndexConfig(kind=index_kind)
    )


# ---- plain functions ----------------------------------------------------------------------
def ingest_into_collection(
    paths: list[Path],
    collection: str,
    root: Path,
    *,
    model: str | None,
    config: RetrievalConfig,
    fresh: bool,
    embedder=None,
) -> dict[str, Any]:
    store = _store(root, model, config, embedder)
    if fresh and collection in {s.name for s in store.list()} | set(store.refused()):
        store.delete(collection)
    store.create(collection, exist_ok=True)
    result, report = store.add_files(collection, paths)
    stats = store.stats(collection)
    return {
        "collection": collection,
        "num_files": report.num_files,
        "num_added": result.num_added,
        "num_duplicates": result.num_duplicates,
        "num_skipped": len(report.skipped),
        "skipped": list(report.skipped),
        "num_documents": stats.num_documents,
        "index_kind": stats.index_kind,
    }


def query_collection(
    text: str, collection: str, root: Path, *, top_k: int, mode: str | None, model: str | None, embedder=None
) -> dict[str, Any]:
    store = _store(root, model, RetrievalConfig(), embedder)
    hits = store.query(collection, text, top_k, mode)
    return {
        "collection": collection,
        "query": text,
        "hits": [
            {"rank": h.rank, "score": h.score, "id": h.document.id, "title": h.document.title, "text": h.document.text}
            for h in hits
        ],
    }


def collection_stats(collection: str | None, root: Path, *, model: str | None, embedder=None) -> dict[str, Any]:
    store = _store(root, model, RetrievalConfig(), embedder)
    stats = [store.stats(collection)] if collection else store.list()
    return {"collections": [asdict(s) for s in stats], "refused": store.refused()}


def run_retrieval_eval(
    data: Path,
    *,
    distractors: Path | None,
    scale_n: int,
    scale_index: str,
    scale_queries: int,
    scale_clusters: int,
    model: str | None,
    config: RetrievalConfig | None = None,
) -> dict[str, Any]:
    from ragspeed.retrieval.evaluation import evaluate_quality, evaluate_scale

    result: dict[str, Any] = {}
    if not data.is_file():
        raise RetrievalError(f"--data {data} is not a file", "data")
    if distractors is not None and not distractors.is_file():
        raise RetrievalError(f"--distractors {distractors} is not a file", "distractors")
    from ragspeed.retrieval.embedders import SentenceTransformerEmbedder

    config = config or RetrievalConfig()
    embedder = SentenceTransformerEmbedder(model, progress_min_texts=config.progress_min_texts)
    result.update(evaluate_quality(data, embedder, config, distractors))
    if scale_n > 0:
        # The scale run measures the large-collection index, so "auto" means the large kind.
        kind = IndexConfig().large_index_kind if scale_index == "auto" else scale_index
        result.update(
            evaluate_scale(
                scale_n, IndexConfig(kind=kind), num_queries=scale_queries, num_clusters=scale_clusters
            )
        )
    return result


# ---- printing -----------------------------------------------------------------------------
def _fail(exc: Exception) -> None:
    typer.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
    raise typer.Exit(code=2)


def _print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        typer.echo(f"{key:<{width}}  {value}")


def _write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


RootOpt = typer.Option(DEFAULT_ROOT, "--root", help="Directory holding the collection files.")
CollOpt = typer.Option("default", "--collection", "-c", help="Collection name.")
ModelOpt = typer.Option(None, "--model", help="Sentence-transformers model path (default: bundled MiniLM).")


def _ingest_command(paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path, fresh):
    try:
        out = ingest_into_collection(
            paths, collection, root, model=model, config=_config(chunk_tokens, chunk_overlap, index_kind), fresh=fresh
        )
    except (RetrievalError, CollectionNotFound) as exc:
        _fail(exc)
    for message in out["skipped"]:
        typer.echo(message, err=True)
    _print_table([(k, v) for k, v in out.items() if k != "skipped"])
    _write_json(json_path, out)


@index_app.command("build")
def build_cmd(
    paths: list[Path] = typer.Argument(..., help=".txt, .md, .jsonl files or directories"),
    collection: str = CollOpt,
    root: Path = RootOpt,
    model: str | None = ModelOpt,
    chunk_tokens: int = typer.Option(200, help="Tokens per chunk."),
    chunk_overlap: int = typer.Option(40, help="Tokens shared by consecutive chunks."),
    index_kind: str = typer.Option("auto", help="auto | flat | ivf | hnsw"),
    json_path: Path | None = typer.Option(None, "--json", help="Write the summary as JSON here."),
) -> None:
    """Build a collection from files, replacing any collection of that name."""
    _ingest_command(paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path, fresh=True)


@index_app.command("add")
def add_cmd(
    paths: list[Path] = typer.Argument(..., help=".txt, .md, .jsonl files or directories"),
    collection: str = CollOpt,
    root: Path = RootOpt,
    model: str | None = ModelOpt,
    chunk_tokens: int = typer.Option(200, help="Tokens per chunk."),
    chunk_overlap: int = typer.Option(40, help="Tokens shared by consecutive chunks."),
    index_kind: str = typer.Option("auto", help="auto | flat | ivf | hnsw"),
    json_path: Path | None = typer.Option(None, "--json", help="Write the summary as JSON here."),
) -> None:
    """Add files to a collection (created if missing); duplicates are dropped."""
    _ingest_command(paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path, fresh=False)


@index_app.command("query")
def query_cmd(
    text: str = typer.Argument(..., help="The question."),
    collection: str = CollOpt,
    root: Path = RootOpt,
    model: str | None = ModelOpt,
    top_k: int = typer.Option(5, "--top-k", "-k"),
    mode: str = typer.Option("hybrid", help="dense | bm25 | hybrid"),
    json_path: Path | None = typer.Option(None, "--json"),
) -> None:
    """Search a collection."""
    try:
        out = query_collection(text, collection, root, top_k=top_k, mode=mode, model=model)
    except (RetrievalError, CollectionNotFound) as exc:
        _fail(exc)
    for hit in out["hits"]:
        snippet = " ".join(hit["text"].split())[:100]
        typer.echo(f"{hit['rank']:>3}  {hit['score']:.4f}  {hit['id']}  {hit['title'][:40]}  {snippet}")
    if not out["hits"]:
        typer.echo("(no hits)")
    _write_json(json_path, out)


@index_app.command("stats")
def stats_cmd(
    collection: str | None = typer.Option(None, "--collection", "-c", help="One collection (default: all)."),
    root: Path = RootOpt,
    model: str | None = ModelOpt,
    json_path: Path | None = typer.Option(None, "--json"),
) -> None:
    """Show collection sizes and index kinds."""
    try:
        out = collection_stats(collection, root, model=model)
    except (RetrievalError, CollectionNotFound) as exc:
        _fail(exc)
    for stats in out["collections"]:
        _print_table(list(stats.items()))
        typer.echo("")
    for name, reason in out["refused"].items():
        typer.echo(f"refused {name}: {reason}", err=True)
    _write_json(json_path, out)


@eval_app.callback()
def _eval_group() -> None:
    """Evaluations."""


@eval_app.command("retrieval")
def eval_retrieval_cmd(
    data: Path = typer.Option(Path("../shared/data/nq_dev.jsonl"), help="NQ-style QA JSONL."),
    json_path: Path | None = typer.Option(None, "--json", help="Write flat JSON results here."),
    distractors: Path | None = typer.Option(None, help="Text file, one extra passage per line."),
    scale_n: int = typer.Option(1_000_000, help="Synthetic vectors for the scale run (0 skips it)."),
    scale_index: str = typer.Option("auto", help="auto | ivf | hnsw | flat for the scale run."),
    scale_queries: int = typer.Option(1000, help="Queries timed in the scale run."),
    scale_clusters: int = typer.Option(4096, help="Gaussian mixture components (~4 per IVF cell at 1M)."),
    model: str | None = ModelOpt,
    rrf_k: int = typer.Option(RetrievalConfig().rrf_k, help="Reciprocal rank fusion constant k."),
    dense_weight: float = typer.Option(RetrievalConfig().dense_weight, help="Fusion weight of the dense ranking."),
    bm25_weight: float = typer.Option(RetrievalConfig().bm25_weight, help="Fusion weight of the BM25 ranking."),
) -> None:
    """Recall@1/5/20 (dense, BM25, hybrid) and latency on NQ passages; HNSW/IVF at scale."""
    try:
        out = run_retrieval_eval(
            data,
            distractors=distractors,
            scale_n=scale_n,
            scale_index=scale_index,
            scale_queries=scale_queries,
            scale_clusters=scale_clusters,
            model=model,
            config=RetrievalConfig(rrf_k=rrf_k, dense_weight=dense_weight, bm25_weight=bm25_weight),
        )
    except RetrievalError as exc:
        _fail(exc)
    _print_table(list(out.items()))
    _write_json(json_path, out)
