"""What the ops with a batch norm in training mode share (``conv_batch_norm``, ``batch_norm_conv``): the
count rule of batch statistics, eager's update of the running statistics, and the op that applies it.

The update is an op of its own, ``fusion::batch_norm_running_update(running_mean, running_var, stats,
momentum)``, which mutates them and says so (``mutates_args``), so that AOTAutograd functionalizes the
call (the buffers are graph inputs it copies the new values back into) and Inductor keeps the update;
the direct runner calls :func:`running_update` eagerly, which updates them in place.  Why apart from the
fused ops: torch.library takes no autograd formula for an op that mutates its arguments, and their
forwards need one.  ``stats`` is a fused op's saved statistics, rows 0 (the batch mean) and 2 (the
unbiased batch variance) read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import UnsupportedInputError

#: Rows of a training batch norm's saved statistics, as ``kernels.batch_norm.batch_norm_stats`` writes them
#: with its fold in one combine launch: the batch mean, ``rstd = 1 / sqrt(var + eps)`` (var biased), the
#: unbiased variance (what the running variance is updated with), the norm folded with its affine
#: (``scale = gamma * rstd``, ``shift = beta - mean * scale``: what a conv's prologue applies), then gamma
#: and beta in the statistics' dtype (1 and 0 without them): the affine rows the norm's kernels read, so
#: that no call copies the norm's weight and bias into rows of their own.
STATS_ROWS = 7
AFFINE_ROWS = slice(5, 7)


def norm_fold(operands: Sequence[Tensor], cfg: Any) -> tuple[Tensor | None, Tensor | None]:
    """The norm's gamma and beta (``operands`` at ``cfg.weight`` / ``cfg.bias``, None where absent) as C
    contiguous values each: what ``kernels.batch_norm.batch_norm_stats`` folds into ``STATS_ROWS``."""
    return tuple(None if i is None else operands[i].reshape(-1).contiguous()  # type: ignore[return-value]
                 for i in (cfg.weight, cfg.bias))  # fmt: skip


def fill_folded_rows(stats: Tensor, gamma: Tensor | None, beta: Tensor | None) -> None:
    """Rows 3-6 of ``stats`` (``STATS_ROWS``) from its rows 0-1 and the norm's weight and bias (None: 1
    and 0; any shape of C values), as the kernels' combine writes them; for the paths that compute the
    first rows another way (the references, the conv family's statistics)."""
    mean, rstd = stats[0], stats[1]
    gamma = torch.ones_like(rstd) if gamma is None else gamma.detach().reshape(-1).to(stats.dtype)
    beta = torch.zeros_like(rstd) if beta is None else beta.detach().reshape(-1).to(stats.dtype)
    scale = gamma * rstd
    for row, value in zip(stats[3:STATS_ROWS], (scale, beta - mean * scale, gamma, beta), strict=True):
        row.copy_(value)


def values_per_channel(shape: Sequence[int]) -> int:
    """How many values each channel's batch statistics cover in a tensor of ``shape``: ``N *
    prod(spatial)``; exactly one is eager's ``ValueError`` (zero is an empty batch: an empty result,
    the running statistics unchanged)."""
    count = shape[0] * math.prod(shape[2:])
    if count == 1:
        raise ValueError(f"Expected more than 1 value per channel when training, got input size {torch.Size(shape)}")
    return count


def update_running_stats(running_mean: Tensor, running_var: Tensor, stats: Tensor, momentum: float) -> None:
    """Eager's in-place update ``running = (1 - m) * running + m * batch`` with the batch mean and
    unbiased variance (``stats`` rows 0 and 2), computed as ``running + m * (batch - running)``
    (``lerp``: within an ulp of eager's form) in the statistics' dtype and stored in the running
    statistics' own.  NOTE: where those dtypes agree (fp32 buffers, the common case), one foreach launch
    for both, where eager's form took eight small kernels (mul, mul, add, copy per statistic), each a
    few microseconds of a training step's GPU time under CUDA graphs."""
    if running_mean.dtype == running_var.dtype == stats.dtype:
        torch._foreach_lerp_([running_mean, running_var], [stats[0], stats[2]], momentum)
        return
    running_mean.copy_(torch.lerp(running_mean.to(stats.dtype), stats[0], momentum))
    running_var.copy_(torch.lerp(running_var.to(stats.dtype), stats[2], momentum))


def running_update(running_mean: Tensor, running_var: Tensor, stats: Tensor, momentum: float) -> None:
    """:func:`update_running_stats` of the running statistics as a graph passes them (any shape of C
    floating values), after checking them (one-line ``UnsupportedInputError``)."""
    for name, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t.numel() != stats.shape[1] or not t.is_floating_point():
            raise UnsupportedInputError(f"fusion::batch_norm_running_update: {name} must hold {stats.shape[1]} "
                                        f"floating values, got {tuple(t.shape)} {t.dtype}")  # fmt: skip
    update_running_stats(running_mean.view(-1), running_var.view(-1), stats, momentum)


batch_norm_running_update = torch.library.custom_op(
    "fusion::batch_norm_running_update", mutates_args=("running_mean", "running_var"))(running_update)


@batch_norm_running_update.register_fake
def _running_update_fake(running_mean, running_var, stats, momentum):
    return None
