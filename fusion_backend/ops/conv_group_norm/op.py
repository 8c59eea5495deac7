"""``fusion::conv_group_norm``'s entry points and registrations: ``conv_group_norm`` (what rewritten
graphs call), the two custom ops with their fakes, the autograd formula, and the autograd-free and
direct implementations.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..conv_epilogue.common import backward_outputs, fake_backward_outputs, run_conv
from ..direct_impls import profiled, records_backward, register_direct
from ..failure import check_backward_call, triton_or_reference
from ..saved_state import direct_function, register_saved_state_ops
from . import reference
from .backward import backward_triton
from .common import allocate_forward_outputs, check_inputs, on_kernel_failure, use_triton
from .config import ConvGroupNormConfig
from .forward import forward_triton


def _fwd_impl(x: Tensor, weight: Tensor, bias: Tensor | None, operands: list[Tensor], config: str,
              save_for_backward: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, saved_stats)`` (``common.allocate_forward_outputs``): the Triton
    path where it serves the call, else (or when a kernel fails, per the failure policy) the reference."""
    cfg = ConvGroupNormConfig.from_json(config)
    check_inputs(x, weight, operands, cfg)
    args = (x, weight, bias, operands, cfg, save_for_backward)
    return triton_or_reference(use_triton(config, cfg, x), lambda: forward_triton(*args),
                               lambda: reference.forward(*args),
                               lambda e: on_kernel_failure("forward", config, cfg, x, weight, e))  # fmt: skip


def _fwd_fake(x, weight, bias, operands, config, save_for_backward):
    cfg = ConvGroupNormConfig.from_json(config)
    y0 = run_conv(x, weight, None, cfg.conv)
    return allocate_forward_outputs(x, y0, cfg, save_for_backward)


def _bwd_impl(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: list[Tensor],
              saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, config: str,
              output_mask: list[bool]) -> list[Tensor]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]``; entries whose mask is False are empty
    placeholders; the others have their input's shape, dtype and ``empty_like`` strides."""
    cfg = ConvGroupNormConfig.from_json(config)
    check_backward_call("conv_group_norm", output_mask, len(operands), saved_stats)
    args = (grad_out, x, weight, bias, operands, saved_y, saved_winner, saved_stats, cfg, output_mask)
    grads = triton_or_reference(use_triton(config, cfg, x), lambda: backward_triton(*args),
                                lambda: reference.backward(*args),
                                lambda e: on_kernel_failure("backward", config, cfg, x, weight, e))  # fmt: skip
    return backward_outputs(grads, [x, weight, bias, *operands], output_mask, x)


def _bwd_fake(grad_out, x, weight, bias, operands, saved_y, saved_winner, saved_stats, config, output_mask):
    return fake_backward_outputs([x, weight, bias, *operands], output_mask, x)


conv_group_norm_fwd, conv_group_norm_bwd = register_saved_state_ops("conv_group_norm", _fwd_impl, _fwd_fake, _bwd_impl, _bwd_fake)


def conv_group_norm(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                    config: str) -> Tensor:  # fmt: skip
    """``post(group_norm(pre(conv(x, weight, bias))) * gamma + beta).to(out_dtype)`` as one fused op.

    Args:
        x: ``(N, C_in, *spatial)``, 1-3 spatial dims, the conv's dtype; any layout.
        weight: conv weight, ``(C_out, C_in/groups, *k)`` or, transposed, ``(C_in, C_out/groups, *k)``.
        bias: ``(C_out,)`` or ``None``.
        operands: the norm's weight (gamma) and bias (beta) at ``config.weight`` / ``config.bias``
            (C values each), and the tensors the chains' ``TensorRef`` operands refer to.
        config: ``ConvGroupNormConfig.to_json()``.

    Returns:
        The conv output's shape (with ``config.pool``, the pooled shape), in its memory format; dtype
        ``out_dtype`` (default the conv's).  Differentiable in x, weight, bias and every operand.
        State for the backward (the conv output, the (2, N, groups) statistics and a max pool's int8
        winners) is kept only when autograd will need it.
    """
    save = records_backward(x, weight, bias, operands)
    return torch.ops.fusion.conv_group_norm_fwd(x, weight, bias, list(operands), config, save)[0]


_DirectConvGroupNorm = direct_function("conv_group_norm", _fwd_impl, _bwd_impl)


@profiled("fusion::conv_group_norm_fwd")
def _conv_group_norm_direct(x, weight, bias, operands, config):
    """``conv_group_norm`` without the custom-op layers (the direct implementation; same contract)."""
    if records_backward(x, weight, bias, operands):
        return _DirectConvGroupNorm.apply(config, x, weight, bias, *operands)
    return _fwd_impl(x, weight, bias, list(operands), config, False)[0]


register_direct(conv_group_norm, _conv_group_norm_direct)
