"""Cast several tensors to one dtype at once: ``fusion::cast_batched``, the weights and biases of a graph's
fused calls under autocast (``match/batch_glue.py``).

WHY: a fused conv under autocast receives its weight (and bias) in the parameters' dtype and casts them
to the conv's on every call, one copy kernel each (the library path's, the family's), as eager's
autocast and Inductor's graph do: in a network's inference graph one small launch per conv (53 in
ResNet-50), several microseconds of host time each in the default mode and a launch each under CUDA
graphs.  ``torch._foreach_copy_`` copies a list of tensors into another of another dtype in a few
multi-tensor launches, with the round-to-nearest-even conversion of ``Tensor.to``.

Contract of :func:`cast_all`: ``tensors`` non-empty, on one device, each non-overlapping and dense
(any strides: channels-last weights too); returns for each a new tensor of ``dtype`` with its shape
and strides and its values converted as ``t.to(dtype)`` converts them.  No gradient (the graphs it is
used in differentiate through none of them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .autograd_free import register_autograd_free
from .direct_impls import register_direct


def cast_all(tensors: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Each of ``tensors`` as ``dtype``, with its shape and strides (module docstring)."""
    out = [torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=t.device) for t in tensors]
    torch._foreach_copy_(out, tensors)
    return out


cast_batched = torch.library.custom_op("fusion::cast_batched", mutates_args=())(cast_all)


@cast_batched.register_fake
def _fake(tensors, dtype):  # noqa: ANN001, ANN202
    return [torch.empty_strided(t.size(), t.stride(), dtype=dtype, device=t.device) for t in tensors]


#: what a graph calls (``match/batch_glue.py``); Inductor's code calls its autograd-free op
CAST_BATCHED = torch.ops.fusion.cast_batched.default
register_direct(CAST_BATCHED, cast_all)
register_autograd_free(cast_batched, cast_all, _fake)
