"""The optional max / avg pool that ends a conv walk's region (``match/conv_walk.py``).

A pool may join when it has the conv's number of spatial dims, arguments the pooled kernels implement
(``Pool.unsupported`` names the others: dilation, ``return_indices``) and metadata
(``pool_refusal``).  After a centre (``pool_after``) it must pool the chain's last value (the
centre's result when the chain is empty) and be that value's only reader; every other pool in that
place is a ``NearMiss`` saying why, and so is an adaptive pool, whose windows depend on the input's
size; the region then ends before it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from ..frontend.canonical import GlobalReduce, Pool
from ..frontend.normalize import target_name
from ..report import NearMiss, ReasonKind
from .engine import MatchContext, fake_of


def pool_after(ctx: MatchContext, pattern: str, anchor: fx.Node, last: fx.Node,
               spatial_dims: int) -> tuple[Optional[Pool], list[NearMiss]]:  # fmt: skip
    """``(the pool that ends the region, [])``, ``(None, [the near miss saying why the pool after
    ``last`` does not])``, or ``(None, [])`` where no pool reads ``last``.

    ``pattern`` / ``anchor``: the family and the conv node the near misses name; ``last``: the
    region's last value so far; ``spatial_dims``: the conv's."""
    pools = [u for u in last.users if isinstance(ctx.op(u), Pool) or _adaptive(ctx, u)]
    if not pools:
        return None, []
    node = pools[0]

    def miss(kind: ReasonKind, msg: str) -> tuple[None, list[NearMiss]]:
        return None, [ctx.near_miss(pattern, anchor, node, kind, msg)]

    if _adaptive(ctx, node):
        return miss(ReasonKind.UNSUPPORTED_OP,
                    f"`{node.name}` is an adaptive pool ({target_name(node) or node.target}), whose windows follow the "
                    "input's size; only max / avg pools with a fixed window end the region")  # fmt: skip
    if len(last.users) > 1:
        others = ", ".join("the graph output" if u.op == "output" else f"`{u.name}`" for u in last.users if u is not node)
        return miss(ReasonKind.SHARED_INTERMEDIATE,
                    f"the pool `{node.name}` reads `{last.name}`, which is also read by {others}: a pool whose input "
                    "is read elsewhere is not fused (that input would have to be written full-size)")  # fmt: skip
    op: Pool = ctx.op(node)
    refused = pool_refusal(op, spatial_dims)
    if refused is not None:
        return miss(*refused)
    return op, []


def pool_refusal(op: Pool, spatial_dims: int) -> Optional[tuple[ReasonKind, str]]:
    """Why the pool ``op`` cannot end a region after a conv of ``spatial_dims`` dims, as ``(reason,
    message)``, or None: another number of dims, arguments the pooled kernels do not implement, no
    metadata."""
    node = op.node
    if op.spatial_dims != spatial_dims:
        return ReasonKind.DIMENSION_MISMATCH, (f"`{node.name}` is a {op.spatial_dims}-d pool after a {spatial_dims}-d "
                                               "conv; only a pool of the conv's dimensionality is fused")  # fmt: skip
    if op.unsupported:
        return ReasonKind.UNSUPPORTED_ARGUMENT, f"`{node.name}`: {op.spec.kind} pool with {op.unsupported}"
    if not isinstance(fake_of(node), torch.Tensor):
        return ReasonKind.MISSING_METADATA, f"no metadata for `{node.name}`"
    return None


def _adaptive(ctx: MatchContext, node: fx.Node) -> bool:
    """Whether ``node`` is an adaptive max / avg pool (``adaptive_avg_pool2d(y, 1)`` normalises to a
    ``GlobalReduce``; the others to opaque ops)."""
    return "adaptive" in target_name(node) and (isinstance(ctx.op(node), GlobalReduce) or not isinstance(ctx.op(node), Pool))
