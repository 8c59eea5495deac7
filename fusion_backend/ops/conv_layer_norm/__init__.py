"""Fused op ``conv_layer_norm``: a convolution, a pointwise chain, a layer norm over trailing dims of
the conv output, a pointwise chain after it.

``conv_layer_norm(x, weight, bias, operands, config)`` has eager semantics::

    y = conv(x, weight, bias)                 # aten.convolution, 1-3d, transposed or not
    v = pre(y)                                # ChainSteps (ops/chain.py), DAG chains included
    z = layer_norm(v, normalized_shape, gamma, beta, eps)   # statistics per row (trailing dims)
    out = post(z).to(out_dtype)

``normalized_shape`` is 1 to ``spatial_dims + 1`` trailing dims of the conv output: only W (e.g.
``nn.LayerNorm(C)`` applied to an (N, C, D, H, W) output whose W is C), (H, W), ..., or (C, *spatial)
(a row per sample).  gamma and beta are elementwise over it.

Two custom ops carry the work (``torch.library.custom_op``, opaque to Inductor, with fakes):

* ``fusion::conv_layer_norm_fwd(x, weight, bias, operands, config, save_for_backward)
  -> (out, saved_y, saved_stats)``: ``out`` contiguous (eager's layer norm returns a contiguous
  tensor whatever its input's layout); the saved state (``common.allocate_forward_outputs``) is the
  conv output without bias in its own layout and each row's mean and ``1 / sqrt(var + eps)`` (fp32
  ``(2, rows)``), nothing else full-size.
* ``fusion::conv_layer_norm_bwd(grad_out, x, weight, bias, operands, saved_y, saved_stats, config,
  output_mask) -> [grad_x, grad_weight, grad_bias, *grad_operands]``.

Implementations:

* Triton (CUDA fp32/fp16/bf16; CPU under ``FUSION_CPU_KERNELS=triton`` with ``TRITON_INTERPRET=1``):
  forward = the library conv without bias, then ``kernels/layer_norm.py``'s kernels (bias,
  pre-chain, row statistics, normalisation, gamma / beta, post-chain; short rows packed many to a
  tile, long rows split into chunks whose partial statistics a second kernel combines); backward =
  the conv output's gradient and fixed-order partial sums of gamma's, beta's and the operands'
  gradients from the saved state, then ``aten.convolution_backward``.
* Reference (``reference.py``; CPU, float64): eager's ops (``aten.native_layer_norm`` and its
  backward).  It is the tests' definition of the op.

Failure policy as the other families' (``ops/failure.py``): a Triton failure raises ``KernelError``
under ``config.strict``, else warns once and runs the reference.
"""

from .common import kernel_path
from .config import ConvLayerNormConfig
from .op import conv_layer_norm, conv_layer_norm_bwd, conv_layer_norm_fwd

__all__ = [
    "ConvLayerNormConfig",
    "conv_layer_norm",
    "conv_layer_norm_bwd",
    "conv_layer_norm_fwd",
    "kernel_path",
]
