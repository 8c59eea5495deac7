"""The Triton path of ``fusion::batch_norm_conv`` (the frame every family's: ``ops/declare.py``).

The forward first computes the batch statistics (``kernels.batch_norm.batch_norm_stats``: one pass over
x, and the combine launch that also folds the norm with its affine into a per-channel scale and shift
and keeps gamma and beta in fp32 beside them, ``config.outputs``).  Then each pass has two
implementations, timed against each other once per call signature on CUDA (``impl_choice``; the
library one where nothing is measured; ``FUSION_CONV_IMPL=family`` or ``library`` forces one for every
pass):

* forward.  family: ``conv_fprop`` normalises and activates x as it loads it (the activation never
  exists in memory).  library: ``batch_norm_apply`` writes the activation, aten's conv reads it.
* input gradient.  family: ``conv_dgrad`` multiplies by the activation's derivative (recomputed from
  x) and sums the norm's backward terms as it stores, then ``batch_norm_input_grad`` writes x's
  gradient and the norm's weight and bias gradients in one launch.  library: aten's input gradient,
  then the norm's two backward kernels (``batch_norm_backward``).
* weight gradient.  family: ``conv_wgrad`` recomputes the activation as it loads x.  library:
  ``batch_norm_apply`` recomputes it, aten's weight gradient reads it.

Nothing full-size is saved: the backward recomputes from x (which the graph keeps) and the saved
per-channel statistics.  Every conv follows eager's precision (``conv_precision``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ... import environment, impl_choice
from ...kernels.plan_cache import tensor_key
from .. import conv_precision
from ..batch_statistics import AFFINE_ROWS, norm_fold
from ..chain_lowering import KernelChains, family_activation
from ..conv_io import in_format, run_conv
from ..library_conv import nominal_format
from .config import OP, BatchNormConvConfig, outputs

#: The implementations of each pass, the default (what runs where nothing is measured) first.
IMPLS = ("library", "family")


def _geometry(cfg: BatchNormConvConfig) -> dict[str, Any]:
    spec = cfg.conv
    return {"stride": spec.stride, "padding": spec.padding, "dilation": spec.dilation, "groups": spec.groups}


def _activation(cfg: BatchNormConvConfig) -> Any:
    from ...kernels.conv import Activation

    return Activation(*family_activation(cfg.act[0])) if cfg.act else None


def _prologue(stats: Tensor) -> Any:
    from ...kernels.conv import ChannelAffine

    return ChannelAffine(stats[3], stats[4])


def _choose(direction: str, x: Tensor, weight: Tensor, bias: Tensor | None, cfg: BatchNormConvConfig,
            candidates: dict[str, Callable[[], object]]) -> str:  # fmt: skip
    """The implementation of one pass: forced by ``FUSION_CONV_IMPL`` (``family`` / ``library``), else
    the faster of the two on this call signature (``impl_choice``: timed once on CUDA; the library
    path where nothing is measured)."""
    forced = environment.conv_impl()
    if forced in IMPLS:
        return forced
    fast_key = (OP, direction, cfg, tensor_key(x), tensor_key(weight), bias is None, torch.backends.cudnn.allow_tf32)
    return impl_choice.choose(
        lambda: f"{OP}|{direction}|{cfg.to_json()}|x {tuple(x.shape)} {x.stride()} {x.dtype}|w {tuple(weight.shape)} "
                f"{weight.stride()}|bias {bias is not None}|tf32 {torch.backends.cudnn.allow_tf32}",
        candidates, default=IMPLS[0], fast_key=fast_key)  # fmt: skip


def _post_chain(x: Tensor, operands: Sequence[Tensor], cfg: BatchNormConvConfig) -> KernelChains:
    """The activation as the norm's kernels take it (their post-chain); the norm's affine rows are the
    saved statistics' rows 5-6 (``config.outputs``), not built here."""
    return KernelChains(cfg.pre, cfg.post, None, operands, x.dim(), x.shape[1], x.device)


def _activation_input(x: Tensor, operands: Sequence[Tensor], stats: Tensor, cfg: BatchNormConvConfig) -> Tensor:
    """``act(norm(x))`` written out, in x's dtype and layout (``batch_norm_apply``): what the library
    conv passes read."""
    from ...kernels.batch_norm import batch_norm_apply

    chains = _post_chain(x, operands, cfg)
    a = torch.empty_like(x)
    batch_norm_apply(x, None, chains.post, chains.post_params, stats[AFFINE_ROWS], stats[:2], a)
    return a


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: BatchNormConvConfig,
            save: bool) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(out, saved_stats)`` as ``config.outputs`` lays them out."""
    from ...kernels.batch_norm import batch_norm_stats, flattening
    from ...kernels.conv import conv_fprop

    x_given = x

    _, stats = outputs(x, weight, bias, operands, cfg, save)
    x = flattening(x)  # (the output's layout stays the one eager gives the x it was called with)
    fold = norm_fold(operands, cfg)
    batch_norm_stats(x, None, cfg.eps, out=stats, fold=fold)
    tf32 = conv_precision.forward_tf32(x, weight, cfg.conv).tf32

    def family() -> Tensor:
        return conv_fprop(x, weight, bias, **_geometry(cfg), prologue=_prologue(stats), act_in=_activation(cfg),
                          allow_tf32=tf32)[0]  # fmt: skip

    def library() -> Tensor:
        a = _activation_input(x, operands, stats, cfg)
        with conv_precision.cudnn_tf32(tf32):
            return run_conv(a, weight, bias, cfg.conv)

    run = {"family": family, "library": library}
    y = run[_choose("forward", x, weight, bias, cfg, run)]()
    return in_format(y, nominal_format(x_given, weight, cfg.conv)), stats


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_stats: Tensor, cfg: BatchNormConvConfig, mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False; the running
    statistics get none)."""
    from ...kernels.batch_norm import flattening

    operand_mask = list(mask[3:])
    wanted = [index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias)]
    tf32 = conv_precision.backward_tf32(x, weight, cfg.conv)
    x = flattening(x)  # x's gradient takes x's strides where the op's outputs are laid out (``declare``)
    grads: list[Tensor | None] = [None] * len(operands)
    grad_x = grad_w = grad_b = None
    if mask[0] or any(wanted):
        grad_x, affine_grads = _input_grad(grad_out, x, weight, bias, operands, saved_stats, cfg, tf32.grad_input,
                                           bool(mask[0]))  # fmt: skip
        for index, grad, want in zip((cfg.weight, cfg.bias), affine_grads, wanted, strict=True):
            if want:
                grads[index] = grad
    if mask[1] or mask[2]:
        grad_w, grad_b = _weight_grad(grad_out, x, weight, bias, operands, saved_stats, cfg, bool(mask[2]),
                                      tf32.grad_weight)  # fmt: skip
    return [grad_x if mask[0] else None, grad_w if mask[1] else None,
            None if grad_b is None else grad_b.to(bias.dtype), *grads]  # fmt: skip


def _affine_grads(operands: Sequence[Tensor], cfg: BatchNormConvConfig, sums: tuple[Tensor, Tensor] | None,
                  channels: int, device: torch.device) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The norm's weight and bias gradients, fresh tensors (the op's outputs must not alias): in each
    operand's shape and dtype (fp32 ``(C,)`` for an absent one), filled from ``sums`` (``(Σ grad_z · x̂,
    Σ grad_z)``) where given, else empty for a kernel to write."""
    out = []
    for index, total in zip((cfg.weight, cfg.bias), sums or (None, None), strict=True):
        like = operands[index] if index is not None else None
        shape, dtype = (like.shape, like.dtype) if like is not None else ((channels,), torch.float32)
        out.append(torch.empty(shape, dtype=dtype, device=device) if total is None
                   else total.reshape(shape).to(dtype, copy=True))  # fmt: skip
    return out[0], out[1]


def _input_grad(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                stats: Tensor, cfg: BatchNormConvConfig, tf32: bool,
                need_x: bool) -> tuple[Tensor | None, tuple[Tensor, Tensor]]:  # fmt: skip
    """x's gradient (x's shape, dtype and ``empty_like`` strides; None without ``need_x``) and the norm's
    weight and bias gradients (``_affine_grads``)."""
    from ...kernels.batch_norm import batch_norm_backward, batch_norm_input_grad
    from ...kernels.conv import NormStats, conv_dgrad

    channels = x.shape[1]

    def family() -> tuple[Tensor | None, tuple[Tensor, Tensor]]:
        grad_z, sums = conv_dgrad(grad_out, weight, x.shape, **_geometry(cfg), x_prev=x, prologue=_prologue(stats),
                                  act_in=_activation(cfg), norm_stats=NormStats(stats[0], stats[1]), allow_tf32=tf32)  # fmt: skip
        if not need_x:
            return None, _affine_grads(operands, cfg, (sums.sum_dz_xhat, sums.sum_dz), channels, x.device)
        grad_x = torch.empty_like(x)
        affine_grads = _affine_grads(operands, cfg, None, channels, x.device)  # written by the same launch
        batch_norm_input_grad(grad_z, x, stats[AFFINE_ROWS], stats, sums.sum_dz, sums.sum_dz_xhat, grad_x,
                              affine_grads)  # fmt: skip
        return grad_x, affine_grads

    def library() -> tuple[Tensor | None, tuple[Tensor, Tensor]]:
        with conv_precision.cudnn_tf32(tf32):
            grad_a = torch.ops.aten.convolution_backward(
                grad_out, x, weight, None, list(cfg.conv.stride), list(cfg.conv.padding), list(cfg.conv.dilation),
                False, list(cfg.conv.output_padding), cfg.conv.groups, [True, False, False])[0]  # fmt: skip
        grad_x = torch.empty_like(x)
        chains = _post_chain(x, operands, cfg)
        dgamma, dbeta, _ = batch_norm_backward(grad_a, x, None, chains.post, chains.post_params, stats[AFFINE_ROWS],
                                               stats[:2], grad_x)  # fmt: skip
        return grad_x if need_x else None, _affine_grads(operands, cfg, (dgamma, dbeta), channels, x.device)

    run = {"family": family, "library": library}
    return run[_choose("input_grad", x, weight, bias, cfg, run)]()


def _weight_grad(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 stats: Tensor, cfg: BatchNormConvConfig, need_b: bool, tf32: bool) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The conv weight's gradient (its shape, dtype and ``empty_like`` strides) and, with ``need_b``, the
    conv bias's (C_out values, x's dtype)."""
    from ...kernels.conv import conv_wgrad

    def family() -> tuple[Tensor, Tensor | None]:
        return conv_wgrad(grad_out, x, weight, **_geometry(cfg), prologue=_prologue(stats), act_in=_activation(cfg),
                          bias_grad=need_b, allow_tf32=tf32)  # fmt: skip

    def library() -> tuple[Tensor, Tensor | None]:
        a = _activation_input(x, operands, stats, cfg)
        _, grad_w, grad_b = conv_precision.conv_backward(grad_out, a, weight, cfg.conv, False, True, need_b,
                                                         (tf32, tf32))  # fmt: skip
        return grad_w, grad_b

    run = {"family": family, "library": library}
    return run[_choose("weight_grad", x, weight, bias, cfg, run)]()

