"""Which tile the conv family's launches use (``kernels/conv/tiles.py``): the candidates fitted to a
problem, the timed choice among them and its cache.

On CPU nothing is timed for real: ``tiles._measuring`` is forced on and ``tiles.gpu_ms_per_call`` replaced
by a fake that gives each tile a time, so the choice, its cache and its fallbacks are checked here; the
kernels run under Triton's interpreter.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fusion_backend import measurements
from fusion_backend.kernels.conv import (
    TileConfig,
    conv_dgrad,
    conv_fprop,
    conv_wgrad,
    dgrad,
    fprop,
    tiles,
    wgrad,
)
from fusion_backend.kernels.conv.tiles import CANDIDATES, candidates, pick_tile, tuned_tile
from fusion_backend.kernels.host import MAX_TUNED_CONFIGS
from fusion_backend.kernels.plan_cache import ContractError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


class FakeBench:
    """``gpu_ms_per_call`` whose time for a tile is ``times[tile]`` (default 1.0); records what it timed.
    ``failing``: tiles whose run raises, as a tile that does not compile would."""

    def __init__(self, times=None, failing=()):
        self.times, self.failing, self.timed, self.attempted = dict(times or {}), set(failing), [], []
        self.current = None

    def wrap(self, time_tile):
        def for_tile(tile):
            run = time_tile(tile)

            def call():
                self.attempted.append(tile)
                if tile in self.failing:
                    raise RuntimeError("out of resources")
                self.current = tile
                return run()

            return call

        return for_tile

    def __call__(self, call):
        call()
        self.timed.append(self.current)
        return self.times.get(self.current, 1.0)


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """Tiles are timed (by a ``FakeBench``) into a fresh measurement cache."""
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    measurements.forget_in_memory()
    bench = FakeBench()
    monkeypatch.setattr(tiles, "_measuring", lambda device: True)
    monkeypatch.setattr(tiles, "gpu_ms_per_call", bench)
    real = tiles.tuned_tile

    def tuned(pass_name, signature, tried, time_tile, device):
        return real(pass_name, signature, tried, bench.wrap(time_tile), device)

    for module in (fprop, dgrad, wgrad):
        monkeypatch.setattr(module, "tuned_tile", tuned)
    for module in (fprop, dgrad, wgrad):
        module._PLANS.clear()
    yield bench
    measurements.forget_in_memory()
    for module in (fprop, dgrad, wgrad):
        module._PLANS.clear()


def test_candidates_start_with_the_heuristic_and_fit_the_problem():
    wide = candidates("fprop", 256, 256, 9, 200704, torch.bfloat16)
    assert wide[0] == pick_tile(256, 256, 9, 200704, torch.bfloat16)
    assert len(wide) == MAX_TUNED_CONFIGS and len(set(wide)) == len(wide)  # each tile compiles: at most three
    assert wide[1:] == [c for c in CANDIDATES["fprop"] if c != wide[0]][: len(wide) - 1]  # best alone first
    narrow = candidates("fprop", 16, 24, 9, 40, torch.float16)  # N at most 32, K at most 16, M at most 64
    assert all(t.block_n <= 32 and t.block_k <= 16 and t.block_m <= 64 for t in narrow)
    padded = candidates("fprop", 96, 96, 9, 4096, torch.bfloat16)  # K steps that divide 96 channels
    assert all(96 % t.block_k == 0 for t in padded)
    fp32 = candidates("wgrad", 256, 256, 9, 200704, torch.float32)
    assert all(t.block_k <= 32 for t in fp32)
    assert all((t.block_m * t.block_k + t.block_k * t.block_n) * 4 * t.num_stages <= tiles._SHARED_BYTES for t in fp32)
    stem = candidates("fprop", 3, 64, 49, 802816, torch.bfloat16)  # flat K: the heuristic's, more warps, fewer rows
    first = pick_tile(3, 64, 49, 802816, torch.bfloat16)
    assert stem[0] == first and all(t.flat_k and t.block_k == first.block_k for t in stem) and len(stem) == 3


@pytest.mark.parametrize("plane,block_m,want", [
    ((56, 56), 64, 8),  # 8 x 8 boxes divide the plane
    ((56, 56), 128, 16),  # none does; of the least wasteful, 8 x 16 hangs over in one column of 7 boxes
    ((7, 7), 128, 16),  # a small plane: one box covers it, 8 x 16 the widest of those
    ((1, 200), 64, 64),  # a 1-d output: one row
    ((300, 300), 256, 16),  # 16 x 16 boxes waste the least (19 x 19 of them)
])  # fmt: skip
def test_a_box_covers_the_output_plane_with_the_fewest_positions_past_its_edge(plane, block_m, want):
    assert tiles.box_width(*plane, block_m) == want


def test_a_call_that_may_load_boxes_times_the_heuristics_tile_as_a_box_second():
    boxed = candidates("fprop", 64, 64, 9, 200704, torch.bfloat16, box_plane=(56, 56))
    assert boxed[0] == pick_tile(64, 64, 9, 200704, torch.bfloat16)
    assert boxed[1] == dataclasses.replace(boxed[0], box_w=tiles.box_width(56, 56, boxed[0].block_m))
    boxed[1].check()
    assert not any(t.box_w for t in candidates("fprop", 64, 64, 9, 200704, torch.bfloat16))


def test_an_input_gradient_with_epilogue_hooks_times_the_heuristics_tile_on_8_warps_after_the_box():
    first = pick_tile(64, 64, 9, 200704, torch.bfloat16)
    assert first.num_warps == 4
    hooked = candidates("dgrad", 64, 64, 9, 200704, torch.bfloat16, box_plane=(56, 56), epilogue_hooks=True)
    assert hooked[:3] == [first, dataclasses.replace(first, box_w=tiles.box_width(56, 56, first.block_m)),
                          dataclasses.replace(first, num_warps=8)]
    hooked[2].check_for("dgrad")
    assert candidates("dgrad", 64, 64, 9, 200704, torch.bfloat16, epilogue_hooks=True)[1] == hooked[2]  # no box
    for other in (candidates("dgrad", 64, 64, 9, 200704, torch.bfloat16),  # no hooks
                  candidates("fprop", 64, 64, 9, 200704, torch.bfloat16, epilogue_hooks=True)):  # not a gradient
        assert dataclasses.replace(first, num_warps=8) not in other


def test_a_weight_gradient_whose_taps_3_or_2_divide_times_several_taps_per_program_on_a_small_tile_and_its_own():
    first = pick_tile(64, 64, 9, 200704, torch.bfloat16)
    assert (first.block_m, first.block_n, first.num_warps) == (128, 64, 4)
    three = candidates("wgrad", 64, 64, 9, 200704, torch.bfloat16)
    assert three == [first, dataclasses.replace(first, block_m=64, taps_per_program=3),
                     dataclasses.replace(first, num_warps=8, taps_per_program=3)]  # 3 x 128 x 64 accumulators: 8 warps
    for tile in three[1:]:
        tile.check_for("wgrad")
    wide = candidates("wgrad", 512, 512, 9, 65536, torch.bfloat16)  # the heuristic's 64 x 128: the small tile is 64 x 64
    assert [(t.block_m, t.block_n, t.num_warps, t.taps_per_program) for t in wide[1:]] == [(64, 64, 4, 3), (64, 128, 8, 3)]
    assert candidates("wgrad", 64, 64, 4, 200704, torch.bfloat16)[1].taps_per_program == 2  # a 2x2 kernel
    small = candidates("wgrad", 64, 64, 9, 300, torch.bfloat16)  # the heuristic's tile is 64 x 64 already
    assert len(set(small)) == len(small) and sum(t.taps_per_program == 3 for t in small) == 1
    boxed = candidates("wgrad", 64, 64, 9, 200704, torch.bfloat16, box_plane=(56, 56))
    assert boxed == three  # a hooked 3x3's taps before its box (the box lost to them on the H200)
    assert candidates("wgrad", 64, 64, 1, 200704, torch.bfloat16, box_plane=(56, 56))[1].box_w  # a hooked 1x1's box
    for other in (candidates("wgrad", 64, 64, 1, 200704, torch.bfloat16),  # a 1x1 conv: one tap
                  candidates("wgrad", 3, 64, 49, 200704, torch.bfloat16),  # the RGB stem: a flat K walk
                  candidates("fprop", 64, 64, 9, 200704, torch.bfloat16),
                  candidates("dgrad", 64, 64, 9, 200704, torch.bfloat16)):  # fmt: skip
        assert all(t.taps_per_program == 1 for t in other)


def test_taps_per_program_is_checked_and_labelled():
    assert TileConfig(128, 64, 64, 8, 3, taps_per_program=3).label() == "128x64x64 w8 s3 taps 3"
    for bad in (TileConfig(64, 64, 64, taps_per_program=4), TileConfig(64, 64, 16, flat_k=True, taps_per_program=2),
                TileConfig(64, 64, 64, box_w=8, taps_per_program=2)):  # fmt: skip
        with pytest.raises(ContractError, match="taps_per_program"):
            bad.check()


def test_a_box_tile_is_checked():
    TileConfig(128, 64, 64, box_w=64).check()
    for bad in (TileConfig(128, 64, 64, box_w=48), TileConfig(64, 64, 64, box_w=128),
                TileConfig(64, 64, 16, flat_k=True, box_w=8)):  # fmt: skip
        with pytest.raises(ContractError, match="box_w"):
            bad.check()


def test_the_fastest_candidate_is_chosen_cached_and_not_timed_again(timed):
    tried = candidates("fprop", 64, 64, 9, 4096, torch.float16)
    timed.times = {tried[0]: 3.0, tried[1]: 2.0, tried[2]: 0.5}
    with tiles.recording_choices() as choices:
        picked = tuned_tile("fprop", ("signature", 1), tried, timed.wrap(lambda t: lambda: None), torch.device("cpu"))
        assert picked == tried[2] and timed.timed == tried
        measurements.forget_in_memory()  # a later process: the file answers
        again = tuned_tile("fprop", ("signature", 1), tried, timed.wrap(lambda t: lambda: None), torch.device("cpu"))
        assert again == tried[2] and timed.timed == tried
    other = tuned_tile("fprop", ("signature", 2), tried, timed.wrap(lambda t: lambda: None), torch.device("cpu"))
    assert other == tried[2] and len(timed.timed) == 2 * len(tried)
    # what a report of the choices reads: the timing, then the cache's answer with its times; none after the block
    assert [(c.pass_name, c.tile, c.ms, c.how) for c in choices] == [("fprop", tried[2], (3.0, 2.0, 0.5), "timed"),
                                                                     ("fprop", tried[2], (3.0, 2.0, 0.5), "cached")]


def test_a_tile_is_labelled_by_its_blocks_launch_and_walk():
    assert TileConfig(128, 64, 64, 4, 3).label() == "128x64x64 w4 s3"
    assert TileConfig(64, 32, 32, 8, 2, flat_k=True).label() == "64x32x32 w8 s2 flat"
    assert TileConfig(128, 64, 64, 4, 3, box_w=16).label() == "128x64x64 w4 s3 box 8x16"


def test_a_tile_that_fails_is_skipped_and_when_all_fail_the_first_is_used_uncached(timed):
    tried = [TileConfig(16, 16, 16, 1, 1), TileConfig(32, 16, 16, 1, 1)]
    timed.failing = {tried[1]}
    timed.times = {tried[1]: 0.1}
    assert tuned_tile("dgrad", "s", tried, timed.wrap(lambda t: lambda: None), torch.device("cpu")) == tried[0]
    timed.failing = set(tried)
    assert tuned_tile("dgrad", "t", tried, timed.wrap(lambda t: lambda: None), torch.device("cpu")) == tried[0]
    assert tuned_tile("dgrad", "t", tried, timed.wrap(lambda t: lambda: None), torch.device("cpu")) == tried[0]
    assert timed.timed == [tried[0]] and len(timed.attempted) == 2 + 2 * 2  # the all-failing key: not cached


def test_without_measuring_the_heuristic_tile_runs_untimed(monkeypatch):
    monkeypatch.setattr(tiles, "gpu_ms_per_call", lambda call: pytest.fail("timed"))
    tried = candidates("fprop", 64, 64, 9, 4096, torch.float16)
    with tiles.recording_choices() as choices:
        assert tuned_tile("fprop", "s", tried, lambda t: lambda: None, torch.device("cpu")) == tried[0]
    assert [(c.tile, c.ms, c.how) for c in choices] == [(tried[0], (), "untimed")]


def test_while_launches_only_compile_every_tile_runs_and_nothing_is_timed_kept_or_planned(timed, monkeypatch):
    """Inside ``launch.compile_ahead`` every candidate's launch compiles in the batch; the answer is the
    first tile, untimed and uncached, and the launcher keeps no plan made with it."""
    from fusion_backend.kernels import launch

    tried = candidates("fprop", 64, 64, 9, 4096, torch.float16)
    ran = []
    monkeypatch.setattr(launch, "compiling_ahead", lambda: True)
    picked = tuned_tile("fprop", "s", tried, lambda t: lambda: ran.append(t), torch.device("cpu"))
    assert picked == tried[0] and ran == tried and timed.timed == []
    built = []
    assert tiles.cached_plan(fprop._PLANS, "k", lambda: built.append(1) or "plan") == "plan"
    assert len(fprop._PLANS) == 0 and built == [1]
    monkeypatch.setattr(launch, "compiling_ahead", lambda: False)  # launches run again: timed and kept
    assert tuned_tile("fprop", "s", tried, timed.wrap(lambda t: lambda: None), torch.device("cpu")) == tried[0]
    assert timed.timed == tried
    assert tiles.cached_plan(fprop._PLANS, "k", lambda: "plan") == "plan" and len(fprop._PLANS) == 1


def _cl(t):
    return t.movedim(1, -1).contiguous().movedim(-1, 1)


def test_each_pass_runs_the_tile_its_timing_chose_and_gives_the_same_result(timed, monkeypatch):
    """fprop, dgrad and wgrad each time their candidates on the call's tensors, launch the fastest,
    and their results match eager's (fp32, TF32 off on CUDA)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    g = torch.Generator().manual_seed(5)
    x = _cl(torch.randn(2, 32, 6, 6, generator=g)).to(DEVICE)
    w = (torch.randn(32, 32, 3, 3, generator=g) * 0.1).to(DEVICE)
    dy = _cl(torch.randn(2, 32, 6, 6, generator=g)).to(DEVICE)
    for name, module, run, tried in (
        ("fprop", fprop, lambda: conv_fprop(x, w, padding=1)[0], candidates("fprop", 32, 32, 9, 72, torch.float32)),
        ("dgrad", dgrad, lambda: conv_dgrad(dy, w, x.shape, padding=1)[0], candidates("dgrad", 32, 32, 9, 72,
                                                                                      torch.float32)),
        ("wgrad", wgrad, lambda: conv_wgrad(dy, x, w, padding=1)[0], candidates("wgrad", 32, 32, 9, 72,
                                                                                torch.float32)),
    ):  # fmt: skip
        assert len(tried) > 1, name
        timed.times = {t: 1.0 for t in tried} | {tried[-1]: 0.25}
        out = run()
        assert module._PLANS.values()[-1].tile == tried[-1], name
        want = {"fprop": lambda: F.conv2d(x, w, padding=1),
                "dgrad": lambda: torch.nn.grad.conv2d_input(x.shape, w, dy, padding=1),
                "wgrad": lambda: torch.nn.grad.conv2d_weight(x, w.shape, dy, padding=1)}[name]()
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)


def test_only_a_hooked_gradient_times_a_box_candidate(timed, monkeypatch):
    """Stride 1 and 128-byte pixels allow boxes everywhere; the forward times one only as the halo
    kernel's box tile (a hooked 'same' conv writing no statistics), a plain gradient none, a gradient
    with hooks does (``tiles.candidates``: where a box has won), after a 3x3 weight gradient's
    several-taps tiles."""
    from fusion_backend.kernels.conv.hooks import ChannelAffine, NormStats

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    g = torch.Generator().manual_seed(6)
    x = _cl(torch.randn(2, 32, 6, 6, generator=g)).to(DEVICE)
    w = (torch.randn(32, 32, 3, 3, generator=g) * 0.1).to(DEVICE)
    dy = _cl(torch.randn(2, 32, 6, 6, generator=g)).to(DEVICE)
    affine = ChannelAffine(torch.rand(32, generator=g).to(DEVICE) + 0.5, torch.randn(32, generator=g).to(DEVICE))
    stats = NormStats(torch.zeros(32, device=DEVICE), torch.ones(32, device=DEVICE))

    def boxes_timed(run) -> bool:  # noqa: ANN001
        timed.timed.clear()
        run()
        assert timed.timed, "nothing was timed"
        return any(t.box_w for t in timed.timed)

    assert boxes_timed(lambda: conv_fprop(x, w, padding=1, prologue=affine, act_in="relu"))
    assert all(t.halo for t in timed.timed if t.box_w)
    assert not boxes_timed(lambda: conv_fprop(x, w, padding=1, prologue=affine, act_in="relu", stats=True))
    assert not boxes_timed(lambda: conv_dgrad(dy, w, x.shape, padding=1))
    assert not boxes_timed(lambda: conv_wgrad(dy, x, w, padding=1))
    assert boxes_timed(lambda: conv_dgrad(dy, w, x.shape, padding=1, x_prev=x, prologue=affine, act_in="relu",
                                          norm_stats=stats))
    w1 = (torch.randn(32, 32, 1, 1, generator=g) * 0.1).to(DEVICE)  # one tap: no taps candidates before the box
    assert boxes_timed(lambda: conv_wgrad(dy, x, w1, prologue=affine, act_in="relu"))
    boxes_timed(lambda: conv_wgrad(dy, x, w, padding=1, prologue=affine, act_in="relu"))  # a 3x3: the taps first
    assert timed.timed[1].taps_per_program == 3

