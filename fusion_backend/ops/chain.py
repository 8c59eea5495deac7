"""The catalogue of pointwise ops that a fused chain may contain.

A chain is a sequence of ``ChainStep``s applied to one flowing tensor ``v`` (the conv output).  Each
step has a ``PointwiseKind`` and a tuple of operands; an operand is a Python number baked into the
static configuration (``Const``), a reference to one of the fused op's tensor operands (``TensorRef``:
a 0-d tensor or a per-channel tensor, broadcastable as (C,1,...,1) or (1,C,1,...,1)), or, for the
first operand of a kind whose first operand is differentiable, the chain's own value before an earlier
step (``ChainValue``), which makes the chain a DAG: ``y * torch.sigmoid(2 * y)`` is
``[mul(2), sigmoid, mul(ChainValue(0))]``.

This module is the single source of truth for:
  * which ops exist and how many operands each takes (``PointwiseKind.arity``),
  * which operands may carry a gradient (``PointwiseKind.differentiable_operands``),
  * the plain-torch semantics of each op (``apply_step``), used by the CPU reference, by tests, and
    as the definition the Triton kernels must reproduce.

Op codes (``PointwiseKind.code``) are stable small integers: the Triton kernels specialise on them as
``tl.constexpr`` values, so one kernel template serves every chain.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

import torch
import torch.nn.functional as F


class PointwiseKind(enum.Enum):
    """A supported pointwise op: ``(code, arity, differentiable operand positions)``.

    Operand meaning per kind (``v`` is the flowing tensor, ``a``/``b`` the operands in order):
      relu: max(v, 0)                  leaky_relu(a): v if v > 0 else a*v (a = negative slope)
      gelu: v*Phi(v) (exact erf)       gelu_tanh: tanh approximation of gelu
      silu, sigmoid, tanh, hardswish, mish: as torch.nn.functional
      clamp(a, b): min(max(v, a), b)   clamp_min(a): max(v, a)      clamp_max(a): min(v, a)
                   (NaN propagates, as in torch.clamp; the gradient passes where a <= v <= b)
      hardtanh(a, b): clamp forward, but the gradient passes only where a < v < b (strict), as
                   torch's hardtanh_backward does; relu6 is hardtanh(0, 6)
      mul(a): v*a    add(a): v+a    sub(a): v-a    rsub(a): a-v    div(a): v/a    rdiv(a): a/v
      minimum(a) / maximum(a): torch.minimum / torch.maximum with a tensor: NaN from either side
                   propagates; at a tie each side gets half the gradient, and NaN gives both all of
                   it, as torch's backward does
    The operands of the arithmetic kinds, of minimum / maximum and the one bound of clamp_min /
    clamp_max may be tensors
    that require grad (a bound's gradient is ``grad`` where the bound was taken: ``v < a`` for
    clamp_min, ``v > a`` for clamp_max, as torch's clamp_min / clamp_max backward; a tie and NaN give
    the flowing value the gradient).  The parameters of leaky_relu, clamp and hardtanh may still come
    from 0-d tensors (Dynamo lifts float module attributes to inputs under ``dynamic=True``) but never
    receive a gradient: a kernel slot has room for one operand gradient.
    """

    RELU = (1, 0, ())
    LEAKY_RELU = (2, 1, ())
    GELU = (3, 0, ())
    GELU_TANH = (4, 0, ())
    SILU = (5, 0, ())
    SIGMOID = (6, 0, ())
    TANH = (7, 0, ())
    HARDSWISH = (8, 0, ())
    MISH = (9, 0, ())
    CLAMP = (10, 2, ())
    CLAMP_MIN = (11, 1, (0,))
    CLAMP_MAX = (12, 1, (0,))
    MUL = (13, 1, (0,))
    ADD = (14, 1, (0,))
    SUB = (15, 1, (0,))
    RSUB = (16, 1, (0,))
    DIV = (17, 1, (0,))
    RDIV = (18, 1, (0,))
    HARDTANH = (19, 2, ())
    MINIMUM = (20, 1, (0,))
    MAXIMUM = (21, 1, (0,))

    def __init__(self, code: int, arity: int, differentiable_operands: tuple[int, ...]) -> None:
        self.code = code
        self.arity = arity
        self.differentiable_operands = differentiable_operands

    @classmethod
    def from_name(cls, name: str) -> PointwiseKind:
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(
                f"unknown pointwise kind {name!r}; known: {sorted(k.name.lower() for k in cls)}"
            ) from None


#: Longest chain one fused op accepts (the Triton template has this many op slots).
MAX_CHAIN_LENGTH = 8


@dataclass(frozen=True)
class Const:
    """A Python number baked into the static configuration."""

    value: float


@dataclass(frozen=True)
class TensorRef:
    """Index into the fused op's ``operands`` tensor list."""

    index: int


@dataclass(frozen=True)
class ChainValue:
    """The chain's value before step ``position`` (0: the conv output, bias included), read again by
    a later step.  ``ChainValue(i)`` as an operand of step ``i`` itself is the flowing value (``y * y``)."""

    position: int


Operand = Union[Const, TensorRef, ChainValue]


@dataclass(frozen=True)
class ChainStep:
    """One pointwise op of a chain: its kind and exactly ``kind.arity`` operands."""

    kind: PointwiseKind
    operands: tuple[Operand, ...] = ()

    def __post_init__(self) -> None:
        if len(self.operands) != self.kind.arity:
            raise ValueError(
                f"{self.kind.name.lower()} takes {self.kind.arity} operand(s), got {len(self.operands)}"
            )
        for i, operand in enumerate(self.operands):
            if isinstance(operand, ChainValue) and i not in self.kind.differentiable_operands:
                raise ValueError(f"{self.kind.name.lower()} cannot take a chain value as operand {i}")


def check_chain(chain: Sequence[ChainStep]) -> None:
    """Raise ``ValueError`` unless every ``ChainValue`` names a value the chain has computed."""
    for i, step in enumerate(chain):
        for operand in step.operands:
            if isinstance(operand, ChainValue) and not 0 <= operand.position <= i:
                raise ValueError(f"step {i} ({step.kind.name.lower()}) reads the chain's value before step "
                                 f"{operand.position}, which it has not computed")


#: A kernel op code is ``kind.code + SOURCE_STRIDE * (position + 1)`` when the step's first operand is
#: ``ChainValue(position)``, plain ``kind.code`` otherwise (``kernels/chain_math.py`` decodes it).
SOURCE_STRIDE = 32


def kernel_code(step: ChainStep) -> int:
    """The step's op code as the Triton kernels take it (``SOURCE_STRIDE``)."""
    first = step.operands[0] if step.operands else None
    if isinstance(first, ChainValue):
        return step.kind.code + SOURCE_STRIDE * (first.position + 1)
    return step.kind.code


def operand_values(step: ChainStep, operands: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
                   detach_fixed: bool = True) -> list[torch.Tensor | float]:
    """The values of ``step``'s operands: numbers, ``operands[i]`` for a ``TensorRef`` (detached where
    the kind takes no gradient, unless ``detach_fixed`` is off), ``inputs[j]`` for ``ChainValue(j)``
    (``inputs``: the chain's value before each step so far, the current one last)."""
    values: list[torch.Tensor | float] = []
    for j, operand in enumerate(step.operands):
        if isinstance(operand, Const):
            values.append(operand.value)
        elif isinstance(operand, ChainValue):
            values.append(inputs[operand.position])
        else:
            t = operands[operand.index]
            values.append(t if not detach_fixed or j in step.kind.differentiable_operands else t.detach())
    return values


def _gelu_tanh(v: torch.Tensor) -> torch.Tensor:
    return F.gelu(v, approximate="tanh")


_UNARY = {
    PointwiseKind.RELU: torch.relu,
    PointwiseKind.GELU: F.gelu,
    PointwiseKind.GELU_TANH: _gelu_tanh,
    PointwiseKind.SILU: F.silu,
    PointwiseKind.SIGMOID: torch.sigmoid,
    PointwiseKind.TANH: torch.tanh,
    PointwiseKind.HARDSWISH: F.hardswish,
    PointwiseKind.MISH: F.mish,
}


def apply_step(kind: PointwiseKind, v: torch.Tensor, operands: Sequence[torch.Tensor | float]) -> torch.Tensor:
    """Apply one op with torch semantics.  Tensor operands must already broadcast against ``v``.

    Differentiable in ``v`` and in every tensor operand (the reference backward relies on that).
    """
    if kind in _UNARY:
        return _UNARY[kind](v)
    if kind is PointwiseKind.LEAKY_RELU:
        (slope,) = operands
        return torch.where(v > 0, v, v * slope)
    if kind is PointwiseKind.CLAMP:
        lo, hi = operands
        return torch.clamp(v, min=lo, max=hi)
    if kind is PointwiseKind.HARDTANH:
        lo, hi = operands
        return _hardtanh(v, lo, hi)
    if kind is PointwiseKind.CLAMP_MIN:
        return torch.clamp(v, min=operands[0])
    if kind is PointwiseKind.CLAMP_MAX:
        return torch.clamp(v, max=operands[0])
    (a,) = operands
    if kind in (PointwiseKind.MINIMUM, PointwiseKind.MAXIMUM):
        other = a if isinstance(a, torch.Tensor) else torch.tensor(a, dtype=v.dtype, device=v.device)
        return (torch.minimum if kind is PointwiseKind.MINIMUM else torch.maximum)(v, other)
    if kind is PointwiseKind.MUL:
        return v * a
    if kind is PointwiseKind.ADD:
        return v + a
    if kind is PointwiseKind.SUB:
        return v - a
    if kind is PointwiseKind.RSUB:
        return a - v
    if kind is PointwiseKind.DIV:
        return v / a
    if kind is PointwiseKind.RDIV:
        return a / v
    raise AssertionError(f"unhandled pointwise kind {kind}")


def _hardtanh(v: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
    # F.hardtanh only takes Python numbers; bounds lifted to 0-d tensors (dynamic=True) need this
    # form, whose gradient is masked strictly inside (lo, hi) like hardtanh_backward.
    lo_t = torch.as_tensor(lo, dtype=v.dtype, device=v.device)
    hi_t = torch.as_tensor(hi, dtype=v.dtype, device=v.device)
    inside = (v > lo_t) & (v < hi_t)
    clamped = torch.clamp(v, min=lo_t, max=hi_t).detach()
    return torch.where(inside | torch.isnan(v), v, clamped)

