"""The app factory: `create_app(settings)`; the lifespan builds an `AppState` (gateway.state)
onto `app.state.services`.

The engines, every offered compressor's models and retrieval's embedder load in the background,
so that `/healthz` can answer "loading" (503) meanwhile; the pipeline is built once all of them
are loaded, and requests are served from then on: none pays a load.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

from ragspeed.engine.backends import build_engine
from ragspeed.engine.config import EngineConfig, UpstreamConfig
from ragspeed.engine.protocol import EngineClient
from ragspeed.gateway.admission import TTFTAdmission
from ragspeed.gateway.compress import CompressionStage
from ragspeed.gateway.cpu_jobs import CpuJobs
from ragspeed.gateway.document_precompute import DocumentPrecompute
from ragspeed.gateway.errors import install_error_handlers
from ragspeed.gateway.experiments import ArmError, ArmHintsMiddleware, build_live_experiment
from ragspeed.gateway.fidelity_gate import settings_default
from ragspeed.gateway.limits import (
    AdmissionMiddleware,
    AdmissionQueue,
    ArrivalMiddleware,
    BodyLimitMiddleware,
    Rejections,
)
from ragspeed.gateway.metrics import GatewayMetrics
from ragspeed.gateway.pipeline import build_pipeline
from ragspeed.gateway.prompt_registry import PromptService
from ragspeed.gateway.retrieval_service import RetrievalService
from ragspeed.gateway.routes import collections, experiments, openai, ops, prompts
from ragspeed.gateway.security import KeyRing, SecurityMiddleware, warn_if_exposed
from ragspeed.gateway.settings import ConfigError, Settings, check_settings
from ragspeed.gateway.state import AppState

logger = logging.getLogger("ragspeed.gateway")


def create_app(
    settings: Settings,
    *,
    engine_factory: Callable[[EngineConfig, UpstreamConfig], EngineClient] = build_engine,
    on_start_failure: Callable[[str], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The app; `engine_factory` builds the main engine and each A/B arm's own (tests pass a
    fake). `on_start_failure(error)` is called when loading fails (`ragspeed serve` exits);
    without it the app stays up, its /healthz answering 503 with the error. `on_ready()` is
    called once everything is loaded, before the first request is served."""
    check_settings(settings)
    keyring = KeyRing(settings.security.api_keys, settings.security.admin_key_hashes)
    rejections = Rejections()
    limits = settings.limits
    experiment = None
    if settings.experiments.path:
        try:
            experiment = build_live_experiment(settings.experiments.path, settings.options())
        except ArmError as exc:
            raise ConfigError(f"experiment: {exc}") from exc

    def build(arm_settings: Settings) -> EngineClient:
        return engine_factory(arm_settings.engine.config(), arm_settings.upstreams.config())

    try:  # built here (nothing loads before `start`), so that a refused option fails at once
        engine = build(settings)
        # A/B arms with `engine` overrides get an engine of their own, started with the main one.
        arm_engines = {
            arm.name: build(settings.with_options(arm.engine))
            for arm in (experiment.spec.arms if experiment else ())
            if arm.engine
        }
    except ValueError as exc:
        raise ConfigError(f"engine {settings.engine.backend}: {exc}") from exc

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        warn_if_exposed(settings.server.host, keyring, logger)
        metrics = GatewayMetrics()
        metrics.registry.register(rejections.counter)
        metrics.watch_engine(engine.stats, settings.model_id)
        admission = TTFTAdmission(
            limits.ttft_deadline_ms / 1000 if limits.ttft_deadline_ms is not None else None
        )
        metrics.watch_admission(admission.snapshot, settings.model_id)
        state = AppState(
            settings=settings,
            metrics=metrics,
            engine=engine,
            retrieval=RetrievalService(settings.retrieval),
            prompts=PromptService(engine, settings.prompts.cache_dir),
            started_at=int(time.time()),
            experiment=experiment,
            arm_engines=arm_engines,
            admission=admission,
        )
        app.state.services = state

        async def load() -> None:
            t0 = time.perf_counter()
            try:
                await engine.start()
                for arm_engine in arm_engines.values():
                    await arm_engine.start()
                await state.prompts.start()  # restore the pinned prompts saved before a restart
                if hasattr(engine, "estimate_new_tokens"):  # an engine on this machine: time it
                    await admission.calibrate(engine)
                state.precompute = DocumentPrecompute(engine, engine.tokenizer, metrics)
                # The fidelity gate's choice, read from `bench fidelity`'s result (logged).
                state.document_cache_default = await asyncio.to_thread(
                    settings_default, settings.engine, engine
                )
                state.compression = CompressionStage(settings.compression, engine.tokenizer)
                jobs = CpuJobs(engine)  # one CPU thread each, as their requests' jobs run
                await jobs.run(state.compression.warm)
                await jobs.run(state.retrieval.warm)
            except Exception as exc:
                state.engine_error = f"{type(exc).__name__}: {exc}"
                logger.error("engine %s failed to start: %s", settings.engine.backend, state.engine_error)
                logger.debug("the failure's traceback", exc_info=True)
                if on_start_failure is not None:
                    on_start_failure(state.engine_error)
                return
            if on_ready is not None:
                on_ready()
            # Every service is loaded: the pipeline is complete from its first request on.
            state.pipeline = build_pipeline(
                settings,
                metrics=metrics,
                engine=engine,
                prompts=state.prompts,
                retrieval=state.retrieval,
                compression=state.compression,
                experiment=experiment,
                arm_engines=arm_engines,
                admission=admission,
                document_cache_default=state.document_cache_default,
            )
            logger.info(
                "engine %s ready with %s in %.1f s",
                settings.engine.backend,
                settings.engine.model,
                time.perf_counter() - t0,
            )

        loading = asyncio.create_task(load())
        try:
            yield
        finally:
            loading.cancel()
            await asyncio.gather(loading, return_exceptions=True)
            if state.precompute is not None:
                await state.precompute.close()
            await state.prompts.close()
            await engine.shutdown()
            for arm_engine in arm_engines.values():
                await arm_engine.shutdown()

    app = FastAPI(title="ragspeed", version=_version(), lifespan=lifespan)
    install_error_handlers(app)
    # Outermost last: auth first (no body read for a bad key), then the body, read whole and
    # size-checked before admission (a slow upload must not hold a generation slot), then admission.
    app.add_middleware(
        AdmissionMiddleware,
        queue=AdmissionQueue(
            limits.max_concurrent_requests, limits.max_queued_requests, limits.queue_timeout_s
        ),
        rejections=rejections,
    )
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=limits.max_body_bytes, rejections=rejections)
    app.add_middleware(SecurityMiddleware, keyring=keyring, rejections=rejections)
    if experiment is not None:
        app.add_middleware(ArmHintsMiddleware)
    app.add_middleware(ArrivalMiddleware)
    app.include_router(openai.router)
    app.include_router(ops.router)
    app.include_router(experiments.router)
    app.include_router(collections.router)
    app.include_router(prompts.router)
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ragspeed")
    except PackageNotFoundError:
        return "0+unknown"
