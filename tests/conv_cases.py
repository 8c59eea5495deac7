"""Vocabulary shared by the channels-last tests: conv specs with one value per spatial dim, and the
chain steps their cases use."""

from fusion_backend.ir.specs import ConvSpec
from fusion_backend.ops.chain import ChainStep, Const, PointwiseKind, TensorRef

LEAKY = ChainStep(PointwiseKind.LEAKY_RELU, (Const(0.01),))
MUL0 = ChainStep(PointwiseKind.MUL, (TensorRef(0),))
GELU = ChainStep(PointwiseKind.GELU, ())


def conv_spec(d: int, stride: int = 1, padding: int = 1, dilation: int = 1, groups: int = 1,
              transposed: bool = False, output_padding: int = 0) -> ConvSpec:  # fmt: skip
    """A ``d``-dimensional ``ConvSpec`` with the same stride, padding, dilation and output padding per dim."""
    return ConvSpec(transposed, (stride,) * d, (padding,) * d, (dilation,) * d, (output_padding,) * d, groups)
