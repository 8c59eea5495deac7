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

Saved state ``(saved_y, saved_stats)`` (``config.conv_outputs``): the conv output without bias in its
own layout and each row's mean and ``1 / sqrt(var + eps)`` (fp32 ``(2, rows)``), nothing else
full-size.  Everything else as every family's (``ops/declare.py``); the reference runs
``aten.native_layer_norm`` and its backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..declare import declare, family_declaration, family_names
from . import config, reference, triton_path
from .config import OP, ConvLayerNormConfig

CONV_LAYER_NORM = declare(family_declaration(
    OP, ConvLayerNormConfig, ("saved_y", "saved_stats"), config, reference, triton_path))
conv_layer_norm_fwd, conv_layer_norm_bwd, kernel_path = CONV_LAYER_NORM.fwd, CONV_LAYER_NORM.bwd, CONV_LAYER_NORM.kernel_path


@CONV_LAYER_NORM.entry
def conv_layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    config: str) -> Tensor:  # fmt: skip
    """``post(layer_norm(pre(conv(x, weight, bias))) * gamma + beta).to(out_dtype)`` as one fused op.

    Arguments and result as every entry point's (``ops/declare.py``), and:

    * ``operands``: the norm's weight (gamma) and bias (beta) at ``config.weight`` / ``config.bias``
      (``prod(normalized_shape)`` values each), and the chains' tensors.
    * ``config``: the conv output's trailing sizes must be its ``normalized_shape``.
    * result: the conv output's shape, contiguous (eager's layer norm returns a contiguous tensor
      whatever its input's layout).
    """
    return CONV_LAYER_NORM(x, weight, bias, operands, config)


__all__ = ["CONV_LAYER_NORM", "ConvLayerNormConfig", *family_names(OP)]
