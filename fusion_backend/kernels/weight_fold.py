"""A per-output-channel affine step folded into a conv's weight and bias, in one kernel.

A conv followed by ``y * scale[c] + shift[c]`` (an eval-mode BatchNorm, ``ops/bn_fold.py``) is the conv
of the folded weight and bias

    w'[c, ...] = round(w[c, ...] * scale[c])
    b'[c]      = round(b[c] * scale[c] + shift[c])          (b = 0 without a bias)

each product in fp32, rounded once to the conv's dtype.  The statistics may change between calls (a
fine-tuned model, a loaded checkpoint), so the fold runs every call, and under CUDA graphs it is part
of the recorded graph: one launch of :func:`_fold_kernel` is what it costs, where the same arithmetic
in torch ops launched about eight kernels (cast, multiply, cast, the bias's four, the layout).

Contract (checked by :class:`FoldPlan`, ``ContractError`` otherwise): ``weight`` is ``(C, ...)`` and
dense, each output channel's ``K = numel / C`` elements one contiguous block (``stride(0) == K``: both
the contiguous and the channels-last layouts); the folded weight has the weight's strides, so the
kernel walks both as flat arrays; ``scale``, ``shift`` and ``bias`` hold ``C`` values each, contiguous
(any shape, e.g. a chain operand's ``(C, 1, 1)``; any float dtype, read as fp32); any of them may be
absent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from .host import cdiv, is_dense, kernels_unavailable
from .launch import FastLaunch
from .plan_cache import ContractError, require_channel_vector

#: elements of the weight per program (4-8 per thread on 4 warps: the kernel is a copy)
BLOCK = 1024


@triton.jit
def _fold_kernel(w_ptr, out_w_ptr, scale_ptr, shift_ptr, bias_ptr, out_b_ptr, numel, per_channel, channels,
                 HAS_SCALE: tl.constexpr, HAS_SHIFT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    inside = offs < numel
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if HAS_SCALE:
        w = w * tl.load(scale_ptr + offs // per_channel, mask=inside, other=1.0).to(tl.float32)
    tl.store(out_w_ptr + offs, w.to(out_w_ptr.dtype.element_ty), mask=inside)
    # The first programs also fold the bias: channel ``offs`` of it (C <= numel always).
    ours = offs < channels
    b = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(bias_ptr + offs, mask=ours, other=0.0).to(tl.float32)
    if HAS_SCALE:
        b = b * tl.load(scale_ptr + offs, mask=ours, other=1.0).to(tl.float32)
    if HAS_SHIFT:
        b = b + tl.load(shift_ptr + offs, mask=ours, other=0.0).to(tl.float32)
    tl.store(out_b_ptr + offs, b.to(out_b_ptr.dtype.element_ty), mask=ours)


class FoldPlan:
    """The fold's launch for one signature (module docstring): checks the contract once, then
    ``plan(weight, scale, shift, bias) -> (folded weight, folded bias)`` launches one kernel."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> None:  # fmt: skip
        channels = weight.shape[0]
        per_channel = weight.numel() // max(channels, 1)
        if weight.numel() == 0 or weight.stride(0) != per_channel or not is_dense(weight):
            raise ContractError(f"weight fold: the weight must be dense with each output channel's elements "
                                f"contiguous (stride(0) == {per_channel}); got shape {tuple(weight.shape)}, "
                                f"strides {weight.stride()}")
        for name, t in (("scale", scale), ("shift", shift), ("bias", bias)):
            require_channel_vector(f"weight fold: {name} must hold the weight's {channels} output channels", t,
                                   channels, weight.device)
        self.dtype = dtype
        self.channels = channels
        self.launch = FastLaunch(_fold_kernel, (cdiv(weight.numel(), BLOCK),), dict(
            HAS_SCALE=scale is not None, HAS_SHIFT=shift is not None, HAS_BIAS=bias is not None, BLOCK=BLOCK,
            num_warps=4,
        ), fixed=(weight.numel(), per_channel, channels))  # fmt: skip

    def __call__(self, weight: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
                 bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        out_w = torch.empty_strided(weight.shape, weight.stride(), dtype=self.dtype, device=weight.device)
        out_b = torch.empty(self.channels, dtype=self.dtype, device=weight.device)
        # absent operands: any pointer (never read: their constexpr flag is off)
        self.launch(weight, out_w, _or(scale, weight), _or(shift, weight), _or(bias, weight), out_b)
        return out_w, out_b


def _or(t: torch.Tensor | None, other: torch.Tensor) -> torch.Tensor:
    return other if t is None else t


def fold_reference(weight: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None,
                   bias: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's arithmetic in torch ops (CPU tensors without the interpreter; the tests' yardstick)."""
    w = weight.float()
    if scale is not None:
        w = w * scale.float().reshape(-1, *([1] * (weight.dim() - 1)))
    b = torch.zeros(weight.shape[0], device=weight.device) if bias is None else bias.float().reshape(-1)
    if scale is not None:
        b = b * scale.float().reshape(-1)
    if shift is not None:
        b = b + shift.float().reshape(-1)
    return w.to(dtype), b.to(dtype)


def fold_plan(weight: torch.Tensor, scale: torch.Tensor | None, shift: torch.Tensor | None, bias: torch.Tensor | None,
              dtype: torch.dtype) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """``plan(weight, scale, shift, bias) -> (w', b')`` for calls laid out as these tensors: a
    :class:`FoldPlan` (one kernel) on CUDA, and on CPU under the interpreter (``kernels_unavailable``),
    else :func:`fold_reference`.  For a caller that keeps a plan per call signature."""
    if kernels_unavailable(dtype, weight.device.type) is not None:
        return functools.partial(fold_reference, dtype=dtype)
    return FoldPlan(weight, scale, shift, bias, dtype)

