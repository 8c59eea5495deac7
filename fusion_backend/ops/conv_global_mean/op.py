"""``fusion::conv_global_mean``'s entry points and registrations: ``conv_global_mean`` (what rewritten
graphs call), the two custom ops with their fakes, the autograd formula, and the autograd-free and direct
implementations.
"""

from __future__ import annotations

import torch

from ..autograd_free import register_autograd_free
from ..direct_impls import profiled, records_backward, register_direct
from .backward import backward_impl, grad_input_strides
from .config import ConvGlobalMeanConfig
from .fold import output_channels
from .forward import forward_impl

conv_global_mean_fwd = torch.library.custom_op("fusion::conv_global_mean_fwd", mutates_args=())(
    forward_impl
)


@conv_global_mean_fwd.register_fake
def _conv_global_mean_fwd_fake(x, weight, bias, operands, config):
    cfg = ConvGlobalMeanConfig.from_json(config)
    n, c_in = x.shape[:2]
    c_out = output_channels(cfg.conv, weight)
    out_dtype = getattr(torch, cfg.out_dtype) if cfg.out_dtype else x.dtype
    out_shape = (n, c_out, *([1] * cfg.conv.spatial_dims)) if cfg.keepdim else (n, c_out)
    return (
        x.new_empty(out_shape, dtype=out_dtype),
        x.new_empty((n, c_in, *weight.shape[2:]), dtype=torch.float64),
        x.new_empty((n, c_out), dtype=torch.float64),
    )


conv_global_mean_bwd = torch.library.custom_op("fusion::conv_global_mean_bwd", mutates_args=())(
    backward_impl
)


@conv_global_mean_bwd.register_fake
def _conv_global_mean_bwd_fake(
    grad_out, weight, bias, operands, tap_sums, conv_mean, x_size, x_stride, x_dtype, need_grad_input, config
):
    grad_x = (
        grad_out.new_empty_strided(tuple(x_size), tuple(x_stride), dtype=x_dtype)
        if need_grad_input
        else grad_out.new_empty((0,))
    )
    grad_bias = torch.empty_like(bias) if bias is not None else grad_out.new_empty((0,))
    return [grad_x, torch.empty_like(weight), grad_bias, *[torch.empty_like(t) for t in operands]]


def _setup_context(ctx, inputs, output) -> None:
    x, weight, bias, operands, config = inputs
    _, tap_sums, conv_mean = output
    ctx.mark_non_differentiable(tap_sums, conv_mean)
    ctx.save_for_backward(weight, bias, tap_sums, conv_mean, *operands)
    ctx.x_size = tuple(x.shape)
    ctx.x_stride = grad_input_strides(x)
    ctx.x_dtype = x.dtype
    ctx.has_bias = bias is not None
    ctx.config = config


def _backward(ctx, grad_out, _grad_tap_sums, _grad_conv_mean):
    weight, bias, tap_sums, conv_mean, *operands = ctx.saved_tensors
    need_x = bool(ctx.needs_input_grad[0])
    grads = conv_global_mean_bwd(
        grad_out,
        weight,
        bias,
        operands,
        tap_sums,
        conv_mean,
        ctx.x_size,
        ctx.x_stride,
        ctx.x_dtype,
        need_x,
        ctx.config,
    )
    grad_x, grad_w, grad_b, *grad_ops = grads
    return (grad_x if need_x else None, grad_w, grad_b if ctx.has_bias else None, grad_ops, None)


conv_global_mean_fwd.register_autograd(_backward, setup_context=_setup_context)


register_autograd_free(conv_global_mean_fwd, forward_impl, _conv_global_mean_fwd_fake)


register_autograd_free(conv_global_mean_bwd, backward_impl, _conv_global_mean_bwd_fake)


def conv_global_mean(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    config: str,
) -> torch.Tensor:
    """``mean over all spatial dims of affine(conv(x, weight, bias))`` without producing the conv output.

    Args:
        x: ``(N, C_in, *spatial)``; any dtype conv accepts, any layout (channels_last included).
        weight: conv weight, ``(C_out, C_in/groups, *k)`` or, transposed, ``(C_in, C_out/groups, *k)``.
        bias: ``(C_out,)`` or ``None``.
        operands: tensors referred to by the config's ``TensorRef`` operands.
        config: ``ConvGlobalMeanConfig.to_json()``.

    Returns:
        ``(N, C_out)`` or, with ``keepdim``, ``(N, C_out, 1, ..., 1)``, dtype ``out_dtype`` (default x's).
        Differentiable in x, weight, bias and every operand.
    """
    return conv_global_mean_fwd(x, weight, bias, operands, config)[0]


class _DirectConvGlobalMean(torch.autograd.Function):
    """``conv_global_mean`` for graphs the backend runs without AOTAutograd (``ops/direct_impls.py``):
    the custom ops' implementations called straight, saving the same state.  ``operands`` are spread
    into separate arguments because autograd tracks only tensors passed one by one."""

    @staticmethod
    def forward(ctx, config, x, weight, bias, *operands):
        out, tap_sums, conv_mean = forward_impl(x, weight, bias, list(operands), config)
        ctx.save_for_backward(weight, bias, *operands)
        ctx.state = (tap_sums, conv_mean)  # intermediates: attributes, as autograd advises
        ctx.x_size = tuple(x.shape)
        ctx.x_stride = grad_input_strides(x)
        ctx.x_dtype = x.dtype
        ctx.config = config
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    @profiled("fusion::conv_global_mean_bwd")
    def backward(ctx, grad_out):
        weight, bias, *operands = ctx.saved_tensors
        tap_sums, conv_mean = ctx.state
        needs = ctx.needs_input_grad  # (config, x, weight, bias, *operands)
        grad_x, grad_w, grad_b, *grad_ops = backward_impl(
            grad_out, weight, bias, operands, tap_sums, conv_mean,
            ctx.x_size, ctx.x_stride, ctx.x_dtype, bool(needs[1]), ctx.config,
        )
        grads = (grad_x if needs[1] else None, grad_w if needs[2] else None,
                 grad_b if bias is not None and needs[3] else None)
        return (None, *grads, *(g if wanted else None for g, wanted in zip(grad_ops, needs[4:], strict=True)))


@profiled("fusion::conv_global_mean_fwd")
def _conv_global_mean_direct(x, weight, bias, operands, config):
    """``conv_global_mean`` without the custom-op layers (the direct implementation; same contract)."""
    if records_backward(x, weight, bias, operands):
        return _DirectConvGlobalMean.apply(config, x, weight, bias, *operands)
    return forward_impl(x, weight, bias, list(operands), config)[0]


register_direct(conv_global_mean, _conv_global_mean_direct)
