"""The autograd wiring shared by the fused ops that save state for their backward op.

``conv_channel_reduce``, ``conv_group_norm``, ``conv_batch_norm`` and ``conv_layer_norm`` have one
shape:

- a forward custom op ``fusion::NAME_fwd(x, weight, bias, operands, config, save_for_backward)``
  returning ``(out, *state)``: ``state`` is what the backward reads (the conv output, statistics...),
  non-differentiable, and placeholders when ``save_for_backward`` is False;
- a backward custom op ``fusion::NAME_bwd(grad_out, x, weight, bias, operands, *state, config,
  output_mask)`` returning ``[grad_x, grad_weight, grad_bias, *grad_operands]`` (empty placeholders
  where the mask is False);
- for graphs run without AOTAutograd (``ops/direct_impls.py``), an ``autograd.Function`` that calls
  the two implementations straight.

:func:`register_saved_state_ops` defines both custom ops from a family's implementations and fakes,
with the forward's autograd formula (:func:`register_saved_state_autograd`, which calls the backward
op) and both autograd-free ops (``ops/autograd_free.py``); :func:`direct_function` builds the direct
``autograd.Function``; each family keeps its kernels, its reference and its public entry point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .autograd_free import register_autograd_free
from .direct_impls import profiled


def _mask(bias: Tensor | None, needs: tuple[bool, ...], operands: int) -> list[bool]:
    """``output_mask`` from autograd's ``needs_input_grad`` of ``(x, weight, bias, *operands)``."""
    return [bool(needs[0]), bool(needs[1]), bias is not None and bool(needs[2])] + [bool(m) for m in needs[3:3 + operands]]


def register_saved_state_ops(op: str, fwd_impl: Callable[..., Any], fwd_fake: Callable[..., Any],
                             bwd_impl: Callable[..., Any], bwd_fake: Callable[..., Any]) -> tuple[Any, Any]:  # fmt: skip
    """``(fusion::{op}_fwd, fusion::{op}_bwd)``: the two custom ops (schemas from the
    implementations' annotations) with their fakes, the forward's autograd formula and both
    autograd-free ops."""
    fwd = torch.library.custom_op(f"fusion::{op}_fwd", mutates_args=())(fwd_impl)
    fwd.register_fake(fwd_fake)
    bwd = torch.library.custom_op(f"fusion::{op}_bwd", mutates_args=())(bwd_impl)
    bwd.register_fake(bwd_fake)
    register_saved_state_autograd(fwd, op)
    register_autograd_free(fwd, fwd_impl, fwd_fake)
    register_autograd_free(bwd, bwd_impl, bwd_fake)
    return fwd, bwd


def register_saved_state_autograd(fwd: Any, op: str) -> None:
    """Register the autograd formula of ``fwd``, the forward custom op ``fusion::{op}_fwd`` (see the
    module docstring): save the inputs and the state, call ``fusion::{op}_bwd`` (the custom op, so
    that AOTAutograd records it), return the gradients of x, weight, bias and the operand list.  The
    public entry point ``{op}()`` sets ``save_for_backward``; the error for a gradient asked of a
    forward that saved nothing names it."""
    name = f"fusion::{op}_fwd"

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        x, weight, bias, operands, config, save_for_backward = inputs
        state = output[1:]
        ctx.mark_non_differentiable(*state)
        ctx.config = config
        ctx.num_operands = len(operands)
        ctx.saved = save_for_backward
        ctx.save_for_backward(x, weight, bias, *operands, *state)

    def backward(ctx: Any, grad_out: Tensor, *_unused: Tensor) -> tuple[Any, ...]:
        if not ctx.saved:
            raise RuntimeError(f"{name} ran with save_for_backward=False but a gradient was requested; call "
                               f"{op}(), which saves state whenever autograd needs it")
        x, weight, bias, *rest = ctx.saved_tensors
        operands, state = rest[: ctx.num_operands], rest[ctx.num_operands :]
        needs = ctx.needs_input_grad  # (x, weight, bias, [operands...], config, save_for_backward)
        mask = _mask(bias, (needs[0], needs[1], needs[2], *needs[3]), ctx.num_operands)
        bwd = getattr(torch.ops.fusion, f"{op}_bwd")
        grads = bwd(grad_out, x, weight, bias, list(operands), *state, ctx.config, mask)
        picked = [g if wanted else None for g, wanted in zip(grads, mask, strict=True)]
        return picked[0], picked[1], picked[2], picked[3:], None, None

    fwd.register_autograd(backward, setup_context=setup_context)


def direct_function(op: str, fwd_impl: Callable[..., tuple[Tensor, ...]], bwd_impl: Callable[..., list[Tensor]],
                    outputs: int = 1) -> type[torch.autograd.Function]:  # fmt: skip
    """An ``autograd.Function`` computing ``fusion::{op}_fwd`` through ``fwd_impl`` and its gradient
    through ``bwd_impl`` (the custom ops' implementations, no dispatcher layers), called as
    ``apply(config, x, weight, bias, *operands)``: ``operands`` spread into separate arguments because
    autograd tracks only tensors passed one by one.  It returns ``out``, or with ``outputs=2`` ``(out,
    state[-1])`` (the last state tensor, non-differentiable: what a caller outside autograd needs, such
    as batch statistics)."""

    def forward(ctx: Any, config: str, x: Tensor, weight: Tensor, bias: Tensor | None, *operands: Tensor) -> Any:
        out, *state = fwd_impl(x, weight, bias, list(operands), config, True)
        ctx.save_for_backward(x, weight, bias, *operands)
        ctx.state = tuple(state)  # intermediates: attributes, as autograd advises
        ctx.config = config
        if outputs == 1:
            return out
        ctx.mark_non_differentiable(state[-1])
        return out, state[-1]

    @torch.autograd.function.once_differentiable
    @profiled(f"fusion::{op}_bwd")
    def backward(ctx: Any, grad_out: Tensor, *_unused: Tensor) -> tuple[Any, ...]:
        x, weight, bias, *operands = ctx.saved_tensors
        mask = _mask(bias, ctx.needs_input_grad[1:], len(operands))  # needs: (config, x, weight, bias, *operands)
        grads = bwd_impl(grad_out, x, weight, bias, operands, *ctx.state, ctx.config, mask)
        return (None, *(g if wanted else None for g, wanted in zip(grads, mask, strict=True)))

    # built with type() so that autograd's node (named at class creation) reads Direct_{op}Backward
    return type(f"Direct_{op}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__})
