"""The conv of ``fusion::conv_batch_norm``'s Triton forward and its batch statistics: the library conv
and then the statistics kernel (``kernels/batch_norm.py``, one more read of the conv output), or the
conv kernel family's forward writing the statistics as it stores (``kernels/conv``: no second read),
under ``FUSION_CONV_IMPL=family`` where it serves the call.

NOTE: ``auto`` keeps the library path: on the H200 the family's conv with its statistics beat cuDNN's
conv plus the statistics pass on 4 of 12 of ResNet-50's convs (the RGB stem 1.95x, the others 1.00-1.09x)
and lost 0.70-0.86x on the rest (``CONVK_STATS=1 CONVK_TESTS=0 CONVK_BENCH=0 CONVK_SWEEP=0 bash
tools/gpu_session.sh convk``), and timing it would add its compile and tile tuning to every region's
measurement, where whole-network first calls are held to 1.25x Inductor's.  :func:`timed_candidates`
is the measured choice ``auto`` would make, the same ``impl_choice`` the other conv paths use,
exercised by the tests."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ... import environment, impl_choice
from ...errors import UnsupportedInputError
from ...impl_choice import results_agree
from ...kernels.host import tensor_key
from .. import conv_precision
from ..batch_statistics import STATS_ROWS, fill_folded_rows
from ..library_conv import channels_last_conv, conv_forward
from .config import ConvBatchNormConfig

#: The norm's gamma and beta as the statistics' fold takes them: each None or C contiguous values.
Affine = tuple[Optional[Tensor], Optional[Tensor]]


def conv_and_statistics(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: ConvBatchNormConfig,
                        affine: Affine) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``(y0, stats)``: the conv output without bias, laid out as ``library_conv.conv_forward`` lays it
    out, and the fp32 ``(STATS_ROWS, C)`` statistics of ``y0 + bias`` (``bias``: None or C contiguous
    values) as ``kernels.batch_norm.batch_norm_stats`` writes them with its fold of ``affine`` (the
    norm's gamma and beta, each None or C contiguous values): ``batch_statistics.STATS_ROWS``' rows."""
    library = functools.partial(_library, x, weight, bias, cfg, affine)
    why = family_unsupported(x, weight, cfg)
    mode = environment.conv_impl()
    if mode == "family":
        if why is not None:
            raise UnsupportedInputError(f"{environment.CONV_IMPL}=family but the conv family's forward cannot run "
                                        f"conv_batch_norm's conv: {why}")  # fmt: skip
        return _family(x, weight, bias, cfg, affine)
    if mode != "auto" or why is not None or x.device.type != "cuda" or not MEASURE_FAMILY:
        return library()
    return timed_candidates(x, weight, bias, cfg, affine)


#: Whether ``auto`` times the family's candidate (module NOTE).
MEASURE_FAMILY = False


def timed_candidates(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: ConvBatchNormConfig,
                     affine: Affine) -> tuple[Tensor, Tensor]:  # fmt: skip
    """:func:`conv_and_statistics` by the faster of the library path and the family's, measured once per
    call signature (``impl_choice``; the family's results checked against the library path's)."""
    library = functools.partial(_library, x, weight, bias, cfg, affine)
    candidates = {"library": library, "family": functools.partial(_family, x, weight, bias, cfg, affine)}
    fast_key = ("conv_batch_norm conv", tensor_key(x), tensor_key(weight), bias is None, cfg,
                torch.backends.cudnn.allow_tf32)  # fmt: skip
    name = impl_choice.choose(lambda: _choice_key(x, weight, bias, cfg), candidates, default="library",
                              agree=results_agree, fast_key=fast_key)  # fmt: skip
    return candidates[name]()


def family_unsupported(x: Tensor, weight: Tensor, cfg: ConvBatchNormConfig) -> str | None:
    """Why the conv family's forward cannot stand in for the library conv here, or None: it runs
    direct 2-d and 3-d convs of fp32, fp16 or bf16 x and weight of one dtype, writing channels-last,
    as the library conv lays out such a conv's output (``channels_last_conv``)."""
    if cfg.conv.transposed:
        return "a transposed conv"
    if x.dtype != weight.dtype:
        return f"x in {x.dtype} and the weight in {weight.dtype}"
    if not channels_last_conv(x):
        return "a conv whose output the library path does not lay out channels-last (1-d, or not fp32/fp16/bf16)"
    return None


def _library(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: ConvBatchNormConfig,
             affine: Affine) -> tuple[Tensor, Tensor]:  # fmt: skip
    from ...kernels.batch_norm import batch_norm_stats

    y0 = conv_forward(x, weight, cfg.conv, channels_last=True)
    return y0, batch_norm_stats(y0, bias, cfg.eps, fold=affine)


def _family(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: ConvBatchNormConfig,
            affine: Affine) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The family's conv with the statistics of its stored output (``kernels.conv.conv_fprop(stats=True)``),
    in TF32 only where eager's conv of x and the weight is (``conv_precision``); the folded rows from
    them (``fill_folded_rows``)."""
    from ...kernels.conv import BatchNormForm, conv_fprop

    spec = cfg.conv
    tf32 = conv_precision.forward_tf32(x, weight, spec).tf32
    y0, st = conv_fprop(x, weight, None, stride=spec.stride, padding=spec.padding, dilation=spec.dilation,
                        groups=spec.groups, stats=True, allow_tf32=tf32, bn_form=BatchNormForm(bias, cfg.eps))  # fmt: skip
    stats = torch.empty((STATS_ROWS, y0.shape[1]), dtype=torch.float32, device=y0.device)
    stats[:3].copy_(st.form[:3])
    fill_folded_rows(stats, *affine)
    return y0, stats


def _choice_key(x: Tensor, weight: Tensor, bias: Tensor | None, cfg: ConvBatchNormConfig) -> str:
    """Everything the library-vs-family timing depends on."""
    return (f"conv_batch_norm conv|{cfg.conv.to_dict()}|x {tuple(x.shape)} {x.stride()} {x.dtype}|w "
            f"{tuple(weight.shape)} {weight.stride()}|bias {bias is not None}|tf32 {torch.backends.cudnn.allow_tf32}")
