"""The Triton path of ``fusion::conv_global_mean``: exactly two launches each way (the package
docstring's kernel pipeline): forward, the set sums over x then the contraction with the weight and the
affine steps; backward, every parameter gradient then the grad_x broadcast.  Per-shape decisions are
cached: a call only binds its tensors.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...ir.specs import ConvSpec
from ..chain import Const, TensorRef
from ..conv_io import conv_channels
from .config import (
    ConvGlobalMeanConfig,
    as_5d,
    call_geometry,
    channel_stride_meta,
    check_bias,
    operand_index,
    outputs,
)


@dataclass(frozen=True)
class _ChainStatic:
    """The shape-dependent half of ``chain_args``: per step its kind code, whether its operand is a
    tensor, the constant, the operand's index in ``operands`` (-1 for a constant) and channel stride."""

    kinds: tuple[int, ...]
    tensor: tuple[bool, ...]
    consts: tuple[float, ...]
    index: tuple[int, ...]
    strides: tuple[int, ...]


# NOTE: the op's Python runs on every call and, at the ``seeds`` suite's sizes, a training step is
# host-bound (``python tools/profile_step.py demos/seeds/convt2d_global_mean_bias_logsumexp.py --mode
# train`` shows the GPU time against the host time per step), so the per-shape decisions below are
# cached; a call only binds its tensors.
@functools.lru_cache(maxsize=256)
def _chain_static(
    cfg: ConvGlobalMeanConfig, operand_meta: tuple[tuple[Any, ...], ...], c_out: int
) -> _ChainStatic:
    out_rank = cfg.conv.spatial_dims + 2
    kinds, tensor, consts, index, strides = [], [], [], [], []
    for step in cfg.affine:
        (op,) = step.operands
        kinds.append(step.kind.code)
        if isinstance(op, Const):
            tensor.append(False)
            consts.append(float(op.value))
            index.append(-1)
            strides.append(0)
        else:
            tensor.append(True)
            consts.append(0.0)
            index.append(operand_index(op, len(operand_meta)))
            strides.append(channel_stride_meta(*operand_meta[op.index][:2], c_out, out_rank))
    return _ChainStatic(tuple(kinds), tuple(tensor), tuple(consts), tuple(index), tuple(strides))


def chain_args(
    cfg: ConvGlobalMeanConfig,
    operands: Sequence[Tensor],
    c_out: int,
    device: torch.device,
    dummy: Tensor,
) -> Any:
    """The affine chain as the kernels' ``ChainArgs`` (host only: no device work unless an operand
    lives on another device, which is then copied); ``dummy`` stands in for the operand pointer of
    constant steps."""
    from ...kernels.global_mean import ChainArgs

    moved = [t if t.device == device else t.detach().to(device) for t in operands]
    static = _chain_static(cfg, tuple((t.shape, t.stride()) for t in moved), c_out)
    ops = tuple(dummy if i < 0 else moved[i] for i in static.index)
    return ChainArgs(static.kinds, static.tensor, static.consts, ops, static.strides)


@functools.lru_cache(maxsize=256)
def _weight_layout_ints(
    shape: tuple[int, ...], stride: tuple[int, ...], transposed: bool, groups: int
) -> tuple[int, ...] | None:
    from ...kernels.global_mean import WeightLayout

    layout = WeightLayout.of(torch.empty_strided(shape, stride, device="meta"), transposed, groups)
    if layout is None:
        return None
    return (layout.s_co, layout.s_ci, layout.s_t, layout.off_g, layout.cin_g, layout.cout_g, layout.taps)


def weight_layout(weight: Tensor, spec: ConvSpec) -> Any:
    """The kernels' view of ``weight`` (a tensor that requires grad is fine: only its data is read)."""
    from ...kernels.global_mean import WeightLayout

    ints = _weight_layout_ints(tuple(weight.shape), weight.stride(), spec.transposed, spec.groups)
    if ints is None:  # kernel dims not flat-addressable (rare): one copy
        weight = weight.contiguous()
        ints = _weight_layout_ints(tuple(weight.shape), weight.stride(), spec.transposed, spec.groups)
    return WeightLayout(weight, *ints)


# NOTE: two launches each way because the small torch ops around the kernels were the cost: measured on
# the H100 (ConvTranspose2d 64->128 k3 on x (16, 64, 512, 512) fp32, before this pipeline), the pass
# over x took 0.36 ms (1.07 GB, ~3 TB/s) and the grad_x pass 0.34 ms, while the ~15 small torch ops
# around them made it 0.65 ms per forward and 2.8 ms per step (``python tools/bench_conv_global_mean.py``
# times the pipeline).
def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGlobalMeanConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, tap_sums, conv_mean)`` (``config.outputs``) from two launches: the pass over x, then
    the contraction + chain.

    NOTE: the pass over x is launched before anything else is prepared: it is nearly all of the GPU
    time, and at the ``seeds`` suite's sizes the GPU otherwise idles while the host builds the second
    launch.
    """
    from ...kernels import global_mean as kernels

    check_bias(cfg, weight, bias)
    geo = call_geometry(cfg, x, weight, x.device)
    partial = kernels.set_sums_partial(as_5d(x), geo.bits, geo.set_counts)
    out, taps, mean = outputs(x, weight, bias, operands, cfg, save)
    n, c_in = x.shape[:2]
    chain = chain_args(cfg, operands, mean.shape[1], x.device, mean)
    kernels.contract_forward(partial, geo.tapset, weight_layout(weight, cfg.conv), bias, chain, geo.n_outputs, out,
                             mean, taps.view(n, c_in, -1))  # fmt: skip
    return out, taps, mean


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


def backward(grad_out: Tensor, x: Any, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             tap_sums: Tensor, conv_mean: Tensor, cfg: ConvGlobalMeanConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` from two launches: one for every parameter
    gradient (and ``G``), one for grad_x (``x``: the input's ``XMeta``; only where ``mask[0]``).
    Operands that are one-element tensors or appear in several steps get their gradient combined on
    the host from per-step partials (a few tiny extra ops).

    NOTE: grad_x is allocated before the first launch so that its pass (nearly all of the backward's
    GPU time) is enqueued right after the small parameter kernel: the step is host-bound at the
    ``seeds`` suite's sizes.
    """
    from ...kernels import global_mean as kernels

    spec = cfg.conv
    device = grad_out.device
    geo = call_geometry(cfg, x, weight, device)
    grad_x = torch.empty_strided(x.shape, x.stride, dtype=x.dtype, device=device) if mask[0] else None
    n, c_in = tap_sums.shape[:2]
    c_out = conv_channels(weight, spec)
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
    kernels.params_backward(grad_out.reshape(n, c_out) if grad_out.dim() > 2 else grad_out, mean, taps, chain, targets,
                            gw_layout, grad_bias, geo.n_outputs, coef, scratch)  # fmt: skip
    if grad_x is not None:
        kernels.grad_broadcast(coef, w_layout, geo.tapset, geo.bits, geo.set_counts, as_5d(grad_x))
    if gw_buffer is not grad_w:
        grad_w.copy_(gw_buffer)
    for index in scratch_for:
        t = grads_ops[index]
        total = scratch[refs[index]].sum(0)
        if t.numel() == 1:
            total = total.sum()
        t.copy_(total.reshape(t.shape))
    return [grad_x, grad_w, grad_bias, *grads_ops]


