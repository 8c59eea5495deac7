"""Per-dim index sets of ``fusion::conv_global_mean`` (host side, cached per shape): for each tap, the
input positions it connects to an in-bounds output, deduplicated per dim, and the device tables the
kernels read (see the package docstring's derivation).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ...errors import UnsupportedInputError
from ...ir.shapes import conv_output_length
from ...ir.specs import ConvSpec


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
    for t, tap in enumerate(_taps(tuple(len(ds.tap_to_set) for ds in dims))):
        j1, j2, j3 = (ds.tap_to_set[k] for ds, k in zip(dims, tap, strict=True))
        onehot[t, (j1 * counts[1] + j2) * counts[2] + j3] = 1.0
        tapset.append((j1 * counts[1] + j2) * counts[2] + j3)
    n_out = math.prod(ds.out_length for ds in real)
    table = torch.tensor(tapset, dtype=torch.int32)
    m1, m2, m3, *on_device = persistent_device_copies([*masks, *bits, onehot, table], device)
    *bits_d, onehot_d, table_d = on_device
    return Geometry(dims, n_out, (m1, m2, m3), tuple(bits_d) if bits else None, onehot_d, table_d)  # type: ignore[arg-type]


def _taps(kernel3: tuple[int, int, int]) -> list[tuple[int, int, int]]:
    return [(a, b, c) for a in range(kernel3[0]) for b in range(kernel3[1]) for c in range(kernel3[2])]
