"""What every part of ``fusion::conv_group_norm`` shares: which implementation serves a case
(``kernel_path``), the outputs and saved state with their exact shapes, dtypes and strides (the fake
and both implementations allocate through ``allocate_forward_outputs``), input checks, the norm's
per-channel scale and shift as the kernels read them, and the failure policy (``on_kernel_failure``).

The conv itself, its backward, the chain semantics and the outputs' memory format are
``conv_epilogue``'s (imported, not repeated).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...kernels.host import kernels_unavailable
from ..conv_epilogue.common import empty_placeholder, in_format, output_memory_format
from ..failure import op_kernel_failed, triton_serves
from .config import ConvGroupNormConfig

_OP = "fusion::conv_group_norm"


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton kernels serve this case, else ``("reference", why)``."""
    ConvGroupNormConfig.from_json(config)  # a valid config
    why = kernels_unavailable(dtype, device_type)
    return ("reference", why) if why is not None else ("triton", None)


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
    return f"pre [{chain(cfg.pre)}] -> group_norm({cfg.groups} groups, eps={cfg.eps:g}{affine}) -> post [{chain(cfg.post)}]"


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


def allocate_forward_outputs(x: Tensor, y0: Tensor, cfg: ConvGroupNormConfig,
                             save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_y, saved_stats)`` with the exact shapes, dtypes and strides of the real op
    (``y0``: the conv output without bias, real or fake).

    * ``out``: y0's shape in ``output_memory_format(y0)``, dtype ``out_dtype`` (default the conv's).
    * ``saved_y`` (with ``save``): the conv output without bias, y0 itself where it is in
      ``output_memory_format(y0)`` already (a conv's output always is), else a copy in it.
    * ``saved_stats`` (with ``save``): ``stats_dtype`` ``(2, N, groups)`` contiguous: row 0 each
      group's mean, row 1 its ``1 / sqrt(var + eps)`` (of the pre-chain's result, bias included).
    Absent entries are ``empty_placeholder(x)``.
    """
    fmt = output_memory_format(y0)
    out = torch.empty(y0.shape, dtype=output_dtype(cfg, y0.dtype), device=x.device, memory_format=fmt)
    if not save:
        return out, empty_placeholder(x), empty_placeholder(x)
    stats = torch.empty([2, y0.shape[0], cfg.groups], dtype=stats_dtype(y0.dtype), device=x.device)
    return out, in_format(y0, fmt), stats


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
