"""``ConvGlobalMeanConfig``, the static part of a ``fusion::conv_global_mean`` call (conv parameters,
per-channel affine steps, keepdim, output dtype, strict), and the shape-dependent geometry every
path shares: the per-dim index sets of the taps (host side, cached per shape) and the device tables
the kernels read (the package docstring's derivation).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ...errors import UnsupportedInputError
from ...ir.shapes import conv_output_length
from ...ir.specs import ConvSpec
from ...kernels.host import cdiv
from ..chain import ChainStep, PointwiseKind
from ..chain_lowering import channel_stride
from ..config import JsonConfig, check_dtype_names, describe_chain
from ..conv_io import conv_channels, dtype_named, output_memory_format

OP = "conv_global_mean"

#: The pointwise kinds that are affine per channel and may therefore be folded into the mean.
AFFINE_KINDS = frozenset(
    {PointwiseKind.MUL, PointwiseKind.ADD, PointwiseKind.SUB, PointwiseKind.RSUB, PointwiseKind.DIV}
)


@dataclass(frozen=True)
class ConvGlobalMeanConfig(JsonConfig):
    """Everything static about one ``conv -> per-channel affine steps -> mean over space`` region.

    * ``conv``: the convolution's hyper-parameters (``ConvSpec``; its tuples fix the spatial rank).
    * ``affine``: steps of kind mul/add/sub/rsub/div applied, in order, to the conv output (bias
      included); operands are ``Const`` or ``TensorRef`` into the op's ``operands`` list, each a 0-d,
      numel-1 or per-channel ``(C_out, 1, .., 1)`` / ``(1, C_out, 1, .., 1)`` tensor.
    * ``keepdim``: output ``(N, C_out, 1, ..., 1)`` instead of ``(N, C_out)``.
    * ``out_dtype``: dtype name of the result (``None`` = the conv's dtype, i.e. x's).
    * ``strict``: a kernel failure raises ``KernelError`` instead of warning and using the reference.

    Nothing here depends on tensor sizes, so one config string serves every input shape.
    """

    conv: ConvSpec
    affine: tuple[ChainStep, ...] = ()
    keepdim: bool = False
    out_dtype: str | None = None
    strict: bool = False

    def __post_init__(self) -> None:
        c = self.conv
        nd = c.spatial_dims
        if not 1 <= nd <= 3:
            raise ValueError(f"conv must have 1..3 spatial dims, got stride {c.stride}")
        for name in ("padding", "dilation", "output_padding"):
            if len(getattr(c, name)) != nd:
                raise ValueError(f"conv.{name} {getattr(c, name)} must have {nd} entries like stride {c.stride}")
        if c.groups < 1 or min(c.stride) < 1 or min(c.dilation) < 1 or min(c.padding) < 0:
            raise ValueError(f"invalid conv hyper-parameters: {c}")
        if not c.transposed and any(c.output_padding):
            raise ValueError(f"output_padding {c.output_padding} is only valid for a transposed conv")
        for step in self.affine:
            if step.kind not in AFFINE_KINDS:
                raise ValueError(f"affine step {step.kind.name.lower()} is not per-channel affine; allowed: "
                                 f"{sorted(k.name.lower() for k in AFFINE_KINDS)}")  # fmt: skip
        check_dtype_names(self, "out_dtype")


def outputs(x: Tensor, weight: Tensor, bias: Tensor | None, operands: Sequence[Tensor], cfg: ConvGlobalMeanConfig,
            save: bool) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Empty ``(out, tap_sums, conv_mean)`` as the real op gives them (real or fake tensors):

    * ``out``: ``(N, C_out)`` or with ``keepdim`` ``(N, C_out, 1, ..., 1)``, dtype ``out_dtype``;
    * ``tap_sums``: ``S`` of the derivation, ``(N, C_in, *kernel_size)``, fp64;
    * ``conv_mean``: ``M`` (mean of the conv output incl. bias, before the affine steps), ``(N, C_out)``, fp64.

    The state is a few numbers per (sample, channel) and the forward computes it on its way: it is
    returned whatever ``save`` says.  All contiguous.
    """
    n, c_in = x.shape[:2]
    c_out = conv_channels(weight, cfg.conv)
    out_shape = (n, c_out, *([1] * cfg.conv.spatial_dims)) if cfg.keepdim else (n, c_out)
    return (x.new_empty(out_shape, dtype=dtype_named(OP, cfg.out_dtype, x.dtype)),
            x.new_empty((n, c_in, *weight.shape[2:]), dtype=torch.float64),
            x.new_empty((n, c_out), dtype=torch.float64))  # fmt: skip


def check_inputs(x: Tensor, weight: Tensor, operands: Sequence[Tensor], cfg: ConvGlobalMeanConfig) -> None:
    """One-line ``UnsupportedInputError`` for an x and weight that do not fit the conv (the bias:
    ``check_bias``)."""
    _check_shapes(cfg.conv, x.shape, weight.shape)


def operand_index(ref: Any, count: int) -> int:
    """The index of a ``TensorRef`` step operand into ``operands``; ``UnsupportedInputError`` when the
    call gave only ``count`` operands."""
    if not 0 <= ref.index < count:
        raise UnsupportedInputError(f"{OP}: affine step refers to operand {ref.index}, but {count} were given")
    return ref.index


def check_bias(cfg: ConvGlobalMeanConfig, weight: Tensor, bias: Tensor | None) -> None:
    """``UnsupportedInputError`` unless ``bias`` is None or has ``(C_out,)`` values."""
    if bias is not None and tuple(bias.shape) != (conv_channels(weight, cfg.conv),):
        raise UnsupportedInputError(f"{OP}: bias must have shape ({conv_channels(weight, cfg.conv)},), "
                                    f"got {tuple(bias.shape)}")  # fmt: skip


@functools.lru_cache(maxsize=256)
def _check_shapes(spec: ConvSpec, x_shape: torch.Size, w_shape: torch.Size) -> None:
    """Cached: runs on every call; a raise is not cached, so a bad call raises every time."""
    nd = spec.spatial_dims
    if len(x_shape) != nd + 2 or len(w_shape) != nd + 2:
        raise UnsupportedInputError(f"{OP}: a {nd}-d conv needs batched x and weight of rank {nd + 2}, got x "
                                    f"{tuple(x_shape)} and weight {tuple(w_shape)}")  # fmt: skip
    g = spec.groups
    c_in = x_shape[1]
    expected_cin = w_shape[0] if spec.transposed else w_shape[1] * g
    if c_in != expected_cin or (spec.transposed and c_in % g) or (not spec.transposed and w_shape[0] % g):
        raise UnsupportedInputError(f"{OP}: x {tuple(x_shape)} does not match weight {tuple(w_shape)} with "
                                    f"groups={g} (transposed={spec.transposed})")  # fmt: skip


def channel_stride_meta(shape: tuple[int, ...], stride: tuple[int, ...], c_out: int, out_rank: int) -> int:
    """Element stride between the channels of an affine operand, 0 for a one-element operand
    (``chain_lowering.channel_stride``); ``UnsupportedInputError`` for a shape that is neither."""
    found = channel_stride(shape, stride, c_out, out_rank)
    if found is None:
        ones = (1,) * (out_rank - 2)
        raise UnsupportedInputError(f"{OP}: affine operand of shape {tuple(shape)} is neither a single element nor "
                                    f"per-channel ({(c_out, *ones)} or {(1, c_out, *ones)})")  # fmt: skip
    return found


def describe(cfg: ConvGlobalMeanConfig) -> str:
    """``affine [mul, add], keepdim`` for messages."""
    return f"affine [{describe_chain(cfg.affine)}]{', keepdim' if cfg.keepdim else ''}"


def call_problem(cfg: ConvGlobalMeanConfig, x: Any, weight: Tensor) -> str | None:
    """Why the kernels cannot serve this call's shapes (x: a tensor or ``XMeta``), or None: a spatial
    dim with more distinct tap index sets than an int32 table holds bits (a kernel wider than 31)."""
    geo = call_geometry(cfg, x, weight, x.device)
    if geo.bits is None:
        return f"a spatial dim has {max(geo.set_counts)} distinct tap index sets (the kernels support {MAX_TABLE_BITS})"
    return None


def grad_input_strides(x: Tensor) -> tuple[int, ...]:
    """Strides of the input gradient eager autograd gives for x: channels_last(_3d) when x is in that
    format (and not also contiguous), else contiguous.  Plain arithmetic: x may have symbolic sizes."""
    size = tuple(x.shape)
    last = len(size) - 1
    # the dims from innermost to outermost: (N, C, *S) as stored, or (N, *S, C) channels-last
    order = range(last, -1, -1) if output_memory_format(x) is torch.contiguous_format else (1, *range(last, 1, -1), 0)
    strides, acc = [0] * len(size), 1
    for d in order:
        strides[d] = acc
        acc *= max(size[d], 1)
    return tuple(strides)


def as_5d(t: Tensor) -> Tensor:
    """``t`` with unit spatial dims inserted after the channels up to 3 spatial dims (the kernels' view)."""
    while t.dim() < 5:
        t = t.unsqueeze(2)
    return t


@dataclass(frozen=True)
class DimSets:
    """The distinct valid input-index sets of one spatial dim.

    Set ``j`` is ``{lo + m*step : 0 <= m <= (hi - lo) // step}`` for ``(lo, hi) = sets[j]``; an empty
    set is ``(0, -1)``.  ``tap_to_set[t]`` is the set of tap ``t``; ``out_length`` is the conv's
    output length along this dim.
    """

    length: int
    out_length: int
    step: int
    sets: tuple[tuple[int, int], ...]
    tap_to_set: tuple[int, ...]

    def members(self, j: int) -> range:
        lo, hi = self.sets[j]
        return range(lo, hi + 1, self.step)


def dim_sets(
    transposed: bool, length: int, kernel: int, stride: int, padding: int, dilation: int, output_padding: int
) -> DimSets:
    """Valid input-index set of every tap along one dim (see the module docstring for the derivation).

    Raises ``UnsupportedInputError`` when the conv would have no output along this dim.
    """
    out_len = conv_output_length(length, kernel, stride, padding, dilation, transposed, output_padding)
    if out_len <= 0 or length <= 0:
        raise UnsupportedInputError(
            f"conv_global_mean: input length {length} with kernel {kernel}, stride {stride}, padding "
            f"{padding}, dilation {dilation} gives output length {out_len}; the conv itself would fail"
        )
    raw: list[tuple[int, int]] = []
    for t in range(kernel):
        off = t * dilation - padding
        if transposed:
            # o = i*s + off must satisfy 0 <= o < O; i itself in [0, L).
            lo = max(0, cdiv(-off, stride))
            hi = min(length - 1, (out_len - 1 - off) // stride)
        else:
            # i = o*s + off for o in [0, O), kept when 0 <= i < L.
            o_lo = max(0, cdiv(-off, stride))
            o_hi = min(out_len - 1, (length - 1 - off) // stride)
            lo, hi = o_lo * stride + off, o_hi * stride + off
        raw.append((lo, hi) if lo <= hi else (0, -1))
    distinct = tuple(dict.fromkeys(raw))
    step = 1 if transposed else stride
    return DimSets(length, out_len, step, distinct, tuple(distinct.index(r) for r in raw))


@dataclass(frozen=True, eq=False)
class Geometry:
    """Everything shape-dependent about one call, built once per (config, shapes, device).

    ``dims`` has exactly three entries: real spatial dims are the last ones; missing leading dims are
    trivial (length 1, one set ``{0}``).  ``masks[d]`` is the ``(J_d, L_d)`` bool membership matrix of
    dim ``d`` (reference path); ``bits`` are the kernels' int32 tables (``None`` when a dim has more
    sets than an int32 holds bits); ``tap_onehot`` is ``(T, J)`` fp64 with ``T`` the kernel's taps
    (row-major over the real dims) and ``J = J1*J2*J3`` the product sets (index ``(j1*J2 + j2)*J3 + j3``);
    ``tapset`` is the same map as an int32 ``(T,)`` table (the kernels' view of it).
    """

    dims: tuple[DimSets, DimSets, DimSets]
    n_outputs: int
    masks: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    bits: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    tap_onehot: torch.Tensor
    tapset: torch.Tensor

    @property
    def set_counts(self) -> tuple[int, int, int]:
        return (len(self.dims[0].sets), len(self.dims[1].sets), len(self.dims[2].sets))


_TRIVIAL_DIM = DimSets(length=1, out_length=1, step=1, sets=((0, 0),), tap_to_set=(0,))


MAX_TABLE_BITS = 31


def _membership(ds: DimSets) -> torch.Tensor:
    idx = torch.arange(ds.length)
    lo = torch.tensor([s[0] for s in ds.sets])[:, None]
    hi = torch.tensor([s[1] for s in ds.sets])[:, None]
    return (idx >= lo) & (idx <= hi) & ((idx - lo) % ds.step == 0)


# NOTE: never evicts: a CUDA graph recorded over the kernels keeps the tables' addresses (entries are
# a few KB: int32 tables of the spatial sizes and small masks).
@functools.cache
def geometry_for(
    spec: ConvSpec, in_sizes: tuple[int, ...], kernel: tuple[int, ...], device: torch.device
) -> Geometry:
    """Built on the host, then copied once to ``device`` (``persistent_device_copies``: outside any
    CUDA-graph memory pool)."""
    from ...kernels.host import persistent_device_copies

    real = [
        dim_sets(spec.transposed, L, k, s, p, d, op)
        for L, k, s, p, d, op in zip(
            in_sizes, kernel, spec.stride, spec.padding, spec.dilation, spec.output_padding, strict=True
        )
    ]
    dims = (*[_TRIVIAL_DIM] * (3 - len(real)), *real)
    masks = tuple(_membership(ds) for ds in dims)
    bits: tuple[torch.Tensor, ...] = ()
    if all(len(ds.sets) <= MAX_TABLE_BITS for ds in dims):
        weights = [(1 << torch.arange(len(ds.sets), dtype=torch.int64))[:, None] for ds in dims]
        bits = tuple(
            (m.to(torch.int64) * w).sum(0).to(torch.int32).contiguous()
            for m, w in zip(masks, weights, strict=True)
        )
    counts = [len(ds.sets) for ds in dims]
    taps = math.prod(kernel)
    onehot = torch.zeros((taps, math.prod(counts)), dtype=torch.float64)
    tapset = []
    for t, tap in enumerate(itertools.product(*(range(len(ds.tap_to_set)) for ds in dims))):
        j1, j2, j3 = (ds.tap_to_set[k] for ds, k in zip(dims, tap, strict=True))
        onehot[t, (j1 * counts[1] + j2) * counts[2] + j3] = 1.0
        tapset.append((j1 * counts[1] + j2) * counts[2] + j3)
    n_out = math.prod(ds.out_length for ds in real)
    table = torch.tensor(tapset, dtype=torch.int32)
    m1, m2, m3, *on_device = persistent_device_copies([*masks, *bits, onehot, table], device)
    *bits_d, onehot_d, table_d = on_device
    return Geometry(dims, n_out, (m1, m2, m3), tuple(bits_d) if bits else None, onehot_d, table_d)  # type: ignore[arg-type]


def call_geometry(cfg: ConvGlobalMeanConfig, x: Any, weight: Tensor, device: torch.device) -> Geometry:
    """``geometry_for`` a call: x's spatial sizes (x: a tensor or ``XMeta``), the weight's kernel size."""
    return geometry_for(cfg.conv, tuple(x.shape[2:]), tuple(weight.shape[2:]), device)
