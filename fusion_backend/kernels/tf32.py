"""Round fp32 GEMM operands to TF32 to nearest before ``tl.dot``, as cuDNN and cuBLAS do.

WHY: with ``input_precision="tf32"`` Triton hands the fp32 registers to the tensor cores as they
are, and the hardware drops the 13 low mantissa bits: the operands are *truncated* toward zero
(triton-lang/triton#4574: Triton's tf32 matmul is several times less accurate than PyTorch's).  The
library path's cuDNN kernels round to nearest (``cvt.rna.tf32.f32``).  On seed A the fused
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

import triton
import triton.language as tl


@triton.jit
def round_tf32(v, PRECISION: tl.constexpr):
    if PRECISION == "tf32":
        if v.dtype == tl.float32:
            v = tl.inline_asm_elementwise(
                "cvt.rna.tf32.f32 $0, $1;", "=r,r", [v], dtype=tl.float32, is_pure=True, pack=1
            )
    return v
