"""What a front end holds: settings, what the model takes and gives, its engine link, its metrics."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from ..config import Settings
from ..link import wire
from ..link.model_info import ModelInfo
from ..link.plan import PLAN_FILE, read_plan
from ..link.tuning_progress import read_tuning
from ..metrics import RequestMetrics
from .auth import ApiKeys, Restrictions
from .engine_client import EngineClient

log = logging.getLogger(__name__)

# Longest JSON number orjson writes for a float ("-1.2345678901234567e-308," is 25 bytes), rounded up.
BYTES_PER_VALUE = 32


def body_limit(max_rows: int, input_features: int) -> int:
    """The largest request body (or gRPC message) a front end reads: max_rows rows of JSON numbers, plus 4 KiB."""
    return max_rows * input_features * BYTES_PER_VALUE + 4096


@dataclass
class FrontendState:
    """Everything one front-end process serves requests with."""

    settings: Settings
    model: ModelInfo
    engines: EngineClient
    metrics: RequestMetrics
    run_dir: Path
    draining: bool = False  # SIGTERM came: answers close their connections, /health/ready reads 503
    _plan: dict | None = None
    _plan_stamp: int | None = None
    # Who may call what (service/frontend/auth.py): inference's API keys (a served front end's are the supervisor's,
    # taken again at each reload by `take_keys`, never read from the keys file) and the restricted routes' header rules.
    api_keys: ApiKeys = field(default=None)  # type: ignore[assignment]  (made from settings when not given)
    restrictions: Restrictions = field(default=None)  # type: ignore[assignment]
    # SIGHUP reloads (service/link/live.py): the supervisor's shared generation and the one this front end has.
    config_generation: object | None = None
    config_seen: int = 0
    _body_limit: tuple[Settings, int] | None = None  # (the settings, max_body_bytes under them)

    def __post_init__(self) -> None:
        if self.api_keys is None:
            self.api_keys = ApiKeys(self.settings)
        if self.restrictions is None:
            self.restrictions = Restrictions(self.settings.restrictions())

    def reload_access(self, settings: Settings | None = None) -> bool:
        """For a front end that runs on its own (in process, no supervisor): read the API keys again (the keys file,
        or `settings`' key settings when given) and take `settings`' restriction rules; True if it did. A keys file
        that cannot be read, or a reload that would turn keys off, is logged and changes nothing: the keys in force
        stay (auth.ApiKeys.reload). A supervisor's front end never reads the file: it takes the supervisor's keys
        (`take_keys`)."""
        from .auth import SecurityFileError

        try:
            n = self.api_keys.reload(settings)
        except SecurityFileError as e:
            log.error("API keys not reloaded: %s", e)
            return False
        if settings is not None:
            self.restrictions = Restrictions(settings.restrictions())
        if n:
            log.info("API keys reloaded: %s", self.api_keys.describe())
        return True

    def take_live_settings(self) -> bool:
        """If the supervisor published new live settings, take them: the request timeout, the configured mode (the
        label of requests no executor ran, and what /health/ready and /model say), the log level. True if it did."""
        generation = self.config_generation
        if generation is None or generation.value == self.config_seen:
            return False
        from ..link.live import read_live
        from ..processes import set_log_level

        try:
            self.config_seen, live = read_live(self.run_dir)
        except Exception:
            self.config_seen = generation.value  # logged by the caller once, not again every poll
            raise
        self.settings = self.settings.model_copy(update=live)
        self.metrics.set_mode(self.settings.mode)
        set_log_level(self.settings.log_level)
        self.take_keys()  # the supervisor's keys of this generation (a SIGHUP after the keys file changed)
        return True

    def take_keys(self) -> bool:
        """Take the API keys the supervisor published with its new configuration (auth.read_keys_in_force), never the
        keys file, which may say anything by now; True if they changed. One that cannot be read (or would turn keys
        off) leaves this front end refusing every inference request (401) and stopping, so that the supervisor starts
        it again with the keys in force in its arguments: it never serves open, nor with keys the others dropped."""
        from .auth import SecurityFileError, read_keys_in_force

        try:
            _, in_force = read_keys_in_force(self.run_dir)
            changed = self.api_keys.take(in_force)
        except (OSError, ValueError, SecurityFileError) as e:
            self.api_keys.refuse_all()
            log.error("cannot take the supervisor's API keys (%s): refusing inference and stopping, to be started "
                      "again with the keys in force", e)  # fmt: skip
            os.kill(os.getpid(), signal.SIGTERM)  # uvicorn drains (every answer 401 meanwhile) and exits
            return False
        if changed:
            log.info("API keys taken: %s", self.api_keys.describe())
        return changed

    @property
    def ready(self) -> bool:
        return not self.draining and self.engines.ready()

    @property
    def status(self) -> str:
        """draining, or the least advanced engine's state: loading, warming, ready, failed, broken or stopped."""
        if self.draining:
            return "draining"
        states = self.engines.states()
        worst = next((s for s in (wire.FAILED_START, wire.BROKEN, wire.STOPPED) if s in states), min(states))
        return wire.ENGINE_STATES[worst]

    @property
    def max_body_bytes(self) -> int:
        settings = self.settings
        cached = self._body_limit
        if cached is not None and cached[0] is settings:  # worked out once per settings (a reload makes new ones)
            return cached[1]
        limit = body_limit(settings.max_rows_per_request, self.model.input_features)
        limit = limit if self.model.image is None else max(limit, settings.max_image_body_bytes)
        self._body_limit = (settings, limit)
        return limit

    def predictions(self, indices: np.ndarray) -> list:
        labels = self.model.labels
        return [labels[i] for i in indices.tolist()] if labels else indices.tolist()

    def plan(self) -> dict:
        # Reread when engine 0 rewrites it (after a warm-up that fell back to unfused ops): one stat per call.
        try:
            stamp = (self.run_dir / PLAN_FILE).stat().st_mtime_ns
        except OSError:
            stamp = None
        if self._plan is None or stamp != self._plan_stamp:
            self._plan, self._plan_stamp = read_plan(self.run_dir), stamp
        return self._plan or {}

    def describe(self) -> dict:
        plan = self.plan()
        s = self.settings
        return {
            **{k: v for k, v in asdict(self.model).items() if k != "input_shape"},
            "input_shape": list(self.model.input_shape),
            "mode": s.mode,
            "device": plan.get("device"),
            "dtype": plan.get("dtype"),
            "engines": len(self.engines.states()),
            "max_batch_size": s.max_batch_size,
            "max_rows_per_request": s.max_rows_per_request,
            "plan": plan.get("plan"),
            # background tuning (FUSEDSERVE_TUNING_BACKGROUND): keys still on an untimed config, and those timed since
            "tuning": {"background": s.tuning and s.tuning_background, **read_tuning(self.run_dir)},
            "status": self.status,
        }
