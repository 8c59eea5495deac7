"""The shift-decomposed backward of a transposed conv followed by a phase-aligned max pool.

Every case is checked against ``aten.convolution_backward`` in float64 on the full-size conv-output
gradient that the implicit ``PooledGrad`` stands for (inputs rounded to the kernel dtype first, so the
reference sees exactly what the kernels see); one test takes the reference from autograd through
``conv_transpose`` + ``max_pool`` directly.  Without CUDA the kernels run under Triton's interpreter
(fp32/fp16, small shapes).  The GPU tests (``-m gpu``) run the ``seeds`` suite's ConvTranspose3d
16->32 + MaxPool3d(2) at full size against ``conv_fused_bwd`` and float64.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from fusion_backend.errors import UnsupportedInputError
from fusion_backend.kernels import conv_fused_bwd as FB
from fusion_backend.kernels import conv_phase_aligned_bwd as S
from fusion_backend.testing import stable_seed

# fp32 parity is checked at ~1e-5: TF32 off (on CUDA the kernels follow cudnn.allow_tf32).
pytestmark = pytest.mark.usefixtures("exact_fp32")

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOL = {torch.float32: 2e-5, torch.float16: 4e-3}


@dataclass(frozen=True)
class Case:
    """A ConvTranspose (c_in -> c_out) on x of ``size`` followed by a max pool whose stride is the
    conv stride; per-dim tuples (a single value applies to every dim)."""

    size: tuple[int, ...]
    c_in: int
    c_out: int
    kernel: tuple[int, ...] | int
    stride: tuple[int, ...] | int
    padding: tuple[int, ...] | int = 0
    dilation: tuple[int, ...] | int = 1
    output_padding: tuple[int, ...] | int = 0
    groups: int = 1
    pool: tuple[int, ...] | int = 2
    pool_padding: tuple[int, ...] | int = 0
    ceil_mode: bool = False
    batch: int = 2

    @property
    def dims(self) -> int:
        return len(self.size)

    def per_dim(self, v: tuple[int, ...] | int) -> tuple[int, ...]:
        return tuple(v) if isinstance(v, tuple) else (v,) * self.dims

    def conv_args(self) -> tuple:
        p = self.per_dim
        return p(self.stride), p(self.padding), p(self.dilation), True, p(self.output_padding), self.groups


def make(case: Case, dtype: torch.dtype, device: str, channels_last: bool = False, winner_dtype=torch.int8):
    """(x, w, full-size gradient) in float64 and (x, w, PooledGrad) for the kernels on ``device``."""
    gen = torch.Generator().manual_seed(stable_seed(case) % 2**31)
    x = torch.randn(case.batch, case.c_in, *case.size, generator=gen, dtype=torch.float64)
    k = case.per_dim(case.kernel)
    w = torch.randn(case.c_in, case.c_out // case.groups, *k, generator=gen, dtype=torch.float64)
    x, w = x.to(dtype).double(), w.to(dtype).double()
    y_shape = torch.ops.aten.convolution(x, w, None, *case.conv_args()).shape
    # winners of a real max pool over random values of the conv output's shape
    pk, ps, pp = case.per_dim(case.pool), case.per_dim(case.stride), case.per_dim(case.pool_padding)
    z = torch.randn(y_shape, generator=gen, dtype=torch.float64)
    pool_fn = (F.max_pool1d, F.max_pool2d, F.max_pool3d)[case.dims - 1]
    _, flat = pool_fn(z, pk, ps, pp, 1, ceil_mode=case.ceil_mode, return_indices=True)
    spatial = list(y_shape[2:])
    win = torch.zeros_like(flat)
    for j in range(case.dims):  # flat in-plane index -> row-major index over the window's taps
        coord = (flat // math.prod(spatial[j + 1 :])) % spatial[j]
        shape = [1] * flat.dim()
        shape[2 + j] = flat.shape[2 + j]
        origin = (torch.arange(flat.shape[2 + j]) * ps[j] - pp[j]).reshape(shape)
        win = win + (coord - origin) * math.prod(pk[j + 1 :])
    g_win = torch.randn(flat.shape, generator=gen, dtype=torch.float64).to(dtype).double()
    full = torch.zeros(y_shape[0], y_shape[1], math.prod(spatial), dtype=torch.float64)
    full.scatter_add_(2, flat.flatten(2), g_win.flatten(2))
    xk, wk, gk, vk = (
        x.to(device, dtype),
        w.to(device, dtype),
        g_win.to(device, dtype),
        win.to(device, winner_dtype),
    )
    if channels_last:
        fmt = torch.channels_last if case.dims == 2 else torch.channels_last_3d
        xk, wk, gk, vk = (t.contiguous(memory_format=fmt) for t in (xk, wk, gk, vk))
    grad = FB.PooledGrad(gk, vk, pk, ps, pp, (), case.ceil_mode)
    return (x, w, full.reshape(y_shape)), (xk, wk, grad)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check(case: Case, dtype, device, channels_last=False, winner_dtype=torch.int8, mask=(True, True, True)):
    (x, w, full), (xk, wk, grad) = make(case, dtype, device, channels_last, winner_dtype)
    args = case.conv_args()
    assert S.unsupported_reason(grad, xk, wk, *args) is None
    want = torch.ops.aten.convolution_backward(full, x, w, [full.shape[1]], *args, list(mask))
    got = S.convolution_backward(grad, xk, wk, *args, mask)
    for name, g, e, ref in zip("xwb", got, want, (xk, wk, wk), strict=True):
        if e is None:
            assert g is None
            continue
        assert g.shape == e.shape and g.dtype == ref.dtype, name
        if name != "b":
            assert g.stride() == torch.empty_like(ref).stride(), name
        assert rel_err(g, e) <= TOL[dtype], f"grad {name}: rel err {rel_err(g, e):.2e}"
    return got


CASES = {
    "3d": Case((3, 4, 5), 3, 5, 3, 2, padding=1, output_padding=1),  # the ConvT3d pipeline's geometry, tiny
    "1d": Case((11,), 3, 4, 3, 2, padding=1, output_padding=1),
    "2d": Case((5, 6), 3, 4, 3, 2, padding=1, output_padding=1),
    "2d_odd_ceil": Case((5, 7), 3, 4, 3, 2, ceil_mode=True),  # odd conv output: partial windows
    "2d_pool_pad_overlap": Case((4, 5), 3, 4, 3, 2, padding=1, pool=(3, 2), pool_padding=(1, 0)),  # KP > s
    "1d_pool_pad_overlap": Case((7,), 3, 4, 3, 2, padding=1, pool=3, pool_padding=1, ceil_mode=True),
    "2d_groups": Case((4, 5), 4, 6, 3, 2, padding=1, output_padding=1, groups=2),
    "2d_s3_k4": Case((4, 5), 3, 4, 4, 3, padding=1, output_padding=2, pool=3),
    "1d_s3_k2": Case((9,), 3, 4, 2, 3, pool=3, ceil_mode=True),
    "2d_dilation": Case((4, 5), 3, 4, 3, 2, padding=(2, 1), dilation=(2, 1), output_padding=1),
    "2d_mixed_strides": Case((4, 5), 3, 4, (3, 2), (2, 3), padding=(1, 0), pool=(2, 3)),
    "3d_wide_channels": Case((2, 3, 3), 20, 18, 2, 2),  # several ci / co blocks
    "2d_long_rows": Case((2, 37), 3, 4, 3, 2, padding=1, output_padding=1),  # pooled width 37 >= BLOCK_M
}


@pytest.mark.parametrize("name", list(CASES))
def test_grads_match_float64_aten_fp32(name, kernel_device):
    check(CASES[name], torch.float32, kernel_device)


@pytest.mark.parametrize("name", ["3d", "2d_groups"])
def test_grads_match_float64_aten_fp16(name, kernel_device):
    check(CASES[name], torch.float16, kernel_device)


@pytest.mark.parametrize("name", ["3d", "2d_groups"])
def test_channels_last_inputs_give_grads_in_their_layout(name, kernel_device):
    check(CASES[name], torch.float32, kernel_device, channels_last=True)


@pytest.mark.parametrize(
    "name,dgrad_kpb,wgrad_kpb,block_m",
    [
        ("3d", 1, 2, 64),
        ("2d_pool_pad_overlap", 4, 4, 64),
        ("3d_wide_channels", 2, 1, 64),
        ("2d_long_rows", 2, 4, 16),
    ],
)
def test_every_tile_shape_gives_the_same_grads(
    name, dgrad_kpb, wgrad_kpb, block_m, kernel_device, monkeypatch
):
    """KPB (window offsets per block) 1 skips every dead pair; larger blocks mask them; a last block
    may run past the window volume.  BLOCK_M <= pooled width takes the weight grad's carry path
    for the unit rows (blocks straddling two lines)."""
    tiles = {"dgrad": (block_m, 16, 16, dgrad_kpb, 4, 1), "wgrad": (block_m, 16, 16, wgrad_kpb, 4, 1)}
    monkeypatch.setattr(S.plan, "_use_autotune", lambda macs: False)
    monkeypatch.setattr(
        S.plan, "heuristic_tile", lambda kind, ci_g, co_g, kpn: S.plan.fit_tiles([tiles[kind]], ci_g, co_g, kpn)[0]
    )
    check(CASES[name], torch.float32, kernel_device)


#: Pooled widths that a BLOCK_M of 16 divides: the weight grad's LINE path (every block of unit rows
#: inside one line; scalar (n, ud, uh) walked by carries).  Odd depths/heights, partial channel
#: tiles, and a negative w shift (pool padding on w: shifts -1..1, LOW < 0).
LINE_CASES = {
    "line_3d_w16": Case((3, 5, 16), 3, 5, 3, 2, padding=1, output_padding=1),  # one block per line
    "line_2d_w32": Case((3, 32), 3, 4, 3, 2, padding=1, output_padding=1),  # two blocks per line
    "line_2d_low_neg": Case((3, 16), 3, 4, 3, 2, padding=1, pool=(2, 3), pool_padding=(0, 1)),
    "line_3d_groups": Case((2, 3, 16), 4, 6, 3, 2, padding=1, output_padding=1, groups=2),
}


def _force_wgrad_tile(monkeypatch, tile: tuple[int, ...]) -> list[dict]:
    """Use ``tile`` for the weight grad (the input grad keeps its heuristic); returns, per weight-grad
    launch built from now on, whether the kernel takes its LINE path."""
    seen: list[bool] = []
    heuristic = S.plan.heuristic_tile
    monkeypatch.setattr(S.plan, "_use_autotune", lambda macs: False)
    monkeypatch.setattr(
        S.plan,
        "heuristic_tile",
        lambda kind, ci_g, co_g, kpn: (
            S.plan.fit_tiles([tile], ci_g, co_g, kpn)[0] if kind == "wgrad" else heuristic(kind, ci_g, co_g, kpn)
        ),
    )

    class Recording(S.plan._KernelLaunch):
        def __init__(self, tuned, raw, tile, grid, constexprs, fixed=()) -> None:  # noqa: ANN001
            if raw is S.device.phase_aligned_wgrad_kernel:
                seen.append(constexprs["LINE_DIV"] % tile[0] == 0)  # the kernel's LINE
            super().__init__(tuned, raw, tile, grid, constexprs, fixed)

    monkeypatch.setattr(S.plan, "_KernelLaunch", Recording)
    monkeypatch.setattr(S.plan, "_PLANS", type(S.plan._PLANS)(256))  # no plan cached with another tile
    return seen


@pytest.mark.parametrize("name", list(LINE_CASES))
@pytest.mark.parametrize("kpb", [2, 8])
def test_weight_grad_line_path(name, kpb, kernel_device, monkeypatch):
    """Every gradient at KPB 2; at KPB 8 the weight and bias grads alone: the input grad keeps its
    heuristic tile whatever the weight grad's KPB, so it would run the same launch on the same inputs
    again."""
    seen = _force_wgrad_tile(monkeypatch, (16, 16, 16, kpb, 4, 1))
    check(LINE_CASES[name], torch.float32, kernel_device, mask=(kpb == 2, True, True))
    assert seen and all(seen)


def test_weight_grad_line_path_channels_last_fp16(kernel_device, monkeypatch):
    seen = _force_wgrad_tile(monkeypatch, (16, 16, 16, 4, 4, 1))
    check(LINE_CASES["line_3d_w16"], torch.float32, kernel_device, channels_last=True)
    check(LINE_CASES["line_3d_w16"], torch.float16, kernel_device)
    assert seen and all(seen)


def test_weight_grad_without_line_path(kernel_device, monkeypatch):
    """BLOCK_M 32 does not divide the pooled width 16: the general row walk (no LINE).  The input grad,
    on its heuristic tile, is ``test_weight_grad_line_path[2-line_3d_w16]``'s: not run again."""
    seen = _force_wgrad_tile(monkeypatch, (32, 16, 16, 4, 4, 1))
    check(LINE_CASES["line_3d_w16"], torch.float32, kernel_device, mask=(False, True, True))
    assert seen and not any(seen)


def test_int32_winners(kernel_device):
    check(CASES["2d_pool_pad_overlap"], torch.float32, kernel_device, winner_dtype=torch.int32)


def test_output_mask_skips_grads(kernel_device):
    check(CASES["2d"], torch.float32, kernel_device, mask=(False, True, False))
    check(CASES["2d"], torch.float32, kernel_device, mask=(True, False, True))


def test_matches_autograd_through_conv_transpose_and_max_pool(kernel_device):
    """The implicit gradient as the fused forward would save it: winners of the pool over the conv output."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 3, 4, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, dtype=torch.float64, requires_grad=True)
    y = F.conv_transpose3d(x, w, b, stride=2, padding=1, output_padding=1)
    pooled, flat = F.max_pool3d(y, 2, return_indices=True)
    g_win = torch.randn(pooled.shape, dtype=torch.float64)
    (pooled * g_win).sum().backward()
    sd, sh, sw = y.shape[2:]
    d, h, ww = flat // (sh * sw), (flat // sw) % sh, flat % sw
    winner = ((d % 2) * 4 + (h % 2) * 2 + ww % 2).to(torch.int8)
    grad = FB.PooledGrad(g_win.float().to(kernel_device), winner.to(kernel_device), (2, 2, 2))
    args = ((2, 2, 2), (1, 1, 1), (1, 1, 1), True, (1, 1, 1), 1)
    got = S.convolution_backward(
        grad, x.detach().float().to(kernel_device), w.detach().float().to(kernel_device), *args
    )
    for g, want in zip(got, (x.grad, w.grad, b.grad), strict=True):
        assert rel_err(g, want) <= TOL[torch.float32]


def test_no_live_pair_gives_zero_grads(kernel_device):
    # k=1, s=2, p=1: the conv writes only odd outputs; a 1-wide pool at stride 2 reads only even ones
    case = Case((5,), 3, 4, 1, 2, padding=1, output_padding=1, pool=1)
    gx, gw, _ = check(case, torch.float32, kernel_device)
    assert not gx.any() and not gw.any()


def test_empty_batch_gives_zero_weight_grad(kernel_device):
    case = Case((3, 4), 3, 4, 3, 2, padding=1, output_padding=1, batch=0)
    (_, w, _), (xk, wk, grad) = make(case, torch.float32, kernel_device)
    gx, gw, gb = S.convolution_backward(grad, xk, wk, *case.conv_args())
    assert gx.shape == xk.shape and gw.shape == wk.shape and not gw.any() and not gb.any()


def test_weight_grad_is_bitwise_reproducible(kernel_device):
    case = CASES["3d"]
    _, (xk, wk, grad) = make(case, torch.float32, kernel_device)
    first = S.convolution_backward(grad, xk, wk, *case.conv_args(), (False, True, False))[1]
    again = S.convolution_backward(grad, xk, wk, *case.conv_args(), (False, True, False))[1]
    assert torch.equal(first, again)


def _assert_same_with_non_finite(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    got = got.double().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"grad {name}: NaN pattern differs"
    assert torch.equal(torch.isinf(got), torch.isinf(want)), f"grad {name}: inf pattern differs"
    assert torch.equal(got[torch.isinf(got)], want[torch.isinf(want)]), f"grad {name}: inf signs differ"
    finite = torch.isfinite(want)
    if not finite.any():
        return
    scale = want[finite].abs().max().clamp_min(1e-30)
    assert ((got[finite] - want[finite]).abs().max() / scale).item() <= TOL[torch.float32], name


def test_inf_and_nan_reach_exactly_the_reference_outputs(kernel_device):
    """inf/NaN in x (interior) and g_win (border and interior units) land where float64 aten puts
    them: dead (offset, shift) pairs never multiply them by a structural zero."""
    case = CASES["3d"]
    (x, w, full), (xk, wk, grad) = make(case, torch.float32, kernel_device)
    x[0, 1, 1, 2, 2] = float("inf")
    x[1, 0, 1, 1, 3] = float("nan")
    g_win = grad.g_win.clone()
    for idx, value in (
        ((0, 2, 2, 3, 4), float("inf")),
        ((1, 1, 0, 0, 0), float("-inf")),
        ((1, 4, 1, 2, 2), float("nan")),
    ):
        n, c, *u = idx  # border units (pooled (3, 4, 5): last / first positions) and one interior
        g_win[idx] = value
        flat_u = (
            (u[0] * 2 + int(grad.winner[idx]) // 4) * 8 + u[1] * 2 + int(grad.winner[idx]) // 2 % 2
        ) * 10
        full.view(full.shape[0], full.shape[1], -1)[n, c, flat_u + u[2] * 2 + int(grad.winner[idx]) % 2] = (
            value
        )
    grad = FB.PooledGrad(g_win, grad.winner, grad.kernel_size, grad.stride, grad.padding)
    args = case.conv_args()
    want = torch.ops.aten.convolution_backward(full, x, w, [full.shape[1]], *args, [True, True, True])
    got = S.convolution_backward(grad, x.float().to(kernel_device), wk, *args)
    for name, g, e in zip("xwb", got, want, strict=True):
        _assert_same_with_non_finite(g, e, name)


@pytest.mark.parametrize("name", ["line_3d_w16", "line_2d_low_neg"])
def test_inf_and_nan_reach_exactly_the_reference_outputs_line_path(name, kernel_device, monkeypatch):
    """As above on the weight grad's LINE path: inf/NaN gradients at w, h and d border units (the
    first and last unit of a line, the last line, the last depth) and at interior units, inf/NaN in
    x (3d case)."""
    seen = _force_wgrad_tile(monkeypatch, (16, 16, 16, 4, 4, 1))
    case = LINE_CASES[name]
    (x, w, full), (xk, wk, grad) = make(case, torch.float32, kernel_device)
    if name == "line_3d_w16":  # (interior positions; see the module docstring for x's inf/NaN)
        x[0, 1, 1, 1, 2] = float("inf")
        x[1, 0, 1, 1, 3] = float("nan")
    g_win, win = grad.g_win.clone(), grad.winner
    units = g_win.shape[2:]
    last = tuple(u - 1 for u in units)
    picks = [
        ((0, 2, *last), float("inf")),  # last unit: w, h (and d) border
        ((1, 1, *(0,) * case.dims), float("-inf")),  # first unit
        ((0, 0, *last[:-1], 7), float("nan")),  # last line (h / d border), middle of the line
        ((1, 3, *(1,) * (case.dims - 1), units[-1] - 1), float("inf")),  # w border only
        ((1, 1, *(1,) * (case.dims - 1), 5), float("nan")),  # interior
    ]
    pk, ps, pp = case.per_dim(case.pool), case.per_dim(case.stride), case.per_dim(case.pool_padding)
    spatial = full.shape[2:]
    for idx, value in picks:
        n, c, *u = idx
        old = g_win[idx].item()
        g_win[idx] = value
        kp = int(win[idx])
        o = []
        for j in range(case.dims):  # winner (row-major over the window) -> conv-output position
            k_j = (kp // math.prod(pk[j + 1 :])) % pk[j]
            o.append(u[j] * ps[j] - pp[j] + k_j)
        if all(0 <= o[j] < spatial[j] for j in range(case.dims)):
            full[(n, c, *o)] += value - old  # (overlapping windows: another unit may share it)
    grad = FB.PooledGrad(g_win, win, grad.kernel_size, grad.stride, grad.padding, (), grad.ceil_mode)
    args = case.conv_args()
    want = torch.ops.aten.convolution_backward(full, x, w, [full.shape[1]], *args, [True, True, True])
    got = S.convolution_backward(grad, x.float().to(kernel_device), wk, *args)
    for name_, g, e in zip("xwb", got, want, strict=True):
        _assert_same_with_non_finite(g, e, name_)
    assert seen and all(seen)


def test_inf_in_weight_reaches_exactly_the_reference_outputs(kernel_device):
    case = CASES["2d"]
    (x, w, full), (xk, wk, grad) = make(case, torch.float32, kernel_device)
    w[1, 2, 0, 1] = float("inf")
    args = case.conv_args()
    want = torch.ops.aten.convolution_backward(full, x, w, [full.shape[1]], *args, [True, True, True])
    got = S.convolution_backward(grad, xk, w.float().to(kernel_device), *args)
    for name, g, e in zip("xwb", got, want, strict=True):
        _assert_same_with_non_finite(g, e, name)


def test_unsupported_cases_say_why(kernel_device):
    case = CASES["2d"]
    (_, _, full), (xk, wk, grad) = make(case, torch.float32, kernel_device)
    args = case.conv_args()
    s, p, d, _, op, groups = args

    def reason(g=grad, x=xk, w=wk, a=args):
        why = S.unsupported_reason(g, x, w, *a)
        assert isinstance(why, str) and why, "expected a reason"
        return why

    assert "PooledGrad" in reason(g=full.float())
    assert "not a transposed conv" in reason(a=(s, p, d, False, op, groups))
    assert "pool stride" in reason(g=FB.PooledGrad(grad.g_win, grad.winner, (2, 2), (1, 1)))
    assert "pool dilation" in reason(g=FB.PooledGrad(grad.g_win, grad.winner, (2, 2), (2, 2), (0, 0), (2, 2)))
    assert "must be in" in reason(x=xk.double(), w=wk.double())
    assert "winner must be" in reason(g=FB.PooledGrad(grad.g_win, grad.winner.long(), (2, 2)))
    assert "max-pooling the conv output" in reason(
        g=FB.PooledGrad(grad.g_win[..., :-1], grad.winner[..., :-1], (2, 2))
    )
    assert "entries" in reason(a=((2,), p, d, True, op, groups))
    assert "does not fit" in reason(w=wk[:2])
    # 7 taps at stride 2: 4 shifts per dim, 16 in all
    wide = Case((4, 5), 3, 4, 7, 2, padding=3, output_padding=1)
    _, (xw, ww, gw) = make(wide, torch.float32, kernel_device)
    assert "shifts" in reason(g=gw, x=xw, w=ww, a=wide.conv_args())
    # malformed arguments give a reason, not an exception
    assert "not understood" in reason(a=(s, p, d, True, op, "two"))
    if S.plan.INTERPRETER:
        assert "bf16" in reason(x=xk.bfloat16(), w=wk.bfloat16())
    with pytest.raises(UnsupportedInputError, match="PooledGrad"):
        S.convolution_backward(full.float(), xk, wk, *args)


def test_tiles_are_clamped_to_the_problem():
    tiles = S.plan.fit_tiles(S.plan.DGRAD_TILES, ci_g=3, co_g=5, kpn=2)
    assert all(t[1] == 16 and t[2] == 16 and t[3] <= 2 for t in tiles)
    assert len(tiles) == len(set(tiles))


# --------------------------------------------------------------------------------------------------
# GPU: the ConvT3d pipeline at full size
# --------------------------------------------------------------------------------------------------


def _convt3d_maxpool(device: str = "cuda"):
    """ConvTranspose3d 16->32 k3 s2 p1 op1 on (16, 16, 16, 32, 32), gradient behind MaxPool3d(2)."""
    torch.manual_seed(0)
    x = torch.rand(16, 16, 16, 32, 32, device=device)
    w = torch.randn(16, 32, 3, 3, 3, device=device) * 0.1
    args = ((2, 2, 2), (1, 1, 1), (1, 1, 1), True, (1, 1, 1), 1)
    y = torch.ops.aten.convolution(x, w, None, *args)
    _, flat = F.max_pool3d(y, 2, return_indices=True)
    d, h, ww = (flat // (64 * 64)) % 32, (flat // 64) % 64, flat % 64
    win = ((d % 2) * 4 + (h % 2) * 2 + (ww % 2)).to(torch.int8)
    g_win = torch.randn(flat.shape, device=device)
    full = torch.zeros(y.shape[0] * y.shape[1], y[0, 0].numel(), device=device, dtype=torch.float64)
    full.scatter_add_(1, flat.reshape(full.shape[0], -1), g_win.double().reshape(full.shape[0], -1))
    return x, w, args, FB.PooledGrad(g_win, win, (2, 2, 2)), full.reshape(y.shape)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16"])
def test_gpu_convt3d_maxpool_matches_float64_and_conv_fused_bwd(mode):
    x, w, args, grad, full = _convt3d_maxpool()
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    x, w = x.to(dtype), w.to(dtype)
    want = torch.ops.aten.convolution_backward(
        full, x.double(), w.double(), [full.shape[1]], *args, [True] * 3
    )
    saved = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    try:
        assert S.unsupported_reason(grad, x, w, *args) is None
        got = S.convolution_backward(grad, x, w, *args)
        generic = FB.convolution_backward(grad, x, w, *args)
    finally:
        torch.backends.cudnn.allow_tf32 = saved
    tol = {"fp32": 1e-5, "tf32": 3e-3, "bf16": 1.5e-2}[mode]
    for name, g, gen, e, ref in zip("xwb", got, generic, want, (x, w, w), strict=True):
        assert g.dtype == ref.dtype and g.shape == e.shape, name
        if name != "b":
            assert g.stride() == torch.empty_like(ref).stride(), name
        err = ((g.double() - e).norm() / e.norm()).item()
        err_generic = ((gen.double() - e).norm() / e.norm()).item()
        assert err < tol, (
            f"{mode} grad {name}: norm-wise rel err {err:.2e} (conv_fused_bwd: {err_generic:.2e})"
        )
        assert err < max(2 * err_generic, tol / 10), (
            f"{mode} grad {name}: {err:.2e} vs conv_fused_bwd {err_generic:.2e}"
        )


def test_cached_plan_reads_each_calls_tensors(kernel_device):
    """``convolution_backward`` caches a plan per shapes: a second call with new data of the same
    shapes must read the new tensors (nothing of the first call's data is baked into the plan)."""
    case = CASES["2d"]
    (x, w, full), (xk, wk, grad) = make(case, torch.float32, kernel_device)
    args = case.conv_args()
    S.convolution_backward(grad, xk, wk, *args)
    grad2 = FB.PooledGrad(grad.g_win * 0.5, grad.winner, grad.kernel_size, grad.stride, grad.padding, (),
                          grad.ceil_mode)  # fmt: skip
    got = S.convolution_backward(grad2, xk * -1.5, wk * 2.0, *args)
    want = torch.ops.aten.convolution_backward(full * 0.5, x * -1.5, w * 2.0, [full.shape[1]], *args, [True] * 3)
    for name, g, e in zip("xwb", got, want, strict=True):
        assert rel_err(g, e) <= TOL[torch.float32], f"grad {name}: rel err {rel_err(g, e):.2e}"
