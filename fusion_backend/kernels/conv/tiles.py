"""Tile configurations of the conv family's kernels and the heuristic that picks one per problem.

A :class:`TileConfig` is everything about a launch that changes speed but not the result (apart
from the order of the fp32 sums, which the tile's ``BLOCK_K`` fixes): the three GEMM block sizes, the
warps, the software-pipeline depth, and how the K axis is walked (``flat_k``, see below).  It is a
plain frozen dataclass so that the measurement cache can store and return one.

Which tile a launch uses (:func:`tuned_tile`): on CUDA, the fastest of a few candidates per pass
(:func:`candidates`: the heuristic's tile and the pass's :data:`CANDIDATES` that fit the problem), timed
once per call signature on the call's own tensors and kept in the measurement cache
(``fusion_backend.measurements``, kind ``"conv_tile"``), so a later process times nothing.  Without
measuring (the interpreter, ``FUSION_CONV_AUTOTUNE=0``, a compile ahead, a CUDA graph being
captured) it is :func:`pick_tile`'s.  Why timed: the best tile moves irregularly with the shape (NOTE
at :data:`CANDIDATES`).

The K axis (``C_in/groups * KD * KH * KW``, the weight's order: taps outer, channels inner):

* ``flat_k=False`` (*tap-major*): a K step is ``BLOCK_K`` channels of ONE tap.  Each row of the A
  tile then reads ``BLOCK_K`` contiguous channels (channels-last), and the bounds test of the tap is one
  test per row.  Wants ``C_in/groups >= BLOCK_K``; the channels are padded to a multiple of
  ``BLOCK_K`` in the weight matrix (the A tile masks them).
* ``flat_k=True``: a K step is ``BLOCK_K`` consecutive entries of the flattened (tap, channel) axis,
  which may span several taps.  For few channels per group (an RGB stem: 3 channels x 49 taps;
  depthwise: 1 x 9), where tap-major steps would be mostly padding.  The bounds test is per element.

The A tile's load: a gather (``box_w == 0``: per element addresses and masks), or, in the gradients,
a *box* (``box_w > 0``, tap-major, stride and dilation 1): the tile's ``BLOCK_M`` positions are a
``(BLOCK_M // box_w) x box_w`` block of one plane (the output's in the weight gradient, the input's in
the input gradient), and a K step's operand is then one block of the other tensor, shifted by the tap,
that a tensor descriptor (TMA on sm_90) loads whole, the padding read as zeros by the copy itself: no
address or mask arithmetic per element (``boxes``, ``dgrad`` and ``wgrad`` module docstrings).  The
copied block, reshaped to the tile, reaches the dot through registers (``fprop`` module docstring: why
the forward has no box path), so a box is a candidate only where the hooks take the tile through
registers anyway: the input gradient's epilogue hooks, the weight gradient's recomputed prologue
(:func:`candidates`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Hashable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from ... import environment, impl_choice, measurements
from ...impl_choice import gpu_ms_per_call
from .. import launch
from ..host import best_first, cdiv, next_pow2
from ..plan_cache import ContractError, PlanCache

#: Channels per group below which K is walked flat (a tap-major step would be mostly padding).
FLAT_K_BELOW = 16


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration: ``[block_m, block_k] x [block_k, block_n]`` dots (powers of two, at
    least 16: ``tl.dot``'s minimum), ``num_warps``, ``num_stages`` (the K loop's pipeline depth) and
    the K walk (``flat_k``, module docstring)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    flat_k: bool = False
    #: the box load's output columns per tile (0: the gather; module docstring)
    box_w: int = 0
    #: the weight gradient's K steps per program: 2 or 3 read each grad_y tile once for that many, one
    #: accumulator each; in the gather kernel consecutive taps of one channel block (``wgrad`` module
    #: docstring), in the TMA kernel consecutive (tap, channel block) steps (``tma_wgrad``); 1 elsewhere
    taps_per_program: int = 1
    #: a Gluon kernel on sm_90: the forward's or the input gradient's on a 1x1 conv (TMA boxes of rows,
    #: the forward's prologue in wgmma's register layout: ``tma_fprop``), or with a box the weight
    #: gradient's (``tma_wgrad``)
    tma: bool = False
    #: the forward's halo kernel (``halo``): a hooked conv wider than 1x1 normalises each tile's input
    #: window once per channel block into a scratch slot, its taps then plain loads of the slot; on a
    #: weight gradient tile, a depthwise conv's (``wgrad._depthwise_halo_weight_grad``)
    halo: bool = False
    #: the weight gradient's split of M aims for this many programs per SM (``wgrad.pick_split``): 2 lets
    #: a second program's loads run under the first's MMAs; 1 halves the fp32 partials where one program
    #: per SM already streams its operands at full speed (TMA tiles: :func:`tma_wgrad_tiles`)
    programs_per_sm: int = 2
    #: the weight gradient's M in one split whatever its programs (``wgrad.pick_split``): the programs
    #: write the gradient themselves, no fp32 partials and no sum launch (``DIRECT``), where a split's
    #: programs fill half the SMs or more (TMA tiles: :func:`tma_wgrad_tiles`)
    one_split: bool = False

    @property
    def box_h(self) -> int:
        """The box load's output rows per tile (``block_m // box_w``)."""
        return self.block_m // self.box_w if self.box_w else 0

    def label(self) -> str:
        """``M x N x K``, warps, stages and the K walk and load, e.g. ``128x64x64 w4 s3 box 8x16``."""
        walk = " flat" if self.flat_k else (f" box {self.box_h}x{self.box_w}" if self.box_w else "")
        taps = f" taps {self.taps_per_program}" if self.taps_per_program > 1 else ""
        kernel = " tma" if self.tma else " halo" if self.halo else ""
        per_sm = " 1 split" if self.one_split else f" {self.programs_per_sm}/sm" if self.programs_per_sm != 2 else ""
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{walk}{taps}"
                f"{kernel}{per_sm}")

    def check(self) -> None:
        """Raise :class:`ContractError` unless the blocks are powers of two >= 16, the launch options
        are positive, a box (``box_w``) is a power of two dividing ``block_m``, tap-major, with sides of
        at most 256 (a tensor copy's limit), and ``taps_per_program`` is 1, 2 or 3 (more than 1: a
        tap-major gather)."""
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ContractError(f"tile {name} must be a power of two >= 16, got {v}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_stages < 1:
            raise ContractError(f"tile num_warps must be a power of two and num_stages >= 1, got "
                                f"{self.num_warps} / {self.num_stages}")  # fmt: skip
        if self.box_w and (self.box_w & (self.box_w - 1) or self.box_w > min(self.block_m, 256)
                           or self.block_m // self.box_w > 256 or self.flat_k):  # fmt: skip
            raise ContractError(f"tile box_w must be a power of two dividing block_m={self.block_m}, at most 256 "
                                f"with block_m / box_w at most 256, and the K walk tap-major; got box_w="
                                f"{self.box_w}, flat_k={self.flat_k}")  # fmt: skip
        if self.taps_per_program not in (1, 2, 3) or (self.taps_per_program > 1 and (
                self.flat_k or (self.box_w and not self.tma))):  # fmt: skip
            raise ContractError(f"tile taps_per_program must be 1, 2 or 3, and 1 with a flat K walk or a gather "
                                f"kernel's box; got {self.taps_per_program} (flat_k={self.flat_k}, "
                                f"box_w={self.box_w})")  # fmt: skip
        if not 1 <= self.programs_per_sm <= 4:
            raise ContractError(f"tile programs_per_sm must be 1 to 4, got {self.programs_per_sm}")

    def check_for(self, pass_name: str) -> None:
        """:meth:`check`, and what ``pass_name``'s kernel takes: the forward loads no boxes of the
        plane (``fprop`` and ``tma_fprop`` module docstrings), several taps per program and the split's
        programs per SM are the weight gradient's alone, and a TMA tile the forward's or the input gradient's
        (rows of a 1x1 conv's GEMM) or the weight gradient's (boxes)."""
        self.check()
        if pass_name == "fprop" and self.box_w and not self.halo:
            raise ContractError(f"tile box_w={self.box_w}: the forward loads its A tiles by gather or as rows, "
                                "not as boxes of the plane, but for the halo kernel's box tiles (fprop, tma_fprop and "
                                "halo module docstrings)")
        if self.halo and (pass_name == "dgrad" or self.flat_k or self.tma or (self.box_w and pass_name != "fprop")):
            raise ContractError(f"tile {self.label()}: a halo is the forward's (on a tap-major gather tile or its "
                                "boxes) or the weight gradient's (on a tap-major gather tile)")
        if pass_name != "wgrad" and (self.taps_per_program != 1 or self.programs_per_sm != 2 or self.one_split):
            raise ContractError(f"tile {self.label()}: several taps per program and a split's programs per SM (or "
                                "one split) are the weight gradient's")
        if self.tma and pass_name == "wgrad":
            if not self.box_w or self.block_k != 16 * self.num_warps or self.num_warps not in (4, 8) \
                    or self.block_n > 256:  # fmt: skip
                raise ContractError(f"tile {self.label()}: the TMA weight gradient loads boxes (box_w), with "
                                    "block_k 64 per warpgroup of 4 or 8 warps (wgmma's M) and block_n <= 256")
        elif self.tma and (self.box_w or self.flat_k or not 64 <= self.block_m <= 256 or self.block_n > 256
                           or self.num_warps not in (4, 8) or self.num_stages < 2):  # fmt: skip
            raise ContractError(f"tile {self.label()}: the TMA forward's and input gradient's tiles are rows, "
                                "tap-major, with 64 <= block_m <= 256 (a warpgroup's wgmma; a TMA box side), "
                                "block_n <= 256, 4 or 8 warps and 2+ stages")


def several_taps(taps: int) -> int:
    """The taps per program (``TileConfig.taps_per_program``) a weight gradient over ``taps`` kernel taps
    takes where it takes several: 3 where 3 divides them, else 2 where 2 does, else 1 (none)."""
    return 3 if taps % 3 == 0 else 2 if taps % 2 == 0 else 1


def box_width(out_h: int, out_w: int, block_m: int) -> int:
    """The box tile's columns for an output plane of ``out_h x out_w`` and ``block_m`` positions per
    tile: the power of two whose boxes cover the plane with the fewest positions past its edge (each
    computed for nothing); of those, the one with the fewest boxes hanging over the edge (a weight
    gradient masks their rows: ``wgrad._box_weight_grad``), then the widest; the box's sides within 256."""
    widths = [1 << i for i in range(block_m.bit_length()) if (1 << i) <= 256 and block_m >> i <= 256]

    def cost(w: int) -> tuple[int, float, int]:
        h = block_m // w
        rows, cols = -(-out_h // h), -(-out_w // w)
        over = (out_h % h != 0) * cols + (out_w % w != 0) * rows - (out_h % h != 0) * (out_w % w != 0)
        return rows * h * cols * w, over / (rows * cols), -w

    return min(widths, key=cost)


def halo_box_width(plane: tuple[int, int], block_m: int, kernel: tuple[int, int], dilation: tuple[int, int]) -> int:
    """The box tiles' columns (``TileConfig.box_w``) for a 'same' conv over planes ``plane`` (rows,
    columns) of ``block_m`` output positions per tile: the power of two whose boxes' windows hold the
    fewest positions over the plane, the wider of a tie: the halo normalises each window position once
    per box, so its prologue work is the windows' positions (8 x 8 boxes of a 3x3 read 10 x 10 per 64
    outputs where 1 x 64 boxes, the widest that tile a 512-wide plane, read 3 x 66; ``candidates``' NOTE
    has the timing)."""
    widths = [1 << i for i in range(block_m.bit_length()) if (1 << i) <= 256 and block_m >> i <= 256]

    def cost(w: int) -> tuple[int, int]:
        h = block_m // w
        boxes = -(-plane[0] // h) * -(-plane[1] // w)
        return boxes * (h + (kernel[0] - 1) * dilation[0]) * (w + (kernel[1] - 1) * dilation[1]), -w

    return min(widths, key=cost)


def halo_tiles(first: TileConfig, n_channels: int, m: int) -> list[TileConfig]:
    """The halo forward's two tiles (before :func:`halo_box_width` makes them boxes) for a conv of
    ``n_channels`` output channels per group over ``m`` output positions whose heuristic tile is
    ``first``: a wide one, 128 rows by up to 256 channels on 8 warps, and a short one, 64 rows of
    ``first``'s channels on 4 warps.  WHY: the halo normalises its window once per tile, so a tile as
    wide as the output's channels normalises each window once, not once per N tile; a short tile on 4
    warps leaves room for more programs per SM, whose window writes (between barriers, not pipelined)
    overlap the others' MMAs.  NOTE: the wide tile ran 1.5-1.7x the short one on the SD VAE decoder's 3x3s
    of 512 channels at 128 x 128 and 256 at 512 x 512 with GroupNorm + SiLU on load (0.290 -> 0.192,
    1.261 -> 0.727 ms; without the prologue 0.234 -> 0.161, 0.858 -> 0.627: the window's writes, not the
    prologue, are the halo's cost) and 1.5x on ResNet-50's 3x3 of 256 channels at 14 x 14 with BatchNorm
    + ReLU (0.059 -> 0.039 ms); the short one won its 3x3 of 64 channels at 56 x 56 (0.062 against the
    wide tile's 0.083) and of 512 at 7 x 7 (0.058 against 0.072: too few wide tiles for the SMs)
    (H200, bf16, ``tile_ms`` of ``python tools/bench_conv.py demos/realnets/sd_vae_decoder.py --passes
    fprop --fprop-hooks gn-silu --out DIR`` and ``python tools/bench_conv.py demos/realnets/resnet50.py
    --passes fprop --fprop-hooks bn-relu --filter '*k3x3 p1 g1*' --out DIR``)."""
    rows = max(16, next_pow2(m))
    wide = replace(first, block_m=min(128, rows), block_n=min(256, max(16, next_pow2(n_channels))), num_warps=8,
                   num_stages=3)  # fmt: skip
    return [wide, replace(first, block_m=min(64, rows), num_warps=4)]


def pick_tile(cin_g: int, cout_g: int, taps: int, m: int, dtype: torch.dtype) -> TileConfig:
    """A tile for a conv of ``cin_g`` input and ``cout_g`` output channels per group, ``taps`` kernel
    taps, ``m`` output positions and operand ``dtype``, without measuring (module docstring).

    * N: all the group's output channels up to 128 (64 for fp32, whose operands take twice the
      shared memory), so that ``x`` is read once per M tile where the layer is narrow.
    * K: tap-major with the widest ``BLOCK_K`` in (64, 32, 16) that divides ``cin_g`` (no masked
      channel step), else the widest that fits; flat when ``cin_g < FLAT_K_BELOW``.  fp32 caps it at 32.
    * M: 128 rows where the problem has several tiles of 128 and N is at most 64 (the accumulator stays
      within 64 fp32 registers per thread on 4 warps), else 64; never wider than ``m`` needs.
    * 8 warps for a 128 x 128 accumulator, and for a flat-K tile of 128 x 32 or more: with a prologue
      its per-element tap arithmetic spilled on 4 warps (NOTE at :func:`candidates`).
    """
    wide = dtype != torch.float32
    block_n = min(max(16, next_pow2(cout_g)), 128 if wide else 64)
    k_caps = (64, 32, 16) if wide else (32, 16)
    flat_k = cin_g < FLAT_K_BELOW
    if flat_k:
        block_k = 32 if cin_g * taps > 16 else 16
    else:
        block_k = next((k for k in k_caps if cin_g % k == 0), None) or next(k for k in k_caps if k <= cin_g)
    block_m = 128 if (m >= 4 * 128 and block_n <= 64) else 64
    block_m = min(block_m, max(16, next_pow2(m)))
    # a flat K walk computes each A element's tap and bounds: 8 warps halve those registers per thread
    num_warps = 8 if block_m * block_n >= 128 * 128 or (flat_k and block_m * block_k >= 128 * 32) else 4
    return TileConfig(block_m, block_n, block_k, num_warps, num_stages=3 if wide else 2, flat_k=flat_k)


def _tile(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int) -> TileConfig:
    return TileConfig(block_m, block_n, block_k, num_warps, num_stages)


# NOTE: bf16, H200, the eight largest convs of ResNet-50 at batch 64, eleven tiles each
# (``python tools/sweep_conv_tiles.py demos/realnets/resnet50.py --max-shapes 8``): the best tile
# changed from shape to shape (fprop: 256x64 on 64 channels at 56x56, 64x128 on 256 at 14x14, where
# 128x128 with 4 warps ran at 0.36 of it); no single tile came within 0.73 (fprop), 0.80 (dgrad),
# 0.87 (wgrad) of the per-shape best on average, the best three together 0.95-1.0.  Listed best alone
# first; a choice times the heuristic's tile and the first two (``host.MAX_TUNED_CONFIGS``).
#: Tiles timed per pass besides the heuristic's (``M x N x K``, warps, stages).  dgrad's N is the
#: input channels, wgrad's M the reduction over output positions.
CANDIDATES: dict[str, tuple[TileConfig, ...]] = {
    "fprop": (_tile(256, 64, 64, 8, 3), _tile(128, 128, 64, 4, 3), _tile(64, 128, 64, 4, 3)),
    "dgrad": (_tile(256, 128, 64, 8, 3), _tile(128, 128, 64, 4, 3), _tile(128, 128, 32, 4, 4)),
    "wgrad": (_tile(128, 128, 128, 8, 3), _tile(64, 64, 64, 4, 3), _tile(128, 64, 64, 4, 3)),
}

#: Shared memory an sm_90 block may use (227 KiB), less room for the epilogue's scratch.
_SHARED_BYTES = 200 * 1024
#: An sm_90 SM's shared memory for its blocks (228 KiB, 1 KiB of it per block reserved), and its registers.
SM_SHARED_BYTES = 226 * 1024
_SM_REGISTERS = 65536
#: Registers per thread the TMA forward holds (ptxas's choice, uncapped).  NOTE: capped at 168 the
#: persistent loop spilled 428 bytes (its store, statistics included, lives inside the loop), at 128 over
#: 1 KB (``python tools/compile_check.py conv_tma --cases resnet_1x1-bf16-hooked`` with the
#: launch option ``maxnreg``); uncapped: 255 and no spill.
TMA_REGISTERS = 255


def candidates(pass_name: str, k_channels: int, n_channels: int, taps: int, m: int, dtype: torch.dtype,
               depthwise_channels: int | None = None, box_plane: tuple[int, int] | None = None,
               epilogue_hooks: bool = False, tma: bool = False, plain: bool = False,
               halo: bool = False, halo_window: tuple[Any, Any, Any] | None = None) -> list[TileConfig]:  # fmt: skip
    """The tiles :func:`tuned_tile` times for ``pass_name`` ("fprop", "dgrad", "wgrad"), at most
    ``host.MAX_TUNED_CONFIGS`` (each compiles before it is timed): the heuristic's (:func:`pick_tile`
    with ``k_channels`` the channels per group a K step walks and ``n_channels`` those of the N axis),
    then :data:`CANDIDATES` in order, fitted to the problem: N no wider than the channels need, K the
    widest up to the candidate's that divides the channels of a tap (none does: no wider than they
    need; fp32: at most 32), M no taller than ``m`` needs, within shared memory; duplicates dropped.  A flat-K problem (few channels per group, whose
    K walk the candidates are not for) tries the heuristic's tile with the other warp count (4 or 8)
    and with half the rows on 4 warps instead.  NOTE: the flat walk's per-element tap arithmetic, with
    a prologue, spilled registers on 4 warps at 128 x 32 (H200, Triton 3.6: ``python
    tools/compile_check.py conv_family``: the RGB stem's hooked fprop 156 spilled, its wgrad 24).
    ``depthwise_channels``: the pass runs the direct depthwise path over that many channels
    (:func:`depthwise_candidates`).  ``box_plane``: the call may load its tiles as boxes (stride and
    dilation 1, aligned strides, a hooked gradient), its planes ``(rows, columns)``: the heuristic's tile
    as a box (:func:`box_width`) comes next, after a weight gradient's several-taps tiles.  NOTE: on the H200 (bf16, a quarter of ResNet-50's convs
    and its 56 x 56 3x3, each pass's three candidates timed: ``CONVK_SWEEP=0 bash tools/gpu_session.sh
    convk``) the box won none of the six plain gradients it was offered (within 3% on two) and four of the
    six hooked ones (the input gradient with relu' and the BatchNorm sums 0.067 against 0.105 ms on 256
    channels at 14 x 14; the weight gradient with the prologue 0.149 against 0.155 on 64 at 56 x 56).
    A weight gradient whose taps 3 or 2 divide (tap-major, more than one channel per group) times that
    many taps per program next (where a ``grad_y`` tile and the taps' A tiles per pipeline stage fit in
    shared memory), before the box: on a tile of at most 64 x 64, then on the heuristic's tile, each on 4
    warps where its accumulators take at most 96 fp32 registers per thread, else 8.  NOTE: the H200's tile
    sweep of ResNet-50's 3x3 weight gradients (bf16; ``CONVK_BENCH=0 CONVK_SWEEP=0 CONVK_HOOKED_SWEEP=1
    bash tools/gpu_session.sh convk`` and the plain sweep ``CONVK_TESTS=0 CONVK_BENCH=0``,
    ``docs/perf/h200/conv-kernels/sweep-*.json``): three taps per program ran fastest of every tile on
    four of the five 3x3 problems (on the fifth, 64 channels at 56 x 56 plain, the box 0.079 against
    0.083 ms), the fastest taps tile 1.11-1.60x the tile the choice had taken plain and 1.05-1.13x with
    the prologue; the 64 x 64 tile on 4 warps was the fastest taps tile on four of them (0.056 against
    cuDNN's 0.052 ms on 128 channels at stride 2) and within 12% on the fifth; the heuristic's 128 x 64 and 64 x 128 tiles
    with three taps ran faster on 8 warps than on 4 in three of four (on 4 warps, 255 registers and the
    SD VAE's 512-channel 3x3 spilling: ``python tools/compile_check.py conv_family --cases
    vae_3x3-bf16-taps --kernels wgrad``); the box won no hooked weight gradient over the taps.
    ``epilogue_hooks``: an input gradient whose epilogue applies the backward hooks (act', the
    BatchNorm-backward sums) times the heuristic's tile on 8 warps next, where the heuristic took 4.
    NOTE: that epilogue's per-element work held 168 registers per thread on a 4-warp 64 x 128 tile (110
    on 8; ``python tools/compile_check.py conv_family --cases resnet_1x1-bf16-hooked --kernels dgrad
    --sass``), three programs per SM at half the plain pass's bandwidth; the H200's hooked sweep
    (``docs/perf/h200/conv-kernels/sweep-hooked.json``) timed 128 x 64 x 64 on 8 warps at 0.094 ms
    against the heuristic's 4-warp 0.117 on ResNet-50's 3x3 of 64 channels at 56 x 56 (on the stride-2
    3x3 of 128 channels 0.221 against 0.146), and the generic 256 x 128 tile it pushes out of the three
    timed where a box is offered at 0.19-0.20 ms on both shapes swept.  ``tma``: a forward the
    Gluon TMA kernel takes (``tma_fprop.supports``), or an input gradient it takes
    (``tma_fprop.supports_grad``): the heuristic's gather tile (what runs untimed), then the TMA kernel's
    tiles (:func:`tma_tiles`; ``plain``: the pass runs no hooks, so the wide TMA tile too).  ``halo``: a
    hooked forward the halo kernel takes (``kernels/conv/halo.py``): after the heuristic's gather tile,
    the halo's tiles (:func:`halo_tiles`; with
    ``halo_window``, the forward's ``(plane, kernel, dilation)``: as box tiles, :func:`halo_box_width`;
    without, a forward with statistics: flat); the direct depthwise path's first tile's halo comes second;
    a weight gradient asks for it only for a
    depthwise conv (``wgrad``'s NOTE), whose direct tile's halo comes second too.  An empty problem
    (``m == 0``) gets its first tile alone."""
    if depthwise_channels is not None:
        tiles = depthwise_candidates(depthwise_channels, m)[: 1 if m == 0 else None]
        if halo and m:  # the direct tile's halo next (``kernels/conv/halo.py``)
            tiles = best_first([tiles[0], replace(tiles[0], halo=True), *tiles[1:]])
        return tiles
    first = pick_tile(k_channels, n_channels, taps, m, dtype)
    if m == 0:
        return [first]
    if tma:
        grad_hooks = pass_name == "dgrad" and epilogue_hooks  # ``tma_tiles``' NOTE
        return best_first([first, *tma_tiles(k_channels, n_channels, m, wide=plain, grad_hooks=grad_hooks)])
    if halo and pass_name == "fprop" and not first.flat_k:
        # NOTE: the halo tile was the fastest of these on ResNet-50's four hooked 3x3 forwards, 1.04-1.38x
        # the gather kernel's (H200, bf16, batch 64: ``python tools/bench_conv.py demos/realnets/resnet50.py
        # --passes fprop --filter '*k3x3 p1 g1*' --profile``, ``tile_ms``), so it is second, ahead of the
        # heuristic's alternatives
        # the halo's box tiles (:func:`halo_box_width`), whose windows reach a few positions past the box
        # where the flat halo reads whole rows of the plane.  NOTE: on the SD VAE decoder's four largest
        # 3x3s with the GroupNorm + SiLU prologue, 1 x 64 boxes ran 1.1-3.0x the flat halo and 8 x 8 boxes
        # 1.2-1.3x the 1 x 64 ones (H200, bf16: ``python tools/bench_conv.py
        # demos/realnets/sd_vae_decoder.py --passes fprop --fprop-hooks gn-silu``, ``tile_ms``); boxes won
        # ResNet-50's four 3x3s with BatchNorm + ReLU on load too (``--fprop-hooks bn-relu``)
        def as_halo(tile: TileConfig) -> TileConfig:
            if halo_window is None:
                return replace(tile, halo=True)
            return replace(tile, halo=True, box_w=halo_box_width(halo_window[0], tile.block_m, *halo_window[1:]))

        halos = [as_halo(t) for t in halo_tiles(first, n_channels, m)]
        return best_first(list(dict.fromkeys([first, *halos, *candidates(pass_name, k_channels, n_channels, taps, m,
                                                                         dtype)[1:]])))  # fmt: skip
    if first.flat_k:
        other_warps = replace(first, num_warps=12 - first.num_warps)  # 4 <-> 8
        halved = replace(first, block_m=max(16, first.block_m // 2), num_warps=4)
        return list(dict.fromkeys([first, other_warps, halved]))
    size = dtype.itemsize
    kept = [first]
    per = several_taps(taps)
    if pass_name == "wgrad" and per > 1 and k_channels > 1:  # several taps per program (``wgrad``)
        small = replace(first, block_m=min(first.block_m, 64), block_n=min(first.block_n, 64))
        for tile in dict.fromkeys((small, first)):  # one where the heuristic's tile is that small already
            staged = (tile.block_m * tile.block_n + per * tile.block_m * tile.block_k) * size * tile.num_stages
            if staged <= _SHARED_BYTES:  # a grad_y tile and ``per`` A tiles per pipeline stage
                # the accumulators within 96 fp32 registers per thread: 4 warps up to three of 64 x 64
                warps = 4 if per * tile.block_m * tile.block_n <= 3 * 64 * 64 else 8
                kept.append(replace(tile, taps_per_program=per, num_warps=warps))
    if box_plane is not None:
        kept.append(replace(first, box_w=box_width(*box_plane, first.block_m)))
    if epilogue_hooks and pass_name == "dgrad" and first.num_warps == 4:
        kept.append(replace(first, num_warps=8))
    for c in CANDIDATES[pass_name]:
        block_n = min(c.block_n, max(16, next_pow2(n_channels)))
        cap = min(c.block_k, 32 if dtype == torch.float32 else 128)  # the widest that divides the channels
        block_k = next((k for k in (128, 64, 32, 16) if k <= cap and k_channels % k == 0),
                       min(cap, max(16, next_pow2(k_channels))))  # fmt: skip
        block_m = min(c.block_m, max(16, next_pow2(m)))
        tile = TileConfig(block_m, block_n, block_k, c.num_warps, c.num_stages)
        if (block_m * block_k + block_k * block_n) * size * c.num_stages > _SHARED_BYTES:
            continue
        if tile not in kept:
            kept.append(tile)
    return best_first(kept)


@dataclass(frozen=True)
class TileChoice:
    """One :func:`tuned_tile` answer, as :func:`recording_choices` keeps it: the pass, the candidates in
    order, the chosen one's index, each candidate's milliseconds where they were timed (now or by an
    earlier process: ``how`` "timed" or "cached"; else empty, ``how`` "untimed": one candidate, no
    timing on this device, or a compile ahead)."""

    pass_name: str
    tiles: tuple[TileConfig, ...]
    index: int
    ms: tuple[float, ...]
    how: str

    @property
    def tile(self) -> TileConfig:
        return self.tiles[self.index]


_recorders: list[list[TileChoice]] = []


@contextlib.contextmanager
def recording_choices() -> Iterator[list[TileChoice]]:
    """Within the block, every :func:`tuned_tile` answer of this process is appended to the yielded
    list (a benchmark's report says which tile each row ran; plans are cached, so only a signature's
    first call asks)."""
    choices: list[TileChoice] = []
    _recorders.append(choices)
    try:
        yield choices
    finally:
        _recorders.remove(choices)


def _chosen(pass_name: str, tiles: list[TileConfig], index: int, ms: list[float], how: str) -> TileConfig:
    choice = TileChoice(pass_name, tuple(tiles), index, tuple(ms), how)
    for choices in _recorders:
        choices.append(choice)
    return choice.tile


def tuned_tile(pass_name: str, signature: Hashable, tiles: list[TileConfig],
               time_tile: Callable[[TileConfig], Callable[[], object]], device: torch.device) -> TileConfig:  # fmt: skip
    """The tile of ``tiles`` a launch of ``pass_name`` with plan key ``signature`` uses (module
    docstring): ``tiles[0]`` without measuring; else the one cached for the signature, or the fastest
    by ``time_tile(tile)`` (a call that runs the pass with that tile on the caller's tensors), timed
    by its GPU time (``impl_choice.gpu_ms_per_call``, as the implementation choices are) and cached.
    NOTE: timed with ``do_bench`` (events around host-paced calls, L2 flushed), the choice ranked the
    gather tile first on ResNet-50's 1x1 64 -> 256 conv at 56 x 56 with the BatchNorm hooks (0.147
    against 0.160 ms) where the TMA kernel's GPU time is 0.093 against 0.145 (H200, bf16,
    ``python tools/bench_conv.py demos/realnets/resnet50.py --passes fprop --filter '*k1x1*'``, its
    ``tile_ms``, against GPU time per call): the TMA launch's host cost decided.  A tile that fails
    to compile or run is skipped; if all fail, ``tiles[0]``.  Inside ``launch.compile_ahead`` (or ``compile_in_background``) every tile's
    call runs once, so that all of them compile in that batch, and the answer is ``tiles[0]``, untimed."""
    if len(tiles) == 1 or not _measuring(device):  # nothing to choose, or no timing here
        return _chosen(pass_name, tiles, 0, [], "untimed")
    key = measurements.key("conv_tile", {"pass": pass_name, "signature": repr(signature),
                                         "tiles": [asdict(t) for t in tiles]})
    cache_dir = environment.cache_dir()
    entry = measurements.lookup(key, cache_dir, lambda e: e.get("kind") == "conv_tile")
    if entry is not None and 0 <= entry.get("index", -1) < len(tiles):
        return _chosen(pass_name, tiles, entry["index"], list(entry.get("ms", [])), "cached")
    if compiling_only():
        # Launches only submit compiles here (``kernels.launch``): every tile's kernel compiles in the
        # batch, and nothing is timed or remembered (a timing would read no GPU work).
        for tile in tiles:
            try:
                time_tile(tile)()
            except Exception:  # noqa: BLE001 - it fails again where it runs for real, and is skipped there
                pass
        return _chosen(pass_name, tiles, 0, [], "untimed")
    times = []
    for tile in tiles:
        try:
            times.append(float(gpu_ms_per_call(time_tile(tile))))
        except Exception:  # noqa: BLE001 - a tile that cannot run is not a candidate
            times.append(math.inf)
    index = min(range(len(tiles)), key=times.__getitem__)
    if math.isfinite(times[index]):
        measurements.store(key, {"kind": "conv_tile", "index": index, "ms": times}, cache_dir)
    return _chosen(pass_name, tiles, index, times, "timed")


def compiling_only() -> bool:
    """Whether launches only submit compiles now (``launch.compile_ahead``, ``compile_in_background``)."""
    return launch.compiling_ahead() or launch.compiling_every_candidate()


def cached_plan(cache: PlanCache, key: Hashable, build: Callable[[], Any]) -> Any:
    """A launcher's plan for ``key``: ``cache.get(key, build)``, except while launches only compile
    (:func:`tuned_tile` answers an untimed tile there): then built and not kept."""
    return build() if compiling_only() else cache.get(key, build)


def _measuring(device: torch.device) -> bool:
    """Whether tiles are timed (or, while launches only compile, all compiled): on CUDA, where a
    measured choice may be timed now (``impl_choice.measuring_now``: measuring on, no compile ahead,
    no CUDA-graph capture) or would be but for a compile ahead (:func:`tuned_tile` compiles every
    tile there)."""
    return device.type == "cuda" and (impl_choice.measuring_now() or (compiling_only() and environment.measuring()))


def tma_shared_bytes(tile: TileConfig, stages: int, store_bytes: int = 2) -> int:
    """Shared memory of one TMA forward program: ``stages`` ring stages of the A and B boxes (16-bit) and
    the store's layout exchange of the accumulator tile at ``store_bytes`` per element
    (``tma_fprop.exchange_bytes``: 2 where the store rounds first, else 4)."""
    return stages * (tile.block_m + tile.block_n) * tile.block_k * 2 + tile.block_m * tile.block_n * store_bytes


def tma_programs_per_sm(tile: TileConfig, stages: int, store_bytes: int = 2) -> int:
    """How many programs of the TMA forward an SM holds with ``tile`` and ``stages`` ring stages:
    by registers (:data:`TMA_REGISTERS` per thread) and by shared memory (:func:`tma_shared_bytes`)."""
    by_registers = _SM_REGISTERS // (TMA_REGISTERS * 32 * tile.num_warps)
    return max(1, min(SM_SHARED_BYTES // tma_shared_bytes(tile, stages, store_bytes), by_registers))


def tma_stages(tile: TileConfig, most: int, store_bytes: int = 2, programs: int | None = None) -> int:
    """The most ring stages, 2 to ``most``, that keep ``programs`` programs of ``tile`` per SM (None: as
    many as one stage allows) and fit an SM's shared memory, the store's exchange taking ``store_bytes``
    per element (:func:`tma_shared_bytes`); 2 where none does."""
    want = tma_programs_per_sm(tile, 1, store_bytes) if programs is None else programs
    return max([2, *(n for n in range(2, most + 1) if tma_programs_per_sm(tile, n, store_bytes) >= want
                     and tma_shared_bytes(tile, n, store_bytes) <= SM_SHARED_BYTES)])  # fmt: skip


# NOTE: a plain pass (no hooks) whose N axis spans 256 channels or more times the 128 x 256 tile first: on
# ResNet-50's 1x1 convs (H200, bf16, batch 64; GPU ms per call, the tile against the 128 x 128 one and the
# timed choice of the tiles before) forwards 512 -> 256 at 28 x 28 0.0306 against 0.0354, 128 -> 512
# 0.0305 against 0.0327, 256 -> 1024 at 14 x 14 0.0181 against 0.0206; input gradients 256 -> 128 at 56 x
# 56 0.0587 against 0.0683, 1024 -> 256 at 14 x 14 0.0180 against 0.0206 (n256 wgmma: half the A reads
# per MMA of the 128-wide tile).  With the prologue it won one forward of five (512 -> 256, 0.0643
# against 0.0685), the 4-warp 128 x 64 tile three; with an input gradient's x_prev tile in registers its
# accumulator leaves no room.  256 x 128 on 8 warps ran within 3% of 128 x 256 and is not offered.  (A
# scratch sweep of the TMA kernel's tiles, stages and programs per SM; ``python tools/sweep_conv_tiles.py
# demos/realnets/resnet50.py --passes fprop,dgrad --tma --filter '*k1x1 p0*'`` times the same tiles.)
# NOTE: the second wide tile is 128 x 128 on 4 warps with a 2-stage ring, two programs per SM, not 8 warps
# with 4 stages, one per SM: on ResNet-50's eight 1x1s with the widest gap to cuBLAS (H200, bf16, batch
# 64; that sweep's grid with both, GPU ms per call) it was the fastest tile of the pass on 7 of the 16
# rows and the 8-warp one on none: forwards 128 -> 512 at 28 x 28 0.0278 against 0.0370 (the choice before
# 0.0299), 256 -> 1024 at 14 x 14 0.0169 against 0.0212; input gradients 256 -> 128 at 56 x 56 0.0516
# against 0.0734 (before 0.0583), 512 -> 128 at 28 x 28 0.0272 against 0.0373 (before 0.0301), 2048 -> 512
# at 7 x 7 0.0179 against 0.0244.
# NOTE: an input gradient with its hooks (relu' and the BatchNorm sums, x_prev's tile read into registers)
# times 128 rows on 8 warps, then 64 rows on 4 warps (one warpgroup: its accumulator and x_prev's tile as
# many registers per thread as the 8-warp 128-row tile's).  ResNet-50's hooked 1x1 input gradients at 14 x
# 14 and 7 x 7 (H200, bf16, batch 64, GPU ms per call, the same scratch sweep as the NOTE above): 64 x 128
# on 4 warps the fastest tile on all five, 256 -> 1024 at 14 x 14 0.0245 against 128 x 128 on 8 warps'
# 0.0272, 1024 -> 256 0.0369 against 0.0430, 1024 -> 512 0.0479 against 0.0556, 2048 -> 512 at 7 x 7
# 0.0276 against 0.0311, 512 -> 2048 0.0220 against 0.0248 (twice the tiles over few rows); 128 x 64 on 4
# warps spilled 96 bytes (``python tools/compile_check.py conv_tma --cases resnet_1x1-bf16-hooked``).
def tma_tiles(c_in: int, c_out: int, m: int, wide: bool = False, grad_hooks: bool = False) -> list[TileConfig]:
    """The TMA forward's tiles for a 1x1 conv of ``c_in`` -> ``c_out`` channels over ``m`` output
    positions (16-bit operands; an input gradient's GEMM: its output channels in ``c_in``'s place), best
    first: 128 rows by up to 128 output channels (8 warps past 64: two warpgroups of 64 rows each, 64
    accumulator registers per thread), then 64 output channels on 4 warps where the layer is wider;
    ``wide`` (a pass without hooks) and 256 output channels or more: 128 by 256 on 8 warps first, then
    128 by 128 on 4 (two programs per SM: one's store runs under the other's MMAs; NOTE above);
    ``grad_hooks`` (an input gradient with its hooks): 128 rows by up to 128 channels on 8 warps, then 64
    rows by as many on 4 (NOTE above).  K steps of 64 channels (fewer where ``c_in`` is narrower).
    Stages: the most, up to 4, that keep as many programs per SM as the registers allow
    (:func:`tma_programs_per_sm`, the store rounding first) and fit the SM's shared memory."""
    block_k = min(64, max(16, next_pow2(c_in)))
    block_m = 128 if m > 64 else 64
    width = min(128, max(16, next_pow2(c_out)))
    shapes = [(block_m, width, 8 if width > 64 else 4), (block_m, min(64, width), 4)]
    if wide and next_pow2(c_out) >= 256:
        shapes = [(block_m, 256, 8), (block_m, 128, 4)]
    elif grad_hooks:
        shapes = [(block_m, width, 8), (64, width, 4)]
    tiles = []
    for rows, block_n, warps in dict.fromkeys(shapes):
        tile = TileConfig(rows, block_n, block_k, warps, 2, tma=True)
        tiles.append(replace(tile, num_stages=tma_stages(tile, 4)))
    return tiles


def depthwise_candidates(c_out: int, m: int) -> list[TileConfig]:
    """The tiles of the direct depthwise path (one input channel per group, ``fprop._depthwise_tile``),
    heuristic's first: ``block_n`` output channels (contiguous in memory, so the long side) by
    ``block_m`` output positions, no K blocking (``block_k`` unused).  Not measured yet: the shape of a
    memory-bound elementwise tile, channels innermost, about 4K elements per program."""
    channels = min(128, max(16, next_pow2(c_out)))
    tiles = [TileConfig(min(max(16, 4096 // channels), max(16, next_pow2(m))), channels, 16, 4, 1)]
    for block_m, block_n in ((128, 64), (32, 128)):
        n = min(block_n, channels)
        tiles.append(TileConfig(min(block_m, max(16, next_pow2(m))), n, 16, 4, 1))
    return best_first(list(dict.fromkeys(tiles)))


#: Shared memory the TMA weight gradient's rings of one SM may take (of an sm_90 SM's 227 KiB).
_TMA_WGRAD_SHARED = 200 * 1024


# NOTE: which TMA weight-gradient tiles are offered is measured (H200, bf16, ResNet-50 at batch 64, every
# stride-1 conv, plain and with the BatchNorm + ReLU prologue, each candidate timed beside the gather
# kernel's: ``python tools/bench_conv.py demos/realnets/resnet50.py --passes wgrad --filter '*k3x3 p1
# g1*,*k1x1 p0 g1*'``, ``docs/perf/h200/conv-kernels-wgrad``).  Rows of 64 positions with two programs
# per SM ran at or below 128 with one (0.0256 against 0.0304 ms on 1024 -> 256 channels at 14 x 14) and
# beat the gather kernel on 12 of the 24 1x1 rows by 1.04-1.47x (512 -> 256 at 28 x 28 and all at 14 x 14
# and 7 x 7, plain and with the prologue: 0.0521 against 0.0733 ms there), tied one and lost the others
# by 0.70-0.92x (56 x 56: 256 -> 64 0.092 against 0.064; 128 <-> 512 at 28 x 28); the timed choice keeps
# the faster per call signature.  A wider
# kernel read from shared memory (plain, boxes tiling the plane exactly) beat it on the 3x3 of 64
# channels at 56 x 56 (0.068 against 0.080 ms; three taps per program 0.087); through registers (a
# prologue, or boxes over the plane's edge masked) it lost on every 3x3 (0.157 against 0.112 ms with the
# prologue there, 0.098 against 0.050 on 128 channels at 28 x 28), so those are not offered.  Boxes over
# the edge whose overhang clipped descriptors zero (``tma_wgrad.overhang_clips``) read from shared memory
# and are offered: the fastest tile on ResNet-50's 3x3s at 14 x 14 and 7 x 7 (0.0483 against the gather
# kernel's 0.0518 ms, 0.0474 against 0.0594) and on R3D-18's 3x3x3s at 28 x 28 and below (1.2-1.45x), 4%
# behind it at 28 x 28 (``python tools/bench_conv.py demos/realnets/resnet50.py demos/realnets/r3d_18.py
# --passes wgrad --no-hooks --filter '*k3x3 p1 g1*,*k3x3x3 p1 g1*'``, ``tile_ms``).
# NOTE: each TMA tile is offered with its split aiming at two programs per SM and at one
# (``TileConfig.programs_per_sm``; H200, bf16, ResNet-50 batch 64, each tile's time against its split,
# with the split sum of ``split_sum.split_sum_blocks``; the bench above times both variants).  On every 1x1
# one program per SM ran fastest, the fp32 partials halved while the kernel kept streaming its operands:
# 64 -> 64 at 56 x 56 0.0186 ms (128 splits) against 0.0216 (262), 128 -> 512 at 28 x 28 0.0320 against
# 0.0393, 1024 -> 256 at 14 x 14 0.0213 against 0.0245, 512 -> 2048 at 7 x 7 0.0209 against 0.0274; on
# the plain 3x3 of 64 channels at 56 x 56 two did (0.058 against 0.088 ms).  The gather kernel's tiles
# keep two: with one, 4 of 5 such rows ran 1.1-1.4x slower.
# NOTE: N of 256 (wgmma's widest, 8 warps, two stages) lost to 128 on 9 of ResNet-50's 10 1x1 weight
# gradients with 256 output channels or more (512 -> 2048 at 7 x 7: 0.0383 against 0.0208 ms; ``python
# tools/bench_conv.py demos/realnets/resnet50.py --passes wgrad --filter '*-> 2048 k1x1 p0 g1*,...'``):
# not offered on rows.
# NOTE: the wide tiles (plain calls, 128 input channels per program or more; one program's ring per SM,
# three stages): H200, bf16, each TMA tile timed beside today's on the SD VAE decoder's 3x3 weight
# gradients at batch 1 and ResNet-50's at batch 64 (a scratch sweep over ``conv_wgrad(..., tile=...)``,
# ``impl_choice.gpu_ms_per_call``; ``docs/perf/RESULTS.md``, "Wider tiles for the TMA weight gradient").
# N of 256 on a plane's boxes of 64 positions reads each ``x`` box once per 256 output channels: 512
# channels at 256 x 256 0.569 ms against 0.750 (cuDNN 0.618), at 128 x 128 0.167 against 0.197, 256
# channels at 256 x 256 0.163 against 0.194 and at 512 x 512 0.596 against 0.751; it lost at 64 x 64
# (0.061 against 0.055) and on rows.  Boxes of 128 positions (half the steps, so half their waits) won on
# rows with one program per SM (256 -> 128 at 56 x 56 0.0513 against 0.0541; 512 -> 256 at 28 x 28 0.0365
# against 0.0393) and on 128 channels at 512 x 512 with two (0.186 against 0.196); the timed choice keeps
# the faster per signature.
def tma_wgrad_tiles(c_in: int, c_out: int, taps: int, plane: tuple[int, int], rows: bool, hooked: bool,
                    clippable: tuple[bool, bool] = (False, False), sms: int = 132) -> list[TileConfig]:  # fmt: skip
    """The TMA weight gradient's tiles (``tma_wgrad``) the timed choice weighs for ``c_in`` -> ``c_out``
    channels, ``taps`` kernel taps and an output plane of ``plane`` (rows, columns): ``wgmma``'s M is the
    input channels, 64 per warpgroup (8 warps where ``c_in`` reaches 128), N up to 128 output channels,
    one K step per program, boxes of 64 positions, the ring's stages as many as fit half of
    :data:`_TMA_WGRAD_SHARED` (two programs per SM, each one's waits under the other's MMAs); each tile
    twice, its split aiming at two programs per SM and at one (NOTE above).  A 1x1 conv
    without padding (``rows``) reads consecutive positions, any hooks; a wider kernel only where its
    ``a^T`` comes from shared memory: no prologue (``hooked``) and boxes that tile the plane exactly or
    hang past it only in a dim of ``clippable`` (rows, columns: ``tma_wgrad.clippable_dims``) (NOTE
    above); none otherwise.  Plain calls of 128 input channels or more also weigh the wide tiles
    (:func:`_wide_tma_wgrad_tiles`), and every call the one-split tiles (:func:`_one_split_tma_wgrad_tiles`,
    for a GPU of ``sms`` SMs)."""
    warps = 8 if c_in >= 128 else 4
    block_k = 16 * warps
    block_n = min(128, max(16, next_pow2(c_out)))
    box_w = 64 if rows else box_width(plane[0], plane[1], 64)
    if not rows and (hooked or not _boxes_read_smem(plane, 64 // box_w, box_w, clippable)):
        return []
    stages = _half_sm_stages(block_n, block_k)
    if stages < 2:
        return []
    tile = TileConfig(64, block_n, block_k, warps, stages, box_w=box_w, tma=True)
    wide = _wide_tma_wgrad_tiles(c_out, plane, rows, tile, clippable) if not hooked and warps == 8 else []
    return [tile, replace(tile, programs_per_sm=1), *wide, *_one_split_tma_wgrad_tiles(tile, c_in, c_out, taps, sms)]


def tma_wgrad_programs(tile: TileConfig, c_in: int, c_out: int, taps: int) -> int:
    """Programs of one split of the TMA weight gradient (``tma_wgrad``) for ``c_in`` -> ``c_out`` channels
    and ``taps`` kernel taps: the K steps' groups (``taps_per_program`` of the tap-major ``(tap, channel
    block)`` steps each) x the output-channel blocks."""
    return taps * cdiv(c_in, tile.block_k) // tile.taps_per_program * cdiv(c_out, tile.block_n)


def _half_sm_stages(block_n: int, block_k: int, block_m: int = 64) -> int:
    """Stages of a TMA weight gradient's ring (a ``dy`` box and an ``x`` box of ``block_m`` positions per
    stage, 16-bit) within half of :data:`_TMA_WGRAD_SHARED` (two programs per SM), four at most."""
    return min(4, _TMA_WGRAD_SHARED // 2 // ((block_n + block_k) * block_m * 2))


def _one_split_tma_wgrad_tiles(tile: TileConfig, c_in: int, c_out: int, taps: int, sms: int) -> list[TileConfig]:
    """``tile`` and its one-warpgroup form (64 input channels per program, where ``tile`` has two: twice
    the programs) with their M in one split (``TileConfig.one_split``), each where its programs fill
    half of ``sms`` SMs or more and a split aiming at one program per SM would not already be one.
    NOTE: on the H200 (bf16, ResNet-50 batch 64, ``python tools/bench_conv.py demos/realnets/resnet50.py
    --passes wgrad --filter '*k1x1 p0 g1*'``, ``tile_ms``) the one-warpgroup form in one split (128
    programs) took the plain 1x1s at 7 x 7 from 0.0216 / 0.0202 ms (two and three splits) to 0.0184 /
    0.0183; with the prologue it ran 4-5% behind the split tiles, and on the 3x3 of 256 at 14 x 14 (72
    programs) twice as long: the timed choice keeps the faster."""
    forms = [tile]
    if tile.num_warps == 8:
        forms.append(replace(tile, block_k=64, num_warps=4, num_stages=_half_sm_stages(tile.block_n, 64, tile.block_m)))
    programs = [tma_wgrad_programs(t, c_in, c_out, taps) for t in forms]
    return [replace(t, one_split=True) for t, p in zip(forms, programs, strict=True)
            if 2 * p >= sms and (t is not tile or p < sms)]


def _boxes_read_smem(plane: tuple[int, int], box_h: int, box_w: int, clippable: tuple[bool, bool]) -> bool:
    """Whether ``box_h x box_w`` boxes over an output ``plane`` read ``a^T`` from shared memory: in each
    dim they tile the plane or their overhang is ``clippable`` (``tma_wgrad.overhang_clips``)."""
    return (plane[0] % box_h == 0 or clippable[0]) and (plane[1] % box_w == 0 or clippable[1])


def _wide_tma_wgrad_tiles(c_out: int, plane: tuple[int, int], rows: bool, tile: TileConfig,
                          clippable: tuple[bool, bool]) -> list[TileConfig]:  # fmt: skip
    """The TMA weight gradient's wide tiles beside ``tile`` (8 warps; NOTE above): on a plane of 256 output
    channels or more, N of 256 (each ``x`` box read once per 256 output channels); boxes of 128 positions
    where they read ``a^T`` from shared memory (:func:`_boxes_read_smem`), or rows of 128 with one program
    per SM.  Each ring takes up to one program's share of :data:`_TMA_WGRAD_SHARED`, three stages at
    most."""

    def stages(block_m: int, block_n: int) -> int:
        return min(3, _TMA_WGRAD_SHARED // ((block_n + tile.block_k) * block_m * 2))

    wide = []
    if not rows and c_out >= 256:
        wide.append(replace(tile, block_n=256, num_stages=stages(64, 256)))
    box_w = 128 if rows else box_width(plane[0], plane[1], 128)
    if rows or _boxes_read_smem(plane, 128 // box_w, box_w, clippable):
        wide.append(replace(tile, block_m=128, box_w=box_w, num_stages=stages(128, tile.block_n),
                            programs_per_sm=1 if rows else 2))  # fmt: skip
    return wide
