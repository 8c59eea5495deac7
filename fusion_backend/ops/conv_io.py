"""What every fused conv op does with its conv's inputs and outputs, below the families.

* the conv and its backward as eager runs them (``run_conv``, ``run_conv_backward``: aten, any dtype,
  layout and device, fake tensors included), the pool after it (``run_pool``) and the shapes both give
  (``conv_output_shape``, ``pooled_output_shape``, ``conv_channels``);
* the outputs' layouts: ``output_memory_format`` picks the memory format of an op's outputs from its
  conv output, ``in_format`` lays a tensor out in it, ``channels_last_format`` names the
  channels-last format of a rank; ``relayout`` / ``planned_relayout`` move data between layouts
  (``kernels.relayout``); a family's saved conv output (``saved_y``: with ``save``, else an
  ``empty_placeholder``) is the conv output without bias, itself where it is in
  ``output_memory_format`` already (a conv's output always is), else a copy in it;
* the dtypes: ``dtype_named`` (a config's dtype name), ``stats_dtype`` (what saved statistics are
  kept in), ``winner_dtype`` (a max pool's saved winners);
* the results of a backward custom op: every requested gradient in its input's dtype and
  ``torch.empty_like`` strides, an ``empty_placeholder`` elsewhere (``backward_outputs`` and, for the
  fake, ``fake_backward_outputs``);
* ``check_conv_inputs``: the one-line errors for x and a weight that do not fit the conv;
* ``DECISIONS``: per-call answers that depend only on shapes, strides, dtypes and configs, cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import UnsupportedInputError
from ..ir.shapes import conv_output_length, pool_output_length
from ..ir.specs import ConvSpec, PoolSpec
from ..kernels.host import BoundedCache, tensor_key

#: Largest pool window whose winner index is saved as int8.
_INT8_WINDOW_LIMIT = 127

#: Per-call decisions that depend only on shapes, strides, dtypes, devices and the config, cached:
#: the ops make them on every call and host time is what small steps wait on.
DECISIONS = BoundedCache(512)


def run_conv(x: Tensor, weight: Tensor, bias: Tensor | None, spec: ConvSpec) -> Tensor:
    """``aten.convolution`` with ``spec``'s hyper-parameters: eager's call, eager's output layout."""
    return torch.ops.aten.convolution(
        x, weight, bias, list(spec.stride), list(spec.padding), list(spec.dilation), spec.transposed,
        list(spec.output_padding), spec.groups,
    )  # fmt: skip


def run_conv_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor, spec: ConvSpec, need_x: bool, need_w: bool, need_b: bool = False
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``aten.convolution_backward``: grad x, weight and (``need_b``) bias, None where not needed."""
    if not (need_x or need_w or need_b):
        return None, None, None
    grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad_y, x, weight, [conv_channels(weight, spec)] if need_b else None, list(spec.stride),
        list(spec.padding), list(spec.dilation), spec.transposed, list(spec.output_padding), spec.groups,
        [need_x, need_w, need_b],
    )  # fmt: skip
    return grad_x, grad_w, grad_b if need_b else None


def run_pool(v: Tensor, pool: PoolSpec, return_indices: bool = False) -> Union[Tensor, tuple[Tensor, Tensor]]:
    """The PoolSpec's F.max_pool{d}d / F.avg_pool{d}d on ``v`` (real or fake)."""
    dims = v.dim() - 2
    k, s, p = list(pool.kernel_size), list(pool.stride), list(pool.padding)
    if pool.kind == "max":
        fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[dims - 1]
        return fn(v, k, s, p, 1, ceil_mode=pool.ceil_mode, return_indices=return_indices)
    if dims == 1:
        # avg_pool1d has no divisor_override: the 2d pool over a (1, L) plane is the same pool.
        out = F.avg_pool2d(
            v.unsqueeze(-2), [1, k[0]], [1, s[0]], [0, p[0]], pool.ceil_mode, pool.count_include_pad,
            pool.divisor_override,
        )  # fmt: skip
        return out.squeeze(-2)
    fn = F.avg_pool2d if dims == 2 else F.avg_pool3d
    return fn(v, k, s, p, pool.ceil_mode, pool.count_include_pad, pool.divisor_override)


def conv_channels(weight: Tensor, spec: ConvSpec) -> int:
    """The conv's output channels: weight ``(C_out, C_in/g, *k)``, or transposed ``(C_in, C_out/g, *k)``."""
    return weight.shape[1] * spec.groups if spec.transposed else weight.shape[0]


def conv_output_shape(x: Tensor, weight: Tensor, spec: ConvSpec) -> list[int]:
    """Shape of ``aten.convolution``'s output (real sizes only; fakes use the op itself)."""
    spatial = [
        conv_output_length(size, weight.shape[2 + i], spec.stride[i], spec.padding[i], spec.dilation[i],
                           spec.transposed, spec.output_padding[i])
        for i, size in enumerate(x.shape[2:])
    ]  # fmt: skip
    return [x.shape[0], conv_channels(weight, spec), *spatial]


def pooled_output_shape(y_shape: Sequence[int], pool: PoolSpec) -> list[int]:
    """The shape ``run_pool`` gives for an input of ``y_shape``."""
    return list(y_shape[:2]) + [
        pool_output_length(size, k, s, p, ceil_mode=pool.ceil_mode)
        for size, k, s, p in zip(y_shape[2:], pool.kernel_size, pool.stride, pool.padding, strict=True)
    ]


def check_conv_inputs(op: str, x: Tensor, weight: Tensor, spec: ConvSpec) -> None:
    """One-line ``UnsupportedInputError`` (naming ``fusion::{op}``) for an x or weight without the conv's
    rank, or a non-floating x."""
    dims = spec.spatial_dims
    if x.dim() != dims + 2 or weight.dim() != dims + 2:
        raise UnsupportedInputError(f"fusion::{op}: a {dims}d conv needs x and weight with {dims + 2} dims, got "
                                    f"x {tuple(x.shape)} and weight {tuple(weight.shape)}")  # fmt: skip
    if not x.is_floating_point():
        raise UnsupportedInputError(f"fusion::{op}: x must be floating point, got {x.dtype}")


def output_memory_format(y: Tensor) -> torch.memory_format:
    """Memory format of an op's outputs, picked from its conv output ``y`` (real or fake).

    channels_last / channels_last_3d when ``y`` is in it and not also contiguous, else contiguous.
    Shared by the fakes and the real implementations so that their strides agree exactly.
    """
    if y.dim() == 4 and y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous():
        return torch.channels_last
    if y.dim() == 5 and y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def channels_last_format(ndim: int) -> torch.memory_format:
    """The channels-last memory format of a 4-d (2-d conv) or 5-d (3-d conv) tensor."""
    return torch.channels_last if ndim == 4 else torch.channels_last_3d


def in_format(t: Tensor, fmt: torch.memory_format) -> Tensor:
    """``t`` itself when it already has the strides ``torch.empty(..., memory_format=fmt)`` gives,
    else a copy that does (size-1 dims included: Inductor compares strides exactly)."""
    expected = torch.empty(t.shape, dtype=t.dtype, device="meta", memory_format=fmt).stride()
    if t.stride() == expected:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt).copy_(t)


def relayout(src: Tensor, dst: Tensor) -> Tensor:
    """``dst.copy_(src)``, through ``kernels.relayout`` where it serves the layouts (any whose
    spatial dims flatten; torch's copy otherwise)."""
    from ..kernels.relayout import relayout_or_copy  # lazily: TRITON_INTERPRET is read at import

    return relayout_or_copy(src, dst)


def planned_relayout(src: Tensor, like: Tensor) -> Any:
    """``kernels.relayout.PlannedRelayout`` from ``src``'s layout into ``like``'s (a meta tensor giving
    the destination's shape, strides and dtype): a callable ``src -> dst``, ``dst`` fresh on every call."""
    from ..kernels.relayout import PlannedRelayout  # lazily, as in ``relayout``

    return PlannedRelayout(src, tuple(like.shape), like.stride(), like.dtype)


def channel_view(t: Tensor, ndim: int) -> Tensor:
    """``t``'s C values as ``(1, C, 1, ..., 1)`` of ``ndim`` dims: broadcast over a conv output."""
    return t.reshape([1, -1] + [1] * (ndim - 2))


def dtype_named(op: str, name: str | None, default: torch.dtype, field: str = "out_dtype") -> torch.dtype:
    """The floating dtype a config field names (``default`` for None); ``UnsupportedInputError``
    naming ``fusion::{op}`` for a name that is not one."""
    if name is None:
        return default
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UnsupportedInputError(f"fusion::{op}: {field} {name!r} is not a torch floating dtype")
    return dtype


def stats_dtype(conv_dtype: torch.dtype) -> torch.dtype:
    """Saved statistics' dtype: fp32 (the kernels' compute type), fp64 for an fp64 conv (the
    reference's, so that float64 runs stay float64 throughout)."""
    return torch.float64 if conv_dtype == torch.float64 else torch.float32


def winner_dtype(pool: PoolSpec) -> torch.dtype:
    """A max pool's saved winner (its row-major tap index in the window): int8 up to 127 taps, else int32."""
    return torch.int8 if pool.window_volume <= _INT8_WINDOW_LIMIT else torch.int32


def empty_placeholder(x: Tensor) -> Tensor:
    """The ``(0,)`` tensor an op returns where its schema has a tensor and the call has none."""
    return torch.empty(0, dtype=x.dtype, device=x.device)


def strided_like(g: Tensor, ref: Tensor) -> Tensor:
    """``g`` (ref's shape) with the dtype and strides of ``torch.empty_like(ref)``."""
    expected = DECISIONS.get(("like", tensor_key(ref)), lambda: torch.empty_like(ref, device="meta").stride())
    if g.dtype == ref.dtype and g.stride() == expected:
        return g
    return torch.empty_like(ref).copy_(g)


def backward_outputs(grads: Sequence[Tensor | None], inputs: Sequence[Tensor | None], mask: Sequence[bool],
                     like: Tensor) -> list[Tensor]:  # fmt: skip
    """A fused op's backward outputs, one per input: each requested gradient with its input's dtype
    and ``torch.empty_like`` strides (``strided_like``), an empty placeholder (``like``'s dtype and
    device) where the mask is off or the input is absent (the custom op's schema returns tensors only)."""
    return [
        strided_like(g, ref) if wanted and ref is not None and g is not None else empty_placeholder(like)
        for g, ref, wanted in zip(grads, inputs, mask, strict=True)
    ]


def fake_backward_outputs(inputs: Sequence[Tensor | None], mask: Sequence[bool], like: Tensor) -> list[Tensor]:
    """``backward_outputs``' metadata, for the backward custom op's fake."""
    return [torch.empty_like(ref) if wanted and ref is not None else empty_placeholder(like)
            for ref, wanted in zip(inputs, mask, strict=True)]  # fmt: skip


def allocate_result(x: Tensor, y0: Tensor, pool: PoolSpec | None, dtype: torch.dtype, save: bool,
                    out_format: torch.memory_format | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_winner)`` of an op whose region may end in a pool (``y0``: the conv output
    without bias, real or fake).

    * ``out``: y0's shape, or with ``pool`` the pooled shape (``pooled_output_shape``), in
      ``out_format`` (default ``output_memory_format(y0)``), ``dtype``.
    * ``saved_winner`` (with ``save`` and a max pool, else ``empty_placeholder(x)``): each window's
      winner as its row-major tap index, ``winner_dtype``, out's shape in y0's layout
      (``output_memory_format(y0)``): the backward kernels walk y0 and read the winners along with it,
      coalesced where both share the contiguous axis.
    """
    fmt = output_memory_format(y0) if out_format is None else out_format
    shape = y0.shape if pool is None else pooled_output_shape(y0.shape, pool)
    out = torch.empty(shape, dtype=dtype, device=x.device, memory_format=fmt)
    if not save or pool is None or pool.kind != "max":
        return out, empty_placeholder(x)
    return out, torch.empty(shape, dtype=winner_dtype(pool), device=x.device, memory_format=output_memory_format(y0))
