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

from . import hooks
from .hooks import ActivationLike, Prologue
from .stats import ChannelStats

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
    act_out: ActivationLike = None,
    residual: torch.Tensor | None = None,
    residual_after_act: bool = False,
    stats: bool = False,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, ChannelStats | None]:
    """``conv_fprop``'s result computed op by op in ``dtype`` (None: x's) on x's device; the
    statistics are float64 sums of the output as returned (in ``dtype``)."""
    dtype = x.dtype if dtype is None else dtype
    v = apply_activation(apply_prologue(x.to(dtype), prologue, dtype), act_in)
    conv = _CONV[x.dim()]
    y = conv(v, weight.to(dtype), None if bias is None else bias.to(dtype), stride=stride, padding=padding,
             dilation=dilation, groups=groups)  # fmt: skip
    if residual is not None and not residual_after_act:
        y = y + residual.to(dtype)
    y = apply_activation(y, act_out)
    if residual is not None and residual_after_act:
        y = y + residual.to(dtype)
    if not stats:
        return y, None
    flat = y.double().transpose(0, 1).reshape(y.shape[1], -1)
    return y, ChannelStats(flat.sum(1), (flat * flat).sum(1), flat.shape[1])
