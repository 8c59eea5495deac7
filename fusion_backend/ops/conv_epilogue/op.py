"""``fusion::conv_epilogue``'s entry points and registrations: ``conv_epilogue`` (what rewritten graphs
call), its eager composite (``conv_epilogue_eager``), the two custom ops with their fakes, the
autograd formula, and the autograd-free and direct implementations.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ...kernels.host import tensor_key
from ..autograd_free import register_autograd_free
from ..chain_reference import apply_chain
from ..config import ConvEpilogueConfig
from ..conv_io import backward_outputs, fake_backward_outputs, run_conv, run_pool
from ..direct_impls import profiled, records_backward, register_direct
from . import backward, forward, reference
from .common import (
    allocate_forward_outputs,
    cast_inputs,
    check_inputs,
    conv_compute_dtype,
    on_kernel_failure,
    output_dtype,
    use_triton,
)


def conv_epilogue(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], config: str
) -> Tensor:
    """``pool(chain(conv(x, weight, bias))).to(out_dtype)`` as one fused op (see the package docstring).

    Backward state is computed only when autograd will need it: under AOTAutograd the grad mode
    seen at trace time is the runtime one, so inference graphs never save anything.
    """
    save = records_backward(x, weight, bias, operands)
    out, _, _ = torch.ops.fusion.conv_epilogue_fwd(x, weight, bias, list(operands), config, save)
    return out


def conv_epilogue_eager(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], config: str
) -> Tensor:
    """The eager composite the fused op stands for (differentiable by autograd; tests' oracle).

    Operands in non-differentiable positions (leaky_relu slope, clamp bounds) are detached, as in
    the fused op.
    """
    cfg = ConvEpilogueConfig.from_json(config)
    dtype = conv_compute_dtype(cfg, x)
    x, weight, bias = cast_inputs(x, weight, bias, dtype)
    v = apply_chain(run_conv(x, weight, bias, cfg.conv), cfg.chain, operands)
    if cfg.pool is not None:
        v = run_pool(v, cfg.pool)
    return v.to(output_dtype(cfg, dtype))


def _conv_epilogue_fwd_impl(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    operands: list[Tensor],
    config: str,
    save_for_backward: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Forward of the fused op: ``(out, saved_y0, saved_winner)`` (see the package docstring).

    A call whose signature (``forward.call_signature``) has a settled plan runs it straight; the
    first call of a signature checks the inputs, picks the path (``forward.plan_for``) and keeps
    the plan.
    """
    key = forward.call_signature(config, save_for_backward, x, weight, bias, operands)
    plan = forward.PLANS.peek(key)
    if plan is None:
        cfg = ConvEpilogueConfig.from_json(config)
        check_inputs(x, weight, operands, cfg)
        if not use_triton(config, cfg, x):
            return reference.forward(x, weight, bias, operands, cfg, save_for_backward)
        try:
            plan, settled = forward.plan_for(x, weight, bias, operands, cfg, save_for_backward)
        except Exception as e:  # any kernel failure takes the documented policy
            on_kernel_failure("forward", config, cfg, x, weight, e)
            return reference.forward(x, weight, bias, operands, cfg, save_for_backward)
        if settled:
            forward.PLANS.put(key, plan)
    try:
        return plan(x, weight, bias, operands)
    except Exception as e:  # any kernel failure takes the documented policy
        cfg = ConvEpilogueConfig.from_json(config)
        on_kernel_failure("forward", config, cfg, x, weight, e)
        return reference.forward(x, weight, bias, operands, cfg, save_for_backward)


conv_epilogue_fwd = torch.library.custom_op("fusion::conv_epilogue_fwd", mutates_args=())(_conv_epilogue_fwd_impl)


@conv_epilogue_fwd.register_fake
def _conv_epilogue_fwd_fake(x, weight, bias, operands, config, save_for_backward):
    """The outputs' metadata (types as in ``_conv_epilogue_fwd_impl``, which gives the op its schema)."""
    cfg = ConvEpilogueConfig.from_json(config)
    dtype = conv_compute_dtype(cfg, x)
    y0 = run_conv(x.to(dtype), weight.to(dtype), None, cfg.conv)
    out_shape = y0.shape if cfg.pool is None else run_pool(y0, cfg.pool).shape
    return allocate_forward_outputs(x, y0, out_shape, cfg, save_for_backward)


def _conv_epilogue_bwd_impl(
    grad_out: Tensor,
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    operands: list[Tensor],
    saved_y0: Tensor,
    saved_winner: Tensor,
    config: str,
    output_mask: list[bool],
) -> list[Tensor]:
    """Backward of the fused op: ``[grad_x, grad_weight, grad_bias, *grad_operands]``.

    ``output_mask`` has ``3 + len(operands)`` entries; unrequested grads are empty placeholders.
    Each requested grad has its input's shape, dtype and ``empty_like`` strides.  Plans are kept
    per signature as in the forward (``backward.plan_for``).
    """
    key = (
        forward.call_signature(config, True, x, weight, bias, operands), tuple(output_mask), tensor_key(grad_out),
        tensor_key(saved_y0), tensor_key(saved_winner),
    )  # fmt: skip
    plan = backward.PLANS.peek(key)
    cfg = None
    if plan is None:
        cfg = ConvEpilogueConfig.from_json(config)
        if len(output_mask) != 3 + len(operands):
            raise ValueError(f"output_mask needs {3 + len(operands)} entries, got {len(output_mask)}")
        if saved_y0.dim() == 1:  # the (0,)-shaped placeholder: saved state is always (N, C, ...)
            raise RuntimeError(
                "fusion::conv_epilogue_bwd: the forward ran with save_for_backward=False; call "
                "conv_epilogue() (which saves state when autograd needs it) instead of the raw op"
            )
        if use_triton(config, cfg, x):
            try:
                plan, settled = backward.plan_for(grad_out, x, weight, bias, operands, saved_y0, saved_winner, cfg, output_mask)
            except Exception as e:  # any kernel failure takes the documented policy
                on_kernel_failure("backward", config, cfg, x, weight, e)
            else:
                if settled:
                    backward.PLANS.put(key, plan)
    grads = None
    if plan is not None:
        try:
            grads = plan(grad_out, x, weight, bias, operands, saved_y0, saved_winner)
        except Exception as e:  # any kernel failure takes the documented policy
            cfg = cfg or ConvEpilogueConfig.from_json(config)
            on_kernel_failure("backward", config, cfg, x, weight, e)
    if grads is None:
        cfg = cfg or ConvEpilogueConfig.from_json(config)
        grads = reference.backward(grad_out, x, weight, bias, operands, saved_y0, saved_winner, cfg, output_mask)
    return backward_outputs(grads, [x, weight, bias, *operands], output_mask, x)


conv_epilogue_bwd = torch.library.custom_op("fusion::conv_epilogue_bwd", mutates_args=())(_conv_epilogue_bwd_impl)


@conv_epilogue_bwd.register_fake
def _conv_epilogue_bwd_fake(grad_out, x, weight, bias, operands, saved_y0, saved_winner, config, output_mask):
    """The gradients' metadata (types as in ``_conv_epilogue_bwd_impl``, which gives the op its schema)."""
    return fake_backward_outputs([x, weight, bias, *operands], output_mask, x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, weight, bias, operands, config, save_for_backward = inputs
    _, saved_y0, saved_winner = output
    ctx.config = config
    ctx.num_operands = len(operands)
    ctx.saved = save_for_backward
    ctx.save_for_backward(x, weight, bias, *operands, saved_y0, saved_winner)


def _backward(ctx: Any, grad_out: Tensor, _grad_saved_y0: Tensor, _grad_saved_winner: Tensor) -> tuple[Any, ...]:
    if not ctx.saved:
        raise RuntimeError(
            "fusion::conv_epilogue_fwd ran with save_for_backward=False but a gradient was requested; "
            "call conv_epilogue(), which saves state whenever autograd needs it"
        )
    x, weight, bias, *rest = ctx.saved_tensors
    operands = rest[: ctx.num_operands]
    saved_y0, saved_winner = rest[ctx.num_operands :]
    needs = ctx.needs_input_grad  # (x, weight, bias, [operands...], config, save_for_backward)
    mask = [bool(needs[0]), bool(needs[1]), bias is not None and bool(needs[2])]
    mask += [bool(m) for m in needs[3]]
    grads = torch.ops.fusion.conv_epilogue_bwd(
        grad_out, x, weight, bias, list(operands), saved_y0, saved_winner, ctx.config, mask
    )
    out = [g if wanted else None for g, wanted in zip(grads, mask, strict=True)]
    return out[0], out[1], out[2], out[3:], None, None


conv_epilogue_fwd.register_autograd(_backward, setup_context=_setup_context)


register_autograd_free(conv_epilogue_fwd, _conv_epilogue_fwd_impl, _conv_epilogue_fwd_fake)


register_autograd_free(conv_epilogue_bwd, _conv_epilogue_bwd_impl, _conv_epilogue_bwd_fake)


class _DirectConvEpilogue(torch.autograd.Function):
    """``conv_epilogue`` for graphs the backend runs without AOTAutograd (``ops/direct_impls.py``).

    The same two implementations as the custom ops, called straight: the forward saves the same
    state, the backward gets the same output mask.  ``operands`` are spread into separate arguments
    because autograd tracks only tensors passed one by one.
    """

    @staticmethod
    def forward(ctx: Any, config: str, x: Tensor, weight: Tensor, bias: Tensor | None, *operands: Tensor) -> Tensor:
        out, saved_y0, saved_winner = _conv_epilogue_fwd_impl(x, weight, bias, list(operands), config, True)
        ctx.config = config
        ctx.save_for_backward(x, weight, bias, *operands)
        # Intermediates (neither inputs nor outputs) are kept as attributes, as autograd advises for
        # state that double backward never needs.
        ctx.state = (saved_y0, saved_winner)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @profiled("fusion::conv_epilogue_bwd")
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Any, ...]:
        x, weight, bias, *operands = ctx.saved_tensors
        saved_y0, saved_winner = ctx.state
        needs = ctx.needs_input_grad  # (config, x, weight, bias, *operands)
        mask = [bool(needs[1]), bool(needs[2]), bias is not None and bool(needs[3])]
        mask += [bool(m) for m in needs[4:]]
        grads = _conv_epilogue_bwd_impl(grad_out, x, weight, bias, operands, saved_y0, saved_winner, ctx.config, mask)
        return (None, *(g if wanted else None for g, wanted in zip(grads, mask, strict=True)))


@profiled("fusion::conv_epilogue_fwd")
def _conv_epilogue_direct(
    x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], config: str
) -> Tensor:
    """``conv_epilogue`` without the custom-op layers (the direct implementation; same contract)."""
    if records_backward(x, weight, bias, operands):
        return _DirectConvEpilogue.apply(config, x, weight, bias, *operands)
    return _conv_epilogue_fwd_impl(x, weight, bias, list(operands), config, False)[0]


register_direct(conv_epilogue, _conv_epilogue_direct)
