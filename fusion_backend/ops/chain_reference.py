"""The plain-torch reference of a pointwise chain (``apply_chain``; ``chain_with_tape`` and
``chain_backward`` its derivative) and of the pool that may end it (max-pool winners as the kernels
save them), and what the norm families' references share around their norm (``norm_forward`` /
``norm_backward``), for every family's reference.

NOTE: the chain is differentiated with torch's own backward formulas (``_step_vjp``), not with
``torch.autograd``: custom-op implementations run below the autograd dispatch key, where
``enable_grad()`` records nothing, and functorch transforms there clash with dispatch modes
(opcheck's schema check, flop counters).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import torch
from torch import Tensor

from ..ir.specs import PoolSpec
from .chain import ChainStep, ChainValue, PointwiseKind, TensorRef, apply_step, operand_values
from .conv_io import channel_view, dtype_named, run_conv_backward, run_pool, stats_dtype, winner_dtype


def apply_chain(y: Tensor, chain: Sequence[ChainStep], operands: Sequence[Tensor]) -> Tensor:
    """Apply ``chain`` to ``y`` with eager semantics; non-differentiable operands are detached."""
    inputs: list[Tensor] = []
    for step in chain:
        inputs.append(y)
        y = apply_step(step.kind, y, operand_values(step, operands, inputs))
    return y


def add_grads(a: Tensor | None, b: Tensor | None) -> Tensor | None:
    """``a + b`` where both are gradients, the one present otherwise (None when neither is)."""
    if a is None:
        return b
    return a if b is None else a + b


def with_bias(y: Tensor, bias: Tensor | None) -> Tensor:
    """``y`` plus the conv ``bias`` (cast to y's dtype) per channel; ``y`` itself without one."""
    return y if bias is None else y + channel_view(bias.to(y.dtype), y.dim())


def _window_strides(sizes: Sequence[int]) -> list[int]:
    """Row-major strides of a box of ``sizes``."""
    return [math.prod(sizes[i + 1 :]) for i in range(len(sizes))]


def _window_origins(pooled_shape: Sequence[int], pool: PoolSpec, device: torch.device) -> list[Tensor]:
    """Per spatial dim, the (broadcastable) input coordinate where each pooled window starts."""
    dims = len(pooled_shape) - 2
    origins = []
    for j, (size, s, p) in enumerate(zip(pooled_shape[2:], pool.stride, pool.padding, strict=True)):
        shape = [1] * (dims + 2)
        shape[2 + j] = size
        origins.append((torch.arange(size, device=device) * s - p).reshape(shape))
    return origins


_Tape = list[tuple[ChainStep, Tensor, list[Union[Tensor, float]]]]


def chain_with_tape(
    y: Tensor, chain: Sequence[ChainStep], operands: Sequence[Tensor]
) -> tuple[Tensor, _Tape]:
    """``apply_chain`` that also records each step's input and operand values."""
    tape: _Tape = []
    detached = [t.detach() for t in operands]
    inputs: list[Tensor] = []
    for step in chain:
        inputs.append(y)
        values = operand_values(step, detached, inputs, detach_fixed=False)
        tape.append((step, y, values))
        y = apply_step(step.kind, y, values)
    return y, tape


def chain_backward(
    tape: _Tape, grad: Tensor, operands: Sequence[Tensor], operand_mask: Sequence[bool]
) -> tuple[Tensor, list[Tensor | None]]:
    """Walk ``tape`` backwards: the gradient of the chain's input and of the masked operands.  The
    gradient of a ``ChainValue`` operand joins the gradient of that step's input when the walk gets
    there, as autograd sums the gradients of a value read twice."""
    grad_operands: list[Tensor | None] = [
        torch.zeros_like(t) if m else None for t, m in zip(operands, operand_mask, strict=True)
    ]
    reread: list[Tensor | None] = [None] * len(tape)  # per step: the gradient its input got as an operand
    for k in reversed(range(len(tape))):
        step, v, values = tape[k]
        grad_v, grad_a = _step_vjp(step.kind, v, values, grad)
        operand = step.operands[0] if step.operands else None
        if grad_a is not None and isinstance(operand, ChainValue):
            j = operand.position
            reread[j] = grad_a if reread[j] is None else reread[j] + grad_a
        elif grad_a is not None and isinstance(operand, TensorRef) and operand_mask[operand.index]:
            t = operands[operand.index]
            reduced = grad_a.sum() if t.dim() == 0 else grad_a.sum_to_size(t.shape)
            grad_operands[operand.index] = grad_operands[operand.index] + reduced.to(t.dtype)
        grad = grad_v.to(v.dtype)  # as autograd does across a type-promoting op
        if reread[k] is not None:
            grad = grad + reread[k].to(v.dtype)
    return grad, grad_operands


def _step_vjp(
    kind: PointwiseKind, v: Tensor, values: Sequence[Union[Tensor, float]], g: Tensor
) -> tuple[Tensor, Tensor | None]:
    """``(d/dv, d/d first operand)`` of one step at input ``v``, with torch's backward formulas.

    The operand gradient is full-size (not reduced); it is None for kinds whose operands get none.
    """
    aten = torch.ops.aten
    a = values[0] if values else None
    if kind is PointwiseKind.RELU:
        return aten.threshold_backward(g, torch.relu(v), 0), None
    if kind is PointwiseKind.LEAKY_RELU:
        return torch.where(v > 0, g, g * a), None
    if kind is PointwiseKind.GELU:
        return aten.gelu_backward(g, v), None
    if kind is PointwiseKind.GELU_TANH:
        return aten.gelu_backward(g, v, approximate="tanh"), None
    if kind is PointwiseKind.SILU:
        return aten.silu_backward(g, v), None
    if kind is PointwiseKind.SIGMOID:
        return aten.sigmoid_backward(g, torch.sigmoid(v)), None
    if kind is PointwiseKind.TANH:
        return aten.tanh_backward(g, torch.tanh(v)), None
    if kind is PointwiseKind.HARDSWISH:
        return aten.hardswish_backward(g, v), None
    if kind is PointwiseKind.MISH:
        return aten.mish_backward(g, v), None
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    if kind is PointwiseKind.CLAMP:
        return torch.where((v >= a) & (v <= values[1]), g, zero), None
    if kind is PointwiseKind.CLAMP_MIN:
        return torch.where(v >= a, g, zero), torch.where(v < a, g, zero)
    if kind is PointwiseKind.CLAMP_MAX:
        return torch.where(v <= a, g, zero), torch.where(v > a, g, zero)
    if kind is PointwiseKind.HARDTANH:
        return torch.where(((v > a) & (v < values[1])) | torch.isnan(v), g, zero), None
    if kind in (PointwiseKind.MINIMUM, PointwiseKind.MAXIMUM):
        # torch: where(v == a, g / 2, g), zero where the other side was taken (NaN: neither is)
        half = torch.where(v == a, g / 2, g)
        v_lost, a_lost = (v > a, v < a) if kind is PointwiseKind.MINIMUM else (v < a, v > a)
        return torch.where(v_lost, zero, half), torch.where(a_lost, zero, half)
    if kind is PointwiseKind.MUL:
        return g * a, g * v
    if kind is PointwiseKind.ADD:
        return g, g
    if kind is PointwiseKind.SUB:
        return g, -g
    if kind is PointwiseKind.RSUB:
        return -g, g
    if kind is PointwiseKind.DIV:
        return g / a, -g * v / (a * a)
    if kind is PointwiseKind.RDIV:
        if not isinstance(a, Tensor):  # float / tensor is reciprocal(v) * a in torch
            r = torch.reciprocal(v)
            return -(g * a) * (r * r), None
        return -g * a / (v * v), g / v
    raise AssertionError(f"unhandled pointwise kind {kind}")


def window_winners(flat: Tensor, spatial: Sequence[int], pool: PoolSpec) -> Tensor:
    """A max pool's winners as the kernels save them (``winner_dtype``: each window's row-major tap
    index) from ``return_indices``' ``flat`` (each window's winner as a flat index into its
    (sample, channel) plane of ``spatial`` sizes)."""
    spatial = list(spatial)
    win = torch.zeros_like(flat)
    for j, (origin, stride, k_stride) in enumerate(
        zip(_window_origins(flat.shape, pool, flat.device), _window_strides(spatial),
            _window_strides(pool.kernel_size), strict=True)
    ):  # fmt: skip
        coord = (flat // stride) % spatial[j]
        win = win + (coord - origin) * k_stride
    return win.to(winner_dtype(pool))


def pool_saving_winners(v: Tensor, pool: PoolSpec | None, winner: Tensor) -> Tensor:
    """``run_pool(v, pool)`` (``v`` itself without a pool); a max pool's winners written into
    ``winner`` (``window_winners``' layout) unless it is a placeholder (no element)."""
    if pool is None:
        return v
    if pool.kind != "max" or winner.numel() == 0:
        return run_pool(v, pool)
    result, flat = run_pool(v, pool, return_indices=True)
    winner.copy_(window_winners(flat, v.shape[2:], pool))
    return result


def pool_input_grad(grad: Tensor, v: Tensor, winner: Tensor | None, pool: PoolSpec) -> Tensor:
    """The gradient at the input ``v`` (full size) of ``run_pool(v, pool)`` from the pooled gradient
    ``grad``: an avg pool's with torch's backward, a max pool's summed into each window's winner
    (``winner``: ``window_winners``' int8 / int32, grad's shape)."""
    if pool.kind == "max":
        return scatter_to_windows(grad, winner, v.shape, pool)
    return avg_pool_backward(grad, v, pool)


def avg_pool_backward(grad: Tensor, v: Tensor, pool: PoolSpec) -> Tensor:
    """Gradient of ``run_pool(v, pool)`` (an avg pool) w.r.t. ``v``."""
    k, s, p = list(pool.kernel_size), list(pool.stride), list(pool.padding)
    args = (pool.ceil_mode, pool.count_include_pad, pool.divisor_override)
    if v.dim() == 3:  # pooled as a (1, L) plane, see run_pool
        return torch.ops.aten.avg_pool2d_backward(
            grad.unsqueeze(-2), v.unsqueeze(-2), [1, k[0]], [1, s[0]], [0, p[0]], *args
        ).squeeze(-2)
    fn = torch.ops.aten.avg_pool2d_backward if v.dim() == 4 else torch.ops.aten.avg_pool3d_backward
    return fn(grad, v, k, s, p, *args)


def scatter_to_windows(grad_w: Tensor, winner: Tensor, y_shape: Sequence[int], pool: PoolSpec) -> Tensor:
    """Full-size (N, C, *spatial) gradient from per-window gradients at the winners (summing)."""
    spatial = list(y_shape[2:])
    rem = winner.to(torch.int64)
    flat = torch.zeros_like(rem)
    for j, (origin, k_stride, plane_stride) in enumerate(
        zip(_window_origins(winner.shape, pool, winner.device), _window_strides(pool.kernel_size),
            _window_strides(spatial), strict=True)
    ):  # fmt: skip
        k = (rem // k_stride) % pool.kernel_size[j]
        flat = flat + (origin + k) * plane_stride
    n, c = y_shape[:2]
    full = torch.zeros(n, c, math.prod(spatial), dtype=grad_w.dtype, device=grad_w.device)
    full.scatter_add_(2, flat.flatten(2), grad_w.flatten(2))
    return full.reshape(y_shape)


def norm_affine(operands: Sequence[Tensor], cfg: Any, dtype: torch.dtype,
                shape: Sequence[int] = (-1,)) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """A norm's ``(weight, bias)``: the operands at ``cfg.weight`` / ``cfg.bias`` (None where absent),
    detached, in ``shape`` and ``dtype``."""
    return tuple(None if i is None else operands[i].detach().reshape(shape).to(dtype)  # type: ignore[return-value]
                 for i in (cfg.weight, cfg.bias))  # fmt: skip


def norm_forward(op: str, y0: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: Any, out: Tensor,
                 stats: Tensor, norm: Callable[..., tuple[Tensor, ...]], winner: Tensor | None = None,
                 affine_shape: Sequence[int] = (-1,)) -> tuple[Tensor, ...]:  # fmt: skip
    """A norm family's reference forward after the conv (``y0``: its output without bias): the bias
    added after the conv (as the kernels add it), ``cfg.pre``, then ``norm(v, weight, bias)`` on the
    pre-chain's result in the statistics' dtype (``stats_dtype``: what eager's norms compute in; the
    norm's weight and bias ``norm_affine``'s in ``affine_shape``), which returns the norm's result
    (scale and shift included) and its statistics; that result is cast to the norm's dtype
    (``cfg.norm_dtype``), ``cfg.post`` and ``cfg.pool`` (a max pool's winners into ``winner``)
    follow, cast to ``cfg.out_dtype`` into ``out``.  The statistics are copied into the rows of
    ``stats`` (unless it is a placeholder) and returned."""
    v = apply_chain(with_bias(y0, bias), cfg.pre, operands).to(stats_dtype(y0.dtype))
    z, *results = norm(v, *norm_affine(operands, cfg, v.dtype, affine_shape))
    result = apply_chain(z.to(dtype_named(op, cfg.norm_dtype, y0.dtype, "norm_dtype")), cfg.post, operands)
    out.copy_(pool_saving_winners(result, cfg.pool, winner).to(dtype_named(op, cfg.out_dtype, y0.dtype)))
    for row, stat in zip(stats if stats.numel() else (), results, strict=False):
        row.copy_(stat.reshape(row.shape))
    return tuple(results)


def norm_backward(
    op: str, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
    saved_y: Tensor, saved_stats: Tensor, cfg: Any, mask: Sequence[bool], normalized: Callable[[Tensor], Tensor],
    norm_grads: Callable[..., tuple[Tensor, Tensor | None, Tensor | None]], saved_winner: Tensor | None = None,
    affine_shape: Sequence[int] = (-1,),
) -> list[Tensor | None]:  # fmt: skip
    """A norm family's reference backward (``ops/declare.py``'s contract) from the saved conv output
    and statistics: the chains' derivatives with the tape, the norm's from ``norm_grads(grad_z, v,
    output_mask, weight, bias)`` (torch's backward op: the gradient of ``v``, the pre-chain's result,
    and of the norm's weight and bias; ``grad_z`` and ``v`` in the statistics' dtype), the conv's
    from ``aten.convolution_backward``.  ``normalized(v)``: ``(v - mean) * rstd`` recomputed from the
    saved statistics, to which the norm's weight and bias (``norm_affine``'s in ``affine_shape``: one
    per channel by default) are applied.  Behind a pool the post-chain's gradient comes from
    ``pool_input_grad`` (a max pool's summed into each window's saved winner)."""
    operand_mask = list(mask[3:])
    sdt = saved_stats.dtype
    gamma, beta = norm_affine(operands, cfg, sdt, affine_shape)
    per_channel = tuple(affine_shape) == (-1,)
    yb = with_bias(saved_y, bias)
    v, pre_tape = chain_with_tape(yb, cfg.pre, operands)
    z = normalized(v)
    for t, apply in ((gamma, torch.mul), (beta, torch.add)):
        z = z if t is None else apply(z, channel_view(t, z.dim()) if per_channel else t)
    out, post_tape = chain_with_tape(z.to(dtype_named(op, cfg.norm_dtype, saved_y.dtype, "norm_dtype")), cfg.post,
                                     operands)  # fmt: skip
    grad = grad_out.to(out.dtype)
    if cfg.pool is not None:
        grad = pool_input_grad(grad, out, saved_winner, cfg.pool)
    grad_z, post_grads = chain_backward(post_tape, grad, operands, operand_mask)
    wanted = [index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias)]
    grad_v, *affine_grads = norm_grads(grad_z.to(sdt), v.to(sdt), [True, *wanted], gamma, beta)
    grad_y, pre_grads = chain_backward(pre_tape, grad_v.to(yb.dtype), operands, operand_mask)
    grad_x, grad_w, grad_b = run_conv_backward(grad_y.to(x.dtype).contiguous(), x, weight, cfg.conv, mask[0],
                                               mask[1], bool(mask[2]))  # fmt: skip
    grads = [add_grads(a, b) for a, b in zip(pre_grads, post_grads, strict=True)]
    for index, g, want in zip((cfg.weight, cfg.bias), affine_grads, wanted, strict=True):
        if want:
            t = operands[index]
            grads[index] = add_grads(grads[index], g.reshape(t.shape).to(t.dtype))
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
