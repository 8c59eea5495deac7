"""What every part of ``fusion::conv_batch_norm`` shares: which implementation serves a case
(``kernel_path``), the outputs and saved state with their exact shapes, dtypes and strides (the fake
and both implementations allocate through ``allocate_forward_outputs``), input checks, the running
statistics' update, and the failure policy (``on_kernel_failure``).

The conv, its backward, the chain semantics and the outputs' memory format are ``conv_epilogue``'s;
the norm's dtypes and its scale and shift rows are ``conv_group_norm``'s (imported, not repeated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...kernels.host import kernels_unavailable
from ..conv_epilogue.common import empty_placeholder, in_format, output_memory_format
from ..conv_group_norm.common import (
    affine_rows,
    allocate_result,
    describe_pool,
    norm_dtype,
    output_dtype,
    pool_unroll_problem,
    stats_dtype,
)
from ..failure import op_kernel_failed, triton_serves
from .config import ConvBatchNormConfig

__all__ = ["affine_rows", "norm_dtype", "output_dtype", "stats_dtype"]

_OP = "fusion::conv_batch_norm"


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton kernels serve this case, else ``("reference", why)``."""
    cfg = ConvBatchNormConfig.from_json(config)
    why = kernels_unavailable(dtype, device_type) or pool_unroll_problem(cfg.pool)
    return ("reference", why) if why is not None else ("triton", None)


def use_triton(config: str, cfg: ConvBatchNormConfig, x: Tensor) -> bool:
    """Whether this call runs the Triton kernels; under ``strict`` on CUDA a case they cannot serve
    raises ``UnsupportedInputError`` instead of running the reference."""
    _, why = kernel_path(config, x.dtype, x.device.type)
    return triton_serves("conv_batch_norm", why, cfg.strict, x.device.type)


def describe(cfg: ConvBatchNormConfig) -> str:
    """``batch_norm(eps=1e-05, momentum=0.1, weight, bias) -> post [relu]`` for messages."""
    affine = "".join([", weight" if cfg.weight is not None else "", ", bias" if cfg.bias is not None else ""])
    post = ", ".join(s.kind.name.lower() for s in cfg.post)
    return f"batch_norm(eps={cfg.eps:g}, momentum={cfg.momentum:g}{affine}) -> post [{post}]{describe_pool(cfg.pool)}"


def on_kernel_failure(direction: str, config: str, cfg: ConvBatchNormConfig, x: Tensor, weight: Tensor,
                      error: Exception) -> None:  # fmt: skip
    """The fused ops' failure policy (``ops/failure.py``): under ``strict`` raise, else warn once
    per (direction, config); the caller then runs the reference."""
    op_kernel_failed("conv_batch_norm", direction, describe(cfg), config, x, weight, error, cfg.strict)


def conv_channels(weight: Tensor, cfg: ConvBatchNormConfig) -> int:
    """The conv's output channels."""
    return weight.shape[1] * cfg.conv.groups if cfg.conv.transposed else weight.shape[0]


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvBatchNormConfig) -> None:
    """One-line ``UnsupportedInputError`` for inputs that do not fit the config."""
    dims = cfg.conv.spatial_dims
    if x.dim() != dims + 2 or weight.dim() != dims + 2:
        raise UnsupportedInputError(
            f"{_OP}: a {dims}d conv needs x and weight with {dims + 2} dims, got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    if not x.is_floating_point():
        raise UnsupportedInputError(f"{_OP}: x must be floating point, got {x.dtype}")
    channels = conv_channels(weight, cfg)
    named = [(f"the norm's {name}", operands[i] if i is not None and i < len(operands) else None, i)
             for name, i in (("weight", cfg.weight), ("bias", cfg.bias))]  # fmt: skip
    for name, t, index in named:
        if index is None:
            continue
        if t is None:
            raise UnsupportedInputError(f"{_OP}: {name} is operands[{index}] but {len(operands)} operand tensors were given")
        if t.numel() != channels or not t.is_floating_point():
            raise UnsupportedInputError(f"{_OP}: {name} must hold {channels} floating values (one per channel), got "
                                        f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    for step in cfg.post:
        for operand in step.operands:
            index = getattr(operand, "index", None)
            if index is not None and not 0 <= index < len(operands):
                raise UnsupportedInputError(f"{_OP}: the post-chain references operands[{index}] but {len(operands)} "
                                            "operand tensors were given")  # fmt: skip


def values_per_channel(y_shape: Sequence[int]) -> int:
    """How many values each channel's batch statistics cover: ``N * prod(spatial)``; like eager, a
    batch norm with batch statistics needs more than one (``ValueError`` otherwise)."""
    count = y_shape[0] * math.prod(y_shape[2:])
    if count <= 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(y_shape)}")
    return count


def allocate_forward_outputs(x: Tensor, y0: Tensor, cfg: ConvBatchNormConfig, save: bool,
                             out_format: torch.memory_format) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_y, saved_winner, stats)`` with the exact shapes, dtypes and strides of the
    real op (``y0``: the conv output without bias, real or fake, as ``library_conv.conv_forward``
    gives it: channels-last for 2-d and 3-d convs in fp16 / bf16 / fp32).

    * ``out`` and ``saved_winner``: ``conv_group_norm.common.allocate_result``'s (y0's shape, or with a
      pool the pooled one, in ``out_format`` (``library_conv.nominal_format``: eager's layout), dtype ``out_dtype``; the winners, int8 per
      window, only with ``save`` and a max pool, else ``empty_placeholder(x)``).
    * ``saved_y`` (with ``save``, else ``empty_placeholder(x)``): the conv output without bias, y0
      itself where it is in ``output_memory_format(y0)`` already (a conv's output always is), else a
      copy in it.
    * ``stats``: ``stats_dtype`` ``(3, C)`` contiguous, of the conv output plus bias per channel: row
      0 the batch mean, row 1 ``1 / sqrt(var + eps)`` (``var`` biased; rows 0-1 are what the backward
      reads), row 2 the unbiased variance (what the running variance is updated with).
    """
    out, winner = allocate_result(x, y0, cfg, save, out_format)
    stats = torch.empty([3, y0.shape[1]], dtype=stats_dtype(y0.dtype), device=x.device)
    return out, (in_format(y0, output_memory_format(y0)) if save else empty_placeholder(x)), winner, stats


def update_running_stats(running_mean: Tensor, running_var: Tensor, stats: Tensor, momentum: float) -> None:
    """Eager's in-place update ``running = (1 - m) * running + m * batch`` with the batch mean and
    unbiased variance (``stats`` rows 0 and 2), computed in the statistics' dtype and stored in the
    running statistics' own dtype."""
    running_mean.copy_(stats[0] * momentum + running_mean.to(stats.dtype) * (1.0 - momentum))
    running_var.copy_(stats[2] * momentum + running_var.to(stats.dtype) * (1.0 - momentum))
