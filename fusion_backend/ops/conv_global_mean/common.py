"""What the parts of ``fusion::conv_global_mean`` share: the environment switch and dtypes the
kernels cover, which implementation serves a case (``kernel_path``), and the failure policy
(``run_with_fallback``: strict raises, otherwise warn once and run the reference).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch

from ... import environment
from ...errors import KernelError
from .config import ConvGlobalMeanConfig
from .geometry import MAX_TABLE_BITS, Geometry

logger = logging.getLogger("fusion_backend")


#: The environment switch that makes CPU tensors run the Triton launchers (``fusion_backend.environment``).
CPU_KERNELS_ENV = environment.CPU_KERNELS
_CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# NOTE: the Triton interpreter has no bf16, so on CPU only fp32/fp16 can take the kernel path.
_INTERPRETER_KERNEL_DTYPES = (torch.float32, torch.float16)


_R = TypeVar("_R")


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """Which implementation a call with this config, x dtype and device type takes.

    Returns ``("triton", None)`` or ``("reference", reason)``.  A problem can still leave the Triton
    path at run time when a spatial dim has more than 31 distinct tap index sets (kernel width > 31),
    which is reported by a one-time warning.
    """
    if device_type == "cuda":
        return _cuda_kernel_path(config, dtype)
    ConvGlobalMeanConfig.from_json(config)  # validates
    if device_type == "cpu":
        from ...kernels.host import cpu_kernels_unavailable

        why = cpu_kernels_unavailable()
        if why is not None:
            return ("reference", why)
        if dtype in _INTERPRETER_KERNEL_DTYPES:
            return ("triton", None)
        return ("reference", f"the Triton interpreter has no kernel for dtype {dtype} (fp32, fp16 only)")
    return ("reference", f"no Triton kernels for device type {device_type!r}")


@functools.lru_cache(maxsize=256)
def _cuda_kernel_path(config: str, dtype: torch.dtype) -> tuple[str, str | None]:
    """``kernel_path`` on CUDA (no environment to read, so cached: it runs on every call)."""
    ConvGlobalMeanConfig.from_json(config)  # validates
    if dtype in _CUDA_KERNEL_DTYPES:
        return ("triton", None)
    return ("reference", f"no Triton kernel for dtype {dtype} (kernels: fp32, fp16, bf16)")


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
            _warn_once(f"{op}:fit:{why_not}", f"fusion_backend: {op} uses the torch reference: {why_not}")
            return reference()
        try:
            return kernel()
        except Exception as err:
            detail = f"{op} Triton kernel failed on shape {tuple(t.shape)} dtype {t.dtype} ({t.device}): {type(err).__name__}: {err}"
            if cfg.strict:
                raise KernelError(detail + "; set strict=False to fall back to the torch reference") from err
            _warn_once(
                f"{op}:fail:{type(err).__name__}",
                f"fusion_backend: {detail}; falling back to the torch reference",
            )
    return reference()


def as_5d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 5:
        t = t.unsqueeze(2)
    return t
