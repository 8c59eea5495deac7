"""Host side of the box loads of the conv family's gradients (``tiles`` module docstring): which calls
may load their tiles as boxes, the walk of the boxes over the planes, and the tensor descriptors the
kernels load them through.  The device side is ``prologue.box_coords`` / ``prologue.load_a_box`` and
the passes' box loops (``dgrad``, ``wgrad``); the forward loads no boxes (``fprop`` module docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..host import cdiv
from ..plan_cache import ContractError
from .tiles import TileConfig

if TYPE_CHECKING:
    from .fprop import _Geometry


def box_descriptor(t: torch.Tensor, block: list[int]) -> Any:
    """``t`` (channels-last, (N, C, *spatial), 1 to 3 spatial dims) as an ``(N, D, H, W, C)`` tensor
    descriptor with block ``block``, zero padding.  A ``t`` that is not 16-byte aligned (a slice) is
    copied first, to a buffer of its own strides (the plan checked those: ``box_refusal``)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if t.data_ptr() % 16:
        t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    sizes, strides = _descriptor_dims(t)
    return TensorDescriptor(t, sizes, strides, block)


def _descriptor_dims(t: torch.Tensor) -> tuple[list[int], list[int]]:
    """``t``'s (N, C, *spatial) sizes and strides as ``(N, D, H, W, C)``, the spatial dims lifted to 3,
    each dim of size 1 given the dense stride over the next inner one (its own addresses nothing, and
    torch sets it to anything, often 1; a tensor copy wants every stride a 16-byte multiple)."""
    sizes = [t.shape[0], *([1] * (5 - t.dim())), *t.shape[2:], t.shape[1]]
    strides = [t.stride(0), *([0] * (5 - t.dim())), *t.stride()[2:], 1]
    for d in range(3, -1, -1):
        if sizes[d] == 1:
            strides[d] = strides[d + 1] * sizes[d + 1]
    return sizes, strides


def box_refusal(geo: _Geometry, x: torch.Tensor, tile: TileConfig | None, what: str = "x") -> str:
    """Why a call of geometry ``geo`` on ``x`` (channels-last, as the kernel reads it) cannot load its
    tiles as boxes with ``tile`` (``tiles`` module docstring); "" where it can.  ``tile`` None: of any
    box tile.  A group's first channel must lie on 16 bytes (where a copy starts); what a group's channel
    tail past its last full K block needs is the pass's rule (``dgrad_box_refusal``, ``wgrad``'s dropped
    K entries).  ``what``: the tensor's name in the answer."""
    if geo.stride != (1, 1, 1) or geo.dilation != (1, 1, 1):
        return f"a box needs stride and dilation 1, got stride {geo.stride} and dilation {geo.dilation}"
    if geo.c_in_g == 1:
        return "one input channel per group runs the direct depthwise tile"
    if tile is not None and tile.box_w and tile.flat_k:
        return "a box walks K tap-major"
    size = x.element_size()
    if any(st * size % 16 for st in _descriptor_dims(x)[1][:-1]):
        return f"the tensor copy needs 16-byte strides, {what} has {x.stride()} of {size}-byte elements"
    group_channels = x.shape[1] // geo.groups
    if geo.groups > 1 and group_channels * size % 16:
        return (f"a tensor copy starts on 16 bytes: {what}'s groups of {group_channels} {size}-byte channels "
                f"do not")  # fmt: skip
    return ""


def box_grid(planes: Sequence[int], n: int, tile: TileConfig, refusal: str) -> tuple[tuple[int, int], int]:
    """A box tile's walk over ``n`` samples' planes of size ``planes`` ``(D, H, W)`` (the output's in the
    weight gradient, the input's in the input gradient): ``((rows, columns) of boxes per
    plane, boxes in all)``, the programs' first grid dim.  Raises :class:`ContractError` with ``refusal``
    (the pass's ``*box_refusal``) where the call cannot load boxes."""
    if refusal:
        raise ContractError(f"tile box_w={tile.box_w}: {refusal}")
    per_plane = (cdiv(planes[1], tile.box_h), cdiv(planes[2], tile.box_w))
    return per_plane, n * planes[0] * per_plane[0] * per_plane[1]


def box_positions(planes: Sequence[int], n: int, tile: TileConfig) -> list[int]:
    """The real output positions of each box of :func:`box_grid`'s walk over ``n`` samples' planes of
    size ``planes`` ``(D, H, W)`` (``prologue.box_coords``' order: column fastest, then row, depth,
    sample): ``box_h x box_w`` but for the boxes that hang over the plane's bottom or right edge (the
    statistics' count per box, ``stats.PartialsReduction``'s ``tile_rows``)."""
    (rows, cols), _ = box_grid(planes, n, tile, "")
    plane = [min(tile.box_h, planes[1] - r * tile.box_h) * min(tile.box_w, planes[2] - c * tile.box_w)
             for r in range(rows) for c in range(cols)]  # fmt: skip
    return plane * (n * planes[0])
