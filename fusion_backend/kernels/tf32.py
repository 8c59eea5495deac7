"""Prepare GEMM operands for ``tl.dot``: cast to the conv's compute dtype, round fp32 to TF32.

``to_compute(v, CDT)``: the conv kernels take ``x`` and ``weight`` in their stored dtype and cast
each loaded tile to the compute dtype (``CDT``: ``compute_code(dtype)``), so an fp32 model under
bf16/fp16 autocast needs no separate cast pass over ``x`` (autocast's casts are absorbed into the
loaders: the values are exactly those of ``x.to(dtype)``).  With ``CDT`` equal to the stored dtype
the cast is a no-op.

Rounding fp32 operands to TF32 to nearest before ``tl.dot``, as cuDNN and cuBLAS do:

WHY: with ``input_precision="tf32"`` Triton hands the fp32 registers to the tensor cores as they
are, and the hardware drops the 13 low mantissa bits: the operands are *truncated* toward zero
(triton-lang/triton#4574: Triton's tf32 matmul is several times less accurate than PyTorch's).  The
library path's cuDNN kernels round to nearest (``cvt.rna.tf32.f32``).  On the ConvTranspose3d ->
leaky -> x m -> leaky -> MaxPool3d pipeline (``convt3d_leaky_mul_leaky_maxpool``) the fused
conv's truncated pre-activations flipped the leaky-ReLU slope of about three times as many max-pool
winners as cuDNN's did, and the conv bias gradient (a sum with heavy cancellation) came out 7.4e-3
from float64 against cuDNN's 2.2e-3, failing the benchmark's correctness gate.  One ``cvt`` per
loaded element (before the tile goes to shared memory) costs little next to the dot.

Contract of ``round_tf32(v, PRECISION)``: ``v`` any fp32/fp16/bf16 tensor; with
``PRECISION == "tf32"`` and an fp32 ``v`` it returns ``v`` rounded to the nearest TF32 value (ties
away from zero; NaN and inf unchanged), otherwise ``v`` itself.  Never called with "tf32" under the
interpreter (the launchers use "ieee" there), so the PTX-only ``cvt`` is never interpreted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: ``CDT`` constexpr codes of the compute dtypes.
_COMPUTE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def compute_code(dtype: torch.dtype) -> int:
    """The ``CDT`` constexpr for a compute dtype (float32, float16 or bfloat16)."""
    try:
        return _COMPUTE_CODES[dtype]
    except KeyError:
        raise ValueError(f"no conv kernels compute in {dtype} (float32, float16, bfloat16)") from None


def dot_precision(compute_dtype: torch.dtype, allow_tf32: bool, interpret: bool) -> str:
    """The ``input_precision`` of the forward conv kernels' dots: "ieee" under the interpreter (it has
    no TF32); for fp32 operands "tf32" iff ``allow_tf32`` (the caller's answer for this conv: the op
    layer passes whether eager's conv of the same tensors runs TF32, ``ops/conv_precision.py``);
    "tf32" for 16-bit operands, where ``tl.dot`` ignores it."""
    if interpret:
        return "ieee"
    if compute_dtype != torch.float32:
        return "tf32"
    return "tf32" if allow_tf32 else "ieee"


def backward_dot_precision(dtype: torch.dtype, allow_tf32: bool | None = None) -> str:
    """The ``input_precision`` of the conv-backward kernels' dots: "tf32" for fp32 data iff
    ``allow_tf32`` (the caller's answer for this gradient, as ``dot_precision``'s; None: the cuDNN
    flag ``torch.backends.cudnn.allow_tf32``, for callers that have no answer), "ieee" for 16-bit
    data and always under the interpreter (it has no TF32)."""
    from .host import INTERPRETER

    if allow_tf32 is None:
        allow_tf32 = bool(torch.backends.cudnn.allow_tf32)
    if dtype == torch.float32 and allow_tf32 and not INTERPRETER:
        return "tf32"
    return "ieee"


@triton.jit
def to_compute(v, CDT: tl.constexpr):
    """``v`` cast to the compute dtype ``CDT`` (``compute_code``): 0 fp32, 1 fp16, 2 bf16."""
    if CDT == 1:
        v = v.to(tl.float16)
    elif CDT == 2:
        v = v.to(tl.bfloat16)
    else:
        v = v.to(tl.float32)
    return v


@triton.jit
def round_tf32(v, PRECISION: tl.constexpr):
    if PRECISION == "tf32":
        if v.dtype == tl.float32:
            v = tl.inline_asm_elementwise(
                "cvt.rna.tf32.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1
            )
    return v
