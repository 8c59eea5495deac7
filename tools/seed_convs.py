"""The ``seeds`` suite's two conv-epilogue pipelines as ``fusion::conv_epilogue`` configs, for the
kernel tools (``bench_conv_fused.py``, ``compile_check.py``): one place for their conv parameters,
chains and pools.

- ``convt3d``: ConvTranspose3d k3 s2 p1 op1 -> leaky_relu(0.2) -> x m -> leaky_relu(0.2) ->
  MaxPool3d(2) (``demos/seeds/convt3d_leaky_mul_leaky_maxpool.py``);
- ``conv2d``: Conv2d k3 -> x m -> leaky_relu(0.01) -> gelu, no pool
  (``demos/seeds/conv2d_mul_leaky_gelu.py``).

The multiplier ``m`` is ``operands[0]``.
"""

from __future__ import annotations

from fusion_backend.ir.specs import ConvSpec, PoolSpec
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef


def seed_conv(name: str) -> tuple[ConvSpec, tuple[ChainStep, ...], PoolSpec | None]:
    """``(conv spec, chain, pool)`` of the ``convt3d`` or ``conv2d`` pipeline."""
    if name == "convt3d":
        leaky = ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.2),))
        chain = (leaky, ChainStep(PointwiseKind.MUL, (TensorRef(0),)), leaky)
        return (ConvSpec(True, (2, 2, 2), (1, 1, 1), (1, 1, 1), (1, 1, 1), 1), chain,
                PoolSpec("max", (2, 2, 2), (2, 2, 2), (0, 0, 0)))  # fmt: skip
    if name == "conv2d":
        chain = (
            ChainStep(PointwiseKind.MUL, (TensorRef(0),)),
            ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.01),)),
            ChainStep(PointwiseKind.GELU),
        )
        return ConvSpec(False, (1, 1), (0, 0), (1, 1), (0, 0), 1), chain, None
    raise ValueError(f"no seed conv pipeline named {name!r} (convt3d, conv2d)")
