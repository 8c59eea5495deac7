"""The Triton path of ``fusion::conv_batch_norm`` (the frame every family's: ``ops/declare.py``).

Forward: the conv and its statistics (``statistics.py``: the library conv and ``kernels/batch_norm.py``'s
statistics kernel, per channel and chunk, with their fixed-order combine, which also writes the norm's
gamma and beta as rows of the statistics, the affine every later kernel reads, forward and backward; or,
under ``FUSION_CONV_IMPL=family``, the conv family writing them as it stores), and the kernel that adds the
bias, normalises, scales and shifts per channel, applies the post-chain and writes the result; where
the region ends in a max or avg pool, the normalise pass is ``kernels/norm_pool.py``'s, which writes
only the pooled result (and the max pool's winners when the backward will need them).  The running
statistics' update is an op of its own.

Backward: two kernels (``kernels/batch_norm.py``) from the output gradient, the saved conv output and
the per-channel statistics (the sums the norm's gradient needs combined in a fixed order between
them), which also give the norm's weight and bias gradients (behind a pool, each position's gradient
gathered from the pooled one: a max pool's only at the saved winners).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from ..batch_statistics import AFFINE_ROWS, norm_fold
from ..chain_lowering import norm_chains, norm_operand_grads, wanted_slots
from ..conv_io import conv_channels
from ..library_conv import conv_backward_plan
from .config import ConvBatchNormConfig, conv_outputs
from .statistics import conv_and_statistics


def forward(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvBatchNormConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """``(out, saved_y, saved_winner, stats)`` as ``config.conv_outputs`` lays them out."""
    from ...kernels.batch_norm import batch_norm_apply

    fold = norm_fold(operands, cfg)
    computed = conv_and_statistics(x, weight, None if bias is None else bias.reshape(-1).contiguous(), cfg, fold)
    y0, out, saved_y, winner, stats = conv_outputs(x, weight, cfg, save, computed=computed)  # STATS_ROWS' rows
    chains = norm_chains(cfg, bias, operands, x.dim(), conv_channels(weight, cfg.conv), x.device,
                         affine=stats[AFFINE_ROWS])  # fmt: skip
    norm_stats = stats[:2]
    if cfg.pool is None:
        batch_norm_apply(y0, chains.bias, chains.post, chains.post_params, chains.affine, norm_stats, out)
    else:
        from ...kernels.norm_pool import norm_pool_forward

        # the bias in its row of ``params``, no pre-chain
        norm_pool_forward(y0, bias is not None, [], chains.post, chains.params, chains.post_params, chains.affine,
                          norm_stats, cfg.pool, out, winner if winner.numel() else None)  # fmt: skip
    return out, saved_y, winner, stats


def backward(grad_out: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor],
             saved_y: Tensor, saved_winner: Tensor, saved_stats: Tensor, cfg: ConvBatchNormConfig,
             mask: Sequence[bool]) -> list[Tensor | None]:  # fmt: skip
    """``[grad_x, grad_weight, grad_bias, *grad_operands]`` (None where ``mask`` is False).  With a
    pool ``grad_out`` is the pooled result's gradient."""
    from ...kernels.batch_norm import batch_norm_backward

    conv_backward = conv_backward_plan(x, weight, cfg.conv, saved_y)
    grad_y = conv_backward.new_grad_y(x.device)
    chains = norm_chains(cfg, bias, operands, saved_y.dim(), saved_y.shape[1], x.device,
                         affine=saved_stats[AFFINE_ROWS])  # fmt: skip
    operand_mask = list(mask[3:])
    dgamma, dbeta, post_sums = batch_norm_backward(
        grad_out, saved_y, chains.bias, chains.post, chains.post_params, chains.affine, saved_stats[:2], grad_y,
        wanted_slots(cfg.post, operand_mask), cfg.pool, saved_winner if saved_winner.numel() else None,
    )  # fmt: skip
    grad_x, grad_w, grad_b = conv_backward(grad_y, x, weight, mask[0], mask[1], bool(mask[2]))
    wanted = [total if index is not None and operand_mask[index] else None
              for index, total in ((cfg.weight, dgamma), (cfg.bias, dbeta))]  # fmt: skip
    grads = norm_operand_grads(operands, operand_mask, cfg, [(cfg.post, post_sums)], wanted)
    return [grad_x, grad_w, None if grad_b is None else exact_zero_bias_grad(grad_b).to(bias.dtype), *grads]


def exact_zero_bias_grad(grad_b: Tensor) -> Tensor:
    """The conv bias's gradient, ``grad_b`` (the library conv's sum of the conv output's gradient), as
    its exact value: zero, NaN where ``grad_b`` is not finite.  The batch statistics subtract each
    channel's mean over every value the bias shifts alike, so the norm's output does not depend on the
    bias: the computed sum is rounding residue (eager's is too), and its size is a coin flip of the
    summation order.
    NOTE: over 24 draws of a conv 8->16 -> BatchNorm2d -> ReLU on 4x8x12x10 (fp32, TF32 off, H200) that
    residue's largest magnitude had a median of 7.6e-6 in eager and 1.05e-5 in the fused op, each draw's
    between 4.8e-6 and 1.9e-5 (``docs/perf/RESULTS.md``, "BatchNorm's passes pipelined")."""
    return grad_b * 0
