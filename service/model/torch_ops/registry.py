"""The torch.export importer's table: ATen op name -> handler, filled by this package's family modules with
`@register("op", ...)` (one handler per op family; adding an op touches one module). `View` says what an FX node's
value is in the format's graph: most are a tensor of the graph ("plain"); the others are ways torch code looks at
one that the format has no tensor for, carried until an op that the format has turns them back into one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import fx

    from ..torch_import import Exporter

Args = dict[str, Any]  # the node's arguments by their names in the op's schema, defaults filled in
Handler = Callable[["Exporter", "fx.Node", Args], None]
HANDLERS: dict[str, Handler] = {}


def register(*ops: str) -> Callable[[Handler], Handler]:
    """Map ATen ops (by name without the overload: `add` takes add.Tensor and add.Scalar; the in-place `add_` is
    taken by the exporter as `add` when nothing reads the old value after it) onto the decorated handler."""

    def add(handler: Handler) -> Handler:
        for op in ops:
            if op in HANDLERS:
                raise RuntimeError(f"ATen op {op!r} is registered twice")
            HANDLERS[op] = handler
        return handler

    return add


# View kinds, with the FX value's per-row shape for a graph tensor of shape (C, H, W):
#   plain          the graph tensor itself
#   channels_last  permute(0, 2, 3, 1) of it: (H, W, C); layer_norm over the last dim, linear (a 1x1 conv),
#                  activations, elementwise ops, channel slices and concats map onto the channel-first tensor
#   grouped        view (groups, C / groups, H, W) of it: half of a channel shuffle
#   shuffled       the grouped view with its two channel axes swapped: view back to (C, H, W) is channel_shuffle
#   parts          split / chunk along channels: a tuple whose items are channel slices [start, end) of it
#   result         a tuple whose item 0 is it (batch norm's and layer norm's saved statistics follow)
#   padded         it with `pad` zero pixels on each side, which every reader (a conv) adds to its own padding
#   selected       x[:, c] of it, (H, W): one channel without its dim, as unsqueeze(1) puts back (parts: ((c, c + 1),);
#                  GoogLeNet's and Inception v3's transform_input, on by default with their pretrained weights)
PLAIN, CHANNELS_LAST, GROUPED, SHUFFLED, PARTS, RESULT, PADDED, SELECTED = (
    "plain", "channels_last", "grouped", "shuffled", "parts", "result", "padded", "selected",
)  # fmt: skip


@dataclass(frozen=True)
class View:
    kind: str
    tensor: str  # the graph tensor
    groups: int = 1  # grouped, shuffled
    parts: tuple[tuple[int, int], ...] = ()  # parts, selected: the channel runs
    item: str = PLAIN  # parts, result: the kind of view each item is (plain or channels_last)
    pad: tuple[int, int] = (0, 0)  # padded: (rows, columns) of zeros on each side


def op_name(target) -> str:
    """aten.conv2d.default -> conv2d; aten.add_.Tensor -> add_; operator.getitem -> getitem."""
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return name.split(".")[0]


def pair(v) -> list[int]:
    """A size argument (an int, or a list of one or two) as [h, w]."""
    return [int(v), int(v)] if isinstance(v, int) else [int(i) for i in (list(v) * 2)[:2]]
