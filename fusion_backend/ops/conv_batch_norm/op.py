"""``fusion::conv_batch_norm``'s entry points and registrations: ``conv_batch_norm`` (what rewritten
graphs call), the two custom ops with their fakes, the autograd formula, and the autograd-free and
direct implementations.

The running statistics' update is an op of its own, ``fusion::batch_norm_running_update``, which
mutates them and says so (``mutates_args``), so that AOTAutograd functionalizes the call (the buffers
are graph inputs it copies the new values back into) and Inductor keeps the update; the direct runner
calls it eagerly, which updates them in place.  WHY apart: torch.library takes no autograd formula for
an op that mutates its arguments, and the forward needs one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ..conv_epilogue.common import backward_outputs, conv_output_shape, fake_backward_outputs
from ..direct_impls import profiled, records_backward, register_direct
from ..failure import check_backward_call, triton_or_reference
from ..library_conv import conv_forward, nominal_format
from ..saved_state import direct_function, register_saved_state_ops
from . import reference
from .backward import backward_triton
from .common import (
    allocate_forward_outputs,
    check_inputs,
    on_kernel_failure,
    update_running_stats,
    use_triton,
    values_per_channel,
)
from .config import ConvBatchNormConfig
from .forward import forward_triton


def _fwd_impl(x: Tensor, weight: Tensor, bias: Tensor | None, operands: list[Tensor], config: str,
              save_for_backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, stats)`` (``common.allocate_forward_outputs``): the Triton path
    where it serves the call, else (or when a kernel fails, per the failure policy) the reference."""
    cfg = ConvBatchNormConfig.from_json(config)
    check_inputs(x, weight, operands, cfg)
    values_per_channel(conv_output_shape(x, weight, cfg.conv))
    args = (x, weight, bias, operands, cfg, save_for_backward)
    return triton_or_reference(use_triton(config, cfg, x), lambda: forward_triton(*args),
                               lambda: reference.forward(*args),
                               lambda e: on_kernel_failure("forward", config, cfg, x, weight, e))  # fmt: skip


def _fwd_fake(x, weight, bias, operands, config, save_for_backward):
    cfg = ConvBatchNormConfig.from_json(config)
    y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    return allocate_forward_outputs(x, y0, cfg, save_for_backward, nominal_format(x, weight, cfg.conv))


def _bwd_impl(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: list[Tensor],
              saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, config: str,
              output_mask: list[bool]) -> list[Tensor]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]``; entries whose mask is False are empty
    placeholders; the others have their input's shape, dtype and ``empty_like`` strides."""
    cfg = ConvBatchNormConfig.from_json(config)
    check_backward_call("conv_batch_norm", output_mask, len(operands), saved_stats)
    args = (grad_out, x, weight, bias, operands, saved_y, saved_winner, saved_stats, cfg, output_mask)
    grads = triton_or_reference(use_triton(config, cfg, x), lambda: backward_triton(*args),
                                lambda: reference.backward(*args),
                                lambda e: on_kernel_failure("backward", config, cfg, x, weight, e))  # fmt: skip
    return backward_outputs(grads, [x, weight, bias, *operands], output_mask, x)


def _bwd_fake(grad_out, x, weight, bias, operands, saved_y, saved_winner, saved_stats, config, output_mask):
    return fake_backward_outputs([x, weight, bias, *operands], output_mask, x)


conv_batch_norm_fwd, conv_batch_norm_bwd = register_saved_state_ops("conv_batch_norm", _fwd_impl, _fwd_fake, _bwd_impl, _bwd_fake)


def _running_update_impl(running_mean: Tensor, running_var: Tensor, stats: Tensor, momentum: float) -> None:
    """``running = (1 - momentum) * running + momentum * batch`` in place (``common.update_running_stats``;
    ``stats``: the forward's ``(3, C)``)."""
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t.numel() != stats.shape[1] or not t.is_floating_point():
            raise UnsupportedInputError(f"fusion::batch_norm_running_update: {name} must hold {stats.shape[1]} "
                                        f"floating values, got {tuple(t.shape)} {t.dtype}")  # fmt: skip
    update_running_stats(running_mean.view(-1), running_var.view(-1), stats, momentum)


batch_norm_running_update = torch.library.custom_op(
    "fusion::batch_norm_running_update", mutates_args=("running_mean", "running_var"))(_running_update_impl)


@batch_norm_running_update.register_fake
def _running_update_fake(running_mean, running_var, stats, momentum):
    return None


def split_operands(operands: Sequence[Tensor], config: str) -> tuple[list[Tensor], Tensor | None, Tensor | None]:
    """``(chain and affine operands, running_mean, running_var)`` from the operand list a rewritten
    graph passes: with ``config.running_stats`` the running statistics are its last two entries (one
    list keeps the graph call's shape ``(x, weight, bias, operands, config)`` every family shares)."""
    if not ConvBatchNormConfig.from_json(config).running_stats:
        return list(operands), None, None
    if len(operands) < 2:
        raise UnsupportedInputError(f"fusion::conv_batch_norm: the config says the running statistics are the last "
                                    f"two operands, but {len(operands)} were given")  # fmt: skip
    return list(operands[:-2]), operands[-2], operands[-1]


def conv_batch_norm(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    config: str) -> Tensor:  # fmt: skip
    """``pool(post(batch_norm(conv(x, weight, bias), training=True) * gamma + beta)).to(out_dtype)`` as
    one fused op (the pool only with ``config.pool``), updating the running statistics as eager's
    batch norm does.

    Args:
        x: ``(N, C_in, *spatial)``, 1-3 spatial dims, the conv's dtype; any layout.
        weight: conv weight, ``(C_out, C_in/groups, *k)`` or, transposed, ``(C_in, C_out/groups, *k)``.
        bias: ``(C_out,)`` or ``None``.
        operands: the norm's weight (gamma) and bias (beta) at ``config.weight`` / ``config.bias``
            (C values each), the tensors the chain's ``TensorRef`` operands refer to, then, with
            ``config.running_stats``, ``running_mean`` and ``running_var`` (C values each, updated in
            place with ``config.momentum``).
        config: ``ConvBatchNormConfig.to_json()``.

    Returns:
        The conv output's shape (with ``config.pool``, the pooled shape), in its memory format; dtype
        ``out_dtype`` (default the conv's).
        Differentiable in x, weight, bias and every chain or affine operand.  State for the backward
        (the conv output, the (3, C) statistics and a max pool's int8 winners) is kept only when
        autograd will need it.
    """
    ops, running_mean, running_var = split_operands(operands, config)
    save = records_backward(x, weight, bias, ops)
    out, _, _, stats = torch.ops.fusion.conv_batch_norm_fwd(x, weight, bias, ops, config, save)
    if running_mean is not None:
        momentum = ConvBatchNormConfig.from_json(config).momentum
        torch.ops.fusion.batch_norm_running_update(running_mean, running_var, stats, momentum)
    return out


_DirectConvBatchNorm = direct_function("conv_batch_norm", _fwd_impl, _bwd_impl, outputs=2)


@profiled("fusion::conv_batch_norm_fwd")
def _conv_batch_norm_direct(x, weight, bias, operands, config):
    """``conv_batch_norm`` without the custom-op layers (the direct implementation; same contract)."""
    ops, running_mean, running_var = split_operands(operands, config)
    if records_backward(x, weight, bias, ops):
        out, stats = _DirectConvBatchNorm.apply(config, x, weight, bias, *ops)
    else:
        out, _, _, stats = _fwd_impl(x, weight, bias, ops, config, False)
    if running_mean is not None:
        with torch.no_grad():
            _running_update_impl(running_mean, running_var, stats, ConvBatchNormConfig.from_json(config).momentum)
    return out


register_direct(conv_batch_norm, _conv_batch_norm_direct)
