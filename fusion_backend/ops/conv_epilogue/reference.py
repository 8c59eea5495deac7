"""The plain-torch reference of ``fusion::conv_epilogue`` (what every reference is: ``ops/declare.py``)
and the op's semantics every path shares: the dtypes, casts, outputs, input checks, description and
the eager composite."""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
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


def conv_input(x: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig, dtype: torch.dtype) -> Tensor:
    """What the conv reads, in ``dtype`` (the conv's): ``x`` (as given), times the gate where the config
    has one (in x's dtype, as eager's product of two tensors of that dtype), or through the input
    group norm and its activation (in fp32, then cast: autocast's fp32 group norm before its conv)."""
    if cfg.gate is not None:
        x = x * operands[cfg.gate].to(x.dtype)
    elif cfg.norm_in is not None:
        weight, bias = input_norm_affine(operands, cfg)
        x = F.group_norm(x.float(), cfg.norm_in, weight, bias, cfg.norm_in_eps)
        x = apply_chain(x, cfg.act_in, operands)
    return x if x.dtype == dtype else x.to(dtype)


def input_norm_affine(operands: Sequence[Tensor], cfg: ConvEpilogueConfig) -> tuple[Tensor | None, Tensor | None]:
    """The input group norm's per-channel weight and bias in fp32 (None, None without affine)."""
    if cfg.norm_in_affine is None:
        return None, None
    return operands[cfg.norm_in_affine].float(), operands[cfg.norm_in_affine + 1].float()


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
    if cfg.norm_in is not None:
        channels = x.shape[1]
        if channels % cfg.norm_in:
            raise UnsupportedInputError(f"fusion::{OP}: the input group norm's {cfg.norm_in} groups do not divide "
                                        f"x's {channels} channels")  # fmt: skip
        for i in () if cfg.norm_in_affine is None else (cfg.norm_in_affine, cfg.norm_in_affine + 1):
            if i >= len(operands) or operands[i].numel() != channels:
                got = "missing" if i >= len(operands) else f"of shape {tuple(operands[i].shape)}"
                raise UnsupportedInputError(f"fusion::{OP}: the input group norm's operands[{i}] must hold one value "
                                            f"per input channel ({channels}), got {got}")  # fmt: skip


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
    _, weight, bias = cast_inputs(x, weight, bias, dtype)
    v = apply_chain(run_conv(conv_input(x, operands, cfg, dtype), weight, bias, cfg.conv), cfg.chain, operands)
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
    _, weight, bias = cast_inputs(x, weight, bias, dtype)
    y0 = run_conv(conv_input(x, operands, cfg, dtype), weight, None, cfg.conv)
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
    x_given = x
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
    prologue = [i for i in _prologue_operands(cfg) if mask[3 + i]]
    grad_x, grad_w, grad_bias = run_conv_backward(
        grad_y.to(x.dtype), conv_input(x_given, operands, cfg, x.dtype), weight, cfg.conv, mask[0] or bool(prologue),
        mask[1], bool(mask[2]))  # fmt: skip
    if (cfg.gate is not None or cfg.norm_in is not None) and grad_x is not None:  # back to x through the prologue
        grads = _prologue_backward(grad_x, x_given, operands, cfg, x.dtype, bool(mask[0]), prologue)
        grad_x = grads.pop(0)
        for i, g in zip(prologue, grads, strict=True):
            grad_operands[i] = g
    return [grad_x, grad_w, None if grad_bias is None else grad_bias.to(bias.dtype), *grad_operands]


def _prologue_operands(cfg: ConvEpilogueConfig) -> tuple[int, ...]:
    """The operands the conv's input is made with (``conv_input``): the gate, the input norm's affine."""
    if cfg.gate is not None:
        return (cfg.gate,)
    return () if cfg.norm_in_affine is None else (cfg.norm_in_affine, cfg.norm_in_affine + 1)


def _prologue_backward(grad_in: Tensor, x: Tensor, operands: Sequence[Tensor], cfg: ConvEpilogueConfig,
                       dtype: torch.dtype, want_x: bool, wanted: Sequence[int]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, *grads of operands[wanted]]`` from the conv input's gradient ``grad_in``, back through
    ``conv_input`` (None for x where it is not wanted).  The gate's product by its formula; the input
    norm's activation step by step (``chain_backward``) and the norm by aten's own group-norm
    backward, in fp32 on the statistics aten's forward gives (what eager's backward runs)."""
    grad_in = grad_in.to(dtype)
    if cfg.gate is not None:  # x * gate: the gradient times the gate, and summed with x for the gate
        gate = operands[cfg.gate]
        acc = torch.promote_types(grad_in.dtype, torch.float32)  # fp32 sums for half types
        spatial = tuple(range(2, x.dim()))
        grad_gate = [(grad_in.to(acc) * x.to(acc)).sum(spatial, keepdim=True).to(gate.dtype)] if wanted else []
        return [grad_in * gate.to(grad_in.dtype) if want_x else None, *grad_gate]
    weight, bias = input_norm_affine(operands, cfg)
    xf, (n, c), groups = x.float().contiguous(), x.shape[:2], cfg.norm_in
    hw = xf[0, 0].numel()
    u, mean, rstd = torch.ops.aten.native_group_norm(xf, weight, bias, n, c, hw, groups, cfg.norm_in_eps)
    _, tape = chain_with_tape(u, cfg.act_in, operands)
    grad_u = chain_backward(tape, grad_in.float(), operands, [False] * len(operands))[0]
    wants = [want_x, *(cfg.norm_in_affine is not None and i in wanted for i in _prologue_operands(cfg))]
    grad_x, grad_w, grad_b = torch.ops.aten.native_group_norm_backward(
        grad_u.contiguous(), xf, mean, rstd, weight, n, c, hw, groups, wants + [False] * (3 - len(wants)))
    by_operand = dict(zip(_prologue_operands(cfg), (grad_w, grad_b), strict=False))
    return [None if grad_x is None else grad_x.to(x.dtype),
            *(by_operand[i].to(operands[i].dtype).reshape(operands[i].shape) for i in wanted)]
