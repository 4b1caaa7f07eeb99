"""CLI: `ragspeed index build|add|query|stats`.

Command logic lives in plain functions returning dicts; the click commands print them.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from ragspeed.retrieval.config import IndexConfig, RetrievalConfig
from ragspeed.retrieval.errors import CollectionNotFound, RetrievalError

DEFAULT_ROOT = Path(".ragspeed") / "collections"


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
            {
                "rank": h.rank,
                "score": h.score,
                "id": h.document.id,
                "title": h.document.title,
                "text": h.document.text,
            }
            for h in hits
        ],
    }


def collection_stats(
    collection: str | None, root: Path, *, model: str | None, embedder=None
) -> dict[str, Any]:
    store = _store(root, model, RetrievalConfig(), embedder)
    stats = [store.stats(collection)] if collection else store.list()
    return {"collections": [asdict(s) for s in stats], "refused": store.refused()}


# ---- printing -----------------------------------------------------------------------------
def _fail(exc: Exception) -> None:
    click.echo(f"error: {getattr(exc, 'message', exc)}", err=True)
    raise click.exceptions.Exit(2)


def _print_table(rows: list[tuple[str, Any]]) -> None:
    width = max(len(key) for key, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {value}")


def _write_json(path: Path | None, payload: dict[str, Any]) -> None:
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n")


def _common_options(command):
    """--collection, --root and --model, shared by every index command."""
    command = click.option(
        "--model", default=None, help="Sentence-transformers model path (default: bundled MiniLM)."
    )(command)
    command = click.option(
        "--root",
        default=DEFAULT_ROOT,
        type=click.Path(file_okay=False, path_type=Path),
        help="Directory holding the collection files.",
    )(command)
    return command


def _collection_option(command):
    return click.option("--collection", "-c", default="default", help="Collection name.")(command)


def _ingest_options(command):
    command = click.option(
        "--json",
        "json_path",
        default=None,
        type=click.Path(dir_okay=False, path_type=Path),
        help="Write the summary as JSON here.",
    )(command)
    command = click.option("--index-kind", default="auto", help="auto | flat | ivf | hnsw")(command)
    command = click.option(
        "--chunk-overlap", default=40, type=int, help="Tokens shared by consecutive chunks."
    )(command)
    command = click.option("--chunk-tokens", default=200, type=int, help="Tokens per chunk.")(command)
    command = _common_options(command)
    command = _collection_option(command)
    return click.argument("paths", nargs=-1, required=True, type=click.Path(path_type=Path))(command)


def _ingest_command(
    paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path, fresh
):
    try:
        out = ingest_into_collection(
            list(paths),
            collection,
            root,
            model=model,
            config=_config(chunk_tokens, chunk_overlap, index_kind),
            fresh=fresh,
        )
    except (RetrievalError, CollectionNotFound) as exc:
        _fail(exc)
    for message in out["skipped"]:
        click.echo(message, err=True)
    _print_table([(k, v) for k, v in out.items() if k != "skipped"])
    _write_json(json_path, out)


@click.group(name="index")
def index_group() -> None:
    """Build, update, query and inspect retrieval collections."""


@index_group.command("build")
@_ingest_options
def build_cmd(paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path) -> None:
    """Build a collection from files, replacing any collection of that name.

    PATHS: .txt, .md, .jsonl files or directories.
    """
    _ingest_command(
        paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path, fresh=True
    )


@index_group.command("add")
@_ingest_options
def add_cmd(paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path) -> None:
    """Add files to a collection (created if missing); duplicates are dropped.

    PATHS: .txt, .md, .jsonl files or directories.
    """
    _ingest_command(
        paths, collection, root, model, chunk_tokens, chunk_overlap, index_kind, json_path, fresh=False
    )


@index_group.command("query")
@click.argument("text")
@_collection_option
@_common_options
@click.option("--top-k", "-k", default=5, type=int)
@click.option("--mode", default="hybrid", help="dense | bm25 | hybrid")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False, path_type=Path))
def query_cmd(
    text: str, collection: str, root: Path, model: str | None, top_k: int, mode: str, json_path: Path | None
) -> None:
    """Search a collection for TEXT (the question)."""
    try:
        out = query_collection(text, collection, root, top_k=top_k, mode=mode, model=model)
    except (RetrievalError, CollectionNotFound) as exc:
        _fail(exc)
    for hit in out["hits"]:
        snippet = " ".join(hit["text"].split())[:100]
        click.echo(f"{hit['rank']:>3}  {hit['score']:.4f}  {hit['id']}  {hit['title'][:40]}  {snippet}")
    if not out["hits"]:
        click.echo("(no hits)")
    _write_json(json_path, out)


@index_group.command("stats")
@click.option("--collection", "-c", default=None, help="One collection (default: all).")
@_common_options
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False, path_type=Path))
def stats_cmd(collection: str | None, root: Path, model: str | None, json_path: Path | None) -> None:
    """Show collection sizes and index kinds."""
    try:
        out = collection_stats(collection, root, model=model)
    except (RetrievalError, CollectionNotFound) as exc:
        _fail(exc)
    for stats in out["collections"]:
        _print_table(list(stats.items()))
        click.echo("")
    for name, reason in out["refused"].items():
        click.echo(f"refused {name}: {reason}", err=True)
    _write_json(json_path, out)
