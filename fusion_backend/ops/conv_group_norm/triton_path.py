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

A forward without a pool and every backward are kept as plans per call signature (``ForwardPlan``,
``BackwardPlan``; ``settled``, ``settled_backward``): later calls of the signature skip the checks, the
chains' lowering and the launch lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ... import environment
from ...kernels.plan_cache import PlanCache, tensor_key
from ..chain_lowering import PlannedChains, norm_chains, norm_operand_grads, wanted_slots
from ..conv_io import conv_channels
from ..library_conv import conv_alone, conv_alone_plan, conv_backward_plan
from .config import ConvGroupNormConfig, conv_outputs

#: the forward and backward plans kept per call signature (``signature``, ``backward_signature``)
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
    """The forward without a pool for one call signature: the chains lowered (``PlannedChains``) and the
    norm kernels' launch (per conv output layout) worked out once; a call convolves, allocates the
    outputs (``conv_outputs``), builds what holds the call's values (the bias and the chains' tensors as
    the operand matrices, the affine rows) and launches.  It holds no tensor of a call.

    WHY: most of a call's Python was the checks, the chains' lowering and the launch lookup, the same
    for every call of a signature, and in the default mode a small region's step waits on it.  NOTE:
    the forward's Python with the conv and the kernel launches stubbed, ``python tools/op_host_cpu.py``
    on this repository's CPU machine: 51 us per call with the plans kept, 219-222 without (the affine
    rows stacked in one launch, ``chain_lowering.affine_rows``, both ways)."""

    def __init__(self, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 cfg: ConvGroupNormConfig, save: bool) -> None:  # fmt: skip
        self.cfg, self.save = cfg, save
        self.chains = PlannedChains(cfg, bias, operands, x.dim(), conv_channels(weight, cfg.conv), x.device)
        self.launches: dict[tuple[int, ...], Any] = {}
        #: a call that saves nothing: its conv as ``library_conv.ConvAlone`` chooses, planned at the first call
        self.conv_plan = None

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None,
                 operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
        from ...kernels.group_norm import group_norm_launch

        cfg, chains = self.cfg, self.chains
        alone = None
        if not self.save:
            if self.conv_plan is None:
                self.conv_plan = conv_alone_plan(x, weight, cfg.conv)
            alone = self.conv_plan(x, weight)
        y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, self.save, alone)
        params, post_params, affine = chains.bind(bias, operands)
        stats_out = stats if self.save else None
        launch = self.launches.get(y0.stride())
        if launch is None:
            launch = self.launches[y0.stride()] = group_norm_launch(
                y0, chains.has_bias, chains.pre, chains.post, cfg.groups, cfg.eps, params, post_params, affine, out,
                stats_out)  # fmt: skip
        launch(y0, params, post_params, affine, out, stats_out, float(cfg.eps))
        return out, saved_y, winner, stats


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGroupNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, saved_stats)`` as ``config.conv_outputs`` lays them out; without a
    pool through the call's ``ForwardPlan``, kept for the signature's later calls."""
    if cfg.pool is None:
        plan = ForwardPlan(x, weight, bias, operands, cfg, save)
        outputs = plan(x, weight, bias, operands)
        PLANS.put(signature(cfg.to_json(), save, x, weight, bias, operands), plan)
        return outputs
    alone = None if save else conv_alone(x, weight, cfg.conv)
    y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, save, alone)
    chains = norm_chains(cfg, bias, operands, y0.dim(), y0.shape[1], y0.device)
    from ...kernels.group_norm import group_norm_stats
    from ...kernels.norm_pool import norm_pool_forward

    group_stats = stats if save else torch.empty((2, y0.shape[0], cfg.groups), dtype=torch.float32, device=y0.device)
    group_norm_stats(y0, bias is not None, chains.pre, cfg.groups, cfg.eps, chains.params, group_stats)
    norm_pool_forward(y0, bias is not None, chains.pre, chains.post, chains.params, chains.post_params, chains.affine,
                      group_stats, cfg.pool, out, winner if winner.numel() else None)  # fmt: skip
    return out, saved_y, winner, stats


class BackwardPlan:
    """The backward for one call signature (``ForwardPlan``'s counterpart, a pool included): the chains
    lowered, the wanted sums and the norm kernels' launch (per conv-output gradient layout) worked out
    once; a call builds the operand matrices and the affine rows from its values, launches, runs the
    conv's backward and gathers the operands' gradients.  It holds no tensor of a call.  NOTE: the
    backward's Python, measured as the forward's (``ForwardPlan``): 126 us per call with the plans kept,
    318-325 without."""

    def __init__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 saved_y: Tensor, cfg: ConvGroupNormConfig, mask: Sequence[bool]) -> None:  # fmt: skip
        self.cfg, self.mask, self.operand_mask = cfg, tuple(mask), list(mask[3:])
        self.chains = PlannedChains(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device)
        self.slots = (wanted_slots(cfg.pre, self.operand_mask), wanted_slots(cfg.post, self.operand_mask),
                      tuple(i is not None and bool(self.operand_mask[i]) for i in (cfg.weight, cfg.bias)))  # fmt: skip
        self.launches: dict[tuple[int, ...], Any] = {}
        #: a call that saves nothing: its conv as ``library_conv.ConvAlone`` chooses, planned at the first call
        self.conv_plan = None

    def __call__(self, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
                 saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor) -> list[Tensor | None]:  # fmt: skip
        from ...kernels.group_norm import group_norm_backward_launch

        cfg, mask, chains = self.cfg, self.mask, self.chains
        conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
        grad_y = conv_backward.new_grad_y(x.device)
        params, post_params, affine = chains.bind(bias, operands)
        winner = saved_winner if saved_winner.numel() else None
        launch = self.launches.get(grad_y.stride())
        if launch is None:
            launch = self.launches[grad_y.stride()] = group_norm_backward_launch(
                grad_out, saved_y, saved_stats, chains.has_bias, chains.pre, chains.post, cfg.groups, params,
                post_params, affine, grad_y, *self.slots, pool=cfg.pool, winner=winner)  # fmt: skip
        pre_sums, post_sums, affine_sums = launch(grad_out, saved_y, saved_stats, params, post_params, affine, grad_y,
                                                  winner)  # fmt: skip
        grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
        grads = norm_operand_grads(operands, self.operand_mask, cfg, [(cfg.pre, pre_sums), (cfg.post, post_sums)],
                                   affine_sums)  # fmt: skip
        return [grad_x, grad_w, None if grad_b is None else grad_b.to(bias.dtype), *grads]


def backward_signature(config: str, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                       operands: Sequence[Tensor], saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor,
                       mask: Sequence[bool]) -> tuple[Any, ...]:  # fmt: skip
    """What a backward plan depends on (``signature``'s parts, the gradient's and the saved state's)."""
    return (signature(config, True, x, weight, bias, operands), tuple(mask), tensor_key(grad_out),
            tensor_key(saved_y), tensor_key(saved_winner), tensor_key(saved_stats))  # fmt: skip


def settled_backward(config: str, grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None,
                     operands: Sequence[Tensor], saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor,
                     mask: Sequence[bool]) -> Any:  # fmt: skip
    """The declaration's ``settled_backward``: the plan kept for this call's signature, or None."""
    return PLANS.peek(backward_signature(config, grad_out, x, weight, bias, operands, saved_y, saved_winner,
                                         saved_stats, mask))  # fmt: skip


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, cfg: ConvGroupNormConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False), through the
    call's ``BackwardPlan``, kept for the signature's later calls.  With a pool ``grad_out`` is the
    pooled result's gradient."""
    plan = BackwardPlan(grad_out, x, weight, bias, operands, saved_y, cfg, mask)
    grads = plan(grad_out, x, weight, bias, operands, saved_y, saved_winner, saved_stats)
    PLANS.put(backward_signature(cfg.to_json(), grad_out, x, weight, bias, operands, saved_y, saved_winner,
                                 saved_stats, mask), plan)  # fmt: skip
    return grads
