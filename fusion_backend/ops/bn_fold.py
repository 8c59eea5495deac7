"""Batch norm with running statistics as a per-channel affine step of the fused chain.

In eval mode ``batch_norm(y)`` is ``y * scale + shift`` with, per channel ``c``,

    scale[c] = gamma[c] / sqrt(running_var[c] + eps)          (gamma = 1 without affine)
    shift[c] = beta[c] - running_mean[c] * scale[c]           (beta = 0 without affine)

so the ``conv_epilogue`` op runs it as a ``mul`` and an ``add`` in its chain, on the values in the
epilogue's float32 registers: no pass over the conv output of its own, and the conv itself untouched
(its result rounds exactly where eager's does).  The rewritten graph calls :func:`scale_and_shift` on
the per-channel tensors every step (one call per batch norm), so gradients reach batch norm's ``weight`` and
``bias`` through autograd (fine-tuning with frozen statistics).

Contract: the statistics, ``gamma`` and ``beta`` are ``(C,)``; the results are ``(C, 1, ..., 1)`` with
``spatial_dims`` ones (a per-channel operand of the chain), computed in at least float32 (batch norm's
kernels compute half-precision inputs in float32; float64 stays float64).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


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
