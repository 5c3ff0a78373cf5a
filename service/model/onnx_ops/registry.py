"""The importer's tables: ONNX op type -> handler, and anchor op type -> patterns of several nodes.

A handler maps one node to ops of the format (or to a view of a tensor: a channels-last alias, a pending pad), or
raises Refuse saying why the node cannot be served and what would be. A pattern (onnxruntime's fusion passes are
the model) is matched before any node is mapped, from its anchor node: it names the nodes it covers and the node
where its result is emitted, so the nodes it absorbs are never mapped on their own. Each family registers itself
from its own module; adding an op touches that module alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


class Refuse(Exception):
    """A node that cannot be served: the message says why and what would be accepted, with the shapes involved.
    The walk prefixes the node's name and op type."""


@dataclass(frozen=True)
class Handler:
    op_type: str
    family: str
    fn: Callable  # fn(importer, node) -> None


@dataclass
class Match:
    """A pattern found in the graph: every node it covers (`nodes`), the one whose output it writes (`last`: the
    pattern is emitted when the walk reaches it, in graph order), the ONNX tensors it reads from outside, and how to
    emit it (may raise Refuse, which names the last node)."""

    pattern: str
    last: int
    nodes: set[int]
    reads: tuple[str, ...]
    emit: Callable[[], None]


@dataclass(frozen=True)
class Pattern:
    name: str
    anchor: str  # the op type the search starts from
    parts: tuple[str, ...]  # op types supported only inside this pattern (for the refusal of a stray one)
    describe: str  # the pattern as a user would write it, for messages
    match: Callable  # match(importer, node) -> Match | None


HANDLERS: dict[str, Handler] = {}
FAMILIES: dict[str, list[str]] = {}  # family -> its op types, in registration order (messages list them so)
PATTERNS: dict[str, list[Pattern]] = {}  # anchor op type -> patterns
PARTS: dict[str, list[Pattern]] = {}  # op type -> patterns it is part of


def handles(*op_types: str, family: str):
    """Register the decorated function as the handler of `op_types` (one family per module)."""

    def register(fn: Callable) -> Callable:
        for t in op_types:
            if t in HANDLERS:
                raise RuntimeError(f"ONNX op {t} has two handlers: {HANDLERS[t].fn.__qualname__}, {fn.__qualname__}")
            HANDLERS[t] = Handler(t, family, fn)
            FAMILIES.setdefault(family, []).append(t)
        return fn

    return register


def pattern(name: str, anchor: str, *, describe: str, parts: tuple[str, ...] = ()):
    """Register the decorated function as the matcher of a pattern that starts from nodes of type `anchor`."""

    def register(fn: Callable) -> Callable:
        p = Pattern(name, anchor, parts, describe, fn)
        PATTERNS.setdefault(anchor, []).append(p)
        for t in parts:
            PARTS.setdefault(t, []).append(p)
        return fn

    return register


def supported_summary() -> str:
    """What the importer takes, by family, for the refusal of an op it has no handler for."""
    families = "; ".join(f"{family} ({', '.join(types)})" for family, types in FAMILIES.items())
    patterns = "; ".join(p.describe for ps in PATTERNS.values() for p in ps)
    return f"fusedserve imports {families}; and patterns of several nodes: {patterns}"
