"""What every part of ``fusion::conv_channel_reduce`` shares: which implementation serves a case
(``kernel_path``), the outputs and saved state with their exact shapes, dtypes and strides (the fake
and both implementations allocate through ``allocate_forward_outputs``), input checks, the chains as
the kernels take them, and the failure policy (``on_kernel_failure``).

The conv itself, its backward, the chain semantics and the outputs' memory format are
``conv_epilogue``'s (imported, not repeated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...kernels.host import kernels_unavailable
from ..config import ConvEpilogueConfig
from ..conv_epilogue.common import empty_placeholder, in_format, kernel_steps, output_memory_format
from ..failure import op_kernel_failed, triton_serves
from .config import ConvChannelReduceConfig

#: Most channels the Triton kernels reduce over (``kernels.channel_reduce.MAX_CHANNELS``; the pattern
#: leaves wider convs as a near miss, and a direct call with more runs the reference).
MAX_CHANNELS = 1024


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton kernels serve this case, else ``("reference", why)``.
    The channel count is checked at run time (``use_triton``)."""
    ConvChannelReduceConfig.from_json(config)  # a valid config
    why = kernels_unavailable(dtype, device_type)
    return ("reference", why) if why is not None else ("triton", None)


def use_triton(config: str, cfg: ConvChannelReduceConfig, x: Tensor, channels: int) -> bool:
    """Whether this call runs the Triton kernels; under ``strict`` on CUDA a case they cannot serve
    raises ``UnsupportedInputError`` instead of running the reference."""
    _, why = kernel_path(config, x.dtype, x.device.type)
    if why is None and channels > MAX_CHANNELS:
        why = f"{channels} channels exceed the kernels' {MAX_CHANNELS}"
    return triton_serves("conv_channel_reduce", why, cfg.strict, x.device.type)


def on_kernel_failure(direction: str, config: str, cfg: ConvChannelReduceConfig, x: Tensor, weight: Tensor,
                      error: Exception) -> None:  # fmt: skip
    """The fused ops' failure policy (``ops/failure.py``): under ``strict`` raise, else warn once
    per (direction, config); the caller then runs the reference."""
    op_kernel_failed("conv_channel_reduce", direction, describe(cfg), config, x, weight, error, cfg.strict)


def describe(cfg: ConvChannelReduceConfig) -> str:
    """``pre [relu] -> amax(dim=1, keepdim) -> post [tanh]`` for messages."""
    def chain(steps) -> str:
        return ", ".join(s.kind.name.lower() for s in steps)

    keep = ", keepdim" if cfg.keepdim and not cfg.full_size else ""
    return f"pre [{chain(cfg.pre)}] -> {cfg.reduction}(dim=1{keep}) -> post [{chain(cfg.post)}]"


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvChannelReduceConfig) -> None:
    """One-line ``UnsupportedInputError`` for inputs that do not fit the config."""
    dims = cfg.conv.spatial_dims
    if x.dim() != dims + 2 or weight.dim() != dims + 2:
        raise UnsupportedInputError(
            f"fusion::conv_channel_reduce: a {dims}d conv needs x and weight with {dims + 2} dims, got "
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if not x.is_floating_point():
        raise UnsupportedInputError(f"fusion::conv_channel_reduce: x must be floating point, got {x.dtype}")
    for name, chain in (("pre", cfg.pre), ("post", cfg.post)):
        for step in chain:
            for operand in step.operands:
                index = getattr(operand, "index", None)
                if index is not None and not 0 <= index < len(operands):
                    raise UnsupportedInputError(
                        f"fusion::conv_channel_reduce: the {name}-chain references operands[{index}] but "
                        f"{len(operands)} operand tensors were given"
                    )


def output_dtype(cfg: ConvChannelReduceConfig, conv_dtype: torch.dtype) -> torch.dtype:
    return conv_dtype if cfg.out_dtype is None else getattr(torch, cfg.out_dtype)


def needs_y(cfg: ConvChannelReduceConfig) -> bool:
    """Whether the backward reads the conv output: every reduction but min / max (those keep the
    winner's value), and sum / mean only through a pre-chain."""
    if cfg.reduction in ("min", "max"):
        return False
    return cfg.reduction not in ("sum", "mean") or len(cfg.pre) > 0


def stats_dtype(conv_dtype: torch.dtype) -> torch.dtype:
    """The saved statistics' dtype: fp32 (the kernels' compute type), fp64 for an fp64 conv (the
    reference's: amin / amax compare the recomputed values with the saved extremum exactly)."""
    return torch.float64 if conv_dtype == torch.float64 else torch.float32


def index_dtype(channels: int) -> torch.dtype:
    """The winner index's dtype: int16 while the channels fit, else int32."""
    return torch.int16 if channels <= torch.iinfo(torch.int16).max else torch.int32


def reduced_shape(y_shape: Sequence[int], cfg: ConvChannelReduceConfig) -> list[int]:
    """The result's shape for a conv output of ``y_shape``."""
    if cfg.full_size:
        return list(y_shape)
    return [y_shape[0], *([1] if cfg.keepdim else []), *y_shape[2:]]


def allocate_forward_outputs(x: Tensor, y0: Tensor, cfg: ConvChannelReduceConfig, save: bool,
                             out_format: torch.memory_format) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_y, saved_index, saved_stats)`` with the exact shapes, dtypes and strides of
    the real op (``y0``: the conv output without bias, real or fake, as ``library_conv.conv_forward``
    gives it: channels-last for 2-d and 3-d convs in fp16 / bf16 / fp32).

    * ``out``: softmax / log_softmax: y's shape in ``out_format`` (``library_conv.nominal_format``:
      eager's layout); else
      ``(N, [1,] *spatial)`` contiguous; dtype ``out_dtype`` (the conv's by default).
    * ``saved_y`` (with ``save`` and ``needs_y``): the conv output without bias, y0 itself where it
      is in ``output_memory_format(y0)`` already (a conv's output always is), else a copy in it.
    * ``saved_index`` (with ``save``, min / max): the winning channel, ``(N, *spatial)`` contiguous,
      ``index_dtype(C)``.
    * ``saved_stats`` (with ``save``): ``stats_dtype`` ``(2, N, *spatial)`` contiguous
      (``kernels/channel_reduce.py``'s table).
    Absent entries are ``empty_placeholder(x)``.
    """
    shape = reduced_shape(y0.shape, cfg)
    dtype = output_dtype(cfg, y0.dtype)
    if cfg.full_size:
        out = torch.empty(shape, dtype=dtype, device=x.device, memory_format=out_format)
    else:
        out = torch.empty(shape, dtype=dtype, device=x.device)
    placeholder = empty_placeholder(x)
    if not save:
        return out, placeholder, empty_placeholder(x), empty_placeholder(x)
    n, channels, spatial = y0.shape[0], y0.shape[1], list(y0.shape[2:])
    saved_y = in_format(y0, output_memory_format(y0)) if needs_y(cfg) else placeholder
    index = (torch.empty([n, *spatial], dtype=index_dtype(channels), device=x.device)
             if cfg.reduction in ("min", "max") else empty_placeholder(x))  # fmt: skip
    stats = torch.empty([2, n, *spatial], dtype=stats_dtype(y0.dtype), device=x.device)
    return out, saved_y, index, stats


def chain_kernel_steps(cfg: ConvChannelReduceConfig, steps, operands: Sequence[Tensor], ndim: int,
                       channels: int) -> list:  # fmt: skip
    """One of ``cfg``'s chains as the launchers take it (``conv_epilogue.common.kernel_steps``'s form,
    which reads only the chain of the config it is given): per step ``(op code, [float | tensor of 1
    or `channels` values])``."""
    return kernel_steps(ConvEpilogueConfig(conv=cfg.conv, chain=tuple(steps)), operands, ndim, channels)
