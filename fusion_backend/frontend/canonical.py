"""Canonical ops: what a graph node *means*, independent of how the user spelled it.

The normalizer (``normalize.py``) turns every FX node into exactly one of these; patterns read only
canonical ops, never FX targets.  Values are referenced as ``ValueRef``: an ``fx.Node``, a Python
number, or a ``ParamRef`` (a module attribute reached through ``call_module``, which the rewriter
materialises as a ``get_attr`` node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.fx as fx

from ..ir.specs import ConvSpec, PoolSpec
from ..ops.chain import PointwiseKind


@dataclass(frozen=True)
class ParamRef:
    """A parameter or buffer of the root module, by qualified name (``"conv.weight"``)."""

    qualified_name: str


ValueRef = Union[fx.Node, ParamRef, float, int, bool, None]


@dataclass(frozen=True)
class Conv:
    """``aten.convolution`` semantics: ``input`` (N, C_in, *spatial), ``weight``, optional ``bias``."""

    node: fx.Node
    input: fx.Node
    weight: ValueRef
    bias: ValueRef
    spec: ConvSpec


@dataclass(frozen=True)
class Pointwise:
    """An elementwise op.  ``args`` are the op's value arguments in its own order, e.g.
    ``(lhs, rhs)`` for ``mul`` or ``(x, slope)`` for ``leaky_relu``; which one is the flowing tensor
    is decided by the pattern (see ``with_flowing``).  ``inplace`` ops alias their first argument.
    """

    node: fx.Node
    kind: PointwiseKind
    args: tuple[ValueRef, ...]
    inplace: bool = False

    def with_flowing(self, flowing: fx.Node) -> tuple[PointwiseKind, tuple[ValueRef, ...]] | str:
        """Return ``(kind, operands)`` seen from ``flowing``, or a sentence saying why not.

        Commutative ops (mul, add, minimum, maximum) accept the flowing tensor on either side; ``a - x`` becomes ``rsub`` and
        ``a / x`` becomes ``rdiv``; ``x * x`` has ``x`` as its operand.  Non-arithmetic ops need the flowing tensor first.
        """
        positions = [i for i, a in enumerate(self.args) if a is flowing]
        if positions == [0, 1] and len(self.args) == 2:  # y * y, y + y, ...: the operand is the flowing tensor too
            return self.kind, (flowing,)
        if len(positions) != 1:
            return "the flowing tensor is used as more than one operand" if positions else "the flowing tensor is not an operand"
        pos = positions[0]
        others = tuple(a for i, a in enumerate(self.args) if i != pos)
        if pos == 0:
            return self.kind, others
        swapped = {
            PointwiseKind.MUL: PointwiseKind.MUL,
            PointwiseKind.ADD: PointwiseKind.ADD,
            PointwiseKind.SUB: PointwiseKind.RSUB,
            PointwiseKind.DIV: PointwiseKind.RDIV,
            PointwiseKind.MINIMUM: PointwiseKind.MINIMUM,
            PointwiseKind.MAXIMUM: PointwiseKind.MAXIMUM,
        }
        if self.kind in swapped and pos == 1:
            return swapped[self.kind], others
        return f"the flowing tensor is argument {pos} of {self.kind.name.lower()}, which must be argument 0"


@dataclass(frozen=True)
class Pool:
    """A max or avg pool over ``spatial_dims`` trailing dims.  ``unsupported`` names an argument the
    fused kernels do not implement (``return_indices``, dilation), or is ``None``."""

    node: fx.Node
    input: fx.Node
    spatial_dims: int
    spec: PoolSpec
    unsupported: Optional[str] = None


@dataclass(frozen=True)
class GlobalReduce:
    """A mean (or sum) over ``dims`` (``None`` = all dims), e.g. ``x.mean((2, 3), keepdim=True)``.

    ``adaptive_avg_pool{d}d(x, 1)`` normalises to a mean over the trailing ``d`` dims with keepdim.
    """

    node: fx.Node
    input: fx.Node
    kind: str
    dims: Optional[tuple[int, ...]]
    keepdim: bool


@dataclass(frozen=True)
class Reduce:
    """A reduction that is not a plain mean or sum (``GlobalReduce``): ``kind`` is ``"min"`` / ``"max"``
    (``torch.min(x, dim)``: a (values, indices) pair, read through ``getitem``), ``"amin"``,
    ``"amax"``, ``"logsumexp"``, ``"softmax"`` / ``"log_softmax"`` (same shape as the input:
    ``keepdim`` is True), or ``"sum"`` / ``"mean"`` with a ``dtype`` argument.  ``dims`` as written
    (negative dims not normalised; ``None``: every dim); ``dtype``: the ``dtype=`` argument or None.
    """

    node: fx.Node
    input: fx.Node
    kind: str
    dims: Optional[tuple[int, ...]]
    keepdim: bool
    dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class BatchNorm:
    """``F.batch_norm`` over dim 1: ``(input - mean) / sqrt(var + eps) * weight + bias``, with the
    running statistics when ``training`` is False, with the batch's otherwise (or when a running
    statistic is ``None``).  ``weight`` and ``bias`` may be ``None`` (``affine=False``).  ``momentum``:
    the factor of the running statistics' update in training mode, as written (a number, ``None``
    for a cumulative average, or a traced value)."""

    node: fx.Node
    input: fx.Node
    running_mean: ValueRef
    running_var: ValueRef
    weight: ValueRef
    bias: ValueRef
    training: bool
    eps: float
    momentum: ValueRef = 0.1


@dataclass(frozen=True)
class GroupNorm:
    """``F.group_norm`` / ``F.instance_norm`` over dim 1: the channels split into ``groups`` equal
    groups (``None``: one group per channel, instance norm), each normalised by its own mean and
    biased variance over the group's channels and every spatial position, per sample; then
    ``* weight + bias`` per channel (either may be ``None``).  ``running_stats`` is True for an
    instance norm given running statistics (it reads or updates them; group norm has none)."""

    node: fx.Node
    input: fx.Node
    groups: Optional[int]
    weight: ValueRef
    bias: ValueRef
    eps: float
    running_stats: bool = False


@dataclass(frozen=True)
class LayerNorm:
    """``F.layer_norm`` over the trailing ``len(normalized_shape)`` dims: each slice over those dims
    normalised by its own mean and biased variance, then ``* weight + bias`` elementwise (each of the
    normalized shape, either may be ``None``).  ``normalized_shape`` holds Python ints and ``eps`` is a
    number, or each is ``None`` when it is not known at compile time (traced sizes; ``dynamic=True``
    lifts a module's float attributes such as ``eps`` to graph inputs)."""

    node: fx.Node
    input: fx.Node
    normalized_shape: Optional[tuple[int, ...]]
    weight: ValueRef
    bias: ValueRef
    eps: Optional[float]


@dataclass(frozen=True)
class Upsample:
    """A nearest-neighbour upsample (``F.interpolate(x, ..., mode="nearest")``, ``nn.Upsample``) of the
    spatial dims.  ``scale_factor``: what the call gave (one float, or one per spatial dim), None
    where it gave a ``size``; the sizes themselves are the fake tensors' (a pattern reads the scale
    from them)."""

    node: fx.Node
    input: fx.Node
    scale_factor: Optional[Union[float, tuple[float, ...]]]


@dataclass(frozen=True)
class Opaque:
    """Anything else.  ``description`` names the op for reports (e.g. ``torch.softmax``)."""

    node: fx.Node
    description: str


CanonicalOp = Union[Conv, Pointwise, Pool, GlobalReduce, Reduce, BatchNorm, GroupNorm, LayerNorm, Upsample, Opaque]
