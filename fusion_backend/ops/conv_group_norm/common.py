"""What every part of ``fusion::conv_group_norm`` shares: which implementation serves a case
(``kernel_path``), the outputs and saved state with their exact shapes, dtypes and strides (the fake
and both implementations allocate through ``allocate_forward_outputs``), input checks, the norm's
per-channel scale and shift as the kernels read them, and the failure policy (``on_kernel_failure``).

The conv itself, its backward, the chain semantics and the outputs' memory format are
``conv_epilogue``'s (imported, not repeated).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...ir.specs import PoolSpec
from ...kernels.host import kernels_unavailable
from ..conv_epilogue.common import (
    empty_placeholder,
    in_format,
    output_memory_format,
    pooled_output_shape,
    winner_dtype,
)
from ..failure import op_kernel_failed, triton_serves
from .config import ConvGroupNormConfig

if TYPE_CHECKING:
    from ..conv_batch_norm.config import ConvBatchNormConfig

_OP = "fusion::conv_group_norm"


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton kernels serve this case, else ``("reference", why)``."""
    cfg = ConvGroupNormConfig.from_json(config)
    why = kernels_unavailable(dtype, device_type) or pool_unroll_problem(cfg.pool)
    return ("reference", why) if why is not None else ("triton", None)


def pool_unroll_problem(pool: PoolSpec | None) -> str | None:
    """Why the pooled normalise kernel (``kernels/norm_pool.py``) cannot take ``pool``, or None: its
    windows are unrolled, at most ``MAX_WINDOW_VOLUME`` taps."""
    from ...kernels.chain_math import MAX_WINDOW_VOLUME  # lazily: TRITON_INTERPRET is read at import

    if pool is not None and pool.window_volume > MAX_WINDOW_VOLUME:
        return f"pool window of {pool.window_volume} taps exceeds the kernel's unroll limit {MAX_WINDOW_VOLUME}"
    return None


def use_triton(config: str, cfg: ConvGroupNormConfig, x: Tensor) -> bool:
    """Whether this call runs the Triton kernels; under ``strict`` on CUDA a case they cannot serve
    raises ``UnsupportedInputError`` instead of running the reference."""
    _, why = kernel_path(config, x.dtype, x.device.type)
    return triton_serves("conv_group_norm", why, cfg.strict, x.device.type)


def on_kernel_failure(direction: str, config: str, cfg: ConvGroupNormConfig, x: Tensor, weight: Tensor,
                      error: Exception) -> None:  # fmt: skip
    """The fused ops' failure policy (``ops/failure.py``): under ``strict`` raise, else warn once
    per (direction, config); the caller then runs the reference."""
    op_kernel_failed("conv_group_norm", direction, describe(cfg), config, x, weight, error, cfg.strict)


def describe(cfg: ConvGroupNormConfig) -> str:
    """``pre [relu] -> group_norm(8 groups, eps=1e-05, affine) -> post [silu]`` for messages."""
    def chain(steps) -> str:
        return ", ".join(s.kind.name.lower() for s in steps)

    affine = "".join([", weight" if cfg.weight is not None else "", ", bias" if cfg.bias is not None else ""])
    return (f"pre [{chain(cfg.pre)}] -> group_norm({cfg.groups} groups, eps={cfg.eps:g}{affine}) -> post "
            f"[{chain(cfg.post)}]{describe_pool(cfg.pool)}")


def describe_pool(pool: PoolSpec | None) -> str:
    """`` -> max_pool(k=(3, 3), s=(2, 2), p=(1, 1), ceil_mode=False)`` for messages ('' without a pool)."""
    if pool is None:
        return ""
    return (f" -> {pool.kind}_pool(k={pool.kernel_size}, s={pool.stride}, p={pool.padding}, "
            f"ceil_mode={pool.ceil_mode})")


def conv_channels(weight: Tensor, cfg: ConvGroupNormConfig) -> int:
    """The conv's output channels."""
    return weight.shape[1] * cfg.conv.groups if cfg.conv.transposed else weight.shape[0]


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvGroupNormConfig) -> None:
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
    if channels % cfg.groups != 0:
        raise UnsupportedInputError(f"{_OP}: {channels} conv output channels do not split into {cfg.groups} groups")
    for name in ("weight", "bias"):
        index = getattr(cfg, name)
        if index is None:
            continue
        if index >= len(operands):
            raise UnsupportedInputError(f"{_OP}: the norm's {name} is operands[{index}] but {len(operands)} operand "
                                        "tensors were given")  # fmt: skip
        t = operands[index]
        if t.numel() != channels or not t.is_floating_point():
            raise UnsupportedInputError(f"{_OP}: the norm's {name} must hold {channels} floating values (one per "
                                        f"channel), got {tuple(t.shape)} {t.dtype}")  # fmt: skip
    for name, chain in (("pre", cfg.pre), ("post", cfg.post)):
        for step in chain:
            for operand in step.operands:
                index = getattr(operand, "index", None)
                if index is not None and not 0 <= index < len(operands):
                    raise UnsupportedInputError(
                        f"{_OP}: the {name}-chain references operands[{index}] but {len(operands)} operand tensors "
                        "were given"
                    )


def _dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    return default if name is None else getattr(torch, name)


def norm_dtype(cfg: ConvGroupNormConfig, conv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the norm's result (and of the post-chain) in eager."""
    return _dtype(cfg.norm_dtype, conv_dtype)


def output_dtype(cfg: ConvGroupNormConfig, conv_dtype: torch.dtype) -> torch.dtype:
    return _dtype(cfg.out_dtype, conv_dtype)


def stats_dtype(conv_dtype: torch.dtype) -> torch.dtype:
    """The saved statistics' dtype: fp32 (the kernels' compute type), fp64 for an fp64 conv."""
    return torch.float64 if conv_dtype == torch.float64 else torch.float32


def allocate_result(x: Tensor, y0: Tensor, cfg: ConvGroupNormConfig | ConvBatchNormConfig, save: bool,
                    out_format: torch.memory_format | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_winner)`` of a norm family's op (``y0``: the conv output without bias, real
    or fake), shared with ``conv_batch_norm``.

    * ``out``: y0's shape, or with ``cfg.pool`` the pooled shape (``pooled_output_shape``), in
      ``out_format`` (default ``output_memory_format(y0)``), dtype ``out_dtype`` (default the conv's).
    * ``saved_winner`` (with ``save`` and a max pool, else ``empty_placeholder(x)``): each window's
      winner as its row-major tap index, ``winner_dtype`` (int8 up to 127 taps), out's shape in y0's
      layout (``output_memory_format(y0)``): the backward kernels walk y0 and read the winners along
      with it, coalesced where both share the contiguous axis.
    """
    fmt = output_memory_format(y0) if out_format is None else out_format
    shape = y0.shape if cfg.pool is None else pooled_output_shape(y0.shape, cfg.pool)
    out = torch.empty(shape, dtype=output_dtype(cfg, y0.dtype), device=x.device, memory_format=fmt)
    if not save or cfg.pool is None or cfg.pool.kind != "max":
        return out, empty_placeholder(x)
    return out, torch.empty(shape, dtype=winner_dtype(cfg.pool), device=x.device,
                            memory_format=output_memory_format(y0))  # fmt: skip


def allocate_forward_outputs(x: Tensor, y0: Tensor, cfg: ConvGroupNormConfig,
                             save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_y, saved_winner, saved_stats)`` with the exact shapes, dtypes and strides of
    the real op (``y0``: the conv output without bias, real or fake).

    * ``out`` and ``saved_winner``: ``allocate_result``'s (the pooled shape with a pool; the winners
      only with ``save`` and a max pool).
    * ``saved_y`` (with ``save``): the conv output without bias, y0 itself where it is in
      ``output_memory_format(y0)`` already (a conv's output always is), else a copy in it.
    * ``saved_stats`` (with ``save``): ``stats_dtype`` ``(2, N, groups)`` contiguous: row 0 each
      group's mean, row 1 its ``1 / sqrt(var + eps)`` (of the pre-chain's result, bias included).
    Absent entries are ``empty_placeholder(x)``.
    """
    out, winner = allocate_result(x, y0, cfg, save)
    if not save:
        return out, empty_placeholder(x), winner, empty_placeholder(x)
    stats = torch.empty([2, y0.shape[0], cfg.groups], dtype=stats_dtype(y0.dtype), device=x.device)
    return out, in_format(y0, output_memory_format(y0)), winner, stats


def affine_rows(operands: Sequence[Tensor], cfg: ConvGroupNormConfig, channels: int, device) -> Tensor:
    """The norm's scale and shift as the kernels read them: fp32 ``(2, C)`` contiguous, row 0 the
    weight (ones without one), row 1 the bias (zeros without one)."""
    rows = torch.empty((2, channels), dtype=torch.float32, device=device)
    for row, index, fill in ((0, cfg.weight, 1.0), (1, cfg.bias, 0.0)):
        if index is None:
            rows[row].fill_(fill)
        else:
            rows[row].copy_(operands[index].reshape(-1))
    return rows
