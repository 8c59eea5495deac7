"""Output sizes of convolutions and pools along one spatial dim: the one place these formulas live.

Both are PyTorch's own (``aten.convolution``'s ``conv_output_size`` / ``conv_input_size`` for the
transposed case, and ``pooling_output_shape``), for concrete ints.
"""

from __future__ import annotations


def conv_output_length(size: int, kernel: int, stride: int, padding: int, dilation: int,
                       transposed: bool = False, output_padding: int = 0) -> int:
    """Output length of a conv (or, with ``transposed``, a transposed conv) along one dim.

    >>> conv_output_length(32, 3, 1, 1, 1)                       # same padding
    32
    >>> conv_output_length(16, 3, 2, 1, 1, transposed=True, output_padding=1)
    32
    """
    if transposed:
        return (size - 1) * stride - 2 * padding + dilation * (kernel - 1) + output_padding + 1
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def pool_output_length(size: int, kernel: int, stride: int, padding: int, dilation: int = 1,
                       ceil_mode: bool = False) -> int:
    """Output length of a max or avg pool along one dim, including ``ceil_mode``'s rule that the
    last window must start inside the input or its left padding.

    >>> pool_output_length(7, 2, 2, 0), pool_output_length(7, 2, 2, 0, ceil_mode=True)
    (3, 4)
    >>> pool_output_length(5, 2, 2, 1, ceil_mode=True)           # a window starting in the right padding is dropped
    3
    """
    out = (size + 2 * padding - dilation * (kernel - 1) - 1 + (stride - 1 if ceil_mode else 0)) // stride + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1
    return out
