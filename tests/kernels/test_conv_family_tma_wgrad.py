"""The conv family's TMA weight gradient (``kernels/conv/tma_wgrad.py``, Gluon, sm_90) against float64,
with eager's own error as the yardstick.

Gluon has no interpreter: the kernel runs on an sm_90 GPU alone (the CPU suite compiles it:
``test_conv_family_sm90.py``; its host rules are tested here on any machine).  Each case runs
``conv_wgrad`` with TMA tiles chosen to reach the kernel's corners: boxes that hang over the output
plane (read through clipped descriptors, or where those cannot serve the masked register path) and
boxes that tile it exactly (``a^T`` read from shared memory),
several K steps per program over taps and over channel blocks, channel counts below one block and
between blocks, 1d/2d/3d, dilation, every prologue kind and the bias gradient.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from conv_prologues import PROLOGUES, conv_prologue, prologue_ids
from conv_tma_cases import requires_sm90

from fusion_backend.kernels.conv import (
    TileConfig,
    conv_wgrad,
    tma_wgrad,
    wgrad,
)
from fusion_backend.kernels.conv.reference import conv_fprop_reference, conv_wgrad_reference
from fusion_backend.kernels.conv.tiles import candidates, tma_wgrad_tiles
from fusion_backend.kernels.plan_cache import ContractError
from fusion_backend.testing import compare, stable_seed

#: The least error bound relative to the result's norm (the gather kernel's tests').
FLOOR = {torch.float16: 5e-4, torch.bfloat16: 4e-3}


def _tile(block_m: int, block_n: int, warps: int, box_w: int, slots: int = 1, stages: int = 2) -> TileConfig:
    return TileConfig(block_m, block_n, 16 * warps, warps, stages, box_w=box_w, taps_per_program=slots, tma=True)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def _randn(*shape, g, dtype=torch.float32, scale=1.0):  # noqa: ANN001, ANN002
    return (torch.randn(*shape, generator=g) * scale).to("cuda", dtype)


def _check(name: str, xs, ws, conv, tile, dtype, prologue=None, act_in=None, bias_grad=False, x=None,  # noqa: ANN001
           split=None, weight_channels_last=False):  # noqa: ANN001
    """``conv_wgrad`` with ``tile`` (and ``split``) against the float64 reference (eager's error the
    yardstick)."""
    g = torch.Generator().manual_seed(stable_seed((name, repr(tile), str(dtype))))
    x = _channels_last(_randn(*xs, g=g, dtype=dtype)) if x is None else x
    w = _randn(*ws, g=g, dtype=dtype, scale=0.3)
    w = _channels_last(w) if weight_channels_last else w
    out_shape = conv_fprop_reference(torch.zeros(xs, device="meta"), torch.zeros(ws, device="meta"), **conv)[0].shape
    gy = _channels_last(_randn(*out_shape, g=g, dtype=dtype))
    hooks = dict(prologue=prologue, act_in=act_in)
    gw, gb = conv_wgrad(gy, x, w, tile=tile, split=split, bias_grad=bias_grad, **hooks, **conv)
    eager_w, eager_b = conv_wgrad_reference(gy, x, w, bias_grad=bias_grad, **hooks, **conv)
    truth_w, truth_b = conv_wgrad_reference(gy, x, w, bias_grad=bias_grad, dtype=torch.float64, **hooks, **conv)
    assert gw.shape == w.shape and gw.dtype == w.dtype and gw.stride() == w.stride(), f"{name}: layout"
    why = compare(f"{name} grad_w", gw, eager_w, FLOOR[dtype], reference=truth_w)
    assert why is None, why
    if bias_grad:
        why = compare(f"{name} grad_bias", gb, eager_b, FLOOR[dtype], reference=truth_b)
        assert why is None, why
    return gw, (gy, x, w)


# name, x shape, weight shape, conv kwargs, tile
CASES = [
    # 12 x 20 with 8 x 16 boxes: the last row and column of boxes hang over the plane (clipped descriptors)
    ("3x3-overhang-3-taps", (2, 64, 12, 20), (64, 64, 3, 3), dict(padding=1), _tile(128, 64, 4, 16, 3)),
    # ResNet-50's planes no power-of-two box tiles: 8 x 8 boxes over 14 x 14 and 7 x 7, 8 warps, N of 256
    ("3x3-overhang-14", (2, 128, 14, 14), (96, 128, 3, 3), dict(padding=1), _tile(64, 64, 8, 8, 1, 3)),
    ("3x3-overhang-7-n256", (3, 128, 7, 7), (256, 128, 3, 3), dict(padding=1), _tile(64, 256, 8, 8, 1, 3)),
    # 8 x 8 boxes that tile a 16 x 16 plane: a^T straight from shared memory
    ("3x3-exact-boxes-smem", (2, 64, 16, 16), (64, 64, 3, 3), dict(padding=1), _tile(64, 64, 4, 8, 1, 3)),
    ("3x3-exact-boxes-3-taps", (1, 64, 16, 16), (128, 64, 3, 3), dict(padding=1), _tile(64, 64, 4, 8, 3)),
    # two warpgroups (128 input channels per block), output channels past one block with a tail
    ("3x3-8-warps-cout-tail", (2, 192, 9, 11), (72, 192, 3, 3), dict(padding=1), _tile(64, 64, 8, 8, 3)),
    ("3x3-wide-n", (2, 128, 8, 8), (256, 128, 3, 3), dict(padding=1), _tile(64, 128, 8, 8, 1)),
    # fewer input channels than a block (the box reads zeros past them), an odd plane, dilation 2
    ("3x3-dil2-cin24", (2, 24, 11, 13), (40, 24, 3, 3), dict(padding=2, dilation=2), _tile(128, 64, 4, 16, 3)),
    ("3x3-no-padding", (2, 32, 10, 9), (16, 32, 3, 3), dict(), _tile(64, 16, 4, 8, 3)),
    ("5x5-pad2-taps-of-25", (1, 16, 12, 12), (32, 16, 5, 5), dict(padding=2), _tile(64, 32, 4, 8, 1)),
    # 1x1 as rows (M consecutive positions), several channel blocks per program, an M tail
    ("1x1-rows-2-blocks", (3, 256, 7, 9), (64, 256, 1, 1), dict(), _tile(128, 64, 8, 128, 2)),
    ("1x1-rows-3-blocks", (2, 192, 5, 5), (40, 192, 1, 1), dict(), _tile(64, 64, 4, 64, 3)),
    ("1x1-padded-boxes", (2, 64, 6, 7), (32, 64, 1, 1), dict(padding=1), _tile(64, 32, 4, 8, 1)),
    ("conv1d-k3", (2, 32, 50), (48, 32, 3), dict(padding=1), _tile(64, 64, 4, 64, 3)),
    ("conv3d-k3", (1, 16, 4, 6, 5), (24, 16, 3, 3, 3), dict(padding=1), _tile(64, 32, 4, 8, 3)),
    # the wide tiles (``tiles._wide_tma_wgrad_tiles``): N of 256 with an output-channel tail, boxes of 128
    # positions on a plane and as rows with an M tail
    ("3x3-n256-cout-tail", (1, 128, 6, 64), (320, 128, 3, 3), dict(padding=1), _tile(64, 256, 8, 64, 1, 3)),
    ("3x3-box-128", (2, 128, 16, 32), (96, 128, 3, 3), dict(padding=1), _tile(128, 128, 8, 32, 1, 3)),
    ("1x1-rows-128", (3, 256, 9, 11), (128, 256, 1, 1), dict(), _tile(128, 128, 8, 128, 1, 3)),
]  # fmt: skip


@requires_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_tma_wgrad_matches_float64(case, dtype):
    name, xs, ws, conv, tile = case
    _check(name, xs, ws, conv, tile, dtype, bias_grad=True)


@requires_sm90
@pytest.mark.parametrize("geometry", ["3x3-overhang", "3x3-exact", "1x1-rows"])
@pytest.mark.parametrize("kind,act", PROLOGUES, ids=prologue_ids(PROLOGUES))
def test_tma_wgrad_recomputes_each_prologue(kind, act, geometry):
    """The forward's prologue and activation recomputed on ``a^T`` in registers; the padding's taps and
    the overhang's positions add nothing (the prologue of a zero is not zero).  Several samples per
    call: a box's per-sample vectors (group affine, gate) follow its sample."""
    xs, ws, conv, tile = {
        "3x3-overhang": ((3, 64, 9, 11), (64, 64, 3, 3), dict(padding=1), _tile(128, 64, 4, 16, 3)),
        "3x3-exact": ((3, 64, 8, 8), (32, 64, 3, 3), dict(padding=1), _tile(64, 32, 4, 8, 1)),
        "1x1-rows": ((3, 128, 5, 7), (64, 128, 1, 1), dict(), _tile(64, 64, 8, 64, 1)),
    }[geometry]
    g = torch.Generator().manual_seed(stable_seed(("tma-prologue", kind, geometry)))
    prologue = conv_prologue(kind, xs[0], xs[1], g, "cuda")
    gw, (gy, x, w) = _check(f"{geometry} {kind}", xs, ws, conv, tile, torch.bfloat16, prologue=prologue, act_in=act)
    w64 = w.double().requires_grad_(True)
    y = conv_fprop_reference(x, w64, prologue=prologue, act_in=act, dtype=torch.float64, **conv)[0]
    (auto,) = torch.autograd.grad(y, w64, gy.double())
    why = compare(f"{geometry} {kind} vs autograd", gw, auto.to(gw.dtype), FLOOR[torch.bfloat16], reference=auto)
    assert why is None, why


@requires_sm90
@pytest.mark.parametrize("plane,edge,conv", [
    ((8, 12), "column", dict(padding=1)),  # 8 x 16 boxes over 12 columns: 4 past the edge, clipped W
    ((12, 8), "row", dict(padding=1)),  # over 12 rows: clipped H
    ((12, 12), "both", dict(padding=1)),
    ((12, 12), "both", dict(padding=2, kernel=5)),  # two taps read past the edge: the masked registers
])  # fmt: skip
def test_tma_wgrad_overhang_beside_an_infinite_input_adds_nothing(plane, edge, conv):
    """A box over the plane's edge reads real inputs for its left- and up-looking taps, where ``grad_y``
    is 0: an infinite input there must not turn the tap's gradient into NaN (eager never pairs them)."""
    conv = dict(conv)
    k = conv.pop("kernel", 3)
    xs, ws = (1, 64, *plane), (64, 64, k, k)
    g = torch.Generator().manual_seed(stable_seed(("tma-inf", plane, edge, k)))
    x = _randn(*xs, g=g, dtype=torch.bfloat16)
    if edge in ("column", "both"):  # the last column: the right-looking taps of the last outputs read it
        x[:, :, :, -1] = float("inf")
    if edge in ("row", "both"):
        x[:, :, -1, :] = float("-inf")
    x = _channels_last(x)
    tile = _tile(128, 64, 4, 16 if plane[0] == 8 else 8, 3 if k == 3 else 1)  # 8 x 16 or 16 x 8 boxes
    gy = _channels_last(_randn(1, 64, *plane, g=g, dtype=torch.bfloat16))
    gw, _ = conv_wgrad(gy, x, torch.empty(ws, device="cuda", dtype=torch.bfloat16), tile=tile, **conv)
    eager, _ = conv_wgrad_reference(gy, x, torch.empty(ws, device="cuda", dtype=torch.bfloat16), **conv)
    assert torch.equal(gw.isfinite(), eager.isfinite()), "the overhang's zero gradient met the infinite input"
    assert not eager.isfinite().all() and eager.isfinite().any()  # the case has both kinds of taps


@pytest.mark.parametrize("size,out,kernel,dilation,padding,box,clips", [
    ((14, 14), (14, 14), (3, 3), 1, 1, (8, 8), (13, 13)),  # 'same' 3x3: the first tap row and column
    ((56, 56), (56, 56), (3, 3), 1, 1, (8, 8), (0, 0)),  # boxes tile the plane: nothing to clip
    ((14, 14), (14, 14), (3, 3), 1, 1, (2, 32), (0, 13)),  # 2-row boxes tile 14 rows
    ((11, 13), (11, 13), (3, 3), 2, 2, (8, 16), (9, 11)),  # dilation 2: the first tap reads 2 back
    ((12, 12), (12, 12), (5, 5), 1, 2, (8, 8), None),  # two taps read past the edge: no single extent
    ((10, 9), (8, 7), (3, 3), 1, 0, (8, 8), None),  # no padding: the later taps read past it too
    ((6, 7), (8, 9), (1, 1), 1, 1, (8, 8), (0, 0)),  # a padded 1x1: every tap there reads padding
])  # fmt: skip
def test_overhang_clips_cut_x_where_only_the_first_tap_reads_past_the_plane(size, out, kernel, dilation, padding,
                                                                            box, clips):  # fmt: skip
    """``tma_wgrad.overhang_clips``: the extents that make every read of a box past the output plane a
    zero (positions past them), without cutting a read eager makes."""
    geo = SimpleNamespace(size=(1, *size), out_size=(1, *out), kernel=(1, *kernel), dilation=(1, dilation, dilation),
                          padding=(0, padding, padding))  # fmt: skip
    assert tma_wgrad.overhang_clips(geo, box) == clips
    assert tma_wgrad.clippable_dims(geo) == (clips is not None,) * 2
    if clips is not None:
        _assert_clipped_reads_are_eagers(geo, box, clips)


def _assert_clipped_reads_are_eagers(geo, box, clips):  # noqa: ANN001
    """Every tap's reads over the box positions of each dim (H, W) of ``geo`` (the outputs' and the
    overhang's), the first tap through its extent in ``clips``: inside the input exactly where eager's
    gradient pairs an input with an output."""
    for dim, clip in enumerate(clips):
        size, out, kernel = geo.size[dim + 1], geo.out_size[dim + 1], geo.kernel[dim + 1]
        dilation, padding = geo.dilation[dim + 1], geo.padding[dim + 1]
        for k in range(kernel):
            extent = clip if k == 0 and clip else size  # the first tap through the clipped descriptor
            for o in range(-(-out // box[dim]) * box[dim]):
                i = o + k * dilation - padding
                assert (0 <= i < extent) == (o < out and 0 <= i < size), (geo, dim, k, o)  # past the outputs: none


@requires_sm90
def test_tma_wgrad_is_bit_identical_across_runs_and_reads_any_layout():
    xs, ws, conv = (2, 64, 12, 12), (64, 64, 3, 3), dict(padding=1)
    tile = _tile(128, 64, 4, 16, 3)
    gw, (gy, x, w) = _check("layouts", xs, ws, conv, tile, torch.bfloat16)
    again, _ = conv_wgrad(gy, x, w, tile=tile, **conv)
    assert torch.equal(gw, again)
    nchw, _ = conv_wgrad(gy.contiguous(), x.contiguous(), w, tile=tile, **conv)  # copied to channels-last
    assert torch.equal(gw, nchw)
    big = torch.empty(x.numel() + 8, device="cuda", dtype=x.dtype)[1:]  # an odd offset: copied to 16 bytes
    odd = big[: x.numel()].view(x.shape[0], *x.shape[2:], x.shape[1]).movedim(-1, 1)
    odd.copy_(x)
    shifted, _ = conv_wgrad(gy, odd, w, tile=tile, **conv)
    assert torch.equal(gw, shifted)


@requires_sm90
@pytest.mark.parametrize("case", ["3x3-overhang-3-taps", "1x1-rows-2-blocks", "3x3-overhang-7-n256"])
@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "prologue"])
def test_tma_wgrad_one_split_writes_the_gradient_from_its_accumulators(case, hooked):
    """With one split each program rounds its accumulators into the gradient itself (``DIRECT``: no
    partials, no sum launch), at the weight's strides (channels-last here): within eager's error of
    float64, the same bits on a rerun, one rounding from three splits' result (through the sum launch)."""
    _, xs, ws, conv, tile = next(c for c in CASES if c[0] == case)
    g = torch.Generator().manual_seed(stable_seed(("tma-direct", case, hooked)))
    hooks = dict(prologue=conv_prologue("channel_affine", xs[0], xs[1], g, "cuda"), act_in="relu") if hooked else {}
    gw, (gy, x, w) = _check(f"{case} one split", xs, ws, conv, tile, torch.bfloat16, split=1,
                            weight_channels_last=True, **hooks)  # fmt: skip
    plan = wgrad._PLANS.values()[-1]
    assert plan.tma and plan.split == 1 and plan.direct, (plan.split, plan.direct)
    again, _ = conv_wgrad(gy, x, w, tile=tile, split=1, **hooks, **conv)
    assert torch.equal(gw, again)
    three, _ = conv_wgrad(gy, x, w, tile=tile, split=3, **hooks, **conv)
    plan = wgrad._PLANS.values()[-1]
    assert plan.split > 1 and not plan.direct
    torch.testing.assert_close(gw, three, rtol=1e-2, atol=1e-2 * three.abs().max().item())


@requires_sm90
def test_tma_wgrad_tiles_join_the_timed_choice_where_the_kernel_applies():
    """``conv_wgrad``'s timed choice weighs the TMA tiles beside the gather kernel's, and its result
    matches float64 whichever it takes."""
    xs, ws, conv = (4, 64, 14, 14), (64, 64, 3, 3), dict(padding=1)
    _check("timed choice", xs, ws, conv, None, torch.bfloat16)


def test_overhang_clips_over_drawn_geometries():
    """``overhang_clips`` over random stride-1 geometries (sizes, kernels, dilations, paddings, boxes):
    where it gives extents, every box position reads x through them exactly where eager's gradient pairs
    it with an output; where it gives None, some tap past the first reads real input past the plane (no
    single extent per dim would do)."""
    g = torch.Generator().manual_seed(stable_seed("overhang-clips-fuzz"))

    def draw(lo, hi):  # noqa: ANN001, ANN202
        return int(torch.randint(lo, hi + 1, (), generator=g))

    drawn = {True: 0, False: 0}
    for _ in range(400):
        dims = []
        for _ in range(2):
            k, d = draw(1, 7), draw(1, 3)
            p, size = draw(0, (k - 1) * d), draw(1, 40)
            out = size + 2 * p - d * (k - 1)
            if out < 1:
                break
            dims.append((size, out, k, d, p, 1 << draw(0, 5)))
        if len(dims) < 2:
            continue
        size, out, kernel, dil, pad, box = (tuple(v[i] for v in dims) for i in range(6))
        geo = SimpleNamespace(size=(1, *size), out_size=(1, *out), kernel=(1, *kernel), dilation=(1, *dil),
                              padding=(0, *pad))  # fmt: skip
        clips = tma_wgrad.overhang_clips(geo, box)
        past = [range(out[i], -(-out[i] // box[i]) * box[i]) for i in range(2)]  # each dim's overhang
        later_tap_reads_past = [any(0 <= o + k * dil[i] - pad[i] < size[i] for k in range(1, kernel[i])
                                    for o in past[i]) for i in range(2)]  # fmt: skip
        if clips is not None:
            _assert_clipped_reads_are_eagers(geo, box, clips)
            assert not any(later_tap_reads_past), dims
        else:  # a dim past whose edge a later tap reads too, or where tap 0's extent would be empty
            assert any(later_tap_reads_past[i] or (len(past[i]) and out[i] - pad[i] < 1) for i in range(2)), dims
        drawn[clips is None] += 1
    assert min(drawn.values()) > 50, drawn  # both outcomes well represented


def test_tma_wgrad_tiles_fit_the_kernel_and_shared_memory():
    """Every tile :func:`tma_wgrad_tiles` offers passes the kernel's refusal rules; the first comes with
    its split aiming at two programs per SM and at one, its ring within half an sm_90 SM's shared memory
    (two programs per SM); the wide tiles (plain calls, 8 warps: N of 256 on a plane of 256 output channels
    or more, boxes of 128 positions) within one program's; a wider kernel is offered only where ``a^T``
    comes from shared memory: no prologue, boxes that tile the plane."""
    offered = {}
    for c_in, c_out, k, plane in [(64, 64, 3, (56, 56)), (256, 64, 1, (56, 56)), (512, 512, 3, (64, 64)),
                                  (24, 40, 3, (11, 13)), (1024, 2048, 1, (7, 7)), (128, 128, 5, (28, 28)),
                                  (256, 256, 3, (256, 256))]:  # fmt: skip
        geo = SimpleNamespace(groups=1, stride=(1, 1, 1), taps=k * k, c_in=c_in)  # what the refusal reads
        for hooked in (False, True):
            tiles = [t for t in tma_wgrad_tiles(c_in, c_out, k * k, plane, k == 1, hooked) if not t.one_split]
            offered[(c_in, k, hooked)] = [t.label() for t in tiles]
            assert tiles[1:2] == [dataclasses.replace(t, programs_per_sm=1) for t in tiles[:1]]
            assert tiles[:1] == [] or tiles[0].programs_per_sm == 2
            assert not tiles[2:] or (not hooked and c_in >= 128)
            for i, tile in enumerate(tiles):
                tile.check_for("wgrad")
                assert tma_wgrad.refusal(geo, torch.bfloat16, tile) == "", tile.label()
                ring = tile.num_stages * (tile.block_n + tile.taps_per_program * tile.block_k) * tile.block_m * 2
                assert 2 <= tile.num_stages and ring <= (100 if i < 2 else 200) * 1024, tile.label()
                assert k == 1 or plane[1] % tile.box_w == 0 and plane[0] % tile.box_h == 0, tile.label()
    assert len(offered[(64, 3, False)]) == 2 and offered[(64, 3, True)] == []  # 8 x 8 boxes tile 56 x 56
    assert offered[(24, 3, False)] == []  # 11 x 13: no box of 64 tiles it
    assert len(offered[(256, 1, True)]) == len(offered[(1024, 1, True)]) == 2  # rows take any hooks
    # plain rows of 128+ channels: boxes of 128 positions, one program per SM; no N of 256 on rows
    assert offered[(1024, 1, False)][2:] == ["128x128x128 w8 s3 box 1x128 tma 1/sm"]
    # a 512-channel plane of 64 x 64: N of 256, and boxes of 128 positions tiling it (2 x 64)
    assert offered[(512, 3, False)][2:] == ["64x256x128 w8 s3 box 1x64 tma", "128x128x128 w8 s3 box 2x64 tma"]
    assert offered[(256, 3, False)][2:] == ["64x256x128 w8 s3 box 1x64 tma", "128x128x128 w8 s3 box 1x128 tma"]
    # boxes past the plane read a^T from shared memory where their overhang is clipped (a 'same' 3x3)
    assert tma_wgrad_tiles(128, 128, 9, (28, 28), False, False) == []
    clipped = tma_wgrad_tiles(128, 128, 9, (28, 28), False, False, (True, True))
    assert [t.label() for t in clipped][2:] == ["128x128x128 w8 s3 box 4x32 tma"]
    assert tma_wgrad_tiles(128, 128, 9, (28, 28), False, True, (True, True)) == []  # a prologue: registers
    assert tma_wgrad_tiles(128, 128, 9, (28, 28), False, False, (True, False)) == []  # 28 columns: 8 x 8 over


@pytest.mark.parametrize("c_in,c_out,taps,sms", [(512, 2048, 1, 132), (2048, 512, 1, 132), (512, 512, 9, 132),
                                                 (256, 256, 27, 132), (1024, 256, 1, 132), (512, 2048, 1, 78),
                                                 (64, 64, 9, 132), (64, 256, 1, 132)])  # fmt: skip
def test_one_split_tma_wgrad_tiles_fill_half_the_sms(c_in, c_out, taps, sms):
    """The one-split tiles: the first tile and, where it has two warpgroups, its one-warpgroup form (64 input
    channels per program), each where its programs fill half the SMs or more and a split aiming at one
    program per SM would not already be one; within the kernel's rules and half an SM's shared memory."""
    rows = taps == 1
    tiles = tma_wgrad_tiles(c_in, c_out, taps, (7, 7) if rows else (8, 8), rows, False, sms=sms)
    first, singles = tiles[0], [t for t in tiles if t.one_split]

    def programs(t: TileConfig) -> int:
        return taps * -(-c_in // t.block_k) * -(-c_out // t.block_n)

    forms = [first] + ([dataclasses.replace(first, block_k=64, num_warps=4)] if first.num_warps == 8 else [])
    want = [f for f in forms if 2 * programs(f) >= sms and (f is not first or programs(f) < sms)]
    assert [(t.block_k, t.num_warps) for t in singles] == [(f.block_k, f.num_warps) for f in want]
    geo = SimpleNamespace(groups=1, stride=(1, 1, 1), taps=taps, c_in=c_in)
    for t in singles:
        t.check_for("wgrad")
        assert tma_wgrad.refusal(geo, torch.bfloat16, t) == "" and t.label().endswith("1 split")
        assert t.num_stages * (t.block_n + t.block_k) * t.block_m * 2 <= 100 * 1024
        assert wgrad.pick_split(10**6, programs(t), t, torch.device("cpu")) == 1


@pytest.mark.parametrize("tile,words", [
    (TileConfig(128, 64, 64, 4, 2, tma=True), "loads boxes"),
    (TileConfig(128, 64, 32, 4, 2, box_w=16, tma=True), "block_k 64 per warpgroup"),
    (TileConfig(128, 64, 64, 8, 2, box_w=16, tma=True), "block_k 64 per warpgroup"),
])  # fmt: skip
def test_tma_wgrad_tile_outside_the_kernel_is_refused_in_one_line(tile, words):
    with pytest.raises(ContractError, match=words) as err:
        tile.check_for("wgrad")
    assert "\n" not in str(err.value)


def test_tma_wgrad_refuses_a_call_outside_its_contract_in_one_line():
    """On a machine without sm_90 (or for fp32, groups, strides) a TMA tile is refused before anything
    launches, with one line naming why; the timed choice never offers one there."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(1, 64, 8, 8, device=device).to(memory_format=torch.channels_last)
    w = torch.randn(64, 64, 3, 3, device=device)
    gy = torch.randn(1, 64, 8, 8, device=device).to(memory_format=torch.channels_last)
    with pytest.raises(ContractError, match="TMA weight gradient takes fp16 or bf16") as err:
        conv_wgrad(gy, x, w, padding=1, tile=_tile(64, 64, 4, 8))
    assert "\n" not in str(err.value)
    assert not tma_wgrad.supports(x, gy, w, (1, 1, 1), 1)
    assert all(not t.tma for t in candidates("wgrad", 64, 64, 9, 64, torch.float32))
