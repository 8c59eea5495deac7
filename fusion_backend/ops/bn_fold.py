"""Batch norm with running statistics as a per-channel affine step of the fused chain.

In eval mode ``batch_norm(y)`` is ``y * scale + shift`` with, per channel ``c``,

    scale[c] = gamma[c] / sqrt(running_var[c] + eps)          (gamma = 1 without affine)
    shift[c] = beta[c] - running_mean[c] * scale[c]           (beta = 0 without affine)

so the ``conv_epilogue`` op runs it as a ``mul`` and an ``add`` in its chain, on the values in the
epilogue's float32 registers: no pass over the conv output of its own, and the conv itself untouched
(its result rounds exactly where eager's does).  The rewritten graph calls :func:`scale_and_shift` on
the per-channel tensors every step (one call per batch norm), so gradients reach batch norm's ``weight`` and
``bias`` through autograd (fine-tuning with frozen statistics).  Inductor makes one kernel of it; where
the graph runs without Inductor (``runtime/direct.py``) it runs as :func:`scale_and_shift_direct`, one
kernel too (``kernels/bn_scale_shift.py``), so that a region timed on its own, which runs directly,
pays for it what it pays inside a network.

Contract: the statistics, ``gamma`` and ``beta`` are ``(C,)``; the results are ``(C, 1, ..., 1)`` with
``spatial_dims`` ones (a per-channel operand of the chain), computed in at least float32 (batch norm's
kernels compute half-precision inputs in float32; float64 stays float64).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from ..kernels.host import kernels_unavailable
from ..kernels.plan_cache import ContractError
from .autograd_free import register_autograd_free
from .direct_impls import register_direct


def scale_and_shift(running_mean: Tensor, running_var: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor],
                    eps: float, spatial_dims: int) -> tuple[Tensor, Tensor]:
    """``(scale, shift)`` as ``(C, 1, ...)`` chain operands (module docstring)."""
    dtype = torch.promote_types(running_var.dtype, torch.float32)
    scale = torch.rsqrt(running_var.to(dtype) + eps)
    if gamma is not None:
        scale = scale * gamma.to(dtype)
    # beta - mean * scale as one op: where the rewritten graph runs without Inductor (``runtime/direct.py``)
    # each op here is a launch of its own
    mean = running_mean.to(dtype)
    shift = torch.addcmul(beta.to(dtype), mean, scale, value=-1) if beta is not None else -(mean * scale)
    per_channel = (-1, *(1,) * spatial_dims)
    return scale.view(per_channel), shift.view(per_channel)


def scale_and_shift_direct(running_mean: Tensor, running_var: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor],
                           eps: float, spatial_dims: int) -> tuple[Tensor, Tensor]:
    """:func:`scale_and_shift` as one kernel where one runs (``kernels/bn_scale_shift.py``: CUDA, or CPU
    under the interpreter; statistics of at most 32 bits), else :func:`scale_and_shift` itself.  The
    same values to rounding (the kernel's ``rsqrt`` is the device's), and the same gradients: the
    backward differentiates :func:`scale_and_shift` (fine-tuning with frozen statistics, rare enough
    for torch ops)."""
    tensors = (running_mean, running_var, gamma, beta)
    if (kernels_unavailable(torch.float32, running_var.device.type) is not None
            or any(t is not None and t.dtype == torch.float64 for t in tensors)):  # fmt: skip
        return scale_and_shift(running_mean, running_var, gamma, beta, eps, spatial_dims)
    from ..kernels import bn_scale_shift

    try:
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
            scale, shift = _ScaleAndShift.apply(running_mean, running_var, gamma, beta, eps)
        else:
            scale, shift = bn_scale_shift.scale_and_shift(running_mean, running_var, gamma, beta, eps)
    except ContractError:  # statistics the kernel cannot walk (a strided view): the torch ops take them
        return scale_and_shift(running_mean, running_var, gamma, beta, eps, spatial_dims)
    per_channel = (-1, *(1,) * spatial_dims)
    return scale.view(per_channel), shift.view(per_channel)


class _ScaleAndShift(torch.autograd.Function):
    """The kernel forward, :func:`scale_and_shift`'s own backward (through autograd, recomputed)."""

    @staticmethod
    def forward(ctx: Any, running_mean: Tensor, running_var: Tensor, gamma: Optional[Tensor],
                beta: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:  # fmt: skip
        from ..kernels import bn_scale_shift

        ctx.save_for_backward(running_mean, running_var, gamma, beta)
        ctx.eps = eps
        return bn_scale_shift.scale_and_shift(running_mean, running_var, gamma, beta, eps)

    @staticmethod
    def backward(ctx: Any, grad_scale: Tensor, grad_shift: Tensor) -> tuple[Optional[Tensor], ...]:
        saved = ctx.saved_tensors
        wanted = [t is not None and need for t, need in zip(saved, ctx.needs_input_grad[:4], strict=True)]
        if not any(wanted):
            return (None,) * 5
        with torch.enable_grad():
            leaves = [None if t is None else t.detach().requires_grad_(want) for t, want in zip(saved, wanted, strict=True)]
            scale, shift = scale_and_shift(*leaves, ctx.eps, 0)
            inputs = [t for t, want in zip(leaves, wanted, strict=True) if want]
            grads = iter(torch.autograd.grad((scale, shift), inputs, (grad_scale, grad_shift), allow_unused=True))
        return (*(next(grads) if want else None for want in wanted), None)


register_direct(scale_and_shift, scale_and_shift_direct)


def batched_scale_and_shift(means: list[Tensor], variances: list[Tensor], gammas: list[Tensor], betas: list[Tensor],
                            eps: float) -> tuple[Tensor, Tensor]:
    """The scale and shift of several eval batch norms at once: fp32 ``(sum of C,)`` each, batch norm
    ``i``'s ``C_i`` values after those of the ones before it, each as :func:`scale_and_shift` gives
    them.  The batch norms share ``eps``, their statistics' dtypes (floats of at most 32 bits) and
    device, and either all have a ``gamma`` (``beta``) or none does (an empty list).  No gradient: for
    graphs in which nothing differentiates through the statistics (``match/batch_glue.py``).

    WHY: a network's inference graph calls :func:`scale_and_shift` once per folded batch norm, and
    Inductor makes a kernel of each call: one small launch per conv (53 in ResNet-50) where one would
    do.  Here the statistics are concatenated (one ``cat`` launch each) and one kernel
    (``kernels/bn_scale_shift.py``) makes every value."""
    mean, var = torch.cat(means), torch.cat(variances)
    gamma = torch.cat(gammas) if gammas else None
    beta = torch.cat(betas) if betas else None
    if kernels_unavailable(torch.float32, var.device.type) is None:
        from ..kernels import bn_scale_shift

        return bn_scale_shift.scale_and_shift(mean, var, gamma, beta, eps)
    scale, shift = scale_and_shift(mean, var, gamma, beta, eps, 0)
    return scale.float(), shift.float()


bn_scale_shift_batched = torch.library.custom_op("fusion::bn_scale_shift_batched",
                                                 mutates_args=())(batched_scale_and_shift)


@bn_scale_shift_batched.register_fake
def _batched_fake(means, variances, gammas, betas, eps):  # noqa: ANN001, ANN202
    total = sum(t.numel() for t in variances)
    return (variances[0].new_empty(total, dtype=torch.float32), variances[0].new_empty(total, dtype=torch.float32))


#: what a graph calls (``match/batch_glue.py``); Inductor's code calls its autograd-free op
BATCHED = torch.ops.fusion.bn_scale_shift_batched.default
register_direct(BATCHED, batched_scale_and_shift)
register_autograd_free(bn_scale_shift_batched, batched_scale_and_shift, _batched_fake)
