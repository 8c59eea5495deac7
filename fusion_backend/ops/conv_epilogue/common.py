"""What every part of ``fusion::conv_epilogue`` shares: the environment switches it reads, which
implementation serves a case (``kernel_path``), the outputs' memory format, the chain applied with
eager semantics, input checks and casts, shape arithmetic, per-shape cached answers
(``DECISIONS``) and the failure policy (``on_kernel_failure``).
"""

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from ... import environment
from ...errors import UnsupportedInputError
from ...ir.shapes import conv_output_length, pool_output_length
from ...ir.specs import ConvSpec, PoolSpec
from ...kernels.host import BoundedCache, kernels_unavailable, tensor_key
from ..chain import (
    MAX_CHAIN_LENGTH,
    ChainStep,
    ChainValue,
    Const,
    TensorRef,
    apply_step,
    kernel_code,
    operand_values,
)
from ..config import ConvEpilogueConfig
from ..failure import op_kernel_failed, triton_serves

logger = logging.getLogger("fusion_backend")


#: The environment switches this op reads (``fusion_backend.environment`` says what they do).
CPU_KERNELS_ENV = environment.CPU_KERNELS
CONV_IMPL_ENV = environment.CONV_IMPL
DEFAULT_CONV_IMPL = environment.DEFAULT_CONV_IMPL
#: Largest window whose winner index is saved as int8.
_INT8_WINDOW_LIMIT = 127


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton kernels serve this case, else ``("reference", why)``.

    Operand shapes are not known here: a non-per-channel operand tensor still falls back at run
    time (with a warning, or ``UnsupportedInputError`` under ``strict``).
    """
    cfg = ConvEpilogueConfig.from_json(config)
    why = kernels_unavailable(dtype, device_type)
    if why is not None:
        return "reference", why
    if len(cfg.chain) > MAX_CHAIN_LENGTH:
        return "reference", f"chain of {len(cfg.chain)} steps exceeds the kernel's {MAX_CHAIN_LENGTH} slots"
    try:
        kernels = epilogue_kernels()
    except ImportError as e:  # pragma: no cover - triton is a dependency
        return "reference", f"Triton is not importable: {e}"
    if cfg.pool is not None and cfg.pool.window_volume > kernels.MAX_WINDOW_VOLUME:
        return "reference", (
            f"pool window of {cfg.pool.window_volume} taps exceeds the kernel's unroll limit "
            f"{kernels.MAX_WINDOW_VOLUME}"
        )
    return "triton", None


def output_memory_format(y: Tensor) -> torch.memory_format:
    """Memory format of the op's outputs, picked from the conv output ``y`` (real or fake).

    channels_last / channels_last_3d when ``y`` is in it and not also contiguous, else contiguous.
    Shared by the fake and the real implementations so that their strides agree exactly.
    """
    if y.dim() == 4 and y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous():
        return torch.channels_last
    if y.dim() == 5 and y.is_contiguous(memory_format=torch.channels_last_3d) and not y.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def apply_chain(y: Tensor, chain: Sequence[ChainStep], operands: Sequence[Tensor]) -> Tensor:
    """Apply ``chain`` to ``y`` with eager semantics; non-differentiable operands are detached."""
    inputs: list[Tensor] = []
    for step in chain:
        inputs.append(y)
        y = apply_step(step.kind, y, operand_values(step, operands, inputs))
    return y


def epilogue_kernels() -> ModuleType:
    # Imported lazily: TRITON_INTERPRET is read when @triton.jit runs, i.e. at this import.
    from ...kernels import epilogue

    return epilogue


def use_triton(config: str, cfg: ConvEpilogueConfig, x: Tensor) -> bool:
    _, why = kernel_path(config, conv_compute_dtype(cfg, x), x.device.type)
    return triton_serves("conv_epilogue", why, cfg.strict, x.device.type)


def on_kernel_failure(
    direction: str, config: str, cfg: ConvEpilogueConfig, x: Tensor, weight: Tensor, error: Exception
) -> None:
    """The fused ops' failure policy (``ops/failure.py``): under ``strict`` raise, else warn once
    per (direction, config); the caller then runs the reference."""
    described = f"chain [{_describe_chain(cfg)}], pool {_describe_pool(cfg.pool)}"
    op_kernel_failed("conv_epilogue", direction, described, config, x, weight, error, cfg.strict)


def _describe_chain(cfg: ConvEpilogueConfig) -> str:
    parts = []
    for step in cfg.chain:
        args = ", ".join(
            f"{o.value:g}" if isinstance(o, Const) else f"operands[{o.index}]" if isinstance(o, TensorRef)
            else f"value before step {o.position}" for o in step.operands
        )  # fmt: skip
        parts.append(f"{step.kind.name.lower()}({args})")
    return ", ".join(parts)


def _describe_pool(pool: PoolSpec | None) -> str:
    if pool is None:
        return "none"
    return f"{pool.kind}(k={pool.kernel_size}, s={pool.stride}, p={pool.padding}, ceil={pool.ceil_mode})"


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig) -> None:
    output_dtype(cfg, conv_compute_dtype(cfg, x))  # both dtype names are valid
    dims = cfg.conv.spatial_dims
    if x.dim() != dims + 2 or weight.dim() != dims + 2:
        raise UnsupportedInputError(
            f"fusion::conv_epilogue: a {dims}d conv needs x and weight with {dims + 2} dims, got "
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if cfg.pool is not None and len(cfg.pool.kernel_size) != dims:
        raise UnsupportedInputError(
            f"fusion::conv_epilogue: pool {cfg.pool} does not have {dims} spatial dims"
        )
    for step in cfg.chain:
        for operand in step.operands:
            if isinstance(operand, TensorRef) and not 0 <= operand.index < len(operands):
                raise UnsupportedInputError(
                    f"fusion::conv_epilogue: chain references operands[{operand.index}] but "
                    f"{len(operands)} operand tensors were given"
                )


def _dtype_named(name: str, field: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise UnsupportedInputError(f"fusion::conv_epilogue: {field} {name!r} is not a torch floating dtype")
    return dtype


def output_dtype(cfg: ConvEpilogueConfig, conv_dtype: torch.dtype) -> torch.dtype:
    """The result's dtype: ``config.out_dtype``, else the conv's (compute) dtype."""
    return conv_dtype if cfg.out_dtype is None else _dtype_named(cfg.out_dtype, "out_dtype")


def conv_compute_dtype(cfg: ConvEpilogueConfig, x: Tensor) -> torch.dtype:
    """The dtype the conv runs in: ``config.compute_dtype``, else x's."""
    return x.dtype if cfg.compute_dtype is None else _dtype_named(cfg.compute_dtype, "compute_dtype")


def cast_inputs(x: Tensor, weight: Tensor, bias: Tensor | None,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``x``, ``weight`` and ``bias`` in the compute dtype (the same tensors where they already are):
    what the library and reference paths run on; the Triton conv kernels cast as they load instead."""
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def run_conv(x: Tensor, weight: Tensor, bias: Tensor | None, spec: ConvSpec) -> Tensor:
    return torch.ops.aten.convolution(
        x, weight, bias, list(spec.stride), list(spec.padding), list(spec.dilation), spec.transposed,
        list(spec.output_padding), spec.groups,
    )  # fmt: skip


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


def pooled_output_shape(y_shape: Sequence[int], pool: PoolSpec) -> list[int]:
    stride = pool.stride
    return list(y_shape[:2]) + [
        pool_output_length(size, k, s, p, ceil_mode=pool.ceil_mode)
        for size, k, s, p in zip(y_shape[2:], pool.kernel_size, stride, pool.padding, strict=True)
    ]


def conv_output_shape(x: Tensor, weight: Tensor, spec: ConvSpec) -> list[int]:
    """Shape of ``aten.convolution``'s output (real sizes only; fakes use the op itself)."""
    spatial = []
    for i, size in enumerate(x.shape[2:]):
        spatial.append(conv_output_length(size, weight.shape[2 + i], spec.stride[i], spec.padding[i], spec.dilation[i],
                                          spec.transposed, spec.output_padding[i]))
    channels = weight.shape[1] * spec.groups if spec.transposed else weight.shape[0]
    return [x.shape[0], channels, *spatial]


def winner_dtype(pool: PoolSpec) -> torch.dtype:
    return torch.int8 if pool.window_volume <= _INT8_WINDOW_LIMIT else torch.int32


def empty_placeholder(x: Tensor) -> Tensor:
    return torch.empty(0, dtype=x.dtype, device=x.device)


def allocate_forward_outputs(
    x: Tensor, y0: Tensor, out_shape: Sequence[int], cfg: ConvEpilogueConfig, save: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Empty ``(out, saved_y0, saved_winner)`` with the exact shapes, dtypes and strides of the real op
    (``x``: the op's input as given, for the device and the placeholders' dtype; ``y0``: the conv
    output in the compute dtype)."""
    fmt = output_memory_format(y0)
    out = torch.empty(out_shape, dtype=output_dtype(cfg, y0.dtype), device=x.device, memory_format=fmt)
    if not save:
        return out, empty_placeholder(x), empty_placeholder(x)
    if cfg.pool is not None and cfg.pool.kind == "max":
        win = torch.empty(out_shape, dtype=winner_dtype(cfg.pool), device=x.device, memory_format=fmt)
        win_y = torch.empty(out_shape, dtype=y0.dtype, device=x.device, memory_format=fmt)
        return out, win_y, win
    return out, torch.empty(y0.shape, dtype=y0.dtype, device=x.device, memory_format=fmt), empty_placeholder(x)


def in_format(t: Tensor, fmt: torch.memory_format) -> Tensor:
    """``t`` itself when it already has the strides ``torch.empty(..., memory_format=fmt)`` gives,
    else a copy that does (size-1 dims included: Inductor compares strides exactly)."""
    expected = torch.empty(t.shape, dtype=t.dtype, device="meta", memory_format=fmt).stride()
    if t.stride() == expected:
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device, memory_format=fmt).copy_(t)


def strided_like(g: Tensor, ref: Tensor) -> Tensor:
    """``g`` (ref's shape) with the dtype and strides of ``torch.empty_like(ref)``."""
    expected = DECISIONS.get(("like", tensor_key(ref)), lambda: torch.empty_like(ref, device="meta").stride())
    if g.dtype == ref.dtype and g.stride() == expected:
        return g
    return torch.empty_like(ref).copy_(g)


def backward_outputs(grads: Sequence[Tensor | None], inputs: Sequence[Tensor | None], mask: Sequence[bool],
                     x: Tensor) -> list[Tensor]:  # fmt: skip
    """A fused op's backward outputs, one per input: each requested gradient with its input's dtype
    and ``torch.empty_like`` strides (``strided_like``), an empty placeholder where the mask is off
    or the input is absent (the custom op's schema returns tensors only)."""
    return [
        strided_like(g, ref) if wanted and ref is not None and g is not None else empty_placeholder(x)
        for g, ref, wanted in zip(grads, inputs, mask, strict=True)
    ]


def fake_backward_outputs(inputs: Sequence[Tensor | None], mask: Sequence[bool], x: Tensor) -> list[Tensor]:
    """``backward_outputs``' metadata, for the backward custom op's fake."""
    return [torch.empty_like(ref) if wanted and ref is not None else empty_placeholder(x)
            for ref, wanted in zip(inputs, mask, strict=True)]  # fmt: skip


def channel_view(t: Tensor, ndim: int) -> Tensor:
    return t.reshape([1, -1] + [1] * (ndim - 2))


def _is_per_channel(t: Tensor, y_ndim: int, channels: int) -> bool:
    """True when ``t`` broadcasts against (N, C, ...) as one value, or one value per channel."""
    if t.dim() > y_ndim:
        return False
    if t.numel() == 1:
        return True
    offset = y_ndim - t.dim()
    return all(size == (channels if i + offset == 1 else 1) for i, size in enumerate(t.shape))


def kernel_steps(cfg: ConvEpilogueConfig, operands: Sequence[Tensor], y_ndim: int, channels: int) -> list:
    """The chain as the launchers take it: ``(op code, [float | per-channel tensor])`` per step."""
    steps = []
    for step in cfg.chain:
        values: list[Union[float, Tensor]] = []
        for operand in step.operands:
            if isinstance(operand, Const):
                values.append(operand.value)
                continue
            if isinstance(operand, ChainValue):  # the kernels read it from the chain: no operand row
                values.append(0.0)
                continue
            t = operands[operand.index]
            if not _is_per_channel(t, y_ndim, channels):
                raise UnsupportedInputError(
                    f"operands[{operand.index}] of shape {tuple(t.shape)} is neither a scalar nor per-channel "
                    f"for a conv output with {channels} channels and {y_ndim} dims"
                )
            values.append(t)
        steps.append((kernel_code(step), values))
    return steps


#: Per-call decisions that depend only on shapes, strides, dtypes, devices and the config, cached:
#: the op makes them on every call and host time is what small steps wait on.
DECISIONS = BoundedCache(512)


def relayout(src: Tensor, dst: Tensor) -> Tensor:
    """``dst.copy_(src)``, through ``kernels.relayout`` where it serves the layouts (any whose
    spatial dims flatten; torch's copy otherwise)."""
    from ...kernels.relayout import relayout_or_copy  # lazily: TRITON_INTERPRET is read at import

    return relayout_or_copy(src, dst)


def planned_relayout(src: Tensor, like: Tensor) -> Any:
    """``kernels.relayout.PlannedRelayout`` from ``src``'s layout into ``like``'s (a meta tensor giving
    the destination's shape, strides and dtype): a callable ``src -> dst``, ``dst`` fresh on every call."""
    from ...kernels.relayout import PlannedRelayout  # lazily, as in ``relayout``

    return PlannedRelayout(src, tuple(like.shape), like.stride(), like.dtype)


def channels_last_format(ndim: int) -> torch.memory_format:
    return torch.channels_last if ndim == 4 else torch.channels_last_3d


def run_conv_backward(
    grad_y: Tensor, x: Tensor, weight: Tensor, spec: ConvSpec, need_x: bool, need_w: bool, need_b: bool = False
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """``aten.convolution_backward``: grad x, weight and (``need_b``) bias, None where not needed."""
    if not (need_x or need_w or need_b):
        return None, None, None
    channels = weight.shape[1] * spec.groups if spec.transposed else weight.shape[0]
    grad_x, grad_w, grad_b = torch.ops.aten.convolution_backward(
        grad_y, x, weight, [channels] if need_b else None, list(spec.stride), list(spec.padding),
        list(spec.dilation), spec.transposed, list(spec.output_padding), spec.groups, [need_x, need_w, need_b],
    )  # fmt: skip
    return grad_x, grad_w, grad_b if need_b else None
