"""Triton implicit-GEMM convolution with the pointwise chain and the pool fused in (forward only).

One kernel template computes ``pool(chain(conv(x, w) + bias))`` without ever writing the conv output:
the conv runs as an implicit GEMM with ``tl.dot`` (fp32 accumulation), the chain runs in registers
(the ``@triton.jit`` helpers of ``fusion_backend.kernels.epilogue``), the optional max/avg pool reduces
in registers, and only the final output plus the backward state are stored.  The saved state has the
exact format of ``epilogue_forward`` (max pool: int8/int32 winner index in its window and the conv
output, without bias, at the winner; otherwise the full conv output ``y0``), so the existing backward
(``epilogue_backward``) consumes it unchanged.

Mapping (every rank lifted to 3d with leading singleton spatial dims):

* GEMM ``M`` = "units" of one program: pooled-output positions with a pool; conv-output positions for
  a plain conv; for a transposed conv without pool, *super-positions* ``u`` each standing for the
  ``s_d * s_h * s_w`` outputs ``o = u * s + r`` (one per phase ``r``).  ``M`` flattens
  ``(n, ud, uh, uw)``.  ``N`` = output channels of one group (``BLOCK_N`` of them), ``K`` = input
  channels of the group (``BLOCK_K`` at a time) x taps (unrolled statically).
* Every unit has a static set of *window offsets* ``kp`` (the pool window; the phases of a
  transposed conv without pool; a single offset for a plain conv without pool); the conv output at
  ``o = u * US - UP + kp`` is computed for each, the chain applied, then reduced (pool) or stored.
* Conv-transpose uses the phase (sub-pixel) decomposition: tap ``k`` contributes to output ``o`` iff
  ``(o + p - k * dil) % s == 0``, from input ``i = (o + p - k * dil) / s``.  When ``US`` is a multiple
  of ``s`` (always without a pool; e.g. the ConvT3d pipeline's MaxPool(2) after a stride-2
  ConvTranspose3d(16->32, k3, p1, op1), the ``convt3d_leaky_mul_leaky_maxpool`` workload), the phase
  of every offset is a compile-time constant: taps that cannot contribute are skipped at compile time
  and no multiply by an inserted zero happens.  With a static phase along every dim and at most
  ``_PHASE_ALIGNED_MAX_SLOTS`` distinct input shifts (offset ``kp`` and tap ``t`` read ``i = u * US / s +
  (kp - UP + p - t * dil) / s``, a compile-time shift; the ConvT3d pipeline: 2 per dim, 8 in all), the
  *phase-aligned* path makes every window offset ONE dense dot: K = (input shift, channel), the X tile
  ``[BLOCK_M, 8 shifts x C_in]`` loaded once per channel block and shared by the dots of all offsets,
  the weight tile zero where no tap links the offset to the shift (the ConvT3d pipeline: 27 live of 64
  (offset, shift) blocks, so 2.4x the MMA work of the live taps, traded for 8 large dots with one live
  accumulator instead of 27 K=16 dots with 8).  Other static cases unroll the live taps
  (``tl.static_range``).  Otherwise (a pool stride that is not a multiple of the conv stride) the
  kernel falls back to a *masked all-taps* loop: every tap is visited and lanes whose phase does not
  match are masked (correct, up to ``s**d`` times more MMA work).

Numerics: the accumulator is rounded to the storage dtype of the conv before the bias and chain, as
the library conv + epilogue kernel path does (the conv output is materialised in that dtype there).
fp32 operands use TF32 iff the launcher is told so (on CUDA the op layer's answer: where eager's conv
of the same tensors runs TF32, ``ops/conv_precision.py``), ``ieee`` otherwise and always under the interpreter; TF32 operands are rounded to nearest first, as
cuDNN does (``kernels.tf32``: the tensor cores would truncate them).  inf/NaN in ``x`` reach exactly
the outputs they reach in aten's conv; a non-finite *weight* also reaches the outputs whose taps fall
on the zero padding (masked loads read 0, and 0 * NaN = NaN), as in implicit-GEMM convs generally.  No atomics; results are deterministic.

Layout: ``device.py`` holds the Triton kernels and their device helpers; ``plan.py`` the host side
(geometry, cases served, per-call plans, tiles and autotuning, launch plans).
"""

from .plan import (
    AUTOTUNE_ENV,
    MAX_UNROLLED_TAPS,
    PHASE_ALIGNED_BLOCK_K,
    conv_fused_forward,
    conv_output_size,
    forward_launch,
    phase_aligned_weight_matrix,
    unsupported_reason,
)

__all__ = [
    "AUTOTUNE_ENV", "MAX_UNROLLED_TAPS", "PHASE_ALIGNED_BLOCK_K", "conv_fused_forward", "conv_output_size",
    "forward_launch", "phase_aligned_weight_matrix", "unsupported_reason",
]  # fmt: skip
