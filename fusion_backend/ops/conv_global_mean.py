"""Fused op ``conv_global_mean``: the mean over all spatial positions of a convolution, done algebraically.

``conv_global_mean(x, weight, bias, operands, config)`` returns, per batch element and output channel,

    mean over all output positions o of affine(conv(x, weight, bias))[n, co, o]

for a regular or transposed convolution (1-d/2-d/3-d, any stride, padding, dilation, output_padding,
groups) followed by per-channel affine steps (mul/add/sub/rsub/div by a constant, a 0-d or a
per-channel tensor), without ever producing the convolution output.  Shape ``(N, C_out)``, or
``(N, C_out, 1, ..., 1)`` with ``keepdim``.

Derivation (exact for every configuration)
------------------------------------------
*Affine fold.*  Every step maps ``v -> a*v + b`` with per-channel ``a``, ``b`` constant over space, so
the composition is ``v -> A[co]*v + B[co]`` and the mean commutes with it:
``out = A * M + B`` with ``M[n, co] = mean_o conv(x)[n, co, o]``.

*Mean of a convolution.*  Write the conv as a sum over taps ``t`` (a multi-index into the kernel) of
``W[co, ci, t] * x[n, ci, i(o, t)]`` over the pairs (output o, input i) that the tap connects.  Summing
over all in-bounds outputs and swapping the sums,

    sum_o conv(x)[n, co, o] = sum_ci sum_t W[co, ci, t] * S[n, ci, t] + bias[co] * P,
    S[n, ci, t] = sum of x[n, ci, i] over V_t,   P = number of output positions,

where ``V_t`` is the set of input positions that tap ``t`` connects to an in-bounds output.  ``V_t`` is
a product over spatial dims of 1-d sets ``V_t = V^1_{t1} x ... x V^D_{tD}`` because the index maps
act per dim.  Per dim (input length L, kernel k, stride s, padding p, dilation d, output length O):

* regular conv, ``O = (L + 2p - d(k-1) - 1) // s + 1``: tap ``t`` reads ``i = o*s - p + t*d`` for
  ``0 <= o < O``; it is valid when ``0 <= i < L``, so ``o`` runs over
  ``[max(0, ceil((p - t*d)/s)), min(O - 1, floor((L - 1 + p - t*d)/s))]`` and ``V_t`` is the arithmetic
  progression ``{o*s - p + t*d}`` over that range: step ``s``, *not* a contiguous range when ``s > 1``
  (padding reads zeros and contributes nothing, which is why padding only clips the range).
* transposed conv, ``O = (L - 1)*s - 2p + d(k-1) + output_padding + 1``: input ``i`` and tap ``t``
  write ``o = i*s - p + t*d``, kept when ``0 <= o < O``.  Distinct ``i`` give distinct ``o``, so ``V_t``
  is the contiguous range ``[max(0, ceil((p - t*d)/s)), min(L - 1, floor((O - 1 + p - t*d)/s))]``
  (output_padding only lengthens O).

Many taps share a set (with zero padding and stride 1 every tap of a transposed conv sees the whole
input), so the host dedups the 1-d sets per dim; the Triton pass (``kernels/global_mean.py``) reads
x once and produces the sum of every plane over every product of distinct sets, and a one-hot matrix
maps sets back to taps.  Groups: ``ci`` runs over the group of ``co``.  Weight layouts:
``(C_out, C_in/g, *k)`` regular, ``(C_in, C_out/g, *k)`` transposed.

Backward.  With ``G[n, co] = g[n, co] * A[co] / P``:
``dx[n, ci, i] = sum_t [i in V_t] sum_co G[n, co] W[co, ci, t]`` (piecewise constant: one Triton pass
writes it from per-set coefficients), ``dW[co, ci, t] = sum_n G[n, co] S[n, ci, t]`` (needs only the
saved ``S``, ``N*C_in*taps`` numbers), ``dbias = sum_n g*A``; the affine operands get theirs by the
chain rule through the fold.  Nothing full-size is saved.

Kernel pipeline (CUDA, and CPU under ``FUSION_CPU_KERNELS=triton``): exactly two Triton launches each way.

* forward: ``set_sums_partial`` (the one pass over x; a channels-innermost variant reads channels_last
  x at full bandwidth) then ``contract_forward`` (sums the per-split partials in a fixed order, writes
  the tap sums ``S``, contracts with W, adds the bias, scales by ``1/P`` and applies the affine steps
  in order, writing ``out`` in its dtype plus ``S`` and ``M`` for the backward).
* backward: ``params_backward`` (grad_weight, grad_bias, every per-channel operand gradient and
  ``G``) then ``grad_broadcast`` (grad_x, in x's memory format; each program first forms its planes'
  per-set coefficients from ``G`` and W, then writes every element once).  One-element or shared
  tensor operands add a few tiny host-combined ops (not the case of the ``seeds`` suite's pipelines).
Shape-only data (bit tables, the tap-to-set table) is built once per shape and cached on the device.

Precision: x is summed in fp32 with per-tile tree reductions (fp64 for fp64 inputs, on the reference
path); the contraction with W, the chain and the parameter gradients run in fp64 in the small
kernels (they cancel; they are tiny), which also keeps them off TF32.  grad_x coefficients are fp32.
Results are cast to ``out_dtype``.  No float atomics anywhere: every reduction has a fixed order.

Cost (H100, ConvTranspose2d 64->128 k3 on x (16, 64, 512, 512) fp32), measured before this pipeline:
the pass over x 0.36 ms (1.07 GB, ~3 TB/s), the grad_x pass 0.34 ms; the ~15 small torch ops around
them made it 0.65 ms per forward and 2.8 ms per step.  ``tools/bench_conv_global_mean.py`` times the
pipeline.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, Union

import torch

from .. import environment
from ..errors import KernelError, UnsupportedInputError
from ..ir.shapes import conv_output_length
from .chain import ChainStep, Const, PointwiseKind, TensorRef
from .config import ConvSpec, chain_from_list, chain_to_list, conv_spec_from_dict, conv_spec_to_dict
from .direct_twins import profiled, records_backward, register_direct
from .runtime_twins import register_twin

logger = logging.getLogger("fusion_backend")

__all__ = [
    "AFFINE_KINDS",
    "ConvGlobalMeanConfig",
    "conv_global_mean",
    "conv_global_mean_bwd",
    "conv_global_mean_fwd",
    "kernel_path",
]

#: The pointwise kinds that are affine per channel and may therefore be folded into the mean.
AFFINE_KINDS = frozenset(
    {PointwiseKind.MUL, PointwiseKind.ADD, PointwiseKind.SUB, PointwiseKind.RSUB, PointwiseKind.DIV}
)

#: The environment switch that makes CPU tensors run the Triton launchers (``fusion_backend.environment``).
CPU_KERNELS_ENV = environment.CPU_KERNELS

_CUDA_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# NOTE: the Triton interpreter has no bf16, so on CPU only fp32/fp16 can take the kernel path.
_INTERPRETER_KERNEL_DTYPES = (torch.float32, torch.float16)


# --------------------------------------------------------------------------------------------------
# Static configuration
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvGlobalMeanConfig:
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
                raise ValueError(
                    f"conv.{name} {getattr(c, name)} must have {nd} entries like stride {c.stride}"
                )
        if c.groups < 1 or min(c.stride) < 1 or min(c.dilation) < 1 or min(c.padding) < 0:
            raise ValueError(f"invalid conv hyper-parameters: {c}")
        if not c.transposed and any(c.output_padding):
            raise ValueError(f"output_padding {c.output_padding} is only valid for a transposed conv")
        for step in self.affine:
            if step.kind not in AFFINE_KINDS:
                raise ValueError(
                    f"affine step {step.kind.name.lower()} is not per-channel affine; allowed: "
                    f"{sorted(k.name.lower() for k in AFFINE_KINDS)}"
                )
        if self.out_dtype is not None and not isinstance(getattr(torch, self.out_dtype, None), torch.dtype):
            raise ValueError(f"out_dtype {self.out_dtype!r} is not a torch dtype name")

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal configs give equal strings."""
        d: dict[str, Any] = {
            "conv": conv_spec_to_dict(self.conv),
            "affine": chain_to_list(self.affine),
            "keepdim": self.keepdim,
            "out_dtype": self.out_dtype,
            "strict": self.strict,
        }
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> ConvGlobalMeanConfig:
        """Parse ``to_json``'s output (cached: the op implementations parse on every call)."""
        return _parse_config(text)


@functools.lru_cache(maxsize=256)
def _parse_config(text: str) -> ConvGlobalMeanConfig:
    d = json.loads(text)
    conv = conv_spec_from_dict(d["conv"])
    affine = chain_from_list(d.get("affine", []))
    return ConvGlobalMeanConfig(
        conv=conv,
        affine=affine,
        keepdim=bool(d.get("keepdim", False)),
        out_dtype=d.get("out_dtype"),
        strict=bool(d.get("strict", False)),
    )


# --------------------------------------------------------------------------------------------------
# Geometry: per-dim index sets (host side, cached per shape)
# --------------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -((-a) // b)


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
            lo = max(0, _ceil_div(-off, stride))
            hi = min(length - 1, (out_len - 1 - off) // stride)
        else:
            # i = o*s + off for o in [0, O), kept when 0 <= i < L.
            o_lo = max(0, _ceil_div(-off, stride))
            o_hi = min(out_len - 1, (length - 1 - off) // stride)
            lo, hi = o_lo * stride + off, o_hi * stride + off
        raw.append((lo, hi) if lo <= hi else (0, -1))
    distinct = tuple(dict.fromkeys(raw))
    step = 1 if transposed else stride
    return DimSets(length, out_len, step, distinct, tuple(distinct.index(r) for r in raw))


@dataclass(frozen=True, eq=False)
class _Geometry:
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
_MAX_TABLE_BITS = 31


def _membership(ds: DimSets) -> torch.Tensor:
    idx = torch.arange(ds.length)
    lo = torch.tensor([s[0] for s in ds.sets])[:, None]
    hi = torch.tensor([s[1] for s in ds.sets])[:, None]
    return (idx >= lo) & (idx <= hi) & ((idx - lo) % ds.step == 0)


# NOTE: never evicts: a CUDA graph recorded over the kernels keeps the tables' addresses (entries are
# a few KB: int32 tables of the spatial sizes and small masks).
@functools.cache
def _geometry(
    spec: ConvSpec, in_sizes: tuple[int, ...], kernel: tuple[int, ...], device: torch.device
) -> _Geometry:
    """Built on the host, then copied once to ``device`` (``persistent_device_copies``: outside any
    CUDA-graph memory pool)."""
    from ..kernels.host import persistent_device_copies

    real = [
        dim_sets(spec.transposed, L, k, s, p, d, op)
        for L, k, s, p, d, op in zip(
            in_sizes, kernel, spec.stride, spec.padding, spec.dilation, spec.output_padding, strict=True
        )
    ]
    dims = (*[_TRIVIAL_DIM] * (3 - len(real)), *real)
    masks = tuple(_membership(ds) for ds in dims)
    bits: tuple[torch.Tensor, ...] = ()
    if all(len(ds.sets) <= _MAX_TABLE_BITS for ds in dims):
        weights = [(1 << torch.arange(len(ds.sets), dtype=torch.int64))[:, None] for ds in dims]
        bits = tuple(
            (m.to(torch.int64) * w).sum(0).to(torch.int32).contiguous()
            for m, w in zip(masks, weights, strict=True)
        )
    counts = [len(ds.sets) for ds in dims]
    taps = math.prod(kernel)
    onehot = torch.zeros((taps, math.prod(counts)), dtype=torch.float64)
    tapset = []
    for t, tap in enumerate(_taps(tuple(len(ds.tap_to_set) for ds in dims))):
        j1, j2, j3 = (ds.tap_to_set[k] for ds, k in zip(dims, tap, strict=True))
        onehot[t, (j1 * counts[1] + j2) * counts[2] + j3] = 1.0
        tapset.append((j1 * counts[1] + j2) * counts[2] + j3)
    n_out = math.prod(ds.out_length for ds in real)
    table = torch.tensor(tapset, dtype=torch.int32)
    m1, m2, m3, *on_device = persistent_device_copies([*masks, *bits, onehot, table], device)
    *bits_d, onehot_d, table_d = on_device
    return _Geometry(dims, n_out, (m1, m2, m3), tuple(bits_d) if bits else None, onehot_d, table_d)  # type: ignore[arg-type]


def _taps(kernel3: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    return [(a, b, c) for a in range(kernel3[0]) for b in range(kernel3[1]) for c in range(kernel3[2])]


# --------------------------------------------------------------------------------------------------
# Shapes, validation, affine fold
# --------------------------------------------------------------------------------------------------


def _out_channels(spec: ConvSpec, weight: torch.Tensor) -> int:
    return _out_channels_of(spec, weight.shape)


def _out_channels_of(spec: ConvSpec, w_shape: Sequence[int]) -> int:
    return w_shape[1] * spec.groups if spec.transposed else w_shape[0]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _validate(
    cfg: ConvGlobalMeanConfig, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> None:
    _validate_shapes(cfg.conv, x.shape, weight.shape, None if bias is None else bias.shape)


@functools.lru_cache(maxsize=256)
def _validate_shapes(
    spec: ConvSpec, x_shape: torch.Size, w_shape: torch.Size, bias_shape: torch.Size | None
) -> None:
    """Raise ``UnsupportedInputError`` unless the shapes fit the conv (cached: runs on every call;
    a raise is not cached, so a bad call raises every time)."""
    nd = spec.spatial_dims
    if len(x_shape) != nd + 2 or len(w_shape) != nd + 2:
        raise UnsupportedInputError(
            f"conv_global_mean: a {nd}-d conv needs batched x and weight of rank {nd + 2}, got x "
            f"{tuple(x_shape)} and weight {tuple(w_shape)}"
        )
    g = spec.groups
    c_in = x_shape[1]
    expected_cin = w_shape[0] if spec.transposed else w_shape[1] * g
    if c_in != expected_cin or (spec.transposed and c_in % g) or (not spec.transposed and w_shape[0] % g):
        raise UnsupportedInputError(
            f"conv_global_mean: x {tuple(x_shape)} does not match weight {tuple(w_shape)} with "
            f"groups={g} (transposed={spec.transposed})"
        )
    c_out = _out_channels_of(spec, w_shape)
    if bias_shape is not None and tuple(bias_shape) != (c_out,):
        raise UnsupportedInputError(
            f"conv_global_mean: bias must have shape ({c_out},), got {tuple(bias_shape)}"
        )


def _channel_vector(t: torch.Tensor, c_out: int, out_rank: int, device: torch.device) -> torch.Tensor:
    """An affine operand as fp64 on ``device``: 0-d when it has one element, else ``(c_out,)``."""
    if t.numel() == 1 and t.dim() <= out_rank:
        return t.detach().reshape(()).to(device=device, dtype=torch.float64)
    shape = tuple(t.shape)
    ones = (1,) * (out_rank - 2)
    if shape in ((c_out, *ones), (1, c_out, *ones)):
        return t.detach().reshape(c_out).to(device=device, dtype=torch.float64)
    raise UnsupportedInputError(
        f"conv_global_mean: affine operand of shape {shape} is neither a single element nor per-channel "
        f"({(c_out, *ones)} or {(1, c_out, *ones)})"
    )


def _operand_values(
    cfg: ConvGlobalMeanConfig, operands: Sequence[torch.Tensor], c_out: int, device: torch.device
) -> list[torch.Tensor | float]:
    """The value of every step's operand: a Python float (``Const``) or an fp64 0-d / ``(c_out,)`` tensor."""
    out_rank = cfg.conv.spatial_dims + 2
    values: list[torch.Tensor | float] = []
    for step in cfg.affine:
        (op,) = step.operands
        if isinstance(op, Const):
            # NOTE: kept a Python float: a device tensor built from it would cost a host->device copy.
            values.append(float(op.value))
        else:
            if not 0 <= op.index < len(operands):
                raise UnsupportedInputError(
                    f"conv_global_mean: affine step refers to operand {op.index}, but {len(operands)} were given"
                )
            values.append(_channel_vector(operands[op.index], c_out, out_rank, device))
    return values


Value = Union[torch.Tensor, float]
_R = TypeVar("_R")


# NOTE: the fold runs on every call, and each torch op on a CUDA tensor costs ~10-20 us of host time
# (more than the kernels' GPU time at the ``seeds`` suite's sizes), so the arithmetic below keeps
# Python floats as long as it can and skips multiplications by 1 and additions of 0.
def _mul(p: Value, q: Value) -> Value:
    for u, v in ((p, q), (q, p)):
        if isinstance(u, float):
            if u == 1.0:
                return v
            if u == 0.0 and isinstance(v, float):
                return 0.0
    return p * q


def _add(p: Value, q: Value) -> Value:
    if isinstance(p, float) and p == 0.0:
        return q
    if isinstance(q, float) and q == 0.0:
        return p
    return p + q


def _recip(v: Value) -> Value:
    if isinstance(v, float):
        return math.copysign(math.inf, v) if v == 0.0 else 1.0 / v  # v / 0.0 is +-inf, as in torch
    return 1.0 / v


def _fold(cfg: ConvGlobalMeanConfig, values: Sequence[Value]) -> list[tuple[Value, Value]]:
    """States ``(A, B)`` before each step and after the last: ``v -> A*v + B``.

    ``A``/``B`` are Python floats while only constants are involved, else fp64 0-d / ``(C_out,)``.
    The offset starts at an exact 0.0 that no operand value can turn into NaN (the eager chain has no
    such term), which is why ``0.0 * v`` stays 0.0 here.
    """
    a: Value = 1.0
    b: Value = 0.0
    states = [(a, b)]
    for step, v in zip(cfg.affine, values, strict=True):
        k = step.kind
        if k is PointwiseKind.MUL:
            a, b = _mul(a, v), (0.0 if isinstance(b, float) and b == 0.0 else _mul(b, v))
        elif k is PointwiseKind.ADD:
            b = _add(b, v)
        elif k is PointwiseKind.SUB:
            b = _add(b, -v)
        elif k is PointwiseKind.RSUB:
            a, b = -a, _add(v, -b)
        elif k is PointwiseKind.DIV:
            inv = _recip(v)
            a, b = _mul(a, inv), (0.0 if isinstance(b, float) and b == 0.0 else _mul(b, inv))
        else:  # pragma: no cover - rejected by the config
            raise AssertionError(k)
        states.append((a, b))
    return states


def _fold_backward(
    cfg: ConvGlobalMeanConfig,
    values: Sequence[Value],
    states: Sequence[tuple[Value, Value]],
    grad_a: torch.Tensor | None,
    grad_b: torch.Tensor,
) -> list[Value | None]:
    """Reverse-mode through ``_fold``: gradient of each ``TensorRef`` step's operand value (else ``None``).

    ``grad_a``/``grad_b`` are the gradients of the final ``A``/``B`` (``grad_a`` may be ``None`` when
    no tensor operand of a mul/div step needs it).  Walking the steps backwards,
    mul: ``A' = A*v, B' = B*v`` gives ``dv = dA'*A + dB'*B``; add/sub: ``dv = +-dB'``; rsub
    (``A' = -A, B' = v - B``): ``dv = dB'``; div: ``dv = -(dA'*A + dB'*B) / v**2``.
    """
    grads: list[Value | None] = [None] * len(cfg.affine)
    ga: Value | None = grad_a
    gb: Value = grad_b
    for i in range(len(cfg.affine) - 1, -1, -1):
        k = cfg.affine[i].kind
        wanted = isinstance(cfg.affine[i].operands[0], TensorRef)
        v = values[i]
        a, b = states[i]
        if k in (PointwiseKind.MUL, PointwiseKind.DIV):
            if wanted:
                assert ga is not None, "grad_a is needed for a mul/div by a tensor"
                dv = _add(_mul(ga, a), _mul(gb, b))
                grads[i] = dv if k is PointwiseKind.MUL else -dv / (v * v)
            scale = v if k is PointwiseKind.MUL else _recip(v)
            ga = None if ga is None else _mul(ga, scale)
            gb = _mul(gb, scale)
        elif k is PointwiseKind.ADD:
            grads[i] = gb if wanted else None
        elif k is PointwiseKind.SUB:
            grads[i] = -gb if wanted else None
        elif k is PointwiseKind.RSUB:
            grads[i] = gb if wanted else None
            ga = None if ga is None else -ga
            gb = -gb
    return grads


def _grouped(spec: ConvSpec, weight: torch.Tensor) -> tuple[torch.Tensor, str]:
    """Weight as fp64 ``(g, ., ., T)`` plus its einsum letters (``o`` = out channel, ``i`` = in channel)."""
    g = spec.groups
    w = weight.detach().to(torch.float64)
    if spec.transposed:
        return w.reshape(g, weight.shape[0] // g, weight.shape[1], -1), "giot"
    return w.reshape(g, weight.shape[0] // g, weight.shape[1], -1), "goit"


# --------------------------------------------------------------------------------------------------
# Dispatch between the Triton kernels and the torch reference
# --------------------------------------------------------------------------------------------------

_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key in _warned:
        return
    _warned.add(key)
    logger.warning(message)
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def kernel_path(config: str, dtype: torch.dtype, device_type: str) -> tuple[str, str | None]:
    """Which implementation a call with this config, x dtype and device type takes.

    Returns ``("triton", None)`` or ``("reference", reason)``.  A problem can still leave the Triton
    path at run time when a spatial dim has more than 31 distinct tap index sets (kernel width > 31),
    which is reported by a one-time warning.
    """
    if device_type == "cuda":
        return _cuda_kernel_path(config, dtype)
    ConvGlobalMeanConfig.from_json(config)  # validates
    if device_type == "cpu":
        from ..kernels.host import cpu_kernels_unavailable

        why = cpu_kernels_unavailable()
        if why is not None:
            return ("reference", why)
        if dtype in _INTERPRETER_KERNEL_DTYPES:
            return ("triton", None)
        return ("reference", f"the Triton interpreter has no kernel for dtype {dtype} (fp32, fp16 only)")
    return ("reference", f"no Triton kernels for device type {device_type!r}")


@functools.lru_cache(maxsize=256)
def _cuda_kernel_path(config: str, dtype: torch.dtype) -> tuple[str, str | None]:
    """``kernel_path`` on CUDA (no environment to read, so cached: it runs on every call)."""
    ConvGlobalMeanConfig.from_json(config)  # validates
    if dtype in _CUDA_KERNEL_DTYPES:
        return ("triton", None)
    return ("reference", f"no Triton kernel for dtype {dtype} (kernels: fp32, fp16, bf16)")


def _kernel_fits(geo: _Geometry) -> str | None:
    if geo.bits is None:
        return f"a spatial dim has {max(geo.set_counts)} distinct tap index sets (the kernels support {_MAX_TABLE_BITS})"
    return None


def _run(
    op: str,
    cfg: ConvGlobalMeanConfig,
    config: str,
    t: torch.Tensor,
    geo: _Geometry,
    kernel: Callable[[], _R],
    reference: Callable[[], _R],
    dtype: torch.dtype | None = None,
) -> _R:
    """Run ``kernel()`` when this call takes the Triton path, else (or on failure) ``reference()``.

    The path is chosen by ``t``'s device and ``dtype`` (default ``t``'s): x forward, grad_out with
    x's dtype backward.  NOTE: a launch error
    (compilation, resources) falls back cleanly; an asynchronous CUDA fault inside a kernel cannot be
    caught here and poisons the CUDA context, as with any kernel.
    """
    path, _ = kernel_path(config, dtype or t.dtype, t.device.type)
    if path == "triton":
        why_not = _kernel_fits(geo)
        if why_not is not None:
            _warn_once(f"{op}:fit:{why_not}", f"fusion_backend: {op} uses the torch reference: {why_not}")
            return reference()
        try:
            return kernel()
        except Exception as err:
            detail = f"{op} Triton kernel failed on shape {tuple(t.shape)} dtype {t.dtype} ({t.device}): {type(err).__name__}: {err}"
            if cfg.strict:
                raise KernelError(detail + "; set strict=False to fall back to the torch reference") from err
            _warn_once(
                f"{op}:fail:{type(err).__name__}",
                f"fusion_backend: {detail}; falling back to the torch reference",
            )
    return reference()


def _as5d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 5:
        t = t.unsqueeze(2)
    return t


# --------------------------------------------------------------------------------------------------
# The custom ops
# --------------------------------------------------------------------------------------------------


def _set_sums_reference(x: torch.Tensor, geo: _Geometry) -> torch.Tensor:
    """``(N, C_in, J)`` sums of x over the product sets, in x's accumulation dtype (torch reference)."""
    n, c = x.shape[:2]
    acc = _acc_dtype(x.dtype)
    m1, m2, m3 = (mask.to(acc) for mask in geo.masks)
    j1, j2, j3 = geo.set_counts
    # NOTE: three matmuls, innermost dim first, rather than one 4-operand einsum: same result,
    # no contraction-path search on every call.
    r = _as5d(x).to(acc) @ m3.T  # (N, C, D, H, J3)
    r = m2 @ r  # (N, C, D, J2, J3)
    r = m1 @ r.reshape(n, c, -1, j2 * j3)  # (N, C, J1, J2*J3)
    return r.reshape(n, c, j1 * j2 * j3)


_STEP_CODES = {
    PointwiseKind.MUL: 1,
    PointwiseKind.ADD: 2,
    PointwiseKind.SUB: 3,
    PointwiseKind.RSUB: 4,
    PointwiseKind.DIV: 5,
}


def _channel_stride(t: torch.Tensor, c_out: int, out_rank: int) -> int:
    """Element stride between channels of an affine operand (0 for a one-element operand); validates
    the shape exactly like ``_channel_vector``."""
    return _channel_stride_meta(tuple(t.shape), t.stride(), c_out, out_rank)


def _channel_stride_meta(shape: tuple[int, ...], stride: tuple[int, ...], c_out: int, out_rank: int) -> int:
    if math.prod(shape) == 1 and len(shape) <= out_rank:
        return 0
    shape = tuple(shape)
    ones = (1,) * (out_rank - 2)
    if shape == (c_out, *ones):
        return stride[0]
    if shape == (1, c_out, *ones):
        return stride[1]
    raise UnsupportedInputError(
        f"conv_global_mean: affine operand of shape {shape} is neither a single element nor per-channel "
        f"({(c_out, *ones)} or {(1, c_out, *ones)})"
    )


@dataclass(frozen=True)
class _ChainStatic:
    """The shape-dependent half of ``_chain_args``: per step its kind code, whether its operand is a
    tensor, the constant, the operand's index in ``operands`` (-1 for a constant) and channel stride."""

    kinds: tuple[int, ...]
    tensor: tuple[bool, ...]
    consts: tuple[float, ...]
    index: tuple[int, ...]
    strides: tuple[int, ...]


# NOTE: the op's Python runs on every call and, at the ``seeds`` suite's sizes, a training step is
# host-bound (``python tools/profile_step.py demos/seeds/convt2d_global_mean_bias_logsumexp.py --mode
# train`` shows the GPU time against the host time per step), so the per-shape decisions below are
# cached; a call only binds its tensors.
@functools.lru_cache(maxsize=256)
def _chain_static(
    cfg: ConvGlobalMeanConfig, operand_meta: tuple[tuple[Any, ...], ...], c_out: int
) -> _ChainStatic:
    out_rank = cfg.conv.spatial_dims + 2
    kinds, tensor, consts, index, strides = [], [], [], [], []
    for step in cfg.affine:
        (op,) = step.operands
        kinds.append(_STEP_CODES[step.kind])
        if isinstance(op, Const):
            tensor.append(False)
            consts.append(float(op.value))
            index.append(-1)
            strides.append(0)
        else:
            if not 0 <= op.index < len(operand_meta):
                raise UnsupportedInputError(
                    f"conv_global_mean: affine step refers to operand {op.index}, but {len(operand_meta)} were given"
                )
            tensor.append(True)
            consts.append(0.0)
            index.append(op.index)
            strides.append(_channel_stride_meta(*operand_meta[op.index][:2], c_out, out_rank))
    return _ChainStatic(tuple(kinds), tuple(tensor), tuple(consts), tuple(index), tuple(strides))


def _chain_args(
    cfg: ConvGlobalMeanConfig,
    operands: Sequence[torch.Tensor],
    c_out: int,
    device: torch.device,
    dummy: torch.Tensor,
) -> Any:
    """The affine chain as the kernels' ``ChainArgs`` (host only: no device work unless an operand
    lives on another device, which is then copied); ``dummy`` stands in for the operand pointer of
    constant steps."""
    from ..kernels.global_mean import ChainArgs

    moved = [t if t.device == device else t.detach().to(device) for t in operands]
    static = _chain_static(cfg, tuple((t.shape, t.stride()) for t in moved), c_out)
    ops = tuple(dummy if i < 0 else moved[i] for i in static.index)
    return ChainArgs(static.kinds, static.tensor, static.consts, ops, static.strides)


@functools.lru_cache(maxsize=256)
def _weight_layout_ints(
    shape: tuple[int, ...], stride: tuple[int, ...], transposed: bool, groups: int
) -> tuple[int, ...] | None:
    from ..kernels.global_mean import WeightLayout

    layout = WeightLayout.of(torch.empty_strided(shape, stride, device="meta"), transposed, groups)
    if layout is None:
        return None
    return (layout.s_co, layout.s_ci, layout.s_t, layout.off_g, layout.cin_g, layout.cout_g, layout.taps)


def _weight_layout(weight: torch.Tensor, spec: ConvSpec) -> Any:
    """The kernels' view of ``weight`` (a tensor that requires grad is fine: only its data is read)."""
    from ..kernels.global_mean import WeightLayout

    ints = _weight_layout_ints(tuple(weight.shape), weight.stride(), spec.transposed, spec.groups)
    if ints is None:  # kernel dims not flat-addressable (rare): one copy
        weight = weight.contiguous()
        ints = _weight_layout_ints(tuple(weight.shape), weight.stride(), spec.transposed, spec.groups)
    return WeightLayout(weight, *ints)


def _forward_kernels(
    cfg: ConvGlobalMeanConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor],
    geo: _Geometry,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward on the Triton kernels: two launches (the pass over x, then the contraction + chain).

    NOTE: the pass over x is launched before anything else is prepared: it is nearly all of the GPU
    time, and at the ``seeds`` suite's sizes the GPU otherwise idles while the host builds the second
    launch.
    """
    from ..kernels import global_mean as kernels

    assert geo.bits is not None
    partial = kernels.set_sums_partial(_as5d(x), geo.bits, geo.set_counts)
    n, c_in = x.shape[:2]
    c_out = _out_channels(cfg.conv, weight)
    out_dtype = getattr(torch, cfg.out_dtype) if cfg.out_dtype else x.dtype
    out_shape = (n, c_out, *([1] * cfg.conv.spatial_dims)) if cfg.keepdim else (n, c_out)
    out = torch.empty(out_shape, dtype=out_dtype, device=x.device)
    mean = torch.empty((n, c_out), dtype=torch.float64, device=x.device)
    chain = _chain_args(cfg, operands, c_out, x.device, mean)
    taps = torch.empty((n, c_in, *weight.shape[2:]), dtype=torch.float64, device=x.device)
    kernels.contract_forward(
        partial,
        geo.tapset,
        _weight_layout(weight, cfg.conv),
        bias,
        chain,
        geo.n_outputs,
        out,
        mean,
        taps.view(n, c_in, -1),
    )
    return out, taps, mean


def _forward_reference(
    cfg: ConvGlobalMeanConfig,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor],
    geo: _Geometry,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward in plain torch (the spec): fp64 contraction and affine fold."""
    spec = cfg.conv
    n, c_in = x.shape[:2]
    c_out = _out_channels(spec, weight)
    r = _set_sums_reference(x, geo)  # (N, C_in, J)
    tap_sums = r.to(torch.float64) @ geo.tap_onehot.T  # (N, C_in, T)
    w, letters = _grouped(spec, weight)
    g = spec.groups
    total = torch.einsum(f"ngit,{letters}->ngo", tap_sums.reshape(n, g, c_in // g, -1), w).reshape(n, c_out)
    if bias is not None:
        mean = torch.add(bias.detach().to(torch.float64), total, alpha=1.0 / geo.n_outputs)
    else:
        mean = total * (1.0 / geo.n_outputs)
    a, b = _fold(cfg, _operand_values(cfg, operands, c_out, x.device))[-1]
    out = _add(_mul(mean, a), b)
    assert isinstance(out, torch.Tensor)
    out_dtype = getattr(torch, cfg.out_dtype) if cfg.out_dtype else x.dtype
    if out.dtype != out_dtype:
        out = out.to(out_dtype)
    elif out.data_ptr() == mean.data_ptr():
        # NOTE: without affine steps and with an fp64 result, ``out`` would be ``conv_mean`` itself;
        # custom ops must not return aliased outputs.
        out = out.clone()
    if cfg.keepdim:
        out = out.reshape(n, c_out, *([1] * spec.spatial_dims))
    return out, tap_sums.reshape(n, c_in, *weight.shape[2:]), mean


def _conv_global_mean_fwd_impl(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    config: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of ``conv_global_mean``; returns ``(out, tap_sums, conv_mean)``.

    * ``out``: the op's result (see the module docstring), dtype ``out_dtype`` or x's.
    * ``tap_sums``: ``S`` of the derivation, ``(N, C_in, *kernel_size)``, fp64.
    * ``conv_mean``: ``M`` (mean of the conv output incl. bias, before the affine steps),
      ``(N, C_out)``, fp64.
    The last two are the tiny tensors the backward needs; they are not differentiable.
    """
    cfg = ConvGlobalMeanConfig.from_json(config)
    _validate(cfg, x, weight, bias)
    geo = _geometry(cfg.conv, tuple(x.shape[2:]), tuple(weight.shape[2:]), x.device)
    return _run(
        "conv_global_mean_fwd",
        cfg,
        config,
        x,
        geo,
        lambda: _forward_kernels(cfg, x, weight, bias, operands, geo),
        lambda: _forward_reference(cfg, x, weight, bias, operands, geo),
    )


conv_global_mean_fwd = torch.library.custom_op("fusion::conv_global_mean_fwd", mutates_args=())(
    _conv_global_mean_fwd_impl
)


@conv_global_mean_fwd.register_fake
def _conv_global_mean_fwd_fake(x, weight, bias, operands, config):
    cfg = ConvGlobalMeanConfig.from_json(config)
    n, c_in = x.shape[:2]
    c_out = _out_channels(cfg.conv, weight)
    out_dtype = getattr(torch, cfg.out_dtype) if cfg.out_dtype else x.dtype
    out_shape = (n, c_out, *([1] * cfg.conv.spatial_dims)) if cfg.keepdim else (n, c_out)
    return (
        x.new_empty(out_shape, dtype=out_dtype),
        x.new_empty((n, c_in, *weight.shape[2:]), dtype=torch.float64),
        x.new_empty((n, c_out), dtype=torch.float64),
    )


def _conv_global_mean_bwd_impl(
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: list[torch.Tensor],
    tap_sums: torch.Tensor,
    conv_mean: torch.Tensor,
    x_size: Sequence[int],
    x_stride: Sequence[int],
    x_dtype: torch.dtype,
    need_grad_input: bool,
    config: str,
) -> list[torch.Tensor]:
    """Backward of ``conv_global_mean``: ``[grad_x, grad_weight, grad_bias, *grad_operands]``.

    ``grad_x`` has ``x_size``/``x_stride``/``x_dtype`` (an empty ``(0,)`` tensor when
    ``need_grad_input`` is false; ``x_stride`` is ``_grad_input_strides(x)``: x's memory format, as
    eager autograd gives it); ``grad_bias`` is ``(C_out,)`` (``(0,)`` when there is no bias); every
    other gradient has its input's shape and dtype.  ``tap_sums`` and ``conv_mean`` are the forward's
    auxiliary outputs.  x itself is not needed: the gradients only use the saved sums.
    """
    cfg = ConvGlobalMeanConfig.from_json(config)
    geo = _geometry(cfg.conv, tuple(x_size[2:]), tuple(weight.shape[2:]), grad_out.device)
    args = (cfg, grad_out, weight, bias, operands, tap_sums, conv_mean, tuple(x_size), tuple(x_stride), x_dtype)
    return _run(
        "conv_global_mean_bwd",
        cfg,
        config,
        grad_out,
        geo,
        lambda: _backward_kernels(*args, need_grad_input, geo),
        lambda: _backward_reference(*args, need_grad_input, geo),
        dtype=x_dtype,
    )


conv_global_mean_bwd = torch.library.custom_op("fusion::conv_global_mean_bwd", mutates_args=())(
    _conv_global_mean_bwd_impl
)


def _grad_input_strides(x: torch.Tensor) -> tuple[int, ...]:
    """Strides of the input gradient eager autograd would give for x: channels_last(_3d) when x is in
    that format (and not also contiguous), else contiguous."""
    size = tuple(x.shape)
    fmt = torch.contiguous_format
    if not x.is_contiguous():
        if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last):
            fmt = torch.channels_last
        elif x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d):
            fmt = torch.channels_last_3d
    if fmt is torch.contiguous_format:
        strides, acc = [], 1
        for d in reversed(size):
            strides.append(acc)
            acc *= max(d, 1)
        return tuple(reversed(strides))
    # channels first, then the spatial dims innermost-last: (N, C, *S) stored as (N, *S, C)
    c = size[1]
    spatial = size[2:]
    strides_sp, acc = [], c
    for d in reversed(spatial):
        strides_sp.append(acc)
        acc *= max(d, 1)
    return (acc, 1, *reversed(strides_sp))


@dataclass(frozen=True)
class _GradTargets:
    """Where ``_params_bwd_kernel`` writes each affine step's operand gradient: per step
    ``(mode, operand index, stride)``; ``referenced`` maps each operand index to its steps;
    ``scratch_for`` lists the operands combined on the host from per-step fp64 partials (one-element
    operands, operands used by several steps, operands on another device)."""

    steps: tuple[tuple[int, int, int], ...]
    referenced: dict[int, list[int]]
    scratch_for: tuple[int, ...]


@functools.lru_cache(maxsize=256)
def _grad_targets(
    cfg: ConvGlobalMeanConfig, operand_meta: tuple[tuple[Any, ...], ...], c_out: int, device: torch.device
) -> _GradTargets:
    from ..kernels import global_mean as kernels

    refs: dict[int, list[int]] = {}
    for i, step in enumerate(cfg.affine):
        if isinstance(step.operands[0], TensorRef):
            refs.setdefault(step.operands[0].index, []).append(i)
    steps = [(kernels.GRAD_NONE, -1, 0)] * len(cfg.affine)
    scratch_for = []
    out_rank = cfg.conv.spatial_dims + 2
    for index, used_by in refs.items():
        shape, stride, where = operand_meta[index]
        channel_stride = _channel_stride_meta(shape, stride, c_out, out_rank)
        if len(used_by) == 1 and channel_stride != 0 and where == device:
            steps[used_by[0]] = (kernels.GRAD_DIRECT, index, channel_stride)
        else:
            scratch_for.append(index)
            for i in used_by:
                steps[i] = (kernels.GRAD_SCRATCH, index, 1)
    return _GradTargets(tuple(steps), refs, tuple(scratch_for))


def _backward_kernels(
    cfg: ConvGlobalMeanConfig,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor],
    tap_sums: torch.Tensor,
    conv_mean: torch.Tensor,
    x_size: tuple[int, ...],
    x_stride: tuple[int, ...],
    x_dtype: torch.dtype,
    need_grad_input: bool,
    geo: _Geometry,
) -> list[torch.Tensor]:
    """Backward on the Triton kernels: one launch for every parameter gradient (and ``G``), one
    for grad_x.  Operands that are one-element tensors or appear in several steps get their
    gradient combined on the host from per-step partials (a few tiny extra ops)."""
    from ..kernels import global_mean as kernels

    spec = cfg.conv
    device = grad_out.device
    n, c_in = x_size[0], x_size[1]
    c_out = _out_channels(spec, weight)
    taps = tap_sums.reshape(n, c_in, -1).contiguous()
    mean = conv_mean.contiguous()
    coef = torch.empty((n, c_out), dtype=torch.float32, device=device)
    chain = _chain_args(cfg, operands, c_out, device, coef)

    targets_plan = _grad_targets(cfg, tuple((t.shape, t.stride(), t.device) for t in operands), c_out, device)
    # operands written by the kernel directly or via scratch are fully overwritten; others stay zero
    grads_ops = [
        torch.empty_like(t) if i in targets_plan.referenced else torch.zeros_like(t) for i, t in enumerate(operands)
    ]
    scratch = coef
    if targets_plan.scratch_for:
        scratch = torch.empty((len(cfg.affine), c_out), dtype=torch.float64, device=device)
    targets = tuple(
        (mode, coef if mode == kernels.GRAD_NONE else scratch if mode == kernels.GRAD_SCRATCH else grads_ops[index],
         stride)
        for mode, index, stride in targets_plan.steps
    )  # fmt: skip
    refs = targets_plan.referenced
    scratch_for = targets_plan.scratch_for

    grad_w = torch.empty_like(weight)
    gw_layout = _weight_layout(grad_w, spec)  # a copy buffer when grad_w is not flat-addressable
    gw_buffer = gw_layout.tensor
    grad_bias = torch.empty_like(bias) if bias is not None else None
    # NOTE: grad_x is prepared before the first launch so that its pass (nearly all of the backward's GPU
    # time) is enqueued right after the small parameter kernel: the step is host-bound at the ``seeds``
    # suite's sizes.
    grad_x = torch.empty_strided(x_size, x_stride, dtype=x_dtype, device=device) if need_grad_input else None
    w_layout = _weight_layout(weight, spec) if need_grad_input else None
    kernels.params_backward(
        grad_out.reshape(n, c_out) if grad_out.dim() > 2 else grad_out,
        mean,
        taps,
        chain,
        targets,
        gw_layout,
        grad_bias,
        geo.n_outputs,
        coef,
        scratch,
    )
    if grad_x is not None:
        assert geo.bits is not None
        kernels.grad_broadcast(coef, w_layout, geo.tapset, geo.bits, geo.set_counts, _as5d(grad_x))
    else:
        grad_x = grad_out.new_empty((0,))
    if gw_buffer is not grad_w:
        grad_w.copy_(gw_buffer)
    for index in scratch_for:
        t = grads_ops[index]
        total = scratch[refs[index]].sum(0)
        if t.numel() == 1:
            total = total.sum()
        t.copy_(total.reshape(t.shape))
    gb = grad_bias if grad_bias is not None else grad_out.new_empty((0,))
    return [grad_x, grad_w, gb, *grads_ops]


def _backward_reference(
    cfg: ConvGlobalMeanConfig,
    grad_out: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    operands: Sequence[torch.Tensor],
    tap_sums: torch.Tensor,
    conv_mean: torch.Tensor,
    x_size: tuple[int, ...],
    x_stride: tuple[int, ...],
    x_dtype: torch.dtype,
    need_grad_input: bool,
    geo: _Geometry,
) -> list[torch.Tensor]:
    """Backward in plain torch (the spec), fp64 contractions."""
    spec = cfg.conv
    device = grad_out.device
    n, c_in = x_size[0], x_size[1]
    c_out = _out_channels(spec, weight)
    g = spec.groups

    values = _operand_values(cfg, operands, c_out, device)
    states = _fold(cfg, values)
    go = grad_out.reshape(n, c_out).to(torch.float64)
    gm = _mul(go, states[-1][0])  # d loss / d conv_mean
    assert isinstance(gm, torch.Tensor)
    coef = (gm * (1.0 / geo.n_outputs)).reshape(n, g, c_out // g)  # G of the derivation

    w, letters = _grouped(spec, weight)
    s = tap_sums.to(torch.float64).reshape(n, g, c_in // g, -1)
    grad_w = _like(weight, torch.einsum(f"ngo,ngit->{letters}", coef, s).reshape(weight.shape))
    grad_bias = _like(bias, gm.sum(0).reshape(bias.shape)) if bias is not None else grad_out.new_empty((0,))

    grad_operands: list[torch.Tensor | None] = [None] * len(operands)
    if any(isinstance(step.operands[0], TensorRef) for step in cfg.affine):
        needs_a = any(
            isinstance(step.operands[0], TensorRef) and step.kind in (PointwiseKind.MUL, PointwiseKind.DIV)
            for step in cfg.affine
        )
        grad_a = (go * conv_mean.to(torch.float64)).sum(0) if needs_a else None
        op_grads = _fold_backward(cfg, values, states, grad_a, go.sum(0))
        for step, grad in zip(cfg.affine, op_grads, strict=True):
            (op,) = step.operands
            if grad is None or not isinstance(op, TensorRef):
                continue
            t = operands[op.index]
            red = torch.as_tensor(grad, dtype=torch.float64, device=device)
            red = red.sum() if t.numel() == 1 else red
            red = red.reshape(t.shape).to(device=t.device, dtype=t.dtype)
            prev = grad_operands[op.index]
            grad_operands[op.index] = red if prev is None else prev + red
    grads_ops = [
        torch.zeros_like(t) if gr is None else _like(t, gr) for t, gr in zip(operands, grad_operands, strict=True)
    ]

    if need_grad_input:
        q_taps = torch.einsum(f"ngo,{letters}->ngit", coef, w).reshape(n, c_in, -1)  # (N, C_in, T)
        q = q_taps @ geo.tap_onehot  # (N, C_in, J): sets shared by several taps add up
        grad_x = _set_broadcast_reference(q, geo, x_size, x_stride, x_dtype, device)
    else:
        grad_x = grad_out.new_empty((0,))
    return [grad_x, grad_w, grad_bias, *grads_ops]


def _set_broadcast_reference(
    q: torch.Tensor,
    geo: _Geometry,
    x_size: tuple[int, ...],
    x_stride: tuple[int, ...],
    x_dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """grad_x of ``x_size``/``x_stride``/``x_dtype``: ``sum_j q[n, ci, j] * [i in set j]`` (torch reference)."""
    grad_x = torch.empty_strided(x_size, x_stride, dtype=x_dtype, device=device)
    acc = _acc_dtype(x_dtype)
    m1, m2, m3 = (mask.to(acc) for mask in geo.masks)
    j1, j2, j3 = geo.set_counts
    n, c = x_size[0], x_size[1]
    full = m1.T @ q.to(acc).reshape(n, c, j1, j2 * j3)  # (N, C, D, J2*J3)
    full = m2.T @ full.reshape(n, c, -1, j2, j3)  # (N, C, D, H, J3)
    full = full @ m3  # (N, C, D, H, W)
    grad_x.copy_(full.reshape(x_size))
    return grad_x


def _like(reference: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in a buffer laid out like ``torch.empty_like(reference)``: the fake promises those
    strides (Inductor asserts them), while einsum/reshape results may come out permuted."""
    return torch.empty_like(reference).copy_(value)


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
    ctx.x_stride = _grad_input_strides(x)
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
register_twin(conv_global_mean_fwd, _conv_global_mean_fwd_impl, _conv_global_mean_fwd_fake)
register_twin(conv_global_mean_bwd, _conv_global_mean_bwd_impl, _conv_global_mean_bwd_fake)


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
    """``conv_global_mean`` for graphs the backend runs without AOTAutograd (``ops/direct_twins.py``):
    the custom ops' implementations called straight, saving the same state.  ``operands`` are spread
    into separate arguments because autograd tracks only tensors passed one by one."""

    @staticmethod
    def forward(ctx, config, x, weight, bias, *operands):
        out, tap_sums, conv_mean = _conv_global_mean_fwd_impl(x, weight, bias, list(operands), config)
        ctx.save_for_backward(weight, bias, *operands)
        ctx.state = (tap_sums, conv_mean)  # intermediates: attributes, as autograd advises
        ctx.x_size = tuple(x.shape)
        ctx.x_stride = _grad_input_strides(x)
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
        grad_x, grad_w, grad_b, *grad_ops = _conv_global_mean_bwd_impl(
            grad_out, weight, bias, operands, tap_sums, conv_mean,
            ctx.x_size, ctx.x_stride, ctx.x_dtype, bool(needs[1]), ctx.config,
        )
        grads = (grad_x if needs[1] else None, grad_w if needs[2] else None,
                 grad_b if bias is not None and needs[3] else None)
        return (None, *grads, *(g if wanted else None for g, wanted in zip(grad_ops, needs[4:], strict=True)))


@profiled("fusion::conv_global_mean_fwd")
def _conv_global_mean_direct(x, weight, bias, operands, config):
    """``conv_global_mean`` without the custom-op layers (the direct twin; same contract)."""
    if records_backward(x, weight, bias, operands):
        return _DirectConvGlobalMean.apply(config, x, weight, bias, *operands)
    return _conv_global_mean_fwd_impl(x, weight, bias, list(operands), config)[0]


register_direct(conv_global_mean, _conv_global_mean_direct)
