"""Batch norm with running statistics as a per-channel affine step of the fused chain.

In eval mode ``batch_norm(y)`` is ``y * scale + shift`` with, per channel ``c``,

    scale[c] = gamma[c] / sqrt(running_var[c] + eps)          (gamma = 1 without affine)
    shift[c] = beta[c] - running_mean[c] * scale[c]           (beta = 0 without affine)

so the ``conv_epilogue`` op runs it as a ``mul`` and an ``add`` at the head of its chain, on the conv
output in the epilogue's float32 registers: no pass over the conv output of its own, and the conv
itself untouched (its result rounds exactly where eager's does).  The rewritten graph calls these two
functions on the per-channel tensors every step, so gradients reach batch norm's ``weight`` and
``bias`` through autograd (fine-tuning with frozen statistics).

Contract: the statistics, ``gamma`` and ``beta`` are ``(C,)``; the results are ``(C, 1, ..., 1)`` with
``spatial_dims`` ones (a per-channel operand of the chain), computed in at least float32 (batch norm's
kernels compute half-precision inputs in float32; float64 stays float64).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _dtype(running_var: Tensor) -> torch.dtype:
    return torch.promote_types(running_var.dtype, torch.float32)


def _scale(running_var: Tensor, gamma: Optional[Tensor], eps: float) -> Tensor:
    dtype = _dtype(running_var)
    scale = torch.rsqrt(running_var.to(dtype) + eps)
    return scale if gamma is None else scale * gamma.to(dtype)


def scale(running_var: Tensor, gamma: Optional[Tensor], eps: float, spatial_dims: int) -> Tensor:
    """``gamma / sqrt(running_var + eps)`` as a ``(C, 1, ...)`` chain operand (module docstring)."""
    return _scale(running_var, gamma, eps).view(-1, *(1,) * spatial_dims)


def shift(running_mean: Tensor, running_var: Tensor, gamma: Optional[Tensor], beta: Optional[Tensor], eps: float,
          spatial_dims: int) -> Tensor:
    """``beta - running_mean * scale`` as a ``(C, 1, ...)`` chain operand (module docstring)."""
    shifted = -running_mean.to(_dtype(running_var)) * _scale(running_var, gamma, eps)
    shifted = shifted if beta is None else shifted + beta.to(shifted.dtype)
    return shifted.view(-1, *(1,) * spatial_dims)
