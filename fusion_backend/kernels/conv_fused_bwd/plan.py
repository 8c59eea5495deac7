"""Host side of the Triton conv backward (``kernels/conv_fused_bwd``): the implicit gradient forms,
which cases are served, the geometry and tap tables, and the launchers."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
import triton

from ... import environment
from ...ir.shapes import conv_output_length, pool_output_length
from ..conv_common import BACKWARD_DTYPES, channels_inner, raise_unsupported
from ..host import INTERPRETER, cdiv, element_extent, lift3, lift_5d, next_pow2, persistent_device_copies
from ..launch import launch
from ..tf32 import backward_dot_precision
from .device import dgrad_configs, dgrad_kernel, dgrad_tuned, wgrad_configs, wgrad_kernel, wgrad_tuned

#: Most candidate windows (product over dims of ceil(window extent / pool stride)) a conv-output
#: position may belong to; the loader unrolls them.
MAX_CANDIDATE_WINDOWS = 8


@dataclass(frozen=True)
class PooledGrad:
    """Form (b): the conv-output gradient behind a max pool, as per-window winner gradients.

    Attributes:
      g_win: (N, C, *pooled) any float dtype, any strides: gradient at each window's winner.
      winner: (N, C, *pooled) int8/int32, any strides: the winner's row-major index over the window's
        taps (kd, kh, kw).  A pooled entry whose winner is out of range contributes nothing.
      kernel_size, stride, padding, dilation: one entry per spatial dim (``stride=()`` means
        ``kernel_size``, ``dilation=()`` means 1), PyTorch's max-pool geometry.
      ceil_mode: only used to validate the pooled shape (partial windows are clipped either way).
    """

    g_win: torch.Tensor
    winner: torch.Tensor
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...] = ()
    padding: tuple[int, ...] = ()
    dilation: tuple[int, ...] = ()
    ceil_mode: bool = False

    def geometry(self, dims: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """(kernel, stride, padding, dilation) lifted to 3 dims."""
        k = list(self.kernel_size)
        s = list(self.stride) if self.stride else k
        p = list(self.padding) if self.padding else [0] * dims
        d = list(self.dilation) if self.dilation else [1] * dims
        pad = 3 - dims
        return [1] * pad + k, [1] * pad + s, [0] * pad + p, [1] * pad + d


#: What the launchers take as the conv-output gradient.
Grad = Union[torch.Tensor, PooledGrad]


# --------------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------------


def launcher(tuned, raw, configs: list[triton.Config]):
    """The autotuned kernel, or with ``FUSION_CONV_AUTOTUNE=0`` (deterministic compile times: no
    tile search on a first call) the raw kernel bound to the first config's tile."""
    if environment.measuring():
        return tuned, {}
    first = configs[0]
    return raw, dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)


def conv_output_spatial(
    x_spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int],
) -> list[int]:  # fmt: skip
    """Spatial sizes of ``aten.convolution``'s output."""
    return [conv_output_length(i, k, s, p, d, transposed, op)
            for i, k, s, p, d, op in zip(x_spatial, kernel, stride, padding, dilation, output_padding, strict=True)]


def pooled_spatial(
    spatial: Sequence[int], kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], ceil_mode: bool,
) -> list[int]:  # fmt: skip
    """PyTorch's max-pool output sizes (``pooling_output_shape``)."""
    return [pool_output_length(size, k, s, p, d, ceil_mode)
            for size, k, s, p, d in zip(spatial, kernel, stride, padding, dilation, strict=True)]


@dataclass(frozen=True)
class _Geometry:
    """Everything the launchers derive from the arguments, lifted to 3 spatial dims."""

    dims: int
    stride: list[int]
    padding: list[int]
    dilation: list[int]
    kernel: list[int]
    out_spatial: list[int]  # conv output (N, C_out, *out_spatial), lifted
    c_out: int
    transposed: bool
    groups: int


def _geometry(
    x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> _Geometry:  # fmt: skip
    dims = x.dim() - 2
    kernel = list(weight.shape[2:])
    out = conv_output_spatial(x.shape[2:], kernel, stride, padding, dilation, transposed, output_padding)
    c_out = weight.shape[1] * groups if transposed else weight.shape[0]
    return _Geometry(
        dims, lift3(stride, 1), lift3(padding, 0), lift3(dilation, 1), lift3(kernel, 1), lift3(out, 1),
        c_out, bool(transposed), int(groups),
    )  # fmt: skip


def _pool_geometry(grad: Grad, dims: int) -> tuple:
    """The kernels' ``POOL_GEOM`` constexpr: the max pool behind ``grad`` as ``(kernel, stride,
    padding, dilation, candidate windows per position)``, each lifted to (d, h, w); a dense gradient
    takes the identity pool."""
    if not isinstance(grad, PooledGrad):
        return ((1, 1, 1), (1, 1, 1), (0, 0, 0), (1, 1, 1), (1, 1, 1))
    k, s, p, d = grad.geometry(dims)
    nj = [cdiv((kk - 1) * dd + 1, ss) for kk, ss, dd in zip(k, s, d, strict=True)]
    return tuple(tuple(int(v) for v in values) for values in (k, s, p, d, nj))


def _grad_operands(grad: Grad) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int], list[int]]:
    """(values, winners, values' lifted strides, winners' lifted strides, pooled lifted spatial)."""
    if isinstance(grad, PooledGrad):
        sizes, strides = lift_5d(grad.g_win)
        return grad.g_win, grad.winner, strides, lift_5d(grad.winner)[1], sizes[2:]
    _, strides = lift_5d(grad)
    return grad, grad, strides, [0] * 5, [1, 1, 1]


def _needs_int64(*tensors: torch.Tensor) -> bool:
    """True when an element offset of one of ``tensors`` may reach 2**31 (offsets then go int64)."""
    return any(element_extent(t) >= 2**31 for t in tensors)


def _block(channels: int, cap: int) -> int:
    """A tl.dot tile dim for ``channels``: a power of 2 in [16, cap] (masked beyond ``channels``)."""
    return max(16, min(cap, next_pow2(max(channels, 1))))


def conv_arguments_reason(
    x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
    output_padding: Sequence[int], groups: int,
) -> str | None:  # fmt: skip
    """Why ``x``, ``weight`` and the conv hyper-parameters do not describe a conv of 1 to 3 spatial
    dims (ranks, one hyper-parameter entry per spatial dim, values in range), or None."""
    if not 3 <= x.dim() <= 5 or weight.dim() != x.dim():
        return f"x and weight must be (N, C, *spatial) with 1 to 3 spatial dims, got {tuple(x.shape)} and {tuple(weight.shape)}"
    dims = x.dim() - 2
    for name, v in (("stride", stride), ("padding", padding), ("dilation", dilation), ("output_padding", output_padding)):
        if len(v) != dims:
            return f"{name} {tuple(v)} must have {dims} entries"
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0 or min(output_padding) < 0 or groups < 1:
        return f"invalid conv hyper-parameters stride={stride} padding={padding} dilation={dilation} groups={groups}"
    return None


def device_reason(tensors: Sequence[torch.Tensor]) -> str | None:
    """Why the Triton kernels cannot take ``tensors`` (x first): they lie on several devices, or on
    one that is not CUDA (a CPU one is taken under Triton's interpreter only); None when they can."""
    if len({t.device for t in tensors}) != 1:
        return f"tensors on several devices: {[str(t.device) for t in tensors]}"
    device = tensors[0].device
    if device.type != "cuda" and not (INTERPRETER and device.type == "cpu"):
        return f"Triton kernels need CUDA tensors (or CPU under TRITON_INTERPRET=1), got {device}"
    return None


def unsupported_reason(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
) -> str | None:  # fmt: skip
    """None when ``convolution_backward`` and the per-part launchers handle these arguments, else why not.

    Arguments as for ``convolution_backward``.
    """
    reason = conv_arguments_reason(x, weight, stride, padding, dilation, output_padding, groups)
    if reason is not None:
        return reason
    dims = x.dim() - 2
    if x.dtype not in BACKWARD_DTYPES or weight.dtype != x.dtype:
        return f"x and weight must share one of {BACKWARD_DTYPES}, got {x.dtype} and {weight.dtype}"
    values = grad.g_win if isinstance(grad, PooledGrad) else grad
    if values.dtype not in BACKWARD_DTYPES:
        return f"the gradient must be fp32/fp16/bf16, got {values.dtype}"
    if INTERPRETER and torch.bfloat16 in (x.dtype, values.dtype):
        return "Triton's interpreter has no bf16"
    reason = device_reason([x, weight, values] + ([grad.winner] if isinstance(grad, PooledGrad) else []))
    if reason is not None:
        return reason
    c_in = x.shape[1]
    if transposed:
        if weight.shape[0] != c_in or c_in % groups:
            return f"conv-transpose weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}, groups={groups}"
    elif weight.shape[1] * groups != c_in or weight.shape[0] % groups:
        return f"conv weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}, groups={groups}"
    if not transposed and any(op != 0 for op in output_padding):
        return "output_padding is only for a transposed conv"
    geo = _geometry(x, weight, stride, padding, dilation, transposed, output_padding, groups)
    y_shape = [x.shape[0], geo.c_out, *geo.out_spatial[3 - dims :]]
    if min(y_shape[2:]) < 1:
        return f"empty conv output {y_shape}"
    x_rows = x.shape[0] * math.prod(x.shape[2:])
    y_rows = x.shape[0] * math.prod(y_shape[2:])
    if max(x_rows, y_rows) >= 2**31:
        return f"index range: N x spatial ({x_rows}, {y_rows}) must stay below 2**31"
    if groups * cdiv(c_in // groups, 16) >= 2**16:
        return f"grid range: groups x channel blocks ({groups} groups) must stay below 2**16"
    if not isinstance(grad, PooledGrad):
        if list(grad.shape) != y_shape:
            return f"dense gradient must have the conv output's shape {y_shape}, got {tuple(grad.shape)}"
        return None
    if grad.winner.dtype not in (torch.int8, torch.int32):
        return f"winner must be int8 or int32, got {grad.winner.dtype}"
    if grad.winner.shape != grad.g_win.shape:
        return f"winner {tuple(grad.winner.shape)} and g_win {tuple(grad.g_win.shape)} differ in shape"
    geom = [grad.kernel_size, grad.stride or grad.kernel_size, grad.padding or (0,) * dims, grad.dilation or (1,) * dims]
    if any(len(v) != dims for v in geom):
        return f"pool geometry {grad} does not have {dims} spatial dims"
    k, s, p, d = geom
    if min(k) < 1 or min(s) < 1 or min(d) < 1 or min(p) < 0:
        return f"invalid pool geometry {grad}"
    pooled = pooled_spatial(y_shape[2:], k, s, p, d, grad.ceil_mode)
    if list(grad.g_win.shape) != y_shape[:2] + pooled:
        return (
            f"pooled gradient has shape {tuple(grad.g_win.shape)}, but max-pooling the conv output "
            f"{y_shape} with {grad} gives {y_shape[:2] + pooled}"
        )
    candidates = math.prod(cdiv((kk - 1) * dd + 1, ss) for kk, ss, dd in zip(k, s, d, strict=True))
    if candidates > MAX_CANDIDATE_WINDOWS:
        return f"pool windows overlap {candidates}-fold (> {MAX_CANDIDATE_WINDOWS} unrolled candidates)"
    return None


def _checked(grad: Grad, x: torch.Tensor, weight: torch.Tensor, *conv_args: Any) -> tuple:
    """``(grad, x, weight, *conv_args)`` (``convolution_backward``'s arguments up to ``groups``) once
    ``unsupported_reason`` finds nothing against them; raises ``UnsupportedInputError`` otherwise."""
    raise_unsupported("conv_fused_bwd", unsupported_reason(grad, x, weight, *conv_args))
    return (grad, x, weight, *conv_args)


def _taps(kernel: Sequence[int]) -> list[tuple[int, int, int]]:
    return [(a, b, c) for a in range(kernel[0]) for b in range(kernel[1]) for c in range(kernel[2])]


@functools.cache  # never evicts: recorded CUDA graphs keep the tables' addresses
def _dgrad_table(
    transposed: bool, kernel: tuple[int, ...], stride: tuple[int, ...], padding: tuple[int, ...],
    dilation: tuple[int, ...], w_tap_strides: tuple[int, ...], device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The input-grad kernel's per-phase tap table (phases, kvol, 4) and tap counts (phases,), int32.

    Entry ``[r, j]``: weight tap offset (elements) and g offsets (d, h, w) of phase r's j-th tap.
    NOTE: cached per geometry, so that a backward makes no host-to-device copy (a pageable copy
    would stall the host until the stream drains).
    """
    taps = _taps(kernel)
    w_tap = [sum(k * st for k, st in zip(tap, w_tap_strides, strict=True)) for tap in taps]
    s, p, dl = stride, padding, dilation
    if transposed:
        rows = [[(w_tap[t], *(-p[i] + k[i] * dl[i] for i in range(3))) for t, k in enumerate(taps)]]
    else:
        rows = []
        for r in [(a, b, c) for a in range(s[0]) for b in range(s[1]) for c in range(s[2])]:
            rows.append([
                (w_tap[t], *((r[i] + p[i] - k[i] * dl[i]) // s[i] for i in range(3)))
                for t, k in enumerate(taps)
                if all((r[i] + p[i] - k[i] * dl[i]) % s[i] == 0 for i in range(3))
            ])  # fmt: skip
    table = torch.zeros(len(rows), len(taps), 4, dtype=torch.int32)
    for ph, row in enumerate(rows):
        if row:
            table[ph, : len(row)] = torch.tensor(row, dtype=torch.int32)
    counts = torch.tensor([len(row) for row in rows], dtype=torch.int32)
    table, counts = persistent_device_copies([table, counts], device)
    return table, counts


@functools.cache  # never evicts: recorded CUDA graphs keep the table's address
def _wgrad_table(
    kernel: tuple[int, ...], padding: tuple[int, ...], dilation: tuple[int, ...], device: torch.device
) -> torch.Tensor:
    """The weight-grad kernel's tap table (kvol, 4) int32: (unused, ``-p + k*dl`` per dim); cached."""
    rows = [(0, *(-padding[i] + k[i] * dilation[i] for i in range(3))) for k in _taps(kernel)]
    return persistent_device_copies([torch.tensor(rows, dtype=torch.int32)], device)[0]


def conv_input_grad(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    allow_tf32: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """Gradient of ``aten.convolution(x, weight, ...)`` w.r.t. ``x``, from a implicit output gradient.

    Args:
      grad: the conv-output gradient ``g``: a dense tensor of the conv output's shape (form a), or a
        ``PooledGrad`` (form b).  Any strides, fp32/fp16/bf16 (converted to x's dtype for the MMA).
      x: the conv input (only its shape, dtype, device and layout are used), (N, C_in, *spatial),
        1 to 3 spatial dims, fp32/fp16/bf16, any strides.
      weight: (C_out, C_in/groups, *k) for a conv, (C_in, C_out/groups, *k) for a transposed conv,
        x's dtype, any strides.
      stride, padding, dilation, transposed, output_padding, groups: as ``aten.convolution``.
      allow_tf32: whether fp32 dots may use TF32 (``kernels.tf32.backward_dot_precision``; None: the
        cuDNN flag).
    Returns:
      grad_x: ``torch.empty_like(x)`` layout and dtype (fp32 accumulation inside).
    """
    checked = _checked(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups)
    return _input_grad(*checked, allow_tf32=allow_tf32)


def _input_grad(grad: Grad, x: torch.Tensor, weight: torch.Tensor, *conv_args: Any,
                allow_tf32: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``conv_input_grad`` without the argument check (done once by the caller).  ``conv_args``:
    stride, padding, dilation, transposed, output_padding, groups."""
    geo = _geometry(x, weight, *conv_args)
    transposed, groups = geo.transposed, geo.groups
    dx = torch.empty_like(x)
    if dx.numel() == 0:
        return dx
    x_sizes, x_strides = lift_5d(dx)
    n, c_in = x_sizes[:2]
    w_sizes, w_strides = lift_5d(weight)
    s = geo.stride
    if transposed:
        ci_g, co_g = c_in // groups, w_sizes[1]
        w_s_grp, w_s_out, w_s_red = ci_g * w_strides[0], w_strides[0], w_strides[1]
        xs, gs = [1, 1, 1], s
    else:
        ci_g, co_g = w_sizes[1], w_sizes[0] // groups
        w_s_grp, w_s_out, w_s_red = co_g * w_strides[0], w_strides[1], w_strides[0]
        xs, gs = s, [1, 1, 1]
    table, counts = _dgrad_table(
        bool(transposed), tuple(geo.kernel), tuple(s), tuple(geo.padding), tuple(geo.dilation),
        tuple(w_strides[2:]), x.device,
    )  # fmt: skip
    kvol, num_phases = table.shape[1], table.shape[0]
    values, winners, g_strides, v_strides, pooled = _grad_operands(grad)
    max_t = math.prod(cdiv(size, step) for size, step in zip(x_sizes[2:], xs, strict=True))
    block_n = _block(ci_g, 16 if INTERPRETER else 128)
    block_k = _block(co_g, 16 if INTERPRETER else 64)
    num_c_blocks = cdiv(ci_g, block_n)

    def grid(meta):
        return (n * num_phases * cdiv(max_t, meta["BLOCK_M"]), groups * num_c_blocks)

    kernel, tile = launcher(dgrad_tuned, dgrad_kernel, dgrad_configs())
    launch(
        kernel, grid, values, winners, weight, table, counts, dx,
        ci_g, co_g, kvol, *x_sizes[2:], *geo.out_spatial, *pooled, max_t, num_c_blocks,
        *x_strides, *g_strides, *v_strides, w_s_grp, w_s_out, w_s_red,
        XSD=xs[0], XSH=xs[1], XSW=xs[2], GSD=gs[0], GSH=gs[1], GSW=gs[2],
        POOLED=isinstance(grad, PooledGrad), G_CL=channels_inner(values),
        X_CL=channels_inner(dx), POOL_GEOM=_pool_geometry(grad, geo.dims),
        PREC=backward_dot_precision(x.dtype, allow_tf32),
        I64=_needs_int64(values, winners, dx, weight),
        BLOCK_N=block_n, BLOCK_K=block_k, **tile,
    )  # fmt: skip
    return dx


def conv_weight_grad(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    allow_tf32: bool | None = None,
) -> torch.Tensor:  # fmt: skip
    """Gradient of ``aten.convolution(x, weight, ...)`` w.r.t. ``weight``, from a implicit output gradient.

    Args as ``conv_input_grad`` (here ``x``'s values are read).  The reduction over N x spatial is
    split over programs into fp32 partials ``(splits, *weight.shape)`` that are summed in a fixed
    order afterwards: bitwise reproducible run to run.
    Returns:
      grad_w: ``torch.empty_like(weight)`` layout and dtype.
    """
    checked = _checked(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups)
    return _weight_grad(*checked, allow_tf32=allow_tf32)


def _weight_grad(grad: Grad, x: torch.Tensor, weight: torch.Tensor, *conv_args: Any,
                 allow_tf32: bool | None = None) -> torch.Tensor:  # fmt: skip
    """``conv_weight_grad`` without the argument check (done once by the caller); ``conv_args`` as
    ``_input_grad``'s."""
    geo = _geometry(x, weight, *conv_args)
    transposed, groups = geo.transposed, geo.groups
    dw = torch.empty_like(weight)
    x_sizes, x_strides = lift_5d(x)
    n = x_sizes[0]
    w_sizes = lift_5d(weight)[0]
    a_g, b_g = w_sizes[0] // groups, w_sizes[1]
    s = geo.stride
    table = _wgrad_table(tuple(geo.kernel), tuple(geo.padding), tuple(geo.dilation), x.device)
    kvol = table.shape[0]
    values, winners, g_strides, v_strides, pooled = _grad_operands(grad)
    pooled_form = isinstance(grad, PooledGrad)
    if transposed:  # A = x over x's grid, B = g over the conv output
        a_t, a_strides, b_t, b_strides = x, x_strides, values, g_strides
        t_sizes, b_sizes = x_sizes[2:], geo.out_spatial
    else:  # A = g over the conv output's grid, B = x
        a_t, a_strides, b_t, b_strides = values, g_strides, x, x_strides
        t_sizes, b_sizes = geo.out_spatial, x_sizes[2:]
    rows = n * math.prod(t_sizes)
    if dw.numel() == 0:
        return dw
    if rows == 0:
        return dw.zero_()
    block_a = _block(a_g, 16 if INTERPRETER else 128)
    block_g = _block(b_g, 16 if INTERPRETER else 128)
    num_a_blocks = cdiv(a_g, block_a)
    num_b_blocks = cdiv(b_g, block_g)
    tiles = groups * num_a_blocks * kvol * num_b_blocks
    # NOTE: about 4 waves of programs on an H100 (132 SMs), each reducing >= 1024 rows; a step
    # covers BLOCK_R positions of one W line (masked beyond TW, so narrow W wastes lanes).
    tw = t_sizes[2]
    # NOTE: 64 fp32 rows keep 3 pipeline stages of 64-channel tiles at 96 KB of shared memory (two
    # programs per SM on an H100); 16-bit tiles are half the size, so 128 rows.
    cap = 16 if INTERPRETER else (128 if x.element_size() == 2 else 64)
    block_r = max(16, min(cap, next_pow2(tw)))
    line_mode = tw >= 0.75 * cdiv(tw, block_r) * block_r  # few masked lanes per W block
    if not line_mode:
        block_r = 32 if INTERPRETER else 64
    lines = n * t_sizes[0] * t_sizes[1]
    min_rows, target = (16, 8) if INTERPRETER else (1024, 4 * 132)
    splits = max(1, min(cdiv(target, tiles), cdiv(lines, cdiv(min_rows, t_sizes[2]))))
    lines_per_split = cdiv(lines, splits)
    splits = cdiv(lines, lines_per_split)
    part_numel = w_sizes[0] * b_g * kvol
    partials = torch.empty(splits, part_numel, dtype=torch.float32, device=x.device)

    grid = (tiles, splits)

    kernel, tile = launcher(wgrad_tuned, wgrad_kernel, wgrad_configs())
    launch(
        kernel, grid, a_t, b_t, winners, table, partials,
        a_g, b_g, kvol, lines, splits, part_numel, lines_per_split, num_a_blocks, num_b_blocks,
        *t_sizes, *b_sizes, *pooled, *a_strides, *b_strides, *v_strides,
        SD=s[0], SH=s[1], SW=s[2], G_IS_A=not transposed,
        A_POOLED=pooled_form and not transposed, B_POOLED=pooled_form and transposed,
        A_CL=channels_inner(a_t), B_CL=channels_inner(b_t),
        POOL_GEOM=_pool_geometry(grad, geo.dims), PREC=backward_dot_precision(x.dtype, allow_tf32),
        BLOCK_A=block_a, BLOCK_G=block_g,
        BLOCK_R=block_r, LINE_MODE=line_mode,
        I64=_needs_int64(values, winners, x, partials), **tile,
    )  # fmt: skip
    # NOTE: torch's sum over a fixed shape runs in a fixed order (no atomics): reproducible.
    dw.copy_(partials.sum(0).view(weight.shape))
    return dw


def conv_bias_grad(grad: Grad) -> torch.Tensor:
    """fp32 (C_out,) per-channel sum of the conv-output gradient, from the implicit form.

    With a ``PooledGrad`` every window adds its ``g_win`` to exactly one conv-output position, so
    the sum of ``g`` is the sum of ``g_win``.  Deterministic (fixed-order torch reduction).
    """
    values = grad.g_win if isinstance(grad, PooledGrad) else grad
    return values.sum([d for d in range(values.dim()) if d != 1], dtype=torch.float32)


def backward_plan(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True), allow_tf32: tuple[bool, bool] | None = None,
) -> Callable[[Grad, torch.Tensor, torch.Tensor], tuple[torch.Tensor | None, torch.Tensor | None]]:
    """``(grad, x, weight) -> (grad_x, grad_w)`` for tensors laid out like these (the same API as
    ``conv_phase_aligned_bwd.backward_plan``): ``convolution_backward`` without the bias.  The arguments
    are checked here; each call runs ``convolution_backward``'s launchers.  ``allow_tf32``: whether the
    input gradient's and the weight gradient's fp32 dots may use TF32 (None: the cuDNN flag, read at
    each launch)."""
    conv_args = _checked(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups)[3:]
    need_x, need_w = bool(output_mask[0]), bool(output_mask[1])
    tf32_x, tf32_w = (None, None) if allow_tf32 is None else allow_tf32

    def run(grad: Grad, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (_input_grad(grad, x, weight, *conv_args, allow_tf32=tf32_x) if need_x else None,
                _weight_grad(grad, x, weight, *conv_args, allow_tf32=tf32_w) if need_w else None)  # fmt: skip

    return run


def convolution_backward(
    grad: Grad, x: torch.Tensor, weight: torch.Tensor, stride: Sequence[int], padding: Sequence[int],
    dilation: Sequence[int], transposed: bool, output_padding: Sequence[int], groups: int,
    output_mask: Sequence[bool] = (True, True, True), allow_tf32: tuple[bool, bool] | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """Drop-in for ``aten.convolution_backward`` (without ``bias_sizes``) taking a implicit gradient;
    ``allow_tf32`` as ``backward_plan``'s.

    Returns ``(grad_x, grad_w, grad_b)``, None where ``output_mask`` is False: grad_x like
    ``empty_like(x)``, grad_w like ``empty_like(weight)``, grad_b (C_out,) in weight's dtype.
    Raises ``UnsupportedInputError`` when ``unsupported_reason(...)`` is not None.
    """
    run = backward_plan(grad, x, weight, stride, padding, dilation, transposed, output_padding, groups, output_mask[:2],
                        allow_tf32)
    gx, gw = run(grad, x, weight)
    gb = conv_bias_grad(grad).to(weight.dtype) if output_mask[2] else None
    return gx, gw, gb
