"""The plain-torch reference of ``fusion::conv_global_mean`` (the spec; any dtype, float64 included):
the affine fold (the per-channel steps composed into one ``A * v + B``, and the chain rule back
through it), the set sums and the contraction in fp64 (``forward``), and the gradients from the saved
sums (``backward``).  The Triton path (``triton_path``) shares the fold's arithmetic through its kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

from ...ir.specs import ConvSpec
from ..chain import Const, PointwiseKind, TensorRef
from ..chain_lowering import add_operand_grad
from ..conv_io import conv_channels, dtype_named, stats_dtype
from .config import (
    OP,
    ConvGlobalMeanConfig,
    Geometry,
    as_5d,
    call_geometry,
    channel_stride_meta,
    check_bias,
    operand_index,
)


def _channel_vector(t: Tensor, c_out: int, out_rank: int, device: torch.device) -> Tensor:
    """An affine operand as fp64 on ``device``: 0-d when it has one element, else ``(c_out,)``."""
    one = channel_stride_meta(tuple(t.shape), t.stride(), c_out, out_rank) == 0 and t.numel() == 1
    return t.detach().reshape(() if one else c_out).to(device=device, dtype=torch.float64)


def operand_values(
    cfg: ConvGlobalMeanConfig, operands: Sequence[Tensor], c_out: int, device: torch.device
) -> list[Tensor | float]:
    """The value of every step's operand: a Python float (``Const``) or an fp64 0-d / ``(c_out,)`` tensor."""
    out_rank = cfg.conv.spatial_dims + 2
    values: list[Tensor | float] = []
    for step in cfg.affine:
        (op,) = step.operands
        if isinstance(op, Const):
            # NOTE: kept a Python float: a device tensor built from it would cost a host->device copy.
            values.append(float(op.value))
        else:
            values.append(_channel_vector(operands[operand_index(op, len(operands))], c_out, out_rank, device))
    return values


Value = Union[Tensor, float]


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
    grad_a: Tensor | None,
    grad_b: Tensor,
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


def grouped_weight(spec: ConvSpec, weight: Tensor) -> tuple[Tensor, str]:
    """Weight as fp64 ``(g, ., ., T)`` plus its einsum letters (``o`` = out channel, ``i`` = in channel)."""
    g = spec.groups
    w = weight.detach().to(torch.float64)
    return w.reshape(g, weight.shape[0] // g, weight.shape[1], -1), "giot" if spec.transposed else "goit"


def _set_sums_reference(x: Tensor, geo: Geometry) -> Tensor:
    """``(N, C_in, J)`` sums of x over the product sets, in x's accumulation dtype (torch reference)."""
    n, c = x.shape[:2]
    acc = stats_dtype(x.dtype)
    m1, m2, m3 = (mask.to(acc) for mask in geo.masks)
    j1, j2, j3 = geo.set_counts
    # NOTE: three matmuls, innermost dim first, rather than one 4-operand einsum: same result,
    # no contraction-path search on every call.
    r = as_5d(x).to(acc) @ m3.T  # (N, C, D, H, J3)
    r = m2 @ r  # (N, C, D, J2, J3)
    r = m1 @ r.reshape(n, c, -1, j2 * j3)  # (N, C, J1, J2*J3)
    return r.reshape(n, c, j1 * j2 * j3)


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGlobalMeanConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, tap_sums, conv_mean)`` (``config.outputs``) in plain torch: fp64 contraction and affine fold."""
    check_bias(cfg, weight, bias)
    spec = cfg.conv
    geo = call_geometry(cfg, x, weight, x.device)
    n, c_in = x.shape[:2]
    c_out = conv_channels(weight, spec)
    r = _set_sums_reference(x, geo)  # (N, C_in, J)
    tap_sums = r.to(torch.float64) @ geo.tap_onehot.T  # (N, C_in, T)
    w, letters = grouped_weight(spec, weight)
    g = spec.groups
    total = torch.einsum(f"ngit,{letters}->ngo", tap_sums.unflatten(1, (g, -1)).flatten(3), w).reshape(n, c_out)
    if bias is not None:
        mean = torch.add(bias.detach().to(torch.float64), total, alpha=1.0 / geo.n_outputs)
    else:
        mean = total * (1.0 / geo.n_outputs)
    a, b = fold_chain(cfg, operand_values(cfg, operands, c_out, x.device))[-1]
    out = add_values(mul_values(mean, a), b)
    assert isinstance(out, Tensor)
    dtype = dtype_named(OP, cfg.out_dtype, x.dtype)
    if out.dtype != dtype:
        out = out.to(dtype)
    elif out.data_ptr() == mean.data_ptr():
        # NOTE: without affine steps and with an fp64 result, ``out`` would be ``conv_mean`` itself;
        # custom ops must not return aliased outputs.
        out = out.clone()
    if cfg.keepdim:
        out = out.reshape(n, c_out, *([1] * spec.spatial_dims))
    return out, tap_sums.reshape(n, c_in, *weight.shape[2:]), mean


def backward(grad_out: Tensor, x: Any, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             tap_sums: Tensor, conv_mean: Tensor, cfg: ConvGlobalMeanConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` in plain torch, fp64 contractions, from the
    saved sums only (``x``: the ``XMeta`` of the input; grad_x with its shape, dtype and strides)."""
    spec = cfg.conv
    device = grad_out.device
    geo = call_geometry(cfg, x, weight, device)
    n, c_in = tap_sums.shape[:2]
    c_out = conv_channels(weight, spec)
    g = spec.groups

    values = operand_values(cfg, operands, c_out, device)
    states = fold_chain(cfg, values)
    go = grad_out.reshape(n, c_out).to(torch.float64)
    gm = mul_values(go, states[-1][0])  # d loss / d conv_mean
    assert isinstance(gm, Tensor)
    coef = (gm * (1.0 / geo.n_outputs)).reshape(n, g, c_out // g)  # G of the derivation

    w, letters = grouped_weight(spec, weight)
    s = tap_sums.to(torch.float64).unflatten(1, (g, -1)).flatten(3)
    grad_w = torch.einsum(f"ngo,ngit->{letters}", coef, s).reshape(weight.shape)
    grad_bias = None if bias is None else gm.sum(0).reshape(bias.shape)

    grad_operands: list[Tensor | None] = [None] * len(operands)
    if any(isinstance(step.operands[0], TensorRef) for step in cfg.affine):
        needs_a = any(
            isinstance(step.operands[0], TensorRef) and step.kind in (PointwiseKind.MUL, PointwiseKind.DIV)
            for step in cfg.affine
        )
        grad_a = (go * conv_mean.to(torch.float64)).sum(0) if needs_a else None
        op_grads = fold_chain_backward(cfg, values, states, grad_a, go.sum(0))
        for step, grad in zip(cfg.affine, op_grads, strict=True):
            (op,) = step.operands
            if grad is None or not isinstance(op, TensorRef):
                continue
            t = operands[op.index]
            red = torch.as_tensor(grad, dtype=torch.float64, device=t.device)
            add_operand_grad(grad_operands, operands, op.index, red.sum() if t.numel() == 1 else red)
    grads_ops = [torch.zeros_like(t) if gr is None else gr for t, gr in zip(operands, grad_operands, strict=True)]

    grad_x = None
    if mask[0]:
        grad_x = torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=device)
        q_taps = torch.einsum(f"ngo,{letters}->ngit", coef, w).reshape(n, c_in, -1)  # (N, C_in, T)
        _set_broadcast_reference(q_taps @ geo.tap_onehot, geo, grad_x)  # (N, C_in, J): shared sets add up
    return [grad_x, grad_w, grad_bias, *grads_ops]


def _set_broadcast_reference(q: Tensor, geo: Geometry, grad_x: Tensor) -> None:
    """Write ``grad_x[n, ci, i] = sum_j q[n, ci, j] * [i in set j]`` (computed in ``grad_x``'s
    accumulation dtype)."""
    acc = stats_dtype(grad_x.dtype)
    m1, m2, m3 = (mask.to(acc) for mask in geo.masks)
    j1, j2, j3 = geo.set_counts
    n, c = grad_x.shape[0], grad_x.shape[1]
    full = m1.T @ q.to(acc).reshape(n, c, j1, j2 * j3)  # (N, C, D, J2*J3)
    full = m2.T @ full.reshape(n, c, -1, j2, j3)  # (N, C, D, H, J3)
    full = full @ m3  # (N, C, D, H, W)
    grad_x.copy_(full.reshape(grad_x.shape))
