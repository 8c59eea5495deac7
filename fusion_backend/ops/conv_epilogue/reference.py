"""The plain-torch reference of ``fusion::conv_epilogue`` (CPU, float64, anything the kernels do not
cover): ``forward`` writes the same outputs and saved state as the kernels; ``backward`` applies
torch's own derivative formulas (``ops/chain_reference.py``) to the chain recomputed from the saved
state.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from ..chain_reference import (
    apply_chain,
    avg_pool_backward,
    chain_backward,
    chain_with_tape,
    scatter_to_windows,
    window_winners,
)
from ..config import ConvEpilogueConfig
from ..conv_io import (
    channel_view,
    conv_output_shape,
    empty_placeholder,
    in_format,
    output_memory_format,
    run_conv,
    run_conv_backward,
    run_pool,
)
from .common import cast_inputs, conv_compute_dtype, output_dtype


def forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager ops (the bias added after a bias-free conv, as the kernels do); max-pool winners from
    ``return_indices``, converted to row-major indices within each window."""
    dtype = conv_compute_dtype(cfg, x)
    xc, weight, bias = cast_inputs(x, weight, bias, dtype)
    y0 = run_conv(xc, weight, None, cfg.conv)
    fmt = output_memory_format(y0)
    y = y0 if bias is None else y0 + channel_view(bias, y0.dim())
    v = apply_chain(y, cfg.chain, operands)
    saved_y0, saved_winner = empty_placeholder(x), empty_placeholder(x)
    pool = cfg.pool
    if pool is not None and pool.kind == "max" and save:
        v, flat = run_pool(v, pool, return_indices=True)
        saved_winner = in_format(window_winners(flat, y0.shape[2:], pool), fmt)
        gathered = y0.reshape(y0.shape[0], y0.shape[1], -1).gather(
            2, flat.reshape(flat.shape[0], flat.shape[1], -1)
        )
        saved_y0 = in_format(gathered.reshape(flat.shape), fmt)
    else:
        if pool is not None:
            v = run_pool(v, pool)
        if save:
            saved_y0 = in_format(y0, fmt)
    out = in_format(v.to(output_dtype(cfg, dtype)), fmt)
    if out.data_ptr() == y0.data_ptr():  # empty chain, no bias, no pool: outputs must not alias
        out = torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=fmt).copy_(out)
    return out, saved_y0, saved_winner


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """The chain recomputed on the saved state and differentiated step by step, then
    ``convolution_backward``.

    With a max pool the chain is recomputed on the winners only (pooled shape) and the resulting
    gradient is scattered (accumulating: windows may overlap) to the full-size conv output.
    """
    pool = cfg.pool
    is_max = pool is not None and pool.kind == "max"
    x, weight, bias_c = cast_inputs(x, weight, bias, conv_compute_dtype(cfg, x))  # grads: ``strided_like`` casts back
    y = saved_y0 if bias_c is None else saved_y0 + channel_view(bias_c, saved_y0.dim())
    v, tape = chain_with_tape(y, cfg.chain, operands)
    grad_v = grad_out.to(v.dtype)
    if pool is not None and not is_max:
        grad_v = avg_pool_backward(grad_v, v, pool)
    grad_y, grad_operands = chain_backward(tape, grad_v, operands, mask[3:])
    if is_max:
        grad_y = scatter_to_windows(grad_y, saved_winner, conv_output_shape(x, weight, cfg.conv), pool)
    # The bias gradient comes from the same aten call as eager's: on these heavily cancelling sums
    # any other summation order differs from eager by ~1e-4 (from float64 by as much), this one by 0.
    grad_x, grad_w, grad_bias = run_conv_backward(
        grad_y.to(x.dtype), x, weight, cfg.conv, mask[0], mask[1], bool(mask[2])
    )
    return [grad_x, grad_w, None if grad_bias is None else grad_bias.to(bias.dtype), *grad_operands]
