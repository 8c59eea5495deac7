"""The fake value a graph node carries: what every stage reads a node's shape, dtype and device from.

Dynamo records it as ``node.meta["example_value"]``; a fake-tensor pass (``FakeTensorProp``, Inductor's)
as ``node.meta["val"]``.  Nodes without either (a ``get_attr``, an output) have ``None``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def fake_of(node: Any) -> Any:
    """The fake value Dynamo (``example_value``) or a fake-tensor pass (``val``) recorded for a node;
    ``None`` for anything that is not a node, or a node without one."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta
    if "example_value" in meta:
        return meta["example_value"]
    return meta.get("val")


def size_hint(size: Any) -> int | None:
    """A size as an int: itself, or a symbolic size's example value (the size of the inputs traced;
    reading it adds no guard); ``None`` for a symbol without one (an unbacked size)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return None if hint is None else int(hint)
    return int(size)
