"""What the launchers run under Triton's interpreter, and how tests change it.

Under the interpreter nothing can be timed (it runs numpy, not the kernel), so a launcher runs one config, built
from its module's `INTERPRETER.choice`: a frozen dataclass whose defaults are what a plain CPU run (CI, the
service without a GPU) uses. Tests change its fields for a `with` block or a fixture (a small tile so that
awkward shapes cross every block edge, split-K so that its reduction runs, the other K loop, another kernel),
and the previous choice comes back when the block ends, on error too. Compiled, the tuner picks, and these
choices are never read.

    with linear.INTERPRETER.override(tile=linear.SMALL_INTERPRETER_TILE, split_k=2):
        fused_linear(x, w, b)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

Choice = TypeVar("Choice")


class InterpreterSwitches(Generic[Choice]):
    """One kernel module's choice under the interpreter (`choice`, a frozen dataclass), changed only through
    `override`."""

    def __init__(self, default: Choice):
        self.choice = default

    @contextmanager
    def override(self, **fields) -> Iterator[Choice]:
        """`choice` with `fields` replaced until the block ends (a field the choice lacks is a TypeError).
        Overrides nest: the inner one starts from the outer one's choice."""
        previous = self.choice
        self.choice = dataclasses.replace(previous, **fields)
        try:
            yield self.choice
        finally:
            self.choice = previous
