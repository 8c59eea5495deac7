"""Fused op ``conv_global_mean``: the mean over all spatial positions of a convolution, done algebraically.

``conv_global_mean(x, weight, bias, operands, config)`` returns, per batch element and output channel,

    mean over all output positions o of affine(conv(x, weight, bias))[n, co, o]

for a regular or transposed convolution (1-d/2-d/3-d, any stride, padding, dilation, output_padding,
groups) followed by per-channel affine steps (mul/add/sub/rsub/div by a constant, a 0-d or a
per-channel tensor), without ever producing the convolution output.  Shape ``(N, C_out)``, or
``(N, C_out, 1, ..., 1)`` with ``keepdim``.

Derivation (exact for every configuration)
------------------------------------------
*Affine fold.*  Every step maps ``v -> a*v + b`` with per-channel ``a``, ``b`` constant over space, so
the composition is ``v -> A[co]*v + B[co]`` and the mean commutes with it:
``out = A * M + B`` with ``M[n, co] = mean_o conv(x)[n, co, o]``.

*Mean of a convolution.*  Write the conv as a sum over taps ``t`` (a multi-index into the kernel) of
``W[co, ci, t] * x[n, ci, i(o, t)]`` over the pairs (output o, input i) that the tap connects.  Summing
over all in-bounds outputs and swapping the sums,

    sum_o conv(x)[n, co, o] = sum_ci sum_t W[co, ci, t] * S[n, ci, t] + bias[co] * P,
    S[n, ci, t] = sum of x[n, ci, i] over V_t,   P = number of output positions,

where ``V_t`` is the set of input positions that tap ``t`` connects to an in-bounds output.  ``V_t`` is
a product over spatial dims of 1-d sets ``V_t = V^1_{t1} x ... x V^D_{tD}`` because the index maps
act per dim.  Per dim (input length L, kernel k, stride s, padding p, dilation d, output length O):

* regular conv, ``O = (L + 2p - d(k-1) - 1) // s + 1``: tap ``t`` reads ``i = o*s - p + t*d`` for
  ``0 <= o < O``; it is valid when ``0 <= i < L``, so ``o`` runs over
  ``[max(0, ceil((p - t*d)/s)), min(O - 1, floor((L - 1 + p - t*d)/s))]`` and ``V_t`` is the arithmetic
  progression ``{o*s - p + t*d}`` over that range: step ``s``, *not* a contiguous range when ``s > 1``
  (padding reads zeros and contributes nothing, which is why padding only clips the range).
* transposed conv, ``O = (L - 1)*s - 2p + d(k-1) + output_padding + 1``: input ``i`` and tap ``t``
  write ``o = i*s - p + t*d``, kept when ``0 <= o < O``.  Distinct ``i`` give distinct ``o``, so ``V_t``
  is the contiguous range ``[max(0, ceil((p - t*d)/s)), min(L - 1, floor((O - 1 + p - t*d)/s))]``
  (output_padding only lengthens O).

Many taps share a set (with zero padding and stride 1 every tap of a transposed conv sees the whole
input), so the host dedups the 1-d sets per dim; the Triton pass (``kernels/global_mean/``) reads
x once and produces the sum of every plane over every product of distinct sets, and a one-hot matrix
maps sets back to taps.  Groups: ``ci`` runs over the group of ``co``.  Weight layouts:
``(C_out, C_in/g, *k)`` regular, ``(C_in, C_out/g, *k)`` transposed.

Saved state ``(tap_sums, conv_mean)`` (``config.outputs``): the sums below, a few numbers per sample
and channel; the backward reads only them, so it takes x's size, strides and dtype instead of x
(``keeps_x=False``, ``ops/declare.py``).

Backward.  With ``G[n, co] = g[n, co] * A[co] / P``:
``dx[n, ci, i] = sum_t [i in V_t] sum_co G[n, co] W[co, ci, t]`` (piecewise constant: one Triton pass
writes it from per-set coefficients), ``dW[co, ci, t] = sum_n G[n, co] S[n, ci, t]`` (needs only the
saved ``S``, ``N*C_in*taps`` numbers), ``dbias = sum_n g*A``; the affine operands get theirs by the
chain rule through the fold.  Nothing full-size is saved.

Kernel pipeline (CUDA, and CPU under ``FUSION_CPU_KERNELS=triton``): exactly two Triton launches each way.

* forward: ``set_sums_partial`` (the one pass over x; a channels-innermost variant reads channels_last
  x at full bandwidth) then ``contract_forward`` (sums the per-split partials in a fixed order, writes
  the tap sums ``S``, contracts with W, adds the bias, scales by ``1/P`` and applies the affine steps
  in order, writing ``out`` in its dtype plus ``S`` and ``M`` for the backward).
* backward: ``params_backward`` (grad_weight, grad_bias, every per-channel operand gradient and
  ``G``) then ``grad_broadcast`` (grad_x, in x's memory format; each program first forms its planes'
  per-set coefficients from ``G`` and W, then writes every element once).  One-element or shared
  tensor operands add a few tiny host-combined ops (not the case of the ``seeds`` suite's pipelines).
Shape-only data (bit tables, the tap-to-set table) is built once per shape and cached on the device.

Precision: x is summed in fp32 with per-tile tree reductions (fp64 for fp64 inputs, on the reference
path); the contraction with W, the chain and the parameter gradients run in fp64 in the small
kernels (they cancel; they are tiny), which also keeps them off TF32.  grad_x coefficients are fp32.
Results are cast to ``out_dtype``.  No float atomics anywhere: every reduction has a fixed order.

``tools/bench_conv_global_mean.py`` times the pipeline.

A call whose shapes the kernels cannot serve (a spatial dim with more than 31 distinct tap index sets:
``config.call_problem``) takes the reference as ``ops/declare.py`` says.  ``config`` also holds the
per-dim index sets, ``reference`` the affine fold.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ... import environment
from ..declare import declare, family_declaration, family_names
from . import config, reference, triton_path
from .config import AFFINE_KINDS, OP, ConvGlobalMeanConfig, dim_sets

#: The environment switch that makes CPU tensors run the Triton launchers (``fusion_backend.environment``).
CPU_KERNELS_ENV = environment.CPU_KERNELS

CONV_GLOBAL_MEAN = declare(family_declaration(
    OP, ConvGlobalMeanConfig, ("tap_sums", "conv_mean"), config, reference, triton_path, outputs=config.outputs,
    call_problem=config.call_problem, keeps_x=False, grad_input_strides=config.grad_input_strides))
conv_global_mean_fwd, conv_global_mean_bwd = CONV_GLOBAL_MEAN.fwd, CONV_GLOBAL_MEAN.bwd
kernel_path = CONV_GLOBAL_MEAN.kernel_path


@CONV_GLOBAL_MEAN.entry
def conv_global_mean(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                     config: str) -> Tensor:  # fmt: skip
    """``mean over all spatial dims of affine(conv(x, weight, bias))`` without producing the conv output.

    Arguments and result as every entry point's (``ops/declare.py``), and:

    * result: ``(N, C_out)`` or, with ``keepdim``, ``(N, C_out, 1, ..., 1)``.
    """
    return CONV_GLOBAL_MEAN(x, weight, bias, operands, config)


__all__ = ["AFFINE_KINDS", "CONV_GLOBAL_MEAN", "CPU_KERNELS_ENV", "ConvGlobalMeanConfig", "dim_sets", *family_names(OP)]
