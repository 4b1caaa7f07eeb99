"""The lifespan builds one `AppState`: every service first, then the pipeline, complete."""

from __future__ import annotations

import asyncio

from ragspeed.gateway.app import create_app
from ragspeed.gateway.compress import CompressionStage
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.retrieval_service import RetrievalService
from ragspeed.gateway.settings import load_settings
from ragspeed.gateway.state import AppState


class _IdleEngine:
    """Just enough engine for a lifespan: starts when told, has no prefix cache."""

    model_name = "idle"
    max_model_len = 64

    def __init__(self, config):
        self.config = config
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.tokenizer = None

    async def start(self) -> None:
        self.started.set()
        await self.release.wait()
        self.tokenizer = object()

    async def shutdown(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def prefix_cache(self):
        return None


def test_the_pipeline_is_built_once_every_service_is_loaded(tmp_path):
    settings = load_settings(
        engine="transformers",
        model="idle",
        collections_dir=str(tmp_path / "collections"),
        compression_methods=["bm25"],  # no compressor models to load; retrieval's embedder is loaded
        compression_default_method="bm25",
    )
    engines: list[_IdleEngine] = []

    def factory(config, upstream):
        engines.append(_IdleEngine(config))
        return engines[-1]

    readiness: list[bool] = []
    app = create_app(
        settings, engine_factory=factory, on_ready=lambda: readiness.append(app.state.services.ready)
    )

    async def main():
        async with app.router.lifespan_context(app):
            state = app.state.services
            await engines[0].started.wait()
            loading = (state.ready, state.pipeline, state.compression, list(readiness))
            engines[0].release.set()
            async with asyncio.timeout(60):  # the load task ends once the embedder has loaded
                while not state.ready and state.engine_error is None:
                    await asyncio.sleep(0)  # yields the loop: no timed wait
            return state, loading

    state, loading = asyncio.run(main())
    assert loading == (False, None, None, [])
    assert readiness == [False]  # called once, loaded, before the first request is served
    assert isinstance(state, AppState) and state.engine_error is None
    assert [e.config.model for e in engines] == ["idle"]
    assert state.engine is engines[0] and state.arm_engines == {} and state.experiment is None
    assert isinstance(state.retrieval, RetrievalService) and isinstance(state.prompts, PromptService)
    assert isinstance(state.compression, CompressionStage)
    assert not state.prompts.pins  # the engine has no prefix cache
    assert state.compression.loaded_methods == ("bm25",) and state.retrieval.loaded
    # The pipeline and its preparer hold the state's services themselves, not copies.
    preparer = state.pipeline.preparer
    assert preparer.engine is state.engine and preparer.registry is state.prompts
    assert (
        preparer.documents.compression is state.compression
        and preparer.documents.retrieval is state.retrieval
    )
    assert state.settings is settings and state.admission is not None
