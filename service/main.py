"""create_app(): load and check the model, build runner + batcher + metrics, warm up, serve.

Loading (and every configuration error) happens in create_app, before uvicorn starts, so a bad
model or setting stops the start with one clear message. Warm-up (kernel compilation and
autotuning) runs after the server is listening: /health/live answers at once, /health/ready turns
200 only once every batch bucket has run.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI

from .config import Settings, load_settings

log = logging.getLogger("fusedserve")
SHUTDOWN_TIMEOUT_S = 30


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or load_settings()
    # Imports that define kernels come after this line: see prepare_backend.
    device = prepare_backend(settings)

    from .api import router
    from .batching import Batcher
    from .metrics import Metrics
    from .model.loader import load_model
    from .model.runner import ModelRunner
    from .state import AppState

    torch.backends.cuda.matmul.allow_tf32 = settings.allow_tf32  # one setting for both modes
    from kernels import pdl, tuning

    tuning.use_cache(settings.tuning_cache or tuning.default_cache_path())
    tuning.set_enabled(settings.tuning)
    pdl.set_enabled(settings.pdl)
    model = load_model(settings.model_path())
    dtype = settings.compute_dtype(device.type)
    metrics = Metrics(model.name, settings.mode, str(device), dtype)
    runner = ModelRunner(
        model,
        settings.mode,
        device,
        dtype,
        kernel_timing_every=settings.kernel_timing_every,
        cuda_graphs=settings.cuda_graphs,
        max_batch_size=settings.max_batch_size,
        observe_kernel=metrics.observe_kernel,
        observe_forward=metrics.observe_forward,
    )
    batcher = Batcher(
        runner.run,
        max_batch_size=settings.max_batch_size,
        max_delay_s=settings.max_delay_ms / 1e3,
        max_queue_requests=settings.max_queue_requests,
        observer=metrics,
    )
    state = AppState(settings, model, device, runner, batcher, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        warm = asyncio.create_task(_warm_up(state))
        try:
            yield
        finally:
            warm.cancel()
            try:
                # stop() waits for the batch in flight; a forward that hangs must not hang shutdown.
                await asyncio.wait_for(batcher.stop(), SHUTDOWN_TIMEOUT_S)
            except TimeoutError:
                log.error("the batch in flight did not finish within %d s; shutting down anyway", SHUTDOWN_TIMEOUT_S)

    app = FastAPI(title="fusedserve", version="0.1.0", lifespan=lifespan)
    app.state.fusedserve = state
    app.include_router(router)
    return app


def prepare_backend(settings: Settings) -> torch.device:
    """Resolve the device, and pick Triton's interpreter for fused kernels on the CPU.

    Triton fixes interpreted-vs-compiled when a kernel is defined, so this must run before
    `kernels` is first imported; if it already was, compiled for CUDA, the kernels' own device check
    names the problem at the first forward.
    """
    from .model.runner import resolve_device

    device = resolve_device(settings.device)
    if device.type == "cpu" and settings.mode == "fused":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return device


async def _warm_up(state) -> None:
    s = state.settings
    state.status = "warming"
    try:
        if s.warmup:
            sizes = await state.batcher.run_in_worker(lambda: state.runner.warmup(s.max_batch_size))
            log.info(
                "warm-up done: %s on %s, %s, batch sizes %s", s.mode, state.device, state.runner.executor.dtype, sizes
            )
        # Everything allocated so far (model, kernels, app) lives as long as the process: move it out of
        # the collector's view, so a full GC pass (100-200 ms seen on this event loop) has less to walk.
        gc.freeze()
        state.status = "ready"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a model that cannot run must not report ready
        log.exception("warm-up failed")
        state.status = "failed"
        state.error = f"warm-up failed: {type(e).__name__}: {e}"
