"""The backward of ``fusion::conv_global_mean``: the two Triton launches (parameter gradients, then the
grad_x broadcast) and the plain-torch reference.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..chain import PointwiseKind, TensorRef
from .common import as_5d, run_with_fallback
from .config import ConvGlobalMeanConfig
from .fold import (
    accumulation_dtype,
    fold_chain,
    fold_chain_backward,
    grouped_weight,
    mul_values,
    operand_values,
    output_channels,
)
from .forward import chain_args, channel_stride_meta, weight_layout
from .geometry import Geometry, geometry_for


def backward_impl(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    tap_sums: torch.Tensor,
    conv_mean: torch.Tensor,
    x_size: Sequence[int],
    x_stride: Sequence[int],
    x_dtype: torch.dtype,
    need_grad_input: bool,
    config: str,
) -> list[torch.Tensor]:
    """Backward of ``conv_global_mean``: ``[grad_x, grad_weight, grad_bias, *grad_operands]``.

    ``grad_x`` has ``x_size``/``x_stride``/``x_dtype`` (an empty ``(0,)`` tensor when
    ``need_grad_input`` is false; ``x_stride`` is ``grad_input_strides(x)``: x's memory format, as
    eager autograd gives it); ``grad_bias`` is ``(C_out,)`` (``(0,)`` when there is no bias); every
    other gradient has its input's shape and dtype.  ``tap_sums`` and ``conv_mean`` are the forward's
    auxiliary outputs.  x itself is not needed: the gradients only use the saved sums.
    """
    cfg = ConvGlobalMeanConfig.from_json(config)
    geo = geometry_for(cfg.conv, tuple(x_size[2:]), tuple(weight.shape[2:]), grad_out.device)
    # NOTE: grad_x is allocated before the first launch so that its pass (nearly all of the backward's GPU
    # time) is enqueued right after the small parameter kernel: the step is host-bound at the ``seeds``
    # suite's sizes.
    grad_x = (
        torch.empty_strided(tuple(x_size), tuple(x_stride), dtype=x_dtype, device=grad_out.device)
        if need_grad_input
        else None
    )
    args = (cfg, grad_out, weight, bias, operands, tap_sums, conv_mean, grad_x, geo)
    return run_with_fallback(
        "conv_global_mean_bwd",
        cfg,
        config,
        grad_out,
        geo,
        lambda: _backward_kernels(*args),
        lambda: _backward_reference(*args),
        dtype=x_dtype,
    )


def grad_input_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of the input gradient eager autograd would give for x: channels_last(_3d) when x is in
    that format (and not also contiguous), else contiguous."""
    size = tuple(x.shape)
    fmt = torch.contiguous_format
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            fmt = torch.channels_last
        elif x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            fmt = torch.channels_last_3d
    if fmt is torch.contiguous_format:
        strides, acc = [], 1
        for d in reversed(size):
            strides.append(acc)
            acc *= max(d, 1)
        return tuple(reversed(strides))
    # channels first, then the spatial dims innermost-last: (N, C, *S) stored as (N, *S, C)
    c = size[1]
    spatial = size[2:]
    strides_sp, acc = [], c
    for d in reversed(spatial):
        strides_sp.append(acc)
        acc *= max(d, 1)
    return (acc, 1, *reversed(strides_sp))


@dataclass(frozen=True)
class _GradTargets:
    """Where ``_params_bwd_kernel`` writes each affine step's operand gradient: per step
    ``(mode, operand index, stride)``; ``referenced`` maps each operand index to its steps;
    ``scratch_for`` lists the operands combined on the host from per-step fp64 partials (one-element
    operands, operands used by several steps, operands on another device)."""

    steps: tuple[tuple[int, int, int], ...]
    referenced: dict[int, list[int]]
    scratch_for: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _grad_targets(
    cfg: ConvGlobalMeanConfig, operand_meta: tuple[tuple[Any, ...], ...], c_out: int, device: torch.device
) -> _GradTargets:
    from ...kernels import global_mean as kernels

    refs: dict[int, list[int]] = {}
    for i, step in enumerate(cfg.affine):
        if isinstance(step.operands[0], TensorRef):
            refs.setdefault(step.operands[0].index, []).append(i)
    steps = [(kernels.GRAD_NONE, -1, 0)] * len(cfg.affine)
    scratch_for = []
    out_rank = cfg.conv.spatial_dims + 2
    for index, used_by in refs.items():
        shape, stride, where = operand_meta[index]
        channel_stride = channel_stride_meta(shape, stride, c_out, out_rank)
        if len(used_by) == 1 and channel_stride != 0 and where == device:
            steps[used_by[0]] = (kernels.GRAD_DIRECT, index, channel_stride)
        else:
            scratch_for.append(index)
            for i in used_by:
                steps[i] = (kernels.GRAD_SCRATCH, index, 1)
    return _GradTargets(tuple(steps), refs, tuple(scratch_for))


def _backward_kernels(
    cfg: ConvGlobalMeanConfig, grad_out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor], tap_sums: torch.Tensor, conv_mean: torch.Tensor,
    grad_x: torch.Tensor | None, geo: Geometry,
) -> list[torch.Tensor]:  # fmt: skip
    """Backward on the Triton kernels: one launch for every parameter gradient (and ``G``), one
    for grad_x (written into ``grad_x``, the destination ``backward_impl`` allocated; ``None`` when
    not needed).  Operands that are one-element tensors or appear in several steps get their
    gradient combined on the host from per-step partials (a few tiny extra ops)."""
    from ...kernels import global_mean as kernels

    spec = cfg.conv
    device = grad_out.device
    n, c_in = tap_sums.shape[:2]
    c_out = output_channels(spec, weight)
    taps = tap_sums.reshape(n, c_in, -1).contiguous()
    mean = conv_mean.contiguous()
    coef = torch.empty((n, c_out), dtype=torch.float32, device=device)
    chain = chain_args(cfg, operands, c_out, device, coef)

    targets_plan = _grad_targets(cfg, tuple((t.shape, t.stride(), t.device) for t in operands), c_out, device)
    # operands written by the kernel directly or via scratch are fully overwritten; others stay zero
    grads_ops = [
        torch.empty_like(t) if i in targets_plan.referenced else torch.zeros_like(t) for i, t in enumerate(operands)
    ]
    scratch = coef
    if targets_plan.scratch_for:
        scratch = torch.empty((len(cfg.affine), c_out), dtype=torch.float64, device=device)
    targets = tuple(
        (mode, coef if mode == kernels.GRAD_NONE else scratch if mode == kernels.GRAD_SCRATCH else grads_ops[index],
         stride)
        for mode, index, stride in targets_plan.steps
    )  # fmt: skip
    refs = targets_plan.referenced
    scratch_for = targets_plan.scratch_for

    grad_w = torch.empty_like(weight)
    gw_layout = weight_layout(grad_w, spec)  # a copy buffer when grad_w is not flat-addressable
    gw_buffer = gw_layout.tensor
    grad_bias = torch.empty_like(bias) if bias is not None else None
    w_layout = weight_layout(weight, spec) if grad_x is not None else None
    kernels.params_backward(
        grad_out.reshape(n, c_out) if grad_out.dim() > 2 else grad_out,
        mean,
        taps,
        chain,
        targets,
        gw_layout,
        grad_bias,
        geo.n_outputs,
        coef,
        scratch,
    )
    if grad_x is not None:
        assert geo.bits is not None
        kernels.grad_broadcast(coef, w_layout, geo.tapset, geo.bits, geo.set_counts, as_5d(grad_x))
    else:
        grad_x = grad_out.new_empty((0,))
    if gw_buffer is not grad_w:
        grad_w.copy_(gw_buffer)
    for index in scratch_for:
        t = grads_ops[index]
        total = scratch[refs[index]].sum(0)
        if t.numel() == 1:
            total = total.sum()
        t.copy_(total.reshape(t.shape))
    gb = grad_bias if grad_bias is not None else grad_out.new_empty((0,))
    return [grad_x, grad_w, gb, *grads_ops]


def _backward_reference(
    cfg: ConvGlobalMeanConfig, grad_out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor], tap_sums: torch.Tensor, conv_mean: torch.Tensor,
    grad_x: torch.Tensor | None, geo: Geometry,
) -> list[torch.Tensor]:  # fmt: skip
    """Backward in plain torch (the spec), fp64 contractions; ``grad_x`` as in ``_backward_kernels``."""
    spec = cfg.conv
    device = grad_out.device
    n, c_in = tap_sums.shape[:2]
    c_out = output_channels(spec, weight)
    g = spec.groups

    values = operand_values(cfg, operands, c_out, device)
    states = fold_chain(cfg, values)
    go = grad_out.reshape(n, c_out).to(torch.float64)
    gm = mul_values(go, states[-1][0])  # d loss / d conv_mean
    assert isinstance(gm, torch.Tensor)
    coef = (gm * (1.0 / geo.n_outputs)).reshape(n, g, c_out // g)  # G of the derivation

    w, letters = grouped_weight(spec, weight)
    s = tap_sums.to(torch.float64).reshape(n, g, c_in // g, -1)
    grad_w = _like(weight, torch.einsum(f"ngo,ngit->{letters}", coef, s).reshape(weight.shape))
    grad_bias = _like(bias, gm.sum(0).reshape(bias.shape)) if bias is not None else grad_out.new_empty((0,))

    grad_operands: list[torch.Tensor | None] = [None] * len(operands)
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
            red = torch.as_tensor(grad, dtype=torch.float64, device=device)
            red = red.sum() if t.numel() == 1 else red
            red = red.reshape(t.shape).to(device=t.device, dtype=t.dtype)
            prev = grad_operands[op.index]
            grad_operands[op.index] = red if prev is None else prev + red
    grads_ops = [
        torch.zeros_like(t) if gr is None else _like(t, gr) for t, gr in zip(operands, grad_operands, strict=True)
    ]

    if grad_x is not None:
        q_taps = torch.einsum(f"ngo,{letters}->ngit", coef, w).reshape(n, c_in, -1)  # (N, C_in, T)
        q = q_taps @ geo.tap_onehot  # (N, C_in, J): sets shared by several taps add up
        _set_broadcast_reference(q, geo, grad_x)
    else:
        grad_x = grad_out.new_empty((0,))
    return [grad_x, grad_w, grad_bias, *grads_ops]


def _set_broadcast_reference(q: torch.Tensor, geo: Geometry, grad_x: torch.Tensor) -> None:
    """Write ``grad_x[n, ci, i] = sum_j q[n, ci, j] * [i in set j]`` (torch reference; computed in
    ``grad_x``'s accumulation dtype)."""
    acc = accumulation_dtype(grad_x.dtype)
    m1, m2, m3 = (mask.to(acc) for mask in geo.masks)
    j1, j2, j3 = geo.set_counts
    n, c = grad_x.shape[0], grad_x.shape[1]
    full = m1.T @ q.to(acc).reshape(n, c, j1, j2 * j3)  # (N, C, D, J2*J3)
    full = m2.T @ full.reshape(n, c, -1, j2, j3)  # (N, C, D, H, J3)
    full = full @ m3  # (N, C, D, H, W)
    grad_x.copy_(full.reshape(grad_x.shape))


def _like(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in a buffer laid out like ``torch.empty_like(reference)``: the fake promises those
    strides (Inductor asserts them), while einsum/reshape results may come out permuted."""
    return torch.empty_like(reference).copy_(value)
