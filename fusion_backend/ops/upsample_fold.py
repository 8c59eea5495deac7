"""A nearest-neighbour upsample before a conv, folded into the conv: ``conv(upsample(x, s), W)`` is the
transposed conv ``conv_transpose(x, K)`` of stride ``s`` on the small input, exactly.

Per spatial dim (kernel ``k``, padding ``p``, integer scale ``s``; the conv's stride and dilation 1):
output ``o`` of the conv reads the upsampled input at ``o + t - p`` for taps ``t < k``, that is
``x[(o + t - p) // s]``.  Gathering, for each output and each input position ``i``, the taps that
land on ``i`` gives a weight that depends only on ``d = o - s*i``:

    K[d + P] = sum of W[t] over t in [p - d, p - d + s - 1] and [0, k - 1],   P = k - 1 - p,

which is the transposed conv ``y[o] = sum_i x[i] K[o - s*i + P]`` of stride ``s``, padding ``P`` and
``s + k - 1`` taps; its output length ``(n - 1)s - 2P + s + k - 1 = s*n + 2p - k + 1`` is the conv's.
With the kernel flipped (``W'[u] = W[k - 1 - u]``) the sum is a moving sum of ``s`` taps over ``W'``
padded with ``s - 1`` zeros each side: ``K[j] = W'[j - s + 1] + ... + W'[j]``.  The zero padding of the
upsampled input is the transposed conv's missing inputs, so borders are exact too (``P >= 0``
needs ``p <= k - 1``).

WHY: the transposed conv reads the input before it is upsampled and does ``((s + k - 1) / s)^D``
taps per output instead of ``k^D`` (4 instead of 9 for the ubiquitous 2x upsample then 3x3 conv of
decoders and UNets), and the upsampled tensor (``s^D`` times the input) is never written.  NOTE: on
the H200, bf16 channels-last, ``F.interpolate(x, scale_factor=2) -> Conv2d(C, C, 3, padding=1)``
took 0.52 / 0.64 ms under Inductor at 1x512x128x128 / 1x256x256x256, cuDNN's transposed conv on
the folded weight 0.32 / 0.44 ms (a scratch script of ``F.conv_transpose2d`` against the compiled
pair, CUDA events; the SD VAE decoder's three upsampling convs).

The folded weight costs one small pass over the weight per call (in the rewritten graph, where
Inductor makes one kernel of :func:`upsampled_conv_weight`'s ops and autograd differentiates them;
a graph that runs without Inductor launches ``kernels/upsample_fold.py``'s one kernel instead);
it is summed in float32 and rounded once to the conv's dtype (autocast's half precision: the
rewrite asks for it, so that no cast of the folded weight follows).  Eager rounds each tap of the
autocast weight instead, so results differ from eager's by that rounding (within eager's own error
against float64: ``tests/e2e/test_e2e_upsample_conv.py``'s autocast case; the definition's exactness in
float64: ``tests/ops/test_upsample_fold.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import Tensor

from ..ir.specs import ConvSpec
from ..kernels.host import kernels_unavailable
from ..kernels.plan_cache import ContractError, tensor_key
from .direct_impls import register_direct
from .failure import kernel_failed


def upsample_fold_problem(spec: ConvSpec, kernel: Sequence[int], scale: Sequence[int]) -> str | None:
    """Why ``conv(upsample(x, scale))`` with this conv is not folded into a transposed conv, or None."""
    if spec.transposed:
        return "the conv after the upsample is a transposed conv"
    if any(s != 1 for s in spec.stride) or any(d != 1 for d in spec.dilation):
        return f"the conv after the upsample has stride {spec.stride} and dilation {spec.dilation} (folded: 1 and 1)"
    if any(p > k - 1 for p, k in zip(spec.padding, kernel, strict=True)):
        return f"the conv's padding {spec.padding} exceeds its kernel {tuple(kernel)} less one"
    if all(s == 1 for s in scale):
        return "the upsample keeps every size"
    return None


def transposed_equivalent(spec: ConvSpec, kernel: Sequence[int], scale: Sequence[int]) -> ConvSpec:
    """The transposed conv that ``conv(upsample(x, scale))`` is (module docstring): stride ``scale``,
    padding ``k - 1 - p``, the conv's groups; its kernel is :func:`upsampled_conv_weight`'s."""
    return ConvSpec(transposed=True, stride=tuple(scale),
                    padding=tuple(k - 1 - p for k, p in zip(kernel, spec.padding, strict=True)),
                    dilation=spec.dilation, output_padding=(0,) * spec.spatial_dims, groups=spec.groups)  # fmt: skip


def upsampled_conv_weight(weight: Tensor, scale: Sequence[int], groups: int,
                          dtype: Optional[torch.dtype] = None) -> Tensor:  # fmt: skip
    """The transposed conv's weight for a conv of ``weight`` ``(C_out, C_in/g, *k)`` after a
    nearest upsample by ``scale``: ``(C_in, C_out/g, *(s + k - 1))`` in ``dtype`` (default the
    weight's) and the weight's memory format (``folded_layout``), computed in at least float32 and
    rounded once, by torch ops autograd differentiates."""
    dims = weight.dim() - 2
    spatial = list(range(2, 2 + dims))
    w = torch.flip(weight.to(torch.promote_types(weight.dtype, torch.float32)), spatial)
    for dim, s in zip(spatial, scale, strict=True):
        if s == 1:
            continue
        length = w.shape[dim] + s - 1
        padded = torch.cat([w.new_zeros(_sized(w, dim, s - 1)), w, w.new_zeros(_sized(w, dim, s - 1))], dim)
        total = padded.narrow(dim, 0, length)
        for r in range(1, s):
            total = total + padded.narrow(dim, r, length)
        w = total
    c_out, c_in_group = w.shape[:2]
    w = w.reshape(groups, c_out // groups, c_in_group, *w.shape[2:]).transpose(1, 2)
    w = w.reshape(groups * c_in_group, c_out // groups, *w.shape[3:])
    return w.to(weight.dtype if dtype is None else dtype).contiguous(memory_format=folded_layout(weight))


def folded_layout(weight: Tensor) -> torch.memory_format:
    """The folded weight's memory format: channels-last where ``weight`` is (and not also contiguous),
    else contiguous."""
    fmt = {4: torch.channels_last, 5: torch.channels_last_3d}.get(weight.dim())
    if fmt is not None and weight.is_contiguous(memory_format=fmt) and not weight.is_contiguous():
        return fmt
    return torch.contiguous_format


def upsampled_conv_weight_direct(weight: Tensor, scale: Sequence[int], groups: int,
                                 dtype: Optional[torch.dtype] = None) -> Tensor:  # fmt: skip
    """:func:`upsampled_conv_weight` as one kernel where one runs (``kernels/upsample_fold.py``: CUDA,
    or CPU under the interpreter; weights of at most 32 bits), else the torch ops themselves.  The
    same values to the rounding of fp32 sums taken in another order, and the same gradient: the
    backward differentiates :func:`upsampled_conv_weight`."""
    out_dtype = weight.dtype if dtype is None else dtype
    if kernels_unavailable(torch.float32, weight.device.type) is not None or torch.float64 in (weight.dtype, out_dtype):
        return upsampled_conv_weight(weight, scale, groups, dtype)
    signature = (tensor_key(weight), tuple(scale), groups, out_dtype)
    if signature in _FAILED:
        return upsampled_conv_weight(weight, scale, groups, dtype)
    try:
        if torch.is_grad_enabled() and weight.requires_grad:
            return _FoldedWeight.apply(weight, tuple(scale), groups, out_dtype)
        from ..kernels.upsample_fold import fold_weight

        return fold_weight(weight, scale, groups, out_dtype, folded_layout(weight))
    except ContractError:  # a weight the kernel cannot take: the torch ops take it
        return upsampled_conv_weight(weight, scale, groups, dtype)
    except Exception as error:  # noqa: BLE001 - a failed launch: the torch ops give the same values
        kernel_failed(f"the upsample fold's kernel failed for a weight {tuple(weight.shape)} {weight.dtype} on "
                      f"{weight.device}: {type(error).__name__}: {error}", error, False,
                      ("upsample_fold", weight.dtype, weight.device.type))  # fmt: skip
        _FAILED.add(signature)
        return upsampled_conv_weight(weight, scale, groups, dtype)


#: the weight signatures whose kernel launch failed: the torch ops serve them from then on
_FAILED: set[tuple[Any, ...]] = set()


class _FoldedWeight(torch.autograd.Function):
    """The kernel forward, :func:`upsampled_conv_weight`'s own backward (through autograd)."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, scale: tuple[int, ...], groups: int, dtype: torch.dtype) -> Tensor:
        from ..kernels.upsample_fold import fold_weight

        ctx.save_for_backward(weight)
        ctx.scale, ctx.groups, ctx.dtype = scale, groups, dtype
        return fold_weight(weight, scale, groups, dtype, folded_layout(weight))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        (weight,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = weight.detach().requires_grad_()
            folded = upsampled_conv_weight(leaf, ctx.scale, ctx.groups, ctx.dtype)
            (grad_weight,) = torch.autograd.grad(folded, leaf, grad)
        return grad_weight, None, None, None


# a graph that runs directly launches one kernel for it (and its calls are marked cacheable:
# ``match/rewrite.mark_cacheable``)
register_direct(upsampled_conv_weight, upsampled_conv_weight_direct)


def _sized(t: Tensor, dim: int, size: int) -> list[int]:
    shape = list(t.shape)
    shape[dim] = size
    return shape
