"""Where the kernels run: compiled for a GPU, or through Triton's interpreter on the CPU.

Triton decides between the two when a kernel is *defined* (`@triton.jit` returns an interpreted
function if TRITON_INTERPRET is set at that moment), so the choice must be made before any module
of this package that defines a kernel is imported. `kernels/__init__.py` calls `choose_backend()`
first thing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# Triton reads the variable as a boolean with these spellings (triton.knobs env_bool).
_TRUE = {"1", "true", "yes", "on", "y"}


_chosen: list[bool] = []  # the choice made when this package's kernels were defined


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def interpreting() -> bool:
    """True when this package's kernels run through the interpreter (numpy on the CPU), not compiled.

    Fixed once the kernels are defined (changing the variable later would not change them), and
    read per launch, so it is cached: 0.05 us instead of ~1 us for the environment lookup.
    """
    return _chosen[0] if _chosen else _env_interpret()


def choose_backend() -> None:
    """Without CUDA, turn the interpreter on so the same kernel code runs (slowly) on the CPU.

    A variable the user set explicitly is left alone.
    """
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    _chosen[:] = [_env_interpret()]


class EnvSwitch:
    """A process-wide on/off setting of this package: the environment variable `name` (`default` when unset; set,
    on unless it says 0, false, no or off), read at first use, unless set() said otherwise (the service passes its
    settings)."""

    def __init__(self, name: str, default: bool = True):
        self.name = name
        self.default = default
        self._on: bool | None = None

    def __call__(self) -> bool:
        if self._on is None:
            value = os.environ.get(self.name)
            self._on = self.default if value is None else value.strip().lower() not in ("0", "false", "no", "off")
        return self._on

    def set(self, on: bool | None) -> None:
        """on/off; None: read the environment again at the next call."""
        self._on = on


class EnvChoice:
    """A process-wide choice among `choices`: the environment variable `name` (`default` when unset), read at
    first use, unless set() said otherwise (the service passes its settings). A value not among the choices
    is an error naming the variable."""

    def __init__(self, name: str, choices: tuple[str, ...], default: str):
        self.name, self.choices, self.default = name, choices, default
        self._value: str | None = None

    def __call__(self) -> str:
        if self._value is None:
            self._value = self._check(os.environ.get(self.name, self.default).strip().lower())
        return self._value

    def set(self, value: str | None) -> None:
        """One of the choices; None: read the environment again at the next call."""
        self._value = None if value is None else self._check(value)

    def _check(self, value: str) -> str:
        if value not in self.choices:
            raise ValueError(f"{self.name} must be one of {', '.join(self.choices)}; got {value!r}")
        return value


class EnvCount:
    """A process-wide count (a whole number >= 0): the environment variable `name` (`default()` when unset), read at
    first use, unless set() said otherwise (the service passes its settings). A value that is not a whole number
    logs a warning naming the variable and takes the default."""

    def __init__(self, name: str, default: Callable[[], int]):
        self.name, self.default = name, default
        self._value: int | None = None

    def __call__(self) -> int:
        if self._value is None:
            self._value = self._read()
        return self._value

    def set(self, value: int | None) -> None:
        """A count; None: read the environment again at the next call."""
        self._value = None if value is None else max(0, int(value))

    def _read(self) -> int:
        raw = os.environ.get(self.name, "").strip()
        if not raw:
            return self.default()
        try:
            return max(0, int(raw))
        except ValueError:
            log.warning("%s=%r is not a whole number; taking %d", self.name, raw, self.default())
            return self.default()


def bf16_on_interpreter(dtype: torch.dtype) -> bool:
    """bf16 under Triton's interpreter, which needs two workarounds in every kernel (triton 3.9): its
    tl.dot on bf16 operands returns garbage (relative error ~1e10), and its fp32 -> bf16 cast truncates
    instead of rounding to nearest. Compiled kernels need neither."""
    return dtype == torch.bfloat16 and interpreting()


def check_device(t: torch.Tensor, name: str) -> None:
    """Fail early, by name, when a tensor sits where the kernels cannot run."""
    if t.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{name} is on the CPU, but Triton kernels here are compiled for CUDA; move it to the GPU, "
            "or set TRITON_INTERPRET=1 before importing `kernels` to run them through the interpreter"
        )
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; fused kernels run on cuda (or cpu when interpreting)")
