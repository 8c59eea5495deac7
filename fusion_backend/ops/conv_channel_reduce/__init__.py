"""Fused op ``conv_channel_reduce``: a convolution, a pointwise chain, ONE reduction over the
channels (dim 1), a pointwise chain after it.

``conv_channel_reduce(x, weight, bias, operands, config)`` has eager semantics::

    y = conv(x, weight, bias)                 # aten.convolution, 1-3d, transposed or not
    v = pre(y)                                # ChainSteps (ops/chain.py), DAG chains included
    r = reduce(v, dim=1[, keepdim])           # min / max (values), amin, amax, sum, mean, logsumexp,
                                              # softmax, log_softmax (full size)
    out = post(r).to(out_dtype)

Two custom ops carry the work (``torch.library.custom_op``, opaque to Inductor, with fakes):

* ``fusion::conv_channel_reduce_fwd(x, weight, bias, operands, config, save_for_backward)
  -> (out, saved_y, saved_index, saved_stats)``; the saved state (``common.allocate_forward_outputs``)
  is what the backward needs and nothing it can recompute: the conv output only where the reduction
  or the pre-chain's derivative reads it (never for min / max), the winning channel (int16) and
  the pre-chain's input there for min / max, and fp32 per-position statistics (the reduced value;
  the number of ties for amin / amax; the column max and exp-sum for softmax / log_softmax).
* ``fusion::conv_channel_reduce_bwd(grad_out, x, weight, bias, operands, saved_y, saved_index,
  saved_stats, config, output_mask) -> [grad_x, grad_weight, grad_bias, *grad_operands]``.

Implementations:

* Triton (CUDA fp32/fp16/bf16, at most 1024 channels; CPU under ``FUSION_CPU_KERNELS=triton`` with
  ``TRITON_INTERPRET=1``): forward = the library conv without bias, then one kernel
  (``kernels/channel_reduce.py``: bias, pre-chain, reduction, post-chain, saved state, with every
  channel of a position tile in registers); backward = one kernel for the conv output's gradient and
  the operands' partial sums, then ``aten.convolution_backward``.
* Reference (``reference.py``; CPU, float64, more channels): eager's ops; the backward applies
  torch's derivative formulas.  It is the tests' definition of the op.

Semantics reproduced on purpose: ``torch.min/max(dim)`` send the gradient to the one index torch
returns (the first; a NaN wins), ``amin/amax`` split it evenly among ties (NaN columns get NaN
gradients, as torch's formula), logsumexp of an all ``-inf`` column is ``-inf``, softmax of a column
with an infinite max or a NaN is NaN throughout.  Failure policy as ``conv_epilogue``'s: a Triton
failure raises ``KernelError`` under ``config.strict``, else warns once and runs the reference.

Modules: ``op`` (entry points, custom ops, autograd, autograd-free and direct implementations),
``forward`` / ``backward`` (the Triton paths), ``reference`` (plain torch), ``common`` (what they
share), ``config`` (the static config).
"""

from .common import kernel_path
from .config import FULL_SIZE, REDUCTIONS, ConvChannelReduceConfig
from .op import conv_channel_reduce, conv_channel_reduce_bwd, conv_channel_reduce_fwd

__all__ = [
    "FULL_SIZE",
    "REDUCTIONS",
    "ConvChannelReduceConfig",
    "conv_channel_reduce",
    "conv_channel_reduce_bwd",
    "conv_channel_reduce_fwd",
    "kernel_path",
]
