"""Backward of a transposed conv whose max pool lines up with the conv's phases (the phase-aligned forward, reversed).

WHY: the ConvT3d pipeline (ConvTranspose3d(16->32, k3, s2, p1, op1) then MaxPool3d(2) on
16x16x16x32x32, ``demos/seeds/convt3d_leaky_mul_leaky_maxpool.py``) trains through
``conv_fused_bwd``'s generic kernels, which are slow there (``docs/perf/RESULTS.md``, *Kernel design measurements*).  They treat the pooled gradient as a sparse full-size gradient and walk taps.  When the pool
stride equals the conv stride on every dim, a pooled unit ``u`` and a window offset ``kp`` address
the conv output ``o = u*US - UP + kp``, and every live (offset, tap) pair reads the input at
``i = u + j`` with a COMPILE-TIME shift ``j``: the same structure as the forward's phase-aligned path
(``conv_fused.device._phase_aligned_*``), so both gradients become a few large dense GEMMs over the pooled
gradient, with no per-tap index arithmetic and nothing full-size ever written.

Notation (per spatial dim, every rank lifted to 3d): conv stride ``s``, padding ``p``, dilation
``dl``, taps ``T``; pool kernel ``KP``, pool stride ``US == s``, pool padding ``UP`` (pool dilation 1).
Offset ``kp`` and tap ``t`` form a *live pair* iff ``(kp - UP + p - t*dl) % s == 0``; the pair reads
``i = u + j`` with ``j = (kp - UP + p - t*dl) // s``.  The distinct shifts along a dim are
``LO .. LO+NS-1``; a given (kp, j) has at most one tap, a given (kp, t) exactly one j.  The ConvT3d
pipeline: 2 shifts per dim, 8 in all, 27 live (offset, shift) pairs of 64 (one per tap).

The implicit gradient is ``PooledGrad(g_win, winner, ...)`` (``conv_fused_bwd``): ``Gexp[n, u, kp, co]
= g_win[n, co, u]`` if ``winner[n, co, u] == kp`` and ``o`` lies inside the conv output, else 0.
It is built in registers with ``tl.where`` from the implicit form, never materialised in memory.
Overlapping windows (``KP > s``) need nothing special: each (window, offset) is its own column.

Kernels (weights of a transposed conv are ``w[ci, co, t]`` per group):

* input grad ``dx[n, ci, i] = sum_{j, kp, co} Gexp[n, i - j, kp, co] * w[ci, co, t(kp, j)]``:
  M = input positions (n, i), N = ci, K = (kp, co).  Outer runtime loop over the shifts j (and
  output-channel blocks): the pooled-gradient tile at ``u = i - j`` is loaded, rounded and checked once;
  inner runtime loop over a host-built table of the shift's *live blocks* (``KPB`` consecutive
  window offsets holding at least one live pair): A = Gexp ``[BLOCK_M, BLOCK_CO * KPB]``, B = the
  weight rows of (kp, j), zero for dead pairs.  ``KPB`` = all offsets is the plain "one dot per
  shift" form; ``KPB = 1`` skips every dead pair (the ConvT3d pipeline: 27 of 64 blocks run).
  Every dx element is written once, no atomics.
* weight grad ``dw[ci, co, t] = sum_{n, u, kp live for t} x[n, ci, u + j(kp, t)] * Gexp[n, u, kp, co]``:
  the reduction runs over chunks of units (one chunk per program along grid axis 0).  Per block of
  ``BLOCK_M`` units, ``P^T += Gexp^T @ X`` with X the ``[BLOCK_M, KS shifts x BLOCK_CI]`` tile of
  the forward's ``_phase_aligned_x_tile`` (0 outside x) and Gexp^T ``[BLOCK_CO * KPB, BLOCK_M]`` (the
  expanded tile is the wgmma A operand in registers, X goes to shared memory as B).  Each program
  writes an fp32 partial for every (shift, offset) pair of its (group, channel, offset) tile; a
  finish kernel sums, per tap, its live pairs over all partials in a fixed order and writes ``dw``
  (bitwise reproducible run to run; dead pairs are computed but never read).
* bias grad: ``conv_fused_bwd.conv_bias_grad`` (sum of ``g_win``).

Numerics: ``tl.dot`` with fp32 accumulation; operands in x's dtype (``Gexp`` is rounded to it, as
``conv_fused_bwd`` does: aten's backward would see a gradient of the conv's dtype); fp32 uses TF32
iff the caller allows it per gradient (``allow_tf32``, as ``conv_fused_bwd``'s; never under the
interpreter), operands rounded to nearest first (``kernels.tf32``).

Non-finite values reach the outputs the float64 aten reference puts them in (tested): in the input
grad, dead (offset, shift) pairs are zero on BOTH sides, so an inf in ``g_win`` or ``w`` never
meets a structural zero.  In the weight grad, the X tile reads 0 where ``u + shift`` lies outside x
(a *border* unit), and 0 * inf would poison that shift's partial: the main loop leaves inf/NaN
gradients of border units out, and a fix-up pass (run only by programs that met one) adds their
masked outer products with the x values inside (selecting products, not operands).  Two
differences remain, both only when x itself holds inf/NaN: (1) at a border position whose
shifted unit lies outside the pooled grid, it spreads to fewer taps of ``dw[ci]`` than aten's CPU
im2col path, which multiplies it by the conv's zero padding; (2) x inf times an inf gradient of a
border unit gives NaN where aten gives +-inf.

Public API (mirrors ``conv_fused_bwd`` so that the two are interchangeable):
``unsupported_reason(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups)``
and ``convolution_backward(..., output_mask)``.  How it is wired: ``ops/conv_epilogue/backward.py``
tries ``conv_phase_aligned_bwd.unsupported_reason(...)`` first and falls back to ``conv_fused_bwd``.

Layout: ``device.py`` holds the Triton kernels and their device helpers, ``plan.py`` the host side
(cases served, tiles, geometry, tables, launch plans).
"""

from .device import MAX_WINDOW_VOLUME
from .plan import MAX_PHASE_ALIGNED_SLOTS, backward_plan, convolution_backward, unsupported_reason

__all__ = ["MAX_PHASE_ALIGNED_SLOTS", "MAX_WINDOW_VOLUME", "backward_plan", "convolution_backward", "unsupported_reason"]
