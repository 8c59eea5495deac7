"""The plain-torch reference of ``fusion::conv_epilogue`` (what every reference is: ``ops/declare.py``)
and the op's semantics every path shares: the dtypes, casts, outputs, input checks, description and
the eager composite."""

from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ..chain import Const, Operand, TensorRef
from ..chain_lowering import check_operand_refs
from ..chain_reference import (
    apply_chain,
    avg_pool_backward,
    chain_backward,
    chain_with_tape,
    scatter_to_windows,
    window_winners,
    with_bias,
)
from ..config import ConvEpilogueConfig, describe_pool
from ..conv_io import (
    allocate_result,
    check_conv_inputs,
    conv_output_shape,
    dtype_named,
    empty_placeholder,
    in_format,
    output_memory_format,
    run_conv,
    run_conv_backward,
    run_pool,
)

OP = "conv_epilogue"


def conv_compute_dtype(cfg: ConvEpilogueConfig, x: Tensor) -> torch.dtype:
    """The dtype the conv runs in: ``config.compute_dtype``, else x's."""
    return dtype_named(OP, cfg.compute_dtype, x.dtype, "compute_dtype")


def cast_inputs(x: Tensor, weight: Tensor, bias: Tensor | None,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor | None]:  # fmt: skip
    """``x``, ``weight`` and ``bias`` in the compute dtype (the same tensors where they already are):
    what the library and reference paths run on; the Triton conv kernels cast as they load instead."""
    return (x if x.dtype == dtype else x.to(dtype), weight if weight.dtype == dtype else weight.to(dtype),
            bias if bias is None or bias.dtype == dtype else bias.to(dtype))


def gated(x: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig) -> Tensor:
    """The conv's input: ``x``, times the gate where the config has one (in x's dtype, as eager's
    product of two tensors of that dtype)."""
    return x if cfg.gate is None else x * operands[cfg.gate].to(x.dtype)


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig) -> None:
    dtype_named(OP, cfg.out_dtype, conv_compute_dtype(cfg, x))  # both dtype names are valid
    check_conv_inputs(OP, x, weight, cfg.conv)
    if cfg.pool is not None and len(cfg.pool.kernel_size) != cfg.conv.spatial_dims:
        raise UnsupportedInputError(f"fusion::{OP}: pool {cfg.pool} does not have {cfg.conv.spatial_dims} "
                                    "spatial dims")  # fmt: skip
    check_operand_refs(OP, {"chain": cfg.chain}, operands)
    if cfg.gate is not None:
        gate = operands[cfg.gate] if cfg.gate < len(operands) else None
        want = (*x.shape[:2], *(1,) * (x.dim() - 2))
        if gate is None or tuple(gate.shape) != want:
            got = "missing" if gate is None else f"of shape {tuple(gate.shape)}"
            raise UnsupportedInputError(f"fusion::{OP}: the gate operands[{cfg.gate}] must be {want} (one value per "
                                        f"sample and input channel), got {got}")  # fmt: skip


def describe(cfg: ConvEpilogueConfig) -> str:
    """``chain [leaky_relu(0.2), mul(operands[0])] -> max_pool(k=...)`` for messages."""
    steps = ", ".join(f"{step.kind.name.lower()}({', '.join(map(_describe_operand, step.operands))})" for step in cfg.chain)
    return f"chain [{steps}]{describe_pool(cfg.pool)}"


def _describe_operand(o: Operand) -> str:
    if isinstance(o, Const):
        return f"{o.value:g}"
    return f"operands[{o.index}]" if isinstance(o, TensorRef) else f"value before step {o.position}"


def allocate_forward_outputs(x: Tensor, y0: Tensor, cfg: ConvEpilogueConfig,
                             save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, saved_y0, saved_winner)`` as the package docstring lays them out (``x``: the op's
    input as given; ``y0``: the conv output in the compute dtype): ``out`` and the winners as
    ``conv_io.allocate_result`` gives them, y0 saved at the winners or full-size."""
    out, winner = allocate_result(x, y0, cfg.pool, dtype_named(OP, cfg.out_dtype, y0.dtype), save)
    if not save:
        return out, empty_placeholder(x), winner
    at_winners = cfg.pool is not None and cfg.pool.kind == "max"
    saved_y0 = torch.empty(out.shape if at_winners else y0.shape, dtype=y0.dtype, device=x.device,
                           memory_format=output_memory_format(y0))  # fmt: skip
    return out, saved_y0, winner


def outputs(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The shape function: ``allocate_forward_outputs`` for the conv's output as aten lays it out."""
    dtype = conv_compute_dtype(cfg, x)
    return allocate_forward_outputs(x, run_conv(x.to(dtype), weight.to(dtype), None, cfg.conv), cfg, save)


def conv_epilogue_eager(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], config: str
) -> Tensor:
    """The eager composite the fused op stands for (differentiable by autograd; tests' oracle);
    operands in non-differentiable positions (leaky_relu slope, clamp bounds) detached, as in the op."""
    cfg = ConvEpilogueConfig.from_json(config)
    dtype = conv_compute_dtype(cfg, x)
    x, weight, bias = cast_inputs(x, weight, bias, dtype)
    v = apply_chain(run_conv(gated(x, operands, cfg), weight, bias, cfg.conv), cfg.chain, operands)
    if cfg.pool is not None:
        v = run_pool(v, cfg.pool)
    return v.to(dtype_named(OP, cfg.out_dtype, dtype))


def forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
    save: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Eager ops (the bias added after a bias-free conv, as the kernels do); max-pool winners from
    ``return_indices``, converted to row-major indices within each window."""
    dtype = conv_compute_dtype(cfg, x)
    xc, weight, bias = cast_inputs(x, weight, bias, dtype)
    y0 = run_conv(gated(xc, operands, cfg), weight, None, cfg.conv)
    fmt = output_memory_format(y0)
    v = apply_chain(with_bias(y0, bias), cfg.chain, operands)
    saved_y0, saved_winner = empty_placeholder(x), empty_placeholder(x)
    pool = cfg.pool
    if pool is not None and pool.kind == "max" and save:
        v, flat = run_pool(v, pool, return_indices=True)
        saved_winner = in_format(window_winners(flat, y0.shape[2:], pool), fmt)
        gathered = y0.flatten(2).gather(2, flat.flatten(2))  # (flatten: a batch of 0 has no -1 to infer)
        saved_y0 = in_format(gathered.reshape(flat.shape), fmt)
    else:
        if pool is not None:
            v = run_pool(v, pool)
        if save:
            saved_y0 = in_format(y0, fmt)
    out = in_format(v.to(dtype_named(OP, cfg.out_dtype, dtype)), fmt)
    if out.data_ptr() == y0.data_ptr():  # empty chain, no bias, no pool: outputs must not alias
        out = torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=fmt).copy_(out)
    return out, saved_y0, saved_winner


def backward(
    grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_y0: Tensor, saved_winner: Tensor, cfg: ConvEpilogueConfig, mask: Sequence[bool],
) -> list[Tensor | None]:  # fmt: skip
    """The chain recomputed on the saved state and differentiated step by step, then
    ``convolution_backward``; with a max pool the chain is recomputed on the winners only and its
    gradient scattered (accumulating: windows may overlap) to the full-size conv output."""
    pool = cfg.pool
    is_max = pool is not None and pool.kind == "max"
    x, weight, bias_c = cast_inputs(x, weight, bias, conv_compute_dtype(cfg, x))  # grads: ``strided_like`` casts back
    y = with_bias(saved_y0, bias_c)
    v, tape = chain_with_tape(y, cfg.chain, operands)
    grad_v = grad_out.to(v.dtype)
    if pool is not None and not is_max:
        grad_v = avg_pool_backward(grad_v, v, pool)
    grad_y, grad_operands = chain_backward(tape, grad_v, operands, mask[3:])
    if is_max:
        grad_y = scatter_to_windows(grad_y, saved_winner, conv_output_shape(x, weight, cfg.conv), pool)
    # The bias gradient comes from the same aten call as eager's: on these heavily cancelling sums
    # any other summation order differs from eager by ~1e-4 (from float64 by as much), this one by 0.
    gate = None if cfg.gate is None else operands[cfg.gate]
    gate_grad = gate is not None and bool(mask[3 + cfg.gate])
    grad_x, grad_w, grad_bias = run_conv_backward(
        grad_y.to(x.dtype), gated(x, operands, cfg), weight, cfg.conv, mask[0] or gate_grad, mask[1], bool(mask[2])
    )
    if gate is not None:  # x * gate: the conv input's gradient times the gate, and summed with x for the gate
        if gate_grad:
            spatial = tuple(range(2, x.dim()))
            acc = torch.promote_types(grad_x.dtype, torch.float32)  # fp32 sums for half types
            grad_operands[cfg.gate] = (grad_x.to(acc) * x.to(acc)).sum(spatial, keepdim=True).to(gate.dtype)
        grad_x = grad_x * gate.to(grad_x.dtype) if mask[0] else None
    return [grad_x, grad_w, None if grad_bias is None else grad_bias.to(bias.dtype), *grad_operands]
