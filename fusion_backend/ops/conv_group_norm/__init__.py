"""Fused op ``conv_group_norm``: a convolution, a pointwise chain, a group norm (an instance norm is
one channel per group), a pointwise chain after it, optionally a max or avg pool.

``conv_group_norm(x, weight, bias, operands, config)`` has eager semantics::

    y = conv(x, weight, bias)                 # aten.convolution, 1-3d, transposed or not
    v = pre(y)                                # ChainSteps (ops/chain.py), DAG chains included
    z = group_norm(v, groups, gamma, beta, eps)   # batch statistics per (sample, group)
    out = pool(post(z)).to(out_dtype)         # pool: config.pool, if any (1-3d max / avg)

Two custom ops carry the work (``torch.library.custom_op``, opaque to Inductor, with fakes):

* ``fusion::conv_group_norm_fwd(x, weight, bias, operands, config, save_for_backward)
  -> (out, saved_y, saved_winner, saved_stats)``: the saved state (``common.allocate_forward_outputs``)
  is the conv output without bias, behind a max pool each window's winner (int8), and each (sample,
  group)'s mean and ``1 / sqrt(var + eps)`` (fp32 ``(2, N, G)``), nothing else full-size.
* ``fusion::conv_group_norm_bwd(grad_out, x, weight, bias, operands, saved_y, saved_winner, saved_stats,
  config, output_mask) -> [grad_x, grad_weight, grad_bias, *grad_operands]``.

Implementations:

* Triton (CUDA fp32/fp16/bf16; CPU under ``FUSION_CPU_KERNELS=triton`` with ``TRITON_INTERPRET=1``):
  forward = the library conv without bias, then ``kernels/group_norm.py``'s kernels (bias,
  pre-chain, group statistics, normalisation, gamma / beta, post-chain; a large group is cut into
  chunks of positions, one program each, whose partial statistics a second kernel combines; with a
  pool the statistics alone, then ``kernels/norm_pool.py`` normalises, pools and writes only the
  pooled result); backward = the same split for the conv output's gradient and the per-channel
  partial sums of gamma's, beta's and the operands' gradients (behind a pool each position's gradient
  gathered from the pooled one), then ``aten.convolution_backward``.
* Reference (``reference.py``; CPU, float64): eager's ops (``aten.native_group_norm`` and its
  backward).  It is the tests' definition of the op.

Failure policy as the other families' (``ops/failure.py``): a Triton failure raises ``KernelError``
under ``config.strict``, else warns once and runs the reference.
"""

from .common import kernel_path
from .config import ConvGroupNormConfig
from .op import conv_group_norm, conv_group_norm_bwd, conv_group_norm_fwd

__all__ = [
    "ConvGroupNormConfig",
    "conv_group_norm",
    "conv_group_norm_bwd",
    "conv_group_norm_fwd",
    "kernel_path",
]
