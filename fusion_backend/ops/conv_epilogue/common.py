"""What every part of ``fusion::conv_epilogue`` shares: the environment switches it reads, which
implementation serves a case (``kernel_path``), the outputs with their layouts, input checks and casts,
and the failure policy (``on_kernel_failure``).  The conv, its layouts and shapes are ``ops/conv_io.py``'s,
the chain's reference ``ops/chain_reference.py``'s and its lowering ``ops/chain_lowering.py``'s.
"""

import logging
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from ... import environment
from ...errors import UnsupportedInputError
from ...ir.specs import PoolSpec
from ...kernels.host import kernels_unavailable
from ..chain import MAX_CHAIN_LENGTH, Const, TensorRef
from ..chain_lowering import check_operand_refs
from ..config import ConvEpilogueConfig
from ..conv_io import check_conv_inputs, dtype_named, empty_placeholder, output_memory_format, winner_dtype
from ..failure import op_kernel_failed, triton_serves

logger = logging.getLogger("fusion_backend")


#: The environment switches this op reads (``fusion_backend.environment`` says what they do).
CPU_KERNELS_ENV = environment.CPU_KERNELS
CONV_IMPL_ENV = environment.CONV_IMPL
DEFAULT_CONV_IMPL = environment.DEFAULT_CONV_IMPL


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
    """One-line ``UnsupportedInputError`` for inputs that do not fit the config."""
    output_dtype(cfg, conv_compute_dtype(cfg, x))  # both dtype names are valid
    check_conv_inputs("conv_epilogue", x, weight, cfg.conv)
    if cfg.pool is not None and len(cfg.pool.kernel_size) != cfg.conv.spatial_dims:
        raise UnsupportedInputError(f"fusion::conv_epilogue: pool {cfg.pool} does not have {cfg.conv.spatial_dims} "
                                    "spatial dims")  # fmt: skip
    check_operand_refs("conv_epilogue", {"chain": cfg.chain}, operands)


def output_dtype(cfg: ConvEpilogueConfig, conv_dtype: torch.dtype) -> torch.dtype:
    """The result's dtype: ``config.out_dtype``, else the conv's (compute) dtype."""
    return dtype_named("conv_epilogue", cfg.out_dtype, conv_dtype)


def conv_compute_dtype(cfg: ConvEpilogueConfig, x: Tensor) -> torch.dtype:
    """The dtype the conv runs in: ``config.compute_dtype``, else x's."""
    return dtype_named("conv_epilogue", cfg.compute_dtype, x.dtype, "compute_dtype")


def cast_inputs(x: Tensor, weight: Tensor, bias: Tensor | None,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``x``, ``weight`` and ``bias`` in the compute dtype (the same tensors where they already are):
    what the library and reference paths run on; the Triton conv kernels cast as they load instead."""
    return x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


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


