"""The forward of ``fusion::conv_global_mean``: the two Triton launches (set sums over x, then the
contraction with the weight and the affine steps) and the plain-torch reference.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import UnsupportedInputError
from ...ir.specs import ConvSpec
from ..chain import Const
from .common import as_5d, run_with_fallback
from .config import ConvGlobalMeanConfig
from .fold import (
    accumulation_dtype,
    add_values,
    fold_chain,
    grouped_weight,
    mul_values,
    operand_values,
    output_channels,
    validate,
)
from .geometry import Geometry, geometry_for


def _set_sums_reference(x: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """``(N, C_in, J)`` sums of x over the product sets, in x's accumulation dtype (torch reference)."""
    n, c = x.shape[:2]
    acc = accumulation_dtype(x.dtype)
    m1, m2, m3 = (mask.to(acc) for mask in geo.masks)
    j1, j2, j3 = geo.set_counts
    # NOTE: three matmuls, innermost dim first, rather than one 4-operand einsum: same result,
    # no contraction-path search on every call.
    r = as_5d(x).to(acc) @ m3.T  # (N, C, D, H, J3)
    r = m2 @ r  # (N, C, D, J2, J3)
    r = m1 @ r.reshape(n, c, -1, j2 * j3)  # (N, C, J1, J2*J3)
    return r.reshape(n, c, j1 * j2 * j3)




def _channel_stride(t: torch.Tensor, c_out: int, out_rank: int) -> int:
    """Element stride between channels of an affine operand (0 for a one-element operand); validates
    the shape exactly like ``_channel_vector``."""
    return channel_stride_meta(tuple(t.shape), t.stride(), c_out, out_rank)


def channel_stride_meta(shape: tuple[int, ...], stride: tuple[int, ...], c_out: int, out_rank: int) -> int:
    if math.prod(shape) == 1 and len(shape) <= out_rank:
        return 0
    shape = tuple(shape)
    ones = (1,) * (out_rank - 2)
    if shape == (c_out, *ones):
        return stride[0]
    if shape == (1, c_out, *ones):
        return stride[1]
    raise UnsupportedInputError(
        f"conv_global_mean: affine operand of shape {shape} is neither a single element nor per-channel "
        f"({(c_out, *ones)} or {(1, c_out, *ones)})"
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
            if not 0 <= op.index < len(operand_meta):
                raise UnsupportedInputError(
                    f"conv_global_mean: affine step refers to operand {op.index}, but {len(operand_meta)} were given"
                )
            tensor.append(True)
            consts.append(0.0)
            index.append(op.index)
            strides.append(channel_stride_meta(*operand_meta[op.index][:2], c_out, out_rank))
    return _ChainStatic(tuple(kinds), tuple(tensor), tuple(consts), tuple(index), tuple(strides))


def chain_args(
    cfg: ConvGlobalMeanConfig,
    operands: Sequence[torch.Tensor],
    c_out: int,
    device: torch.device,
    dummy: torch.Tensor,
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


def weight_layout(weight: torch.Tensor, spec: ConvSpec) -> Any:
    """The kernels' view of ``weight`` (a tensor that requires grad is fine: only its data is read)."""
    from ...kernels.global_mean import WeightLayout

    ints = _weight_layout_ints(tuple(weight.shape), weight.stride(), spec.transposed, spec.groups)
    if ints is None:  # kernel dims not flat-addressable (rare): one copy
        weight = weight.contiguous()
        ints = _weight_layout_ints(tuple(weight.shape), weight.stride(), spec.transposed, spec.groups)
    return WeightLayout(weight, *ints)


def forward_kernels(
    cfg: ConvGlobalMeanConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor], geo: Geometry,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Forward on the Triton kernels: two launches (the pass over x, then the contraction + chain).

    NOTE: the pass over x is launched before anything else is prepared: it is nearly all of the GPU
    time, and at the ``seeds`` suite's sizes the GPU otherwise idles while the host builds the second
    launch.
    """
    from ...kernels import global_mean as kernels

    assert geo.bits is not None
    partial = kernels.set_sums_partial(as_5d(x), geo.bits, geo.set_counts)
    n, c_in = x.shape[:2]
    c_out = output_channels(cfg.conv, weight)
    out_dtype = getattr(torch, cfg.out_dtype) if cfg.out_dtype else x.dtype
    out_shape = (n, c_out, *([1] * cfg.conv.spatial_dims)) if cfg.keepdim else (n, c_out)
    out = torch.empty(out_shape, dtype=out_dtype, device=x.device)
    mean = torch.empty((n, c_out), dtype=torch.float64, device=x.device)
    chain = chain_args(cfg, operands, c_out, x.device, mean)
    taps = torch.empty((n, c_in, *weight.shape[2:]), dtype=torch.float64, device=x.device)
    kernels.contract_forward(
        partial,
        geo.tapset,
        weight_layout(weight, cfg.conv),
        bias,
        chain,
        geo.n_outputs,
        out,
        mean,
        taps.view(n, c_in, -1),
    )
    return out, taps, mean


def forward_reference(
    cfg: ConvGlobalMeanConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor], geo: Geometry,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Forward in plain torch (the spec): fp64 contraction and affine fold."""
    spec = cfg.conv
    n, c_in = x.shape[:2]
    c_out = output_channels(spec, weight)
    r = _set_sums_reference(x, geo)  # (N, C_in, J)
    tap_sums = r.to(torch.float64) @ geo.tap_onehot.T  # (N, C_in, T)
    w, letters = grouped_weight(spec, weight)
    g = spec.groups
    total = torch.einsum(f"ngit,{letters}->ngo", tap_sums.reshape(n, g, c_in // g, -1), w).reshape(n, c_out)
    if bias is not None:
        mean = torch.add(bias.detach().to(torch.float64), total, alpha=1.0 / geo.n_outputs)
    else:
        mean = total * (1.0 / geo.n_outputs)
    a, b = fold_chain(cfg, operand_values(cfg, operands, c_out, x.device))[-1]
    out = add_values(mul_values(mean, a), b)
    assert isinstance(out, torch.Tensor)
    out_dtype = getattr(torch, cfg.out_dtype) if cfg.out_dtype else x.dtype
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    elif out.data_ptr() == mean.data_ptr():
        # NOTE: without affine steps and with an fp64 result, ``out`` would be ``conv_mean`` itself;
        # custom ops must not return aliased outputs.
        out = out.clone()
    if cfg.keepdim:
        out = out.reshape(n, c_out, *([1] * spec.spatial_dims))
    return out, tap_sums.reshape(n, c_in, *weight.shape[2:]), mean


def forward_impl(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, operands: list[torch.Tensor],
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Forward of ``conv_global_mean``; returns ``(out, tap_sums, conv_mean)``.

    * ``out``: the op's result (see the module docstring), dtype ``out_dtype`` or x's.
    * ``tap_sums``: ``S`` of the derivation, ``(N, C_in, *kernel_size)``, fp64.
    * ``conv_mean``: ``M`` (mean of the conv output incl. bias, before the affine steps),
      ``(N, C_out)``, fp64.
    The last two are the tiny tensors the backward needs; they are not differentiable.
    """
    cfg = ConvGlobalMeanConfig.from_json(config)
    validate(cfg, x, weight, bias)
    geo = geometry_for(cfg.conv, tuple(x.shape[2:]), tuple(weight.shape[2:]), x.device)
    return run_with_fallback(
        "conv_global_mean_fwd",
        cfg,
        config,
        x,
        geo,
        lambda: forward_kernels(cfg, x, weight, bias, operands, geo),
        lambda: forward_reference(cfg, x, weight, bias, operands, geo),
    )
