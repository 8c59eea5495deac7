"""The fused op ``conv -> pointwise chain -> optional pool``, forward and backward.

Public entry point (what the graph rewriter calls)::

    conv_epilogue(x, weight, bias, operands, config) -> Tensor

with eager semantics: ``y = aten.convolution(x, weight, bias, *conv params)``, then every
``ChainStep`` of the config in order (``chain.apply_step``; ``Const`` operands are numbers,
``TensorRef(i)`` is ``operands[i]``: 0-d, per-channel ``(C,1,..,1)`` / ``(1,C,1,..,1)``, any shape
with one element and at most ``y.ndim`` dims, or, for ``config.residual``, ``y``'s full shape: a
residual branch that one ``add`` reads, with no pool; for ``config.gate``, ``(N, C_in, 1, ..)``: it
multiplies x before the conv and no step reads it; for ``config.norm_in``'s affine, ``(C_in,)`` each:
the conv reads ``act_in(group_norm(x))`` instead of x, in fp32 then cast), then the optional max/avg
pool, and finally a
cast to ``config.out_dtype`` (None = the conv's dtype).  The conv runs in ``config.compute_dtype``
(None = x's dtype): ``x``, ``weight`` and ``bias`` stored in another dtype are cast to it first, as
autocast would (the Triton kernels cast as they load; gradients come back in each input's dtype);
operands may be fp32 under a bf16/fp16 conv.  1d/2d/3d, transposed or not, any conv
hyper-parameters, chains of 0..MAX_CHAIN_LENGTH steps.

Saved state ``(saved_y0, saved_winner)``, with ``C``/spatial of the conv output ``y0`` (the conv output
WITHOUT bias; every backward adds the bias back itself):

=================  ====================================  =====================================
case               saved_y0                              saved_winner
=================  ====================================  =====================================
max pool           y0 at each window's winner, pooled    winner index in its window, pooled
                   shape, conv dtype                     shape, row-major over (kd, kh, kw),
                                                         int8 (window <= 127 taps) else int32
avg pool / none    y0, full size, conv dtype             empty
no save            empty                                 empty
=================  ====================================  =====================================

"empty" is ``torch.empty(0, dtype=x.dtype)``.  The chain's full-size intermediates are never saved:
with a max pool the backward needs only 1/window of the elements.  ``out``, the pooled saved tensors
and a full-size ``saved_y0`` use the memory format that ``output_memory_format`` picks from ``y0``
(channels-last when ``y0`` is channels-last and not also contiguous).

The Triton path (CUDA fp32/fp16/bf16) has interchangeable implementations chosen by
``FUSION_CONV_IMPL`` (``conv_impl``; they write the same saved state and pass the same parity tests).
By default (``auto``) the first call of a shape times those that serve it (and the library path's
channels-last variant) on the GPU and keeps the fastest, per direction (``impl_choice``; cached on disk; the library
path when measuring is off or on CPU):

- library: the conv through aten/cuDNN WITHOUT bias, then one Triton kernel adds the bias, applies the
  chain and the pool and writes only ``out`` and the saved state (``kernels.epilogue``).  Backward:
  one Triton kernel writes the full-size conv-output gradient plus fixed-order per-channel partial
  sums of the operand and bias gradients (bitwise reproducible), then ``aten.convolution_backward``.
  Each direction has a channels-last variant among ``auto``'s measured candidates for 2-d/3-d convs
  of NCHW-style tensors: the conv (or conv backward) runs on channels-last copies, where cuDNN's fast
  Hopper kernels are, and the epilogue kernels transpose between the layouts in their tiles
  (``ChannelsLastLibraryForward``, ``LibraryBackward(channels_last=True)``).
- fused (``triton``, or ``auto`` where measured faster): one implicit-GEMM Triton kernel computes the
  conv and applies bias, chain and pool in registers (``kernels.conv_dense`` for the plain stride-1
  1d/2d convs it serves, e.g. Conv2d 64->64 k3; ``kernels.conv_fused`` otherwise); the backward
  differentiates the chain at the max-pool winners only and hands the implicit gradient to Triton
  conv-backward kernels that expand it on the fly (``kernels.conv_phase_aligned_bwd`` for a
  transposed conv whose pool stride is its stride, e.g. ConvTranspose3d k3 s2 + MaxPool3d(2);
  ``kernels.conv_fused_bwd`` otherwise), so no full-size gradient exists.
- family (``family``, or ``auto`` where measured faster): the conv kernel family's forward
  (``kernels.conv.conv_fprop``) with the bias and the chain in its epilogue (and the saved conv
  output written in the same pass), for a direct conv without a pool writing a channels-last output
  (``forward.family_forward_unsupported``); the backward under ``family`` is the library one.

A region with a residual takes the library path with the residual added in the epilogue kernel's
pass (``forward._residual_library_or_reference``) or, where measured faster for a call without a
backward, the family's forward (which adds it in its store); a gate or an input norm takes the
family's forward (which applies it as it loads x) or the input norm's library plan; elsewhere, and in
the backward, plain torch on the device (``ReferenceForward``, ``ReferenceBackward``).

The reference, the failure policy and ``kernel_path`` are every family's (``ops/declare.py``); a call
whose signature has a settled plan (``forward.settled`` / ``backward.settled``) runs it straight.

Modules: this one (the declaration and the entry point), ``forward`` and ``backward`` (the Triton
paths, their measured choices and call plans), ``reference`` (plain torch and the op's semantics).
"""

from collections.abc import Sequence

from torch import Tensor

from ..chain import MAX_CHAIN_LENGTH
from ..chain_lowering import pool_unroll_problem
from ..chain_reference import apply_chain
from ..config import ConvEpilogueConfig
from ..conv_io import output_memory_format
from ..declare import FusedOpDeclaration, declare, family_names
from . import backward, forward, reference
from .forward import CONV_IMPL_ENV, CPU_KERNELS_ENV, DEFAULT_CONV_IMPL, conv_impl
from .reference import OP, conv_epilogue_eager


def _kernel_problem(cfg: ConvEpilogueConfig) -> str | None:
    """Why no call of ``cfg`` can take the Triton path (None: it may).  Operand shapes are not known
    here: a non-per-channel operand tensor still falls back at run time."""
    if len(cfg.chain) > MAX_CHAIN_LENGTH:
        return f"chain of {len(cfg.chain)} steps exceeds the kernel's {MAX_CHAIN_LENGTH} slots"
    return pool_unroll_problem(cfg.pool)


CONV_EPILOGUE = declare(FusedOpDeclaration(  # the Triton path is two modules: its own declaration
    name=OP, config=ConvEpilogueConfig, state=("saved_y0", "saved_winner"), outputs=reference.outputs,
    reference_forward=reference.forward, triton_forward=forward.forward, reference_backward=reference.backward,
    triton_backward=backward.backward, check_inputs=reference.check_inputs, describe=reference.describe,
    kernel_problem=_kernel_problem, compute_dtype=reference.conv_compute_dtype, casts_weight=True,
    settled_forward=forward.settled, settled_backward=backward.settled))
conv_epilogue_fwd, conv_epilogue_bwd, kernel_path = CONV_EPILOGUE.fwd, CONV_EPILOGUE.bwd, CONV_EPILOGUE.kernel_path


@CONV_EPILOGUE.entry
def conv_epilogue(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                  config: str) -> Tensor:  # fmt: skip
    """``pool(chain(conv(x, weight, bias))).to(out_dtype)`` as one fused op (see the module docstring)."""
    return CONV_EPILOGUE(x, weight, bias, operands, config)


__all__ = ["CONV_EPILOGUE", "CONV_IMPL_ENV", "CPU_KERNELS_ENV", "DEFAULT_CONV_IMPL", "apply_chain", "conv_epilogue_eager",
           "conv_impl", "output_memory_format", *family_names(OP)]
