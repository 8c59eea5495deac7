"""Shapes, validation and the affine fold of ``fusion::conv_global_mean``: the per-channel steps composed
into one ``A * v + B`` (forward) and the chain rule back through it (backward).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Union

import torch

from ...errors import UnsupportedInputError
from ...ir.specs import ConvSpec
from ..chain import Const, PointwiseKind, TensorRef
from .config import ConvGlobalMeanConfig


def output_channels(spec: ConvSpec, weight: torch.Tensor) -> int:
    return _out_channels_of(spec, weight.shape)


def _out_channels_of(spec: ConvSpec, w_shape: Sequence[int]) -> int:
    return w_shape[1] * spec.groups if spec.transposed else w_shape[0]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def validate(
    cfg: ConvGlobalMeanConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    _validate_shapes(cfg.conv, x.shape, weight.shape, None if bias is None else bias.shape)


@functools.lru_cache(maxsize=256)
def _validate_shapes(
    spec: ConvSpec, x_shape: torch.Size, w_shape: torch.Size, bias_shape: torch.Size | None
) -> None:
    """Raise ``UnsupportedInputError`` unless the shapes fit the conv (cached: runs on every call;
    a raise is not cached, so a bad call raises every time)."""
    nd = spec.spatial_dims
    if len(x_shape) != nd + 2 or len(w_shape) != nd + 2:
        raise UnsupportedInputError(
            f"conv_global_mean: a {nd}-d conv needs batched x and weight of rank {nd + 2}, got x "
            f"{tuple(x_shape)} and weight {tuple(w_shape)}"
        )
    g = spec.groups
    c_in = x_shape[1]
    expected_cin = w_shape[0] if spec.transposed else w_shape[1] * g
    if c_in != expected_cin or (spec.transposed and c_in % g) or (not spec.transposed and w_shape[0] % g):
        raise UnsupportedInputError(
            f"conv_global_mean: x {tuple(x_shape)} does not match weight {tuple(w_shape)} with "
            f"groups={g} (transposed={spec.transposed})"
        )
    c_out = _out_channels_of(spec, w_shape)
    if bias_shape is not None and tuple(bias_shape) != (c_out,):
        raise UnsupportedInputError(
            f"conv_global_mean: bias must have shape ({c_out},), got {tuple(bias_shape)}"
        )


def _channel_vector(t: torch.Tensor, c_out: int, out_rank: int, device: torch.device) -> torch.Tensor:
    """An affine operand as fp64 on ``device``: 0-d when it has one element, else ``(c_out,)``."""
    if t.numel() == 1 and t.dim() <= out_rank:
        return t.detach().reshape(()).to(device=device, dtype=torch.float64)
    shape = tuple(t.shape)
    ones = (1,) * (out_rank - 2)
    if shape in ((c_out, *ones), (1, c_out, *ones)):
        return t.detach().reshape(c_out).to(device=device, dtype=torch.float64)
    raise UnsupportedInputError(
        f"conv_global_mean: affine operand of shape {shape} is neither a single element nor per-channel "
        f"({(c_out, *ones)} or {(1, c_out, *ones)})"
    )


def operand_values(
    cfg: ConvGlobalMeanConfig, operands: Sequence[torch.Tensor], c_out: int, device: torch.device
) -> list[torch.Tensor | float]:
    """The value of every step's operand: a Python float (``Const``) or an fp64 0-d / ``(c_out,)`` tensor."""
    out_rank = cfg.conv.spatial_dims + 2
    values: list[torch.Tensor | float] = []
    for step in cfg.affine:
        (op,) = step.operands
        if isinstance(op, Const):
            # NOTE: kept a Python float: a device tensor built from it would cost a host->device copy.
            values.append(float(op.value))
        else:
            if not 0 <= op.index < len(operands):
                raise UnsupportedInputError(
                    f"conv_global_mean: affine step refers to operand {op.index}, but {len(operands)} were given"
                )
            values.append(_channel_vector(operands[op.index], c_out, out_rank, device))
    return values


Value = Union[torch.Tensor, float]


# NOTE: the fold runs on every call, and each torch op on a CUDA tensor costs ~10-20 us of host time
# (more than the kernels' GPU time at the ``seeds`` suite's sizes), so the arithmetic below keeps
# Python floats as long as it can and skips multiplications by 1 and additions of 0.
def mul_values(p: Value, q: Value) -> Value:
    for u, v in ((p, q), (q, p)):
        if isinstance(u, float):
            if u == 1.0:
                return v
            if u == 0.0 and isinstance(v, float):
                return 0.0
    return p * q


def add_values(p: Value, q: Value) -> Value:
    if isinstance(p, float) and p == 0.0:
        return q
    if isinstance(q, float) and q == 0.0:
        return p
    return p + q


def _recip(v: Value) -> Value:
    if isinstance(v, float):
        return math.copysign(math.inf, v) if v == 0.0 else 1.0 / v  # v / 0.0 is +-inf, as in torch
    return 1.0 / v


def fold_chain(cfg: ConvGlobalMeanConfig, values: Sequence[Value]) -> list[tuple[Value, Value]]:
    """States ``(A, B)`` before each step and after the last: ``v -> A*v + B``.

    ``A``/``B`` are Python floats while only constants are involved, else fp64 0-d / ``(C_out,)``.
    The offset starts at an exact 0.0 that no operand value can turn into NaN (the eager chain has no
    such term), which is why ``0.0 * v`` stays 0.0 here.
    """
    a: Value = 1.0
    b: Value = 0.0
    states = [(a, b)]
    for step, v in zip(cfg.affine, values, strict=True):
        k = step.kind
        if k is PointwiseKind.MUL:
            a, b = mul_values(a, v), (0.0 if isinstance(b, float) and b == 0.0 else mul_values(b, v))
        elif k is PointwiseKind.ADD:
            b = add_values(b, v)
        elif k is PointwiseKind.SUB:
            b = add_values(b, -v)
        elif k is PointwiseKind.RSUB:
            a, b = -a, add_values(v, -b)
        elif k is PointwiseKind.DIV:
            inv = _recip(v)
            a, b = mul_values(a, inv), (0.0 if isinstance(b, float) and b == 0.0 else mul_values(b, inv))
        else:  # pragma: no cover - rejected by the config
            raise AssertionError(k)
        states.append((a, b))
    return states


def fold_chain_backward(
    cfg: ConvGlobalMeanConfig,
    values: Sequence[Value],
    states: Sequence[tuple[Value, Value]],
    grad_a: torch.Tensor | None,
    grad_b: torch.Tensor,
) -> list[Value | None]:
    """Reverse-mode through ``fold_chain``: gradient of each ``TensorRef`` step's operand value (else ``None``).

    ``grad_a``/``grad_b`` are the gradients of the final ``A``/``B`` (``grad_a`` may be ``None`` when
    no tensor operand of a mul/div step needs it).  Walking the steps backwards,
    mul: ``A' = A*v, B' = B*v`` gives ``dv = dA'*A + dB'*B``; add/sub: ``dv = +-dB'``; rsub
    (``A' = -A, B' = v - B``): ``dv = dB'``; div: ``dv = -(dA'*A + dB'*B) / v**2``.
    """
    grads: list[Value | None] = [None] * len(cfg.affine)
    ga: Value | None = grad_a
    gb: Value = grad_b
    for i in range(len(cfg.affine) - 1, -1, -1):
        k = cfg.affine[i].kind
        wanted = isinstance(cfg.affine[i].operands[0], TensorRef)
        v = values[i]
        a, b = states[i]
        if k in (PointwiseKind.MUL, PointwiseKind.DIV):
            if wanted:
                assert ga is not None, "grad_a is needed for a mul/div by a tensor"
                dv = add_values(mul_values(ga, a), mul_values(gb, b))
                grads[i] = dv if k is PointwiseKind.MUL else -dv / (v * v)
            scale = v if k is PointwiseKind.MUL else _recip(v)
            ga = None if ga is None else mul_values(ga, scale)
            gb = mul_values(gb, scale)
        elif k is PointwiseKind.ADD:
            grads[i] = gb if wanted else None
        elif k is PointwiseKind.SUB:
            grads[i] = -gb if wanted else None
        elif k is PointwiseKind.RSUB:
            grads[i] = gb if wanted else None
            ga = None if ga is None else -ga
            gb = -gb
    return grads


def grouped_weight(spec: ConvSpec, weight: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Weight as fp64 ``(g, ., ., T)`` plus its einsum letters (``o`` = out channel, ``i`` = in channel)."""
    g = spec.groups
    w = weight.detach().to(torch.float64)
    if spec.transposed:
        return w.reshape(g, weight.shape[0] // g, weight.shape[1], -1), "giot"
    return w.reshape(g, weight.shape[0] // g, weight.shape[1], -1), "goit"
