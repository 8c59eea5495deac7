"""What the parts of ``fusion::conv_global_mean`` share: the environment switch and dtypes the
kernels cover, which implementation serves a case (``kernel_path``), and the failure policy
(``run_with_fallback``: strict raises, otherwise warn once and run the reference).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

from ... import environment
from ...kernels.host import kernels_unavailable
from ..failure import kernel_failed, warn_once
from .config import ConvGlobalMeanConfig
from .geometry import MAX_TABLE_BITS, Geometry

#: The environment switch that makes CPU tensors run the Triton launchers (``fusion_backend.environment``).
CPU_KERNELS_ENV = environment.CPU_KERNELS


_R = TypeVar("_R")


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """Which implementation a call with this config, x dtype and device type takes.

    Returns ``("triton", None)`` or ``("reference", reason)``.  A problem can still leave the Triton
    path at run time when a spatial dim has more than 31 distinct tap index sets (kernel width > 31),
    which is reported by a one-time warning.
    """
    if device_type == "cuda":
        return _cuda_kernel_path(config, dtype)
    ConvGlobalMeanConfig.from_json(config)  # validates
    why = kernels_unavailable(dtype, device_type)
    return ("reference", why) if why is not None else ("triton", None)


@functools.lru_cache(maxsize=256)
def _cuda_kernel_path(config: str, dtype: torch.dtype) -> tuple[str, str | None]:
    """``kernel_path`` on CUDA (no environment to read, so cached: it runs on every call)."""
    ConvGlobalMeanConfig.from_json(config)  # validates
    why = kernels_unavailable(dtype, "cuda")
    return ("reference", why) if why is not None else ("triton", None)


def _kernel_fits(geo: Geometry) -> str | None:
    if geo.bits is None:
        return f"a spatial dim has {max(geo.set_counts)} distinct tap index sets (the kernels support {MAX_TABLE_BITS})"
    return None


def run_with_fallback(
    op: str,
    cfg: ConvGlobalMeanConfig,
    config: str,
    t: torch.Tensor,
    geo: Geometry,
    kernel: Callable[[], _R],
    reference: Callable[[], _R],
    dtype: torch.dtype | None = None,
) -> _R:
    """Run ``kernel()`` when this call takes the Triton path, else (or on failure) ``reference()``.

    The path is chosen by ``t``'s device and ``dtype`` (default ``t``'s): x forward, grad_out with
    x's dtype backward.  NOTE: a launch error
    (compilation, resources) falls back cleanly; an asynchronous CUDA fault inside a kernel cannot be
    caught here and poisons the CUDA context, as with any kernel.
    """
    path, _ = kernel_path(config, dtype or t.dtype, t.device.type)
    if path == "triton":
        why_not = _kernel_fits(geo)
        if why_not is not None:
            warn_once(("conv_global_mean", op, "fit", why_not), f"fusion_backend: {op} uses the torch reference: {why_not}")
            return reference()
        try:
            return kernel()
        except Exception as err:  # the fused ops' failure policy (``ops/failure.py``)
            what = f"{op} Triton kernel failed on shape {tuple(t.shape)} dtype {t.dtype} ({t.device}): {type(err).__name__}: {err}"
            kernel_failed(what, err, cfg.strict, ("conv_global_mean", op, config))
    return reference()


def as_5d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 5:
        t = t.unsqueeze(2)
    return t
