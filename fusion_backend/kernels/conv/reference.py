"""The conv family's forward in plain torch: ``F.conv{1,2,3}d`` with the same hooks, op by op.

What the kernels are measured against.  Run in float64 it is the truth; run in the inputs' own dtype
it is what eager does with the same model (a rounding after every op), whose distance to the truth is
the tests' yardstick.  Its arguments are :func:`fprop.conv_fprop`'s; every tensor (hooks included) is
cast to ``dtype`` first, so the float64 run sees exactly the kernel's input values.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..chain_math import KernelStep
from . import hooks
from .hooks import ActivationLike, Prologue
from .stats import BatchNormGradSums, ChannelStats, GroupStats

_CONV = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}


def apply_activation(v: torch.Tensor, act: ActivationLike) -> torch.Tensor:
    """``v`` through an activation of the catalogue (None: unchanged), as torch computes it."""
    a = hooks.as_activation(act, "activation")
    if a is None:
        return v
    if a.kind == "relu":
        return torch.relu(v)
    if a.kind == "leaky_relu":
        return F.leaky_relu(v, a.slope)
    if a.kind == "gelu":
        return F.gelu(v)
    return F.silu(v)


def apply_chain(v: torch.Tensor, chain: Sequence[KernelStep], dtype: torch.dtype) -> torch.Tensor:
    """``v`` (N, C, *spatial) through ``chain`` (``chain_math.KernelStep`` s of plain op codes), each step
    with torch's semantics as the fused ops' references apply them (``ops.chain.apply_step``), tensor
    operands cast to ``dtype`` and broadcast over the channels."""
    from ...ops.chain import PointwiseKind, apply_step

    kinds = {kind.code: kind for kind in PointwiseKind}
    shape = (1, v.shape[1]) + (1,) * (v.dim() - 2)
    for code, operands in chain:
        values = [o.to(v.device, dtype).reshape(shape if o.numel() > 1 else ()) if isinstance(o, torch.Tensor)
                  else o for o in operands]  # fmt: skip
        v = apply_step(kinds[int(code)], v, values)
    return v


def apply_prologue(x: torch.Tensor, prologue: Prologue | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` (N, C, *spatial) through the prologue's normalisation, its tensors cast to ``dtype``."""
    if prologue is None:
        return x
    n, c = x.shape[:2]
    tail = [1] * (x.dim() - 2)

    def per_channel(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).view(1, c, *tail)

    if isinstance(prologue, hooks.ChannelAffine):
        return x * per_channel(prologue.scale) + per_channel(prologue.shift)
    if isinstance(prologue, hooks.GroupAffine):
        per_group = c // prologue.groups

        def per_sample_group(t: torch.Tensor) -> torch.Tensor:
            return t.to(dtype).repeat_interleave(per_group, dim=1).view(n, c, *tail)

        x = x * per_sample_group(prologue.scale) + per_sample_group(prologue.shift)
        if prologue.weight is not None:
            x = x * per_channel(prologue.weight) + per_channel(prologue.bias)
        return x
    if isinstance(prologue, hooks.SampleChannelScale):
        return x * prologue.gate.to(dtype).view(n, c, *tail)
    raise TypeError(f"unknown prologue {type(prologue).__name__}")


def conv_fprop_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    prologue: Prologue | None = None,
    act_in: ActivationLike = None,
    scale: torch.Tensor | None = None,
    chain: Sequence[KernelStep] = (),
    act_out: ActivationLike = None,
    residual: torch.Tensor | None = None,
    residual_after_act: bool = False,
    stats: bool = False,
    dtype: torch.dtype | None = None,
    stats_groups: int = 0,
) -> tuple[torch.Tensor, ChannelStats | GroupStats | None]:
    """``conv_fprop``'s result computed op by op in ``dtype`` (None: x's) on x's device; the
    statistics are float64 (sums and squared deviations) of the output as returned (in ``dtype``):
    per channel, or with ``stats_groups`` per sample and group of channels (``conv_fprop``'s)."""
    dtype = x.dtype if dtype is None else dtype
    v = apply_activation(apply_prologue(x.to(dtype), prologue, dtype), act_in)
    conv = _CONV[x.dim()]
    per_channel = (-1, *(1,) * (x.dim() - 2))
    fused_bias = None if bias is None or scale is not None else bias.to(dtype)  # the conv adds it, as eager's
    y = conv(v, weight.to(dtype), fused_bias, stride=stride, padding=padding, dilation=dilation, groups=groups)
    if scale is not None:
        y = y * scale.to(dtype).view(per_channel)
        if bias is not None:
            y = y + bias.to(dtype).view(per_channel)
    y = apply_chain(y, chain, dtype)
    if residual is not None and not residual_after_act:
        y = y + residual.to(dtype)
    y = apply_activation(y, act_out)
    if residual is not None and residual_after_act:
        y = y + residual.to(dtype)
    if stats_groups:
        grouped = y.double().reshape(y.shape[0], stats_groups, -1)
        deviations = grouped - grouped.mean(2, keepdim=True)
        return y, GroupStats(grouped.sum(2), (deviations * deviations).sum(2), grouped.shape[2])
    if not stats:
        return y, None
    flat = y.double().transpose(0, 1).reshape(y.shape[1], -1)
    deviations = flat - flat.mean(1, keepdim=True)
    return y, ChannelStats(flat.sum(1), (deviations * deviations).sum(1), flat.shape[1])


_WEIGHT_GRAD = {3: torch.nn.grad.conv1d_weight, 4: torch.nn.grad.conv2d_weight, 5: torch.nn.grad.conv3d_weight}
_INPUT_GRAD = {3: torch.nn.grad.conv1d_input, 4: torch.nn.grad.conv2d_input, 5: torch.nn.grad.conv3d_input}


def conv_wgrad_reference(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    prologue: Prologue | None = None,
    act_in: ActivationLike = None,
    bias_grad: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``conv_wgrad``'s result in ``dtype`` (None: x's): the hooked input ``act_in(prologue(x))`` op by
    op, then ``torch.nn.grad.conv{1,2,3}d_weight`` (eager's convolution backward); ``grad_bias`` the sum
    of ``grad_y`` over all dims but the channels."""
    dtype = x.dtype if dtype is None else dtype
    a = apply_activation(apply_prologue(x.to(dtype), prologue, dtype), act_in)
    gy = grad_y.to(dtype)
    grad_w = _WEIGHT_GRAD[x.dim()](a, weight.shape, gy, stride=stride, padding=padding, dilation=dilation,
                                    groups=groups)  # fmt: skip
    dims = [0, *range(2, gy.dim())]
    return grad_w, (gy.sum(dims) if bias_grad else None)


def conv_dgrad_reference(
    grad_y: torch.Tensor,
    weight: torch.Tensor,
    input_size: Sequence[int],
    *,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
    x_prev: torch.Tensor | None = None,
    prologue: Prologue | None = None,
    act_in: ActivationLike = None,
    norm_stats: hooks.NormStats | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, BatchNormGradSums | None]:
    """``conv_dgrad``'s result in ``dtype`` (None: grad_y's): ``torch.nn.grad.conv{1,2,3}d_input``, then
    with ``act_in`` the activation's backward by autograd at ``z = prologue(x_prev)`` (torch's own
    derivative conventions, e.g. relu'(0) = 0); with ``norm_stats`` the float64 sums over all dims but
    the channels of ``grad_z`` and ``grad_z * (x_prev - mean) * rstd`` (x̂ formed in ``dtype``)."""
    dtype = grad_y.dtype if dtype is None else dtype
    grad = _INPUT_GRAD[grad_y.dim()](tuple(input_size), weight.to(dtype), grad_y.to(dtype), stride=stride,
                                     padding=padding, dilation=dilation, groups=groups)  # fmt: skip
    if act_in is not None:
        z = apply_prologue(x_prev.to(dtype), prologue, dtype).detach().requires_grad_(True)
        with torch.enable_grad():
            (grad,) = torch.autograd.grad(apply_activation(z, act_in), z, grad)
    if norm_stats is None:
        return grad, None
    c, tail = grad.shape[1], [1] * (grad.dim() - 2)
    xhat = (x_prev.to(dtype) - norm_stats.mean.to(dtype).view(1, c, *tail)) * norm_stats.rstd.to(dtype).view(1, c, *tail)
    flat = grad.double().transpose(0, 1).reshape(c, -1)
    flat_xhat = xhat.double().transpose(0, 1).reshape(c, -1)
    return grad, BatchNormGradSums(flat.sum(1), (flat * flat_xhat).sum(1), flat.shape[1])
