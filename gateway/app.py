"""The app factory: `create_app(settings)`; the lifespan builds everything onto `app.state`.

The engine loads in the background so that `/healthz` can answer "loading" (503) meanwhile;
requests are served once it is ready.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.backends import build_engine
from gateway.errors import install_error_handlers
from gateway.metrics import GatewayMetrics
from gateway.pipeline import Pipeline
from gateway.routes import openai, ops
from gateway.settings import Settings

logger = logging.getLogger("ragspeed.gateway")


def create_app(settings: Settings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state = app.state
        state.settings = settings
        state.started_at = int(time.time())
        state.metrics = GatewayMetrics()
        state.engine = build_engine(settings.engine_config())
        state.engine_ready, state.engine_error = False, None
        state.pipeline = Pipeline(settings=settings, engine=state.engine, metrics=state.metrics)
        state.metrics.watch_engine(state.engine.stats, settings.model_id)

        async def load() -> None:
            t0 = time.perf_counter()
            try:
                await state.engine.start()
            except Exception as exc:
                state.engine_error = f"{type(exc).__name__}: {exc}"
                logger.exception("engine %s failed to start", settings.engine)
                return
            state.engine_ready = True
            logger.info("engine %s ready with %s in %.1f s", settings.engine, settings.model,
                        time.perf_counter() - t0)

        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            await state.engine.shutdown()

    app = FastAPI(title="ragspeed", version=_version(), lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(ops.router)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ragspeed")
    except PackageNotFoundError:
        return "0+unknown"
