"""Fused op ``conv_batch_norm``: a convolution, a batch norm with batch statistics (training mode), a
pointwise chain after it, optionally a max or avg pool.

``conv_batch_norm(x, weight, bias, operands, config)`` has eager semantics::

    y = conv(x, weight, bias)                 # aten.convolution, 1-3d, transposed or not
    z = batch_norm(y, running_mean, running_var, gamma, beta, training=True, momentum, eps)
    out = pool(post(z)).to(out_dtype)         # pool: config.pool, if any (1-3d max / avg)

with the running statistics (when the norm tracks them: the last two operands) updated in place as
eager updates them.  Three custom ops carry the work (``torch.library.custom_op``, opaque to Inductor,
with fakes):

* ``fusion::conv_batch_norm_fwd(x, weight, bias, operands, config, save_for_backward) -> (out,
  saved_y, saved_winner, stats)``, functional: the saved state (``common.allocate_forward_outputs``)
  is the conv output without bias and, behind a max pool, each window's winner (int8), both only with
  ``save_for_backward``, and fp32 ``(3, C)`` statistics (each channel's mean, ``1 / sqrt(var + eps)``
  and unbiased variance), nothing else full-size.
* ``fusion::batch_norm_running_update(running_mean, running_var, stats, momentum)``, which mutates
  the running statistics and declares it (``mutates_args``; torch.library takes no autograd formula
  for a mutating op, hence an op of its own).
* ``fusion::conv_batch_norm_bwd(grad_out, x, weight, bias, operands, saved_y, saved_winner,
  saved_stats, config, output_mask) -> [grad_x, grad_weight, grad_bias, *grad_operands]``.

Implementations:

* Triton (CUDA fp32/fp16/bf16; CPU under ``FUSION_CPU_KERNELS=triton`` with ``TRITON_INTERPRET=1``):
  forward = the library conv without bias, then a statistics kernel over (channel block, chunk of
  the batch and positions), a fixed-order combine, and a kernel for the bias, normalisation, gamma /
  beta and post-chain (``kernels/batch_norm.py``; with a pool ``kernels/norm_pool.py``'s, which also
  pools and writes only the pooled result); backward = a kernel for the per-channel sums, a kernel
  for the conv output's gradient (behind a pool both gather each position's gradient from the pooled
  one), then ``aten.convolution_backward``.
* Reference (``reference.py``; CPU, float64): eager's ops (``aten.native_batch_norm`` and its
  backward).  It is the tests' definition of the op.

Failure policy as the other families' (``ops/failure.py``): a Triton failure raises ``KernelError``
under ``config.strict``, else warns once and runs the reference.
"""

from .common import kernel_path
from .config import ConvBatchNormConfig
from .op import (
    batch_norm_running_update,
    conv_batch_norm,
    conv_batch_norm_bwd,
    conv_batch_norm_fwd,
    split_operands,
)

__all__ = [
    "ConvBatchNormConfig",
    "batch_norm_running_update",
    "conv_batch_norm",
    "conv_batch_norm_bwd",
    "conv_batch_norm_fwd",
    "kernel_path",
    "split_operands",
]
