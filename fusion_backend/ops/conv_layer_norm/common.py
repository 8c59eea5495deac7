"""What every part of ``fusion::conv_layer_norm`` shares: which implementation serves a case
(``kernel_path``), the outputs and saved state with their exact shapes, dtypes and strides (the fake
and both implementations allocate through ``allocate_forward_outputs``), input checks, the chains
and the norm's scale and shift as the kernels read them, and the failure policy
(``on_kernel_failure``).

The conv itself, its backward, the chain semantics and the saved state's memory format are
``conv_epilogue``'s; the norm's dtypes and its scale and shift rows are ``conv_group_norm``'s
(imported, not repeated).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...kernels.chain_math import KernelStep
from ...kernels.host import kernels_unavailable
from ..conv_channel_reduce.common import chain_kernel_steps
from ..conv_epilogue.common import conv_output_shape, empty_placeholder, in_format, output_memory_format
from ..conv_group_norm.common import affine_rows, norm_dtype, output_dtype, stats_dtype
from ..failure import op_kernel_failed, triton_serves
from .config import ConvLayerNormConfig

__all__ = ["norm_dtype", "output_dtype", "stats_dtype"]

_OP = "fusion::conv_layer_norm"


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """``("triton", None)`` when the Triton kernels serve this case, else ``("reference", why)``."""
    ConvLayerNormConfig.from_json(config)  # a valid config
    why = kernels_unavailable(dtype, device_type)
    return ("reference", why) if why is not None else ("triton", None)


def use_triton(config: str, cfg: ConvLayerNormConfig, x: Tensor) -> bool:
    """Whether this call runs the Triton kernels; under ``strict`` on CUDA a case they cannot serve
    raises ``UnsupportedInputError`` instead of running the reference."""
    _, why = kernel_path(config, x.dtype, x.device.type)
    return triton_serves("conv_layer_norm", why, cfg.strict, x.device.type)


def on_kernel_failure(direction: str, config: str, cfg: ConvLayerNormConfig, x: Tensor, weight: Tensor,
                      error: Exception) -> None:  # fmt: skip
    """The fused ops' failure policy (``ops/failure.py``): under ``strict`` raise, else warn once
    per (direction, config); the caller then runs the reference."""
    op_kernel_failed("conv_layer_norm", direction, describe(cfg), config, x, weight, error, cfg.strict)


def describe(cfg: ConvLayerNormConfig) -> str:
    """``pre [relu] -> layer_norm((64,), eps=1e-05, weight, bias) -> post [gelu, mul]`` for messages."""
    def chain(steps) -> str:
        return ", ".join(s.kind.name.lower() for s in steps)

    affine = "".join([", weight" if cfg.weight is not None else "", ", bias" if cfg.bias is not None else ""])
    shape = tuple(cfg.normalized_shape)
    return f"pre [{chain(cfg.pre)}] -> layer_norm({shape}, eps={cfg.eps:g}{affine}) -> post [{chain(cfg.post)}]"


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvLayerNormConfig) -> None:
    """One-line ``UnsupportedInputError`` for inputs that do not fit the config."""
    dims = cfg.conv.spatial_dims
    if x.dim() != dims + 2 or weight.dim() != dims + 2:
        raise UnsupportedInputError(
            f"{_OP}: a {dims}d conv needs x and weight with {dims + 2} dims, got x {tuple(x.shape)} and weight "
            f"{tuple(weight.shape)}"
        )
    if not x.is_floating_point():
        raise UnsupportedInputError(f"{_OP}: x must be floating point, got {x.dtype}")
    y_shape = conv_output_shape(x, weight, cfg.conv)
    trailing = tuple(y_shape[len(y_shape) - cfg.normalized_dims:])
    if trailing != cfg.normalized_shape:
        raise UnsupportedInputError(f"{_OP}: the conv output {tuple(y_shape)} does not end in the normalized shape "
                                    f"{cfg.normalized_shape}")  # fmt: skip
    for name in ("weight", "bias"):
        index = getattr(cfg, name)
        if index is None:
            continue
        if index >= len(operands):
            raise UnsupportedInputError(f"{_OP}: the norm's {name} is operands[{index}] but {len(operands)} operand "
                                        "tensors were given")  # fmt: skip
        t = operands[index]
        if t.numel() != cfg.elements or not t.is_floating_point():
            raise UnsupportedInputError(f"{_OP}: the norm's {name} must hold {cfg.elements} floating values (the "
                                        f"normalized shape {cfg.normalized_shape}), got {tuple(t.shape)} {t.dtype}")  # fmt: skip
    for name, chain in (("pre", cfg.pre), ("post", cfg.post)):
        for step in chain:
            for operand in step.operands:
                index = getattr(operand, "index", None)
                if index is not None and not 0 <= index < len(operands):
                    raise UnsupportedInputError(
                        f"{_OP}: the {name}-chain references operands[{index}] but {len(operands)} operand tensors "
                        "were given"
                    )


def rows(y_shape: Sequence[int], cfg: ConvLayerNormConfig) -> int:
    """How many rows (normalized slices) a conv output of ``y_shape`` holds (sizes may be symbolic)."""
    return math.prod(y_shape[: len(y_shape) - cfg.normalized_dims])


def allocate_forward_outputs(x: Tensor, y0: Tensor, cfg: ConvLayerNormConfig,
                             save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_y, saved_stats)`` with the exact shapes, dtypes and strides of the real op
    (``y0``: the conv output without bias, real or fake).

    * ``out``: y0's shape, contiguous (what eager's layer norm returns whatever its input's layout),
      dtype ``out_dtype`` (default the conv's).
    * ``saved_y`` (with ``save``): the conv output without bias, y0 itself where it is in
      ``output_memory_format(y0)`` already (a conv's output always is), else a copy in it.
    * ``saved_stats`` (with ``save``): ``stats_dtype`` ``(2, M)`` contiguous, ``M`` the rows in
      ``native_layer_norm``'s order (the dims before the normalized ones, row-major): row 0 each
      row's mean, row 1 its ``1 / sqrt(var + eps)`` (of the pre-chain's result, bias included).
    Absent entries are ``empty_placeholder(x)``.
    """
    out = torch.empty(y0.shape, dtype=output_dtype(cfg, y0.dtype), device=x.device)
    if not save:
        return out, empty_placeholder(x), empty_placeholder(x)
    stats = torch.empty([2, rows(y0.shape, cfg)], dtype=stats_dtype(y0.dtype), device=x.device)
    return out, in_format(y0, output_memory_format(y0)), stats


class KernelChains(NamedTuple):
    """The pre- and post-chain as the launchers take them, their operand matrices ``P`` (bias row +
    pre-chain operands) and ``Q`` (post-chain operands), both over the C channels, and the norm's
    scale and shift ``A``, fp32 ``(2, prod(normalized_shape))``."""

    pre: list[KernelStep]
    post: list[KernelStep]
    params: Tensor
    post_params: Tensor
    affine: Tensor


def kernel_chains(cfg: ConvLayerNormConfig, bias: Tensor | None, operands: Sequence[Tensor], ndim: int, channels: int,
                  device: torch.device) -> KernelChains:  # fmt: skip
    """``KernelChains`` of a call (a conv output of ``ndim`` dims and ``channels`` channels)."""
    from ...kernels.epilogue import build_params  # lazily: TRITON_INTERPRET is read at import

    pre = chain_kernel_steps(cfg, cfg.pre, operands, ndim, channels)
    post = chain_kernel_steps(cfg, cfg.post, operands, ndim, channels)
    return KernelChains(pre, post, build_params(pre, bias, channels, device), build_params(post, None, channels, device),
                        affine_rows(operands, cfg, cfg.elements, device))  # fmt: skip
