"""The Triton path of ``fusion::conv_group_norm`` (the frame every family's: ``ops/declare.py``; the
conv here is eager's, ``run_conv``).

Forward: ``kernels/group_norm.py``'s forward (one launch, or two where large groups are split into
chunks) adds the bias, applies the pre-chain, normalises each (sample, group), scales and shifts per
channel, applies the post-chain and writes the result and the group statistics; where the region ends
in a max or avg pool, the statistics pass runs alone and ``kernels/norm_pool.py`` normalises, pools
and writes only the pooled result (and, saving for a max pool's backward, each window's winner).

Backward: ``kernels/group_norm.py``'s backward from the output gradient, the saved conv output and the
group statistics (behind a pool each position's gradient gathered from the pooled one, a max pool's
only at the saved winners), with the norm's weight and bias gradients as partial sums too.

A forward without a pool is kept as a plan per call signature (``ForwardPlan``, ``settled``): later
calls of the signature skip the checks, the chains' lowering and the launch lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ... import environment
from ...kernels.plan_cache import PlanCache, tensor_key
from ..chain import TensorRef
from ..chain_lowering import affine_rows, kernel_steps, norm_chains, norm_operand_grads, wanted_slots
from ..library_conv import conv_backward_plan
from .config import ConvGroupNormConfig, conv_outputs

#: the forward plans kept per call signature (``signature``)
PLANS = PlanCache(256)


def signature(config: str, save: bool, x: Tensor, weight: Tensor, bias: Tensor | None,
              operands: Sequence[Tensor]) -> tuple[Any, ...]:  # fmt: skip
    """What a forward plan depends on: the config, whether it saves, every tensor's shape, strides,
    dtype and device, and the switches plans follow (``environment.plan_switches``)."""
    return (config, save, tensor_key(x), tensor_key(weight), tensor_key(bias), tuple(map(tensor_key, operands)),
            *environment.plan_switches())  # fmt: skip


def settled(config: str, save: bool, x: Tensor, weight: Tensor, bias: Tensor | None,
            operands: Sequence[Tensor]) -> Any:  # fmt: skip
    """The declaration's ``settled_forward``: the plan kept for this call's signature, or None."""
    return PLANS.peek(signature(config, save, x, weight, bias, operands))


class ForwardPlan:
    """The forward without a pool for one call signature: the chains' op codes and operand matrices'
    plans, their operands' places among ``operands``, and the norm kernels' launch (per conv output
    layout) worked out once; a call convolves, allocates the outputs (``conv_outputs``), builds what
    holds values of the call (the bias and the chains' tensors as the operand matrices, the affine
    rows) and launches.  It holds no tensor of a call.

    WHY: most of a call's Python was the checks, the chains' lowering and the launch lookup, the same
    for every call of a signature, and in the default mode a small region's step waits on it.  NOTE:
    ``conv_group_norm``'s direct call on CPU tensors with the conv and the kernel launches stubbed (its
    Python alone; this repository's CPU machine): 203.5 us per call without the plan, 64.5 with it,
    52.0 with the affine rows stacked in one launch (``chain_lowering.affine_rows``)."""

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvGroupNormConfig, save: bool) -> None:  # fmt: skip
        from ...kernels.epilogue import OperandMatrix

        self.cfg, self.save = cfg, save
        channels = weight.shape[1] * cfg.conv.groups if cfg.conv.transposed else weight.shape[0]
        dims = x.dim()
        pre, post = kernel_steps(cfg.pre, operands, dims, channels), kernel_steps(cfg.post, operands, dims, channels)
        self.pre = [(code, ()) for code, _ in pre]  # the codes alone: no tensor of a call is kept
        self.post = [(code, ()) for code, _ in post]
        self.pre_matrix = OperandMatrix(pre, bias, channels, x.device)
        self.post_matrix = OperandMatrix(post, None, channels, x.device)
        self.pre_sources, self.post_sources = _sources(cfg.pre), _sources(cfg.post)
        self.channels, self.has_bias = channels, bias is not None
        self.launches: dict[tuple[int, ...], Any] = {}

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        from ...kernels.group_norm import group_norm_launch

        cfg = self.cfg
        y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, self.save)
        params = self.pre_matrix.build([*([bias] if self.has_bias else []), *(operands[i] for i in self.pre_sources)])
        post_params = self.post_matrix.build([operands[i] for i in self.post_sources])
        affine = affine_rows(operands, cfg.weight, cfg.bias, self.channels, y0.device)
        launch = self.launches.get(y0.stride())
        if launch is None:
            launch = self.launches[y0.stride()] = group_norm_launch(
                y0, self.has_bias, self.pre, self.post, cfg.groups, cfg.eps, params, post_params, affine, out,
                stats if self.save else None)  # fmt: skip
        launch(y0, params, post_params, affine, out, stats if self.save else None, float(cfg.eps))
        return out, saved_y, winner, stats


def _sources(chain: Sequence[Any]) -> tuple[int, ...]:
    """The indices into ``operands`` of a chain's tensor operands, in the operand matrix's row order."""
    return tuple(op.index for step in chain for op in step.operands if isinstance(op, TensorRef))


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGroupNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, saved_stats)`` as ``config.conv_outputs`` lays them out; without a
    pool through the call's ``ForwardPlan``, kept for the signature's later calls."""
    from ...kernels.group_norm import group_norm_forward

    if cfg.pool is None:
        plan = ForwardPlan(x, weight, bias, operands, cfg, save)
        outputs = plan(x, weight, bias, operands)
        PLANS.put(signature(cfg.to_json(), save, x, weight, bias, operands), plan)
        return outputs
    y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, save)
    chains = norm_chains(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
    if cfg.pool is None:
        group_norm_forward(y0, bias is not None, chains.pre, chains.post, cfg.groups, cfg.eps, chains.params,
                           chains.post_params, chains.affine, out, stats if save else None)  # fmt: skip
        return out, saved_y, winner, stats
    from ...kernels.group_norm import group_norm_stats
    from ...kernels.norm_pool import norm_pool_forward

    group_stats = stats if save else torch.empty((2, y0.shape[0], cfg.groups), dtype=torch.float32, device=y0.device)
    group_norm_stats(y0, bias is not None, chains.pre, cfg.groups, cfg.eps, chains.params, group_stats)
    norm_pool_forward(y0, bias is not None, chains.pre, chains.post, chains.params, chains.post_params, chains.affine,
                      group_stats, cfg.pool, out, winner if winner.numel() else None)  # fmt: skip
    return out, saved_y, winner, stats


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, cfg: ConvGroupNormConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False).  With a
    pool ``grad_out`` is the pooled result's gradient."""
    from ...kernels.group_norm import group_norm_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
    grad_y = conv_backward.new_grad_y(x.device)
    chains = norm_chains(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device)
    operand_mask = list(mask[3:])
    affine_wanted = tuple(index is not None and bool(operand_mask[index]) for index in (cfg.weight, cfg.bias))
    pre_sums, post_sums, affine_sums = group_norm_backward(
        grad_out, saved_y, saved_stats, bias is not None, chains.pre, chains.post, cfg.groups, chains.params,
        chains.post_params, chains.affine, grad_y, wanted_slots(cfg.pre, operand_mask),
        wanted_slots(cfg.post, operand_mask), affine_wanted, pool=cfg.pool,
        winner=saved_winner if saved_winner.numel() else None,
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    grads = norm_operand_grads(operands, operand_mask, cfg, [(cfg.pre, pre_sums), (cfg.post, post_sums)], affine_sums)
    return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]
