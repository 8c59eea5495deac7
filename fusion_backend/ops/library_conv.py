"""The library conv's backward (``aten.convolution_backward``: cuDNN) for the families whose own kernel
writes the conv output's gradient (``conv_channel_reduce``, ``conv_group_norm``, ``conv_batch_norm``,
``conv_layer_norm``): the layout that kernel writes the gradient in, and the conv backward on
channels-last tensors, whatever x's layout, where cuDNN has channels-last kernels.

Contract (:class:`ConvBackwardPlan`, one per call signature, from :func:`conv_backward_plan`):

* ``plan.new_grad_y(device)``: an empty conv-output gradient of the conv output's shape and dtype,
  channels-last for 2-d and 3-d convs in fp16 / bf16 / fp32, else in the saved conv output's memory
  format (``conv_epilogue.common.output_memory_format``).  The family's kernel writes it through
  its strides, whatever they are.
* ``plan(grad_y, x, weight, need_x, need_w, need_b) -> (grad_x, grad_w, grad_b)``: None where not
  needed; ``grad_x`` in x's own layout (``torch.empty_like(x)`` strides) and the conv's dtype, the
  others as ``aten.convolution_backward`` gives them (the ops' ``backward_outputs`` gives every
  gradient its input's dtype and strides).  With a channels-last plan, x and the weight are relaid
  into channels-last for the call and the input gradient relaid back, each in one pass of
  ``kernels.relayout`` (a tensor whose spatial dims do not flatten, e.g. a slice, takes torch's copy).

WHY channels-last: cuDNN's NCHW backward converts x and the gradient to channels-last itself, once for
the data gradient and again for the weight gradient.  NOTE: measured on the H100 (torch 2.11, cuDNN
9.19; ``aten.convolution_backward`` alone on NCHW vs channels-last tensors, ms, fp32 with TF32 / bf16):

=============================================  ===============  ===============
conv, input                                    fp32             bf16
=============================================  ===============  ===============
Conv2d 64->64 k3 p1, 32x64x128x128             0.988 / 0.592    0.475 / 0.219
ConvTranspose2d 64->32 k4 s2 p1, 16x64x64x64   0.331 / 0.298    0.134 / 0.098
Conv2d 64->64 k3 p1, 32x64x64x64               0.284 / 0.179    0.141 / 0.076
Conv2d 64->128 k3, 64x64x128x128               2.962 / 1.853    1.344 / 0.709
depthwise Conv2d 144 k3 p1, 32x144x56x56       0.502 / 0.256    (not measured)
=============================================  ===============  ===============

Relaying x in and the input gradient back costs two passes at memory speed (0.01-0.18 ms for these
inputs), less than the difference in every row.  ``conv_epilogue`` measures the same choice per shape
(its ``LibraryBackward``), as its NCHW path reads a saved state in the caller's layout; here the
family's kernel writes the gradient in whichever layout is asked for at no extra cost, so the rule
needs no timing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..ir.specs import ConvSpec
from ..kernels.host import BoundedCache, tensor_key
from .conv_epilogue.common import (
    channels_last_format,
    conv_output_shape,
    output_memory_format,
    planned_relayout,
    run_conv_backward,
)

#: Conv dtypes whose channels-last backward cuDNN runs with its channels-last kernels (float64 runs
#: NCHW whatever the layout).
CHANNELS_LAST_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def channels_last_backward(x: Tensor) -> bool:
    """Whether the conv backward of a conv on ``x`` runs on channels-last tensors (see the module
    docstring): 2-d and 3-d convs in fp16 / bf16 / fp32."""
    return x.dim() in (4, 5) and x.dtype in CHANNELS_LAST_DTYPES


@dataclass
class ConvBackwardPlan:
    """``aten.convolution_backward`` for one call signature (see the module docstring).  Keeps no
    tensor: a plan outlives the calls, and a tensor made during a CUDA-graph capture would live in
    the graph's pool."""

    spec: ConvSpec
    #: shape, strides and dtype of the conv output's gradient the family's kernel writes
    grad_y_layout: tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
    #: x relaid into channels-last in one copy (None: x is used as it is)
    x_relayout: object | None
    #: the weight relaid into channels-last (None: used as it is)
    weight_relayout: object | None
    #: the input gradient, channels-last from the conv backward, relaid into x's layout (None: kept)
    grad_x_relayout: object | None

    def new_grad_y(self, device: torch.device) -> Tensor:
        shape, stride, dtype = self.grad_y_layout
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)

    def __call__(self, grad_y: Tensor, x: Tensor, weight: Tensor, need_x: bool, need_w: bool,
                 need_b: bool) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # fmt: skip
        if not (need_x or need_w or need_b):
            return None, None, None
        if self.x_relayout is not None:
            x = self.x_relayout(x)
        if self.weight_relayout is not None:
            weight = self.weight_relayout(weight)
        grad_x, grad_w, grad_b = run_conv_backward(grad_y, x, weight, self.spec, need_x, need_w, need_b)
        if grad_x is not None and self.grad_x_relayout is not None:
            grad_x = self.grad_x_relayout(grad_x)
        return grad_x, grad_w, grad_b


_PLANS = BoundedCache(256)


def conv_backward_plan(x: Tensor, weight: Tensor, spec: ConvSpec, layout_of: Tensor) -> ConvBackwardPlan:
    """The cached plan for a conv of ``x`` and ``weight`` (its output: ``conv_output_shape``, x's
    dtype).  ``layout_of``: the tensor whose memory format an NCHW-kept gradient takes (the saved conv
    output, or x where the forward saved none)."""
    key = (tensor_key(x), tensor_key(weight), output_memory_format(layout_of), spec)
    return _PLANS.get(key, lambda: _plan(x, weight, spec, layout_of))


def _plan(x: Tensor, weight: Tensor, spec: ConvSpec, layout_of: Tensor) -> ConvBackwardPlan:
    shape = conv_output_shape(x, weight, spec)
    if not channels_last_backward(x):
        grad_y = torch.empty(shape, dtype=x.dtype, device="meta", memory_format=output_memory_format(layout_of))
        return ConvBackwardPlan(spec, (tuple(grad_y.shape), grad_y.stride(), grad_y.dtype), None, None, None)
    fmt = channels_last_format(x.dim())
    grad_y = torch.empty(shape, dtype=x.dtype, device="meta", memory_format=fmt)
    x_cl = torch.empty(x.shape, dtype=x.dtype, device="meta", memory_format=fmt)
    w_cl = torch.empty(weight.shape, dtype=weight.dtype, device="meta", memory_format=fmt)
    x_is_cl = x.stride() == x_cl.stride()
    return ConvBackwardPlan(
        spec,
        (tuple(grad_y.shape), grad_y.stride(), grad_y.dtype),
        None if x_is_cl else planned_relayout(x, x_cl),
        None if weight.stride() == w_cl.stride() else planned_relayout(weight, w_cl),
        None if x_is_cl else planned_relayout(x_cl, torch.empty_like(x, device="meta")),
    )  # fmt: skip
