"""What one `bench serve` run does, resolved from the flags: the systems it starts and the Plan that cli.py
builds and run.py executes (both import this module; neither imports the other back)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .model import ModelInfo, resolve

SYSTEMS = ("empty", "empty_grpc", "eager", "fused", "unfused", "pil")
FUSEDSERVE = ("fused", "unfused")
GRPC_ONLY = ("empty_grpc",)  # no HTTP: only the single-row gRPC phases (bench/serve/apps/empty_grpc.py)


@dataclass(frozen=True)
class System:
    name: str  # empty | empty_grpc | eager | fused | unfused | pil
    workers: int

    @property
    def key(self) -> str:
        return f"{self.name}@{self.workers}"

    @property
    def fusedserve(self) -> bool:
        return self.name in FUSEDSERVE

    @property
    def grpc_only(self) -> bool:
        return self.name in GRPC_ONLY

    def cannot_serve(self, model: ModelInfo) -> str | None:
        """Why this system cannot serve `model` (None: it can): the comparison apps answer for the digits MLP only,
        but the empty route takes an image model's binary requests in too (its v2 route reads no tensor)."""
        if self.name == "pil":  # the CPU-preprocessing peer (bench/serve/apps/pil.py): files in, tensors upstream
            return None if model.takes_files else f"pil prepares encoded files: {model.name} declares no input.image"
        if self.fusedserve or model.shipped_mlp or (self.name == "empty" and model.image):
            return None
        return f"{self.name} answers only for the digits MLP's 64-value rows, not {model.name}'s {model.input_shape}"


@dataclass(frozen=True)
class Plan:
    """One run, resolved from the flags."""

    device: str
    dtype: str
    systems: tuple[System, ...]
    workers: int
    connections: tuple[int, ...]
    rows: tuple[int, ...]
    duration_s: float
    warmup_s: float
    rates: tuple[float, ...] | None  # None: auto (fractions of the empty route's closed-loop peak)
    open_systems: tuple[System, ...]
    open_connections: int
    clients: int
    client: str
    sigterm: bool
    time_budget_s: float
    drain_timeout_s: float
    ready_timeout_s: float
    tuning_cache: Path | None
    v2: tuple[str, ...]  # Open Inference Protocol phases: v2_binary, v2_grpc
    v2_rows: int
    rounds: int  # how many times a fused/unfused pair runs each shared phase
    quick: bool
    seed: int
    out: Path | None  # None: bench/results/<gpu>
    model: ModelInfo = field(default_factory=lambda: resolve(None))  # what fusedserve serves (the digits MLP)
    input_dtype: str = "FP32"  # the v2 tensors' datatype: FP32, FP16, or UINT8 (a model that declares uint8 input)
    perf_analyzer: str | None = None  # its binary; None: the first that runs of perf_analyzer.candidates(); "": none
