"""``tools/bench_conv.py`` on CPU: the conv collection and its dedup, the missing-library skip, the
reports written from fake timings, and its argument errors.  Nothing here times or launches a kernel."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

TOOLS = Path(__file__).resolve().parents[1] / "tools"
sys.path.insert(0, str(TOOLS))

import bench_conv  # noqa: E402
from conv_bench_report import HOOKS, Row, merge_rows, read_rows, rows_table, summaries, write_reports  # noqa: E402
from conv_shapes import ConvShape, collect  # noqa: E402

from fusion_backend.bench.measure import TimedStep, TimingStats  # noqa: E402

#: Two identical 3x3 convs (one shape), a strided grouped one, a 1x1 with bias, a Conv3d, a
#: ConvTranspose2d and a reflect-padded conv; batch 4.
CONVS_MODEL = """
import torch
import torch.nn as nn

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.b = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.down = nn.Conv2d(8, 16, 3, stride=2, padding=1, groups=2, bias=False)
        self.proj = nn.Conv2d(16, 4, 1)
        self.up = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.reflect = nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect")
        self.vol = nn.Conv3d(1, 2, (1, 3, 3), padding=(0, 1, 1))

    def forward(self, x):
        y = self.b(self.a(x)) + self.a(x)
        y = self.reflect(self.up(self.proj(self.down(y))))
        return self.vol(y[:, :1].unsqueeze(1))

def get_inputs():
    return [torch.randn(4, 8, 16, 16)]

def get_init_inputs():
    return []
"""

NEEDS_LIBRARY = """
import torch.nn as nn
REQUIRES = ("a_library_that_is_not_installed",)

class Model(nn.Module):
    pass

def get_inputs():
    return []

def get_init_inputs():
    return []
"""

IMPORTS_MISSING = NEEDS_LIBRARY.replace('REQUIRES = ("a_library_that_is_not_installed",)\n', "").replace(
    "class Model(nn.Module):\n    pass",
    "class Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        import another_library_that_is_not_installed  # noqa: F401",
)


def write_model(folder: Path, name: str, source: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_collection_dedups_identical_convs_and_keeps_every_model(tmp_path: Path) -> None:
    first = write_model(tmp_path, "convs", CONVS_MODEL)
    second = write_model(tmp_path, "again", CONVS_MODEL)
    found = collect([first, second])
    a = ConvShape((4, 8, 16, 16), (8, 8, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)
    assert list(found.shapes)[0] == a
    assert found.shapes[a] == ["convs"] * 3 + ["again"] * 3  # a twice and b once, per model
    assert found.models_of(a) == ["convs", "again"]
    labels = [s.label() for s in found.shapes]
    assert labels == [
        "conv2d 4x8x16x16 -> 8 k3x3 p1 g1",
        "conv2d 4x8x16x16 -> 16 k3x3 s2 p1 g2",
        "conv2d 4x16x8x8 -> 4 k1x1 p0 g1 +bias",
        "conv2d 4x4x18x18 -> 4 k3x3 p0 g1 +bias",  # reflect padding: the conv sees the padded input
        "conv3d 4x1x1x16x16 -> 2 k1x3x3 p0x1x1 g1 +bias",
    ]
    assert found.shapes[list(found.shapes)[3]] == ["convs", "again"]
    assert [m for m, _ in found.transposed] == ["convs", "again"]
    assert "ConvTranspose2d x(4, 4, 8, 8)" in found.transposed[0][1]
    assert not found.skipped and not found.notes


def test_shape_parameters_and_output_shape_match_torch() -> None:
    shape = ConvShape((2, 6, 9, 11), (4, 3, 3, 2), (2, 1), (1, 0), (1, 2), 2, True)
    out = torch.nn.functional.conv2d(torch.zeros(shape.x_shape), torch.zeros(shape.w_shape), None, shape.stride,
                                     shape.padding, shape.dilation, shape.groups)  # fmt: skip
    assert shape.out_shape == tuple(out.shape)
    assert shape.params()["out"] == list(out.shape) and shape.params()["bias"] is True
    assert shape.macs == out.numel() * 3 * 3 * 2


def test_a_model_whose_library_is_missing_is_skipped_with_one_line(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    declared = write_model(tmp_path, "declared", NEEDS_LIBRARY)
    imported = write_model(tmp_path, "imported", IMPORTS_MISSING)
    convs = write_model(tmp_path, "convs", CONVS_MODEL)
    found = collect([declared, imported, convs])
    assert found.skipped == [("declared", "needs a_library_that_is_not_installed, not installed"),
                             ("imported", "needs another_library_that_is_not_installed, not installed")]  # fmt: skip
    assert len(found.shapes) == 5
    assert bench_conv.main([str(declared), str(convs), "--list"]) == 0
    out = capsys.readouterr().out
    assert "5 distinct convs" in out and "conv2d 4x8x16x16 -> 8 k3x3 p1 g1" in out and "convs x3" in out
    assert "skipped declared: needs a_library_that_is_not_installed, not installed" in out
    assert "transposed (not timed) convs: ConvTranspose2d" in out


def test_filter_shard_and_max_shapes_select_in_order(tmp_path: Path) -> None:
    found = collect([write_model(tmp_path, "convs", CONVS_MODEL)])
    labels = lambda shapes: [s.label().split(" -> ")[0] for s in shapes]  # noqa: E731
    assert labels(bench_conv.select(found, "conv3d,*s2*", None, None)) == ["conv2d 4x8x16x16", "conv3d 4x1x1x16x16"]
    assert len(bench_conv.select(found, "convs", None, None)) == 5  # a model's name selects its shapes
    assert bench_conv.select(found, None, (2, 2), None) == [list(found.shapes)[1], list(found.shapes)[3]]
    assert bench_conv.select(found, None, None, 2) == list(found.shapes)[:2]


class FakeTimer:
    """Per step name a fixed time; records what it was asked to time."""

    def __init__(self, ms: dict[str, float]) -> None:
        self.ms, self.calls = ms, []

    def time(self, steps: list[TimedStep], *, cold: bool = False) -> list[TimingStats | Exception]:
        self.calls.append(([s.name for s in steps], cold))
        return [TimingStats.from_samples([self.ms[s.name]]) for s in steps]


def fake_case(op: str, hooked_result: float = 1.0) -> bench_conv.Case:
    shape = ConvShape((2, 4, 8, 8), (4, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)
    one = torch.ones(3)
    steps = {"kernel": lambda: one, "cudnn": lambda: one, "hooked": lambda: one * hooked_result,
             "unfused": lambda: one}  # fmt: skip
    checks = {"plain": lambda r: bench_conv.rel_err(r["kernel"], r["cudnn"]),
              "hooked": lambda r: bench_conv.rel_err(r["hooked"], r["unfused"])}  # fmt: skip
    return bench_conv.Case(shape, ["net"], "bf16", op, steps, checks)


def test_measure_case_times_the_steps_interleaved_and_checks_them() -> None:
    timer = FakeTimer({"kernel": 1.0, "cudnn": 2.0, "hooked": 1.5, "unfused": 3.0})
    plain, hooked = bench_conv.measure_case(fake_case("fprop"), timer, rounds=3)
    assert timer.calls == [(["kernel", "cudnn", "hooked", "unfused"], False)] * 3  # warm L2, 3 rounds
    assert (plain.hooks, plain.ms, plain.cudnn_ms, plain.unfused_ms, plain.ok) == ("none", 1.0, 2.0, None, True)
    assert (hooked.hooks, hooked.ms, hooked.cudnn_ms, hooked.unfused_ms) == (HOOKS["fprop"], 1.5, 2.0, 3.0)
    assert hooked.round_medians_ms == {"hooked": [1.5] * 3, "unfused": [3.0] * 3}
    _, wrong = bench_conv.measure_case(fake_case("dgrad", hooked_result=1.5), timer, rounds=1)
    assert wrong.ok is False and wrong.rel_err == pytest.approx(0.5)


def test_profile_lists_each_rows_two_steps_kernels_and_survives_a_failing_profile() -> None:
    """``--profile``: a row carries its own step's and its reference's kernel times; a profile that fails
    leaves one line in their place and the row's times as they were."""
    profiled = []

    def profiler(fn: Any) -> dict[str, float]:
        profiled.append(fn)
        if len(profiled) == 3:  # the hooked step's
            raise RuntimeError("profiler busy\nmore")
        return {"conv_kernel": 10.0 * len(profiled), "sum_splits_kernel": 1.0}

    case = fake_case("wgrad")
    plain, hooked = bench_conv.measure_case(case, FakeTimer({n: 1.0 for n in case.steps}), rounds=1, profiler=profiler)
    assert profiled == [case.steps[n] for n in ("kernel", "cudnn", "hooked", "unfused")]
    assert plain.kernels == {"kernel": {"conv_kernel": 10.0, "sum_splits_kernel": 1.0},
                             "cudnn": {"conv_kernel": 20.0, "sum_splits_kernel": 1.0}}  # fmt: skip
    assert list(hooked.kernels["hooked"]) == ["profile failed: RuntimeError: profiler busy"]
    assert hooked.kernels["unfused"]["conv_kernel"] == 40.0 and hooked.ms == 1.0
    assert bench_conv.measure_case(case, FakeTimer({n: 1.0 for n in case.steps}), rounds=1)[0].kernels == {}


def test_a_row_names_the_tile_its_kernels_first_call_chose() -> None:
    from fusion_backend.kernels.conv.tiles import TileConfig, tuned_tile

    plain_tiles = [TileConfig(64, 64, 32, 4, 3), TileConfig(128, 64, 32, 4, 3)]
    hooked_tiles = [TileConfig(128, 64, 64, 4, 3, box_w=16)]
    case = fake_case("wgrad")
    one = torch.ones(3)

    def run_with(tiles: list[TileConfig]) -> Any:
        def step() -> torch.Tensor:
            tuned_tile("fprop", "other pass", [TileConfig()], lambda t: lambda: None, torch.device("cpu"))
            tuned_tile("wgrad", "signature", tiles, lambda t: lambda: None, torch.device("cpu"))  # untimed on CPU
            return one
        return step

    case.steps["kernel"], case.steps["hooked"] = run_with(plain_tiles), run_with(hooked_tiles)
    plain, hooked = bench_conv.measure_case(case, FakeTimer({n: 1.0 for n in case.steps}), rounds=1)
    assert (plain.tile, plain.tile_ms) == ("64x64x32 w4 s3", {})  # the pass's own choice, not fprop's
    assert hooked.tile == "128x64x64 w4 s3 box 8x16"
    assert "| 128x64x64 w4 s3 box 8x16 |" in rows_table([plain, hooked], markdown=True)


def test_a_failing_step_becomes_the_rows_error_and_is_not_timed() -> None:
    case = fake_case("wgrad")

    def broken() -> None:
        raise ValueError("no kernel for this shape\nsecond line")

    case.steps["hooked"] = broken
    timer = FakeTimer({"kernel": 1.0, "cudnn": 2.0, "unfused": 3.0})
    plain, hooked = bench_conv.measure_case(case, timer, rounds=1)
    assert timer.calls == [(["kernel", "cudnn", "unfused"], False)]
    assert plain.error is None and plain.ok
    assert hooked.ms is None and hooked.ok is None and hooked.error == "hooked: ValueError: no kernel for this shape"


def test_reports_carry_rows_environment_and_summaries(tmp_path: Path) -> None:
    rows = []
    for op, kernel_ms, hooked_ms in (("fprop", 1.0, 1.2), ("dgrad", 4.0, 4.4), ("wgrad", 2.0, 1.0)):
        timer = FakeTimer({"kernel": kernel_ms, "cudnn": 2.0, "hooked": hooked_ms, "unfused": 3.0})
        rows += bench_conv.measure_case(fake_case(op), timer, rounds=1)
    env = {"command": "python tools/bench_conv.py --out X", "gpu": {"name": "FakeGPU"}, "torch": "2.x",
           "triton": "3.x", "git_commit": "abc123"}  # fmt: skip
    js, md = write_reports(rows, env, tmp_path / "out", ["skipped resnet50: needs torchvision, not installed"])
    doc = json.loads(js.read_text())
    assert doc["environment"] == env and len(doc["rows"]) == 6
    first = doc["rows"][0]
    assert {k: first[k] for k in ("op", "dtype", "hooks", "ms", "cudnn_ms", "unfused_ms", "ok", "models")} == {
        "op": "fprop", "dtype": "bf16", "hooks": "none", "ms": 1.0, "cudnn_ms": 2.0, "unfused_ms": None,
        "ok": True, "models": ["net"]}  # fmt: skip
    assert first["shape"] == "conv2d 2x4x8x8 -> 4 k3x3 p1 g1" and first["params"]["stride"] == [1, 1]
    by_op = {s["op"]: s for s in doc["summaries"]}
    assert by_op["fprop"]["cudnn_over_ms"] == pytest.approx(2.0)
    assert by_op["dgrad"]["worst_ratio"] == pytest.approx(0.5)
    assert by_op["wgrad"]["hooked_over_plain"] == pytest.approx(0.5)
    assert (by_op["dgrad"]["beat_unfused"], by_op["dgrad"]["hooked_timed"]) == (0, 1)
    text = md.read_text()
    assert "FakeGPU" in text and "`python tools/bench_conv.py --out X`" in text
    assert "| fprop | bf16 | 1 |" not in text  # the summary counts both rows of a pass
    assert "| fprop | bf16 | 2 | 0 | 2.00x |" in text
    assert "skipped resnet50" in text and "prologue bn+relu, epilogue stats" in text
    assert read_rows(js) == rows


def test_a_mismatch_is_shown_as_such_and_left_out_of_the_summary(tmp_path: Path) -> None:
    timer = FakeTimer({"kernel": 1.0, "cudnn": 2.0, "hooked": 0.1, "unfused": 3.0})
    rows = bench_conv.measure_case(fake_case("fprop", hooked_result=2.0), timer, rounds=1)
    (summary,) = summaries(rows)
    assert summary.mismatches == 1 and summary.hooked_timed == 0 and summary.hooked_over_plain is None
    _, md = write_reports(rows, {}, tmp_path)
    hooked_line = next(line for line in md.read_text().splitlines() if "epilogue stats |" in line)
    assert "MISMATCH" in hooked_line and "30.0x" not in hooked_line


def test_append_replaces_rows_of_the_same_key() -> None:
    old = [Row("fprop", "s", {}, ["a"], "bf16", "none", ms=1.0), Row("dgrad", "s", {}, ["a"], "bf16", "none", ms=2.0)]
    new = [Row("fprop", "s", {}, ["a"], "bf16", "none", ms=0.5), Row("fprop", "s", {}, ["a"], "fp32", "none")]
    merged = merge_rows(old, new)
    assert [(r.op, r.dtype, r.ms) for r in merged] == [("fprop", "bf16", 0.5), ("dgrad", "bf16", 2.0),
                                                       ("fprop", "fp32", None)]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), [
    (["--dtype", "bf8"], "--dtype takes a comma-separated list of bf16, fp16, fp32"),
    (["--passes", "fprop,bwd"], "--passes takes a comma-separated list of fprop, dgrad, wgrad"),
    (["--shard", "3/2"], "--shard K/N needs 1 <= K <= N"),
    (["--shard", "half"], "--shard takes K/N"),
    (["--max-shapes", "0"], "expected a positive int"),
    (["--out", "x", "--docs-out"], "--out and --docs-out name two folders"),
    (["--append"], "--append needs --out DIR"),
])  # fmt: skip
def test_argument_errors_name_the_option(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_conv.parse_args(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_missing_model_file_is_an_error_and_timing_needs_cuda(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    assert bench_conv.main([str(tmp_path / "nope.py"), "--list"]) == 2
    assert "nope.py does not exist" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert bench_conv.main([str(write_model(tmp_path, "convs", CONVS_MODEL))]) == 1
        assert "no CUDA device" in capsys.readouterr().err


def test_the_default_models_exist_and_are_listed_without_their_missing_libraries(
        capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    files = bench_conv.model_files(bench_conv.DEFAULT_MODELS)
    assert {f.stem for f in files} >= {"resnet50", "efficientnet_b0", "sd_vae_decoder", "r3d_18",
                                       "conv2d_mul_leaky_gelu"}  # fmt: skip
    assert bench_conv.main(["--list", "--filter", "conv2d_mul_leaky_gelu"]) == 0
    out = capsys.readouterr().out
    assert "conv2d 64x64x256x256 -> 64 k3x3 p0 g1 +bias" in out


def test_tile_sweep_scores_a_set_by_its_best_member_per_row_and_needs_cuda(capsys):
    """``tools/sweep_conv_tiles.py``: a set's score is the geometric mean over rows of the row's best
    time over the set's best; without CUDA it says so and exits 2."""
    import sweep_conv_tiles

    rows = [{"cudnn": 1.0, "a": 2.0, "b": 1.0, "c": 4.0}, {"cudnn": 1.0, "a": 1.0, "b": 4.0, "c": 2.0}]
    assert sweep_conv_tiles._score(rows, ("a", "b")) == pytest.approx(1.0)
    assert sweep_conv_tiles._score(rows, ("b",)) == pytest.approx((1.0 * 0.25) ** 0.5)
    assert sweep_conv_tiles._score(rows, ("c",)) == pytest.approx((0.25 * 0.5) ** 0.5)
    if not torch.cuda.is_available():
        assert sweep_conv_tiles.main([]) == 2
        assert "needs CUDA" in capsys.readouterr().out


def test_tile_sweep_variants_follow_the_options() -> None:
    """``sweep_conv_tiles``' variants of one grid tile: boxes for the gradients only, several taps and
    programs per SM for the weight gradient only (each variant again at each), the TMA row kernel's for a
    1x1 forward and input gradient, the TMA weight gradient's tiles where the call is stride 1 with one
    group, each at both of its own programs per SM and the asked ones; the halo's for a forward tile (with
    boxes, its box tiles too) and a depthwise weight gradient's."""
    import sweep_conv_tiles

    from fusion_backend.kernels.conv.tiles import TileConfig

    conv3 = ConvShape((8, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)
    tile = TileConfig(64, 64, 64, 4, 3)
    labels = [v.label() for v in sweep_conv_tiles.tile_variants(tile, conv3, "wgrad", True, True, False, (1,))]
    assert labels == ["64x64x64 w4 s3", "64x64x64 w4 s3 box 8x8", "64x64x64 w4 s3 taps 3", "64x64x64 w4 s3 1/sm",
                      "64x64x64 w4 s3 box 8x8 1/sm", "64x64x64 w4 s3 taps 3 1/sm"]  # fmt: skip
    assert [v.label() for v in sweep_conv_tiles.tile_variants(tile, conv3, "fprop", True, True, True, (1,))] == [
        "64x64x64 w4 s3"]  # a 3x3 forward: no box, no taps, no TMA, no split
    per_sm = [[t.programs_per_sm for t in sweep_conv_tiles.tma_wgrad_variants(conv3, False, extra)] for extra in ((), (4,))]
    assert per_sm == [[2, 1], [2, 1, 4]]  # the two offered tiles are one tile at 4 per SM
    conv1 = ConvShape((8, 64, 56, 56), (256, 64, 1, 1), (1, 1), (0, 0), (1, 1), 1, False)
    for pass_name in ("fprop", "dgrad"):  # a 1x1 without padding: the TMA row kernel's too
        labels = [v.label() for v in sweep_conv_tiles.tile_variants(tile, conv1, pass_name, False, False, True, ())]
        assert labels == ["64x64x64 w4 s3", "64x64x64 w4 s3 tma"]
    halo = [v.label() for v in sweep_conv_tiles.tile_variants(tile, conv3, "wgrad", False, True, False, (), True)]
    assert halo == ["64x64x64 w4 s3", "64x64x64 w4 s3 taps 3"]  # a dense weight gradient has no halo
    depthwise = ConvShape((8, 64, 56, 56), (64, 1, 3, 3), (1, 1), (1, 1), (1, 1), 64, False)
    assert [v.label() for v in sweep_conv_tiles.tile_variants(tile, depthwise, "wgrad", False, True, False, (),
                                                              True)] == ["64x64x64 w4 s3", "64x64x64 w4 s3 halo"]
    assert [v.label() for v in sweep_conv_tiles.tile_variants(tile, conv3, "fprop", False, False, False, (), True)] == [
        "64x64x64 w4 s3", "64x64x64 w4 s3 halo"]
    # with boxes: the halo forward's box tiles too (``tiles.halo_box_width``)
    assert [v.label() for v in sweep_conv_tiles.tile_variants(tile, conv3, "fprop", True, False, False, (), True)] == [
        "64x64x64 w4 s3", "64x64x64 w4 s3 halo", "64x64x64 w4 s3 box 8x8 halo"]
    strided = ConvShape((8, 64, 56, 56), (64, 64, 3, 3), (2, 2), (1, 1), (1, 1), 1, False)
    assert sweep_conv_tiles.tma_wgrad_variants(strided, False, (1,)) == []
    with pytest.raises(Exception, match="from 1 to 4"):
        sweep_conv_tiles._per_sm("0,2")


#: Where the kernels of the two tests below run: the GPU where there is one, else the CPU interpreter.
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("pass_name", ["fprop", "dgrad", "wgrad"])
def test_the_tile_sweeps_hooked_calls_are_the_benchmarks_hooked_rows(pass_name: str, monkeypatch) -> None:  # noqa: ANN001
    """``sweep_conv_tiles --hooked`` times the same hooked call ``bench_conv`` reports (same result bits),
    with a tile of its own where it passes one (fp32 without TF32: two tiles agree to fp32 rounding)."""
    import sweep_conv_tiles

    from fusion_backend.kernels.conv.tiles import TileConfig

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    shape = ConvShape((2, 16, 6, 6), (16, 16, 3, 3), (1, 1), (1, 1), (1, 1), 1, False)
    t = bench_conv._Inputs.make(shape, torch.float32, KERNEL_DEVICE)
    swept = sweep_conv_tiles._steps(t, pass_name, None, hooked=True)()
    reported = bench_conv.CASE_BUILDERS[pass_name](t, True)[0]["hooked"]()
    first = [v for v in (swept if isinstance(swept, tuple) else (swept,)) if isinstance(v, torch.Tensor)][0]
    want = [v for v in (reported if isinstance(reported, tuple) else (reported,)) if isinstance(v, torch.Tensor)][0]
    assert torch.equal(first, want)
    tiled = sweep_conv_tiles._steps(t, pass_name, TileConfig(16, 16, 16, num_warps=1, num_stages=1), hooked=True)()
    got = [v for v in (tiled if isinstance(tiled, tuple) else (tiled,)) if isinstance(v, torch.Tensor)][0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_the_tile_sweep_times_a_grid_it_is_given_with_the_forwards_hooks_it_is_asked_for(monkeypatch) -> None:  # noqa: ANN001
    """``sweep_conv_tiles --grid``: tiles as the benchmark labels them (a malformed one refused in one line);
    ``--fprop-hooks gn-silu``: the forward's hooked step and its baseline are the benchmark's GroupNorm +
    SiLU ones (a halo box tile of the given grid computing what the tuned choice does; fp32, no TF32)."""
    import sweep_conv_tiles

    from fusion_backend.kernels.conv.tiles import TileConfig

    assert sweep_conv_tiles._grid("128x256x64 w8 s3, 64x128x64 w4 s3") == [(128, 256, 64, 8, 3), (64, 128, 64, 4, 3)]
    with pytest.raises(Exception, match="--grid takes tiles as 'MxNxK wW sS', got '128x256 w8'") as info:
        sweep_conv_tiles._grid("128x256 w8")
    assert "\n" not in str(info.value)
    monkeypatch.setattr(bench_conv, "_inductor", lambda fn: fn)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    shape = ConvShape((1, 64, 6, 5), (16, 64, 3, 3), (1, 1), (1, 1), (1, 1), 1, True)
    t = bench_conv._Inputs.make(shape, torch.float32, KERNEL_DEVICE)
    unfused = sweep_conv_tiles._baseline(t, "fprop", True, "gn-silu")()[0]  # (the conv's output, no statistics)
    tuned, stats = sweep_conv_tiles._steps(t, "fprop", None, True, "gn-silu")()
    box = TileConfig(16, 16, 16, num_warps=1, num_stages=1, halo=True, box_w=4)
    boxed, _ = sweep_conv_tiles._steps(t, "fprop", box, True, "gn-silu")()
    assert stats is None  # the prologue alone
    torch.testing.assert_close(tuned, unfused, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(boxed, tuned, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("hooks,label,c_in", [("bn-relu", "prologue bn+relu", 4), ("gn-silu", "prologue gn+silu", 64)])
def test_the_forwards_prologue_alone_is_timed_against_the_prologue_pass_and_the_conv(hooks, label, c_in,  # noqa: ANN001
                                                                                    monkeypatch) -> None:  # noqa: ANN001
    """``--fprop-hooks bn-relu`` / ``gn-silu``: the hooked forward applies the BatchNorm + ReLU (GroupNorm, 32
    groups, + SiLU) prologue and writes no statistics, checked against the prologue pass and cuDNN's conv
    (fp32; on CPU under the interpreter)."""
    monkeypatch.setattr(bench_conv, "_inductor", lambda fn: fn)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    shape = ConvShape((2, c_in, 6, 5), (6, c_in, 3, 3), (1, 1), (1, 1), (1, 1), 1, True)
    (case,) = bench_conv.build_cases(shape, ["m"], "fp32", ["fprop"], True, KERNEL_DEVICE, fprop_hooks=hooks)
    plain, hooked = bench_conv.measure_case(case, FakeTimer({n: 1.0 for n in case.steps}), rounds=1)
    assert hooked.hooks == label and plain.hooks == "none"
    assert hooked.ok and plain.ok and hooked.rel_err < 1e-5, (hooked.error, hooked.rel_err)
    y, stats = case.steps["hooked"]()
    assert stats is None and bench_conv.rel_err(y, case.steps["cudnn"]()) > 1e-2  # the prologue changed the input


def test_the_forwards_statistics_alone_are_timed_against_the_conv_and_the_statistics_pass(monkeypatch) -> None:
    """``--fprop-hooks stats``: the hooked forward writes its output's statistics without a prologue,
    checked against cuDNN's conv and the statistics pass (fp32; on CPU under the interpreter)."""
    monkeypatch.setattr(bench_conv, "_inductor", lambda fn: fn)  # the pass in eager: no compile on CPU
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # both convs exact on a GPU
    shape = ConvShape((2, 4, 6, 5), (6, 4, 3, 3), (1, 1), (1, 1), (1, 1), 1, True)
    (case,) = bench_conv.build_cases(shape, ["m"], "fp32", ["fprop"], True, KERNEL_DEVICE, fprop_hooks="stats")
    plain, hooked = bench_conv.measure_case(case, FakeTimer({n: 1.0 for n in case.steps}), rounds=1)
    assert hooked.hooks == bench_conv.STATS_HOOKS and plain.hooks == "none"
    assert hooked.ok and plain.ok and hooked.rel_err < 1e-5, (hooked.error, hooked.rel_err)
    y, _ = case.steps["hooked"]()
    assert bench_conv.rel_err(y, case.steps["cudnn"]()) < 1e-5  # the plain conv's output: no prologue
    (default,) = bench_conv.build_cases(shape, ["m"], "fp32", ["fprop"], True, torch.device("cpu"))
    assert default.hooks == bench_conv.HOOKS["fprop"]


def test_the_profiling_tool_launches_the_benchmarks_four_forwards_on_the_tile_given(tmp_path: Path, triton_kernels: None,
                                                                                    kernel_device: str) -> None:
    """``tools/profile_conv_family.py`` (Nsight Compute's launcher): per selected conv the forward
    plain, with its statistics, with the prologue, and with both, as the benchmark calls them, on the
    tile given; a malformed tile is a one-line error."""
    import profile_conv_family

    (tmp_path / "tiny.py").write_text(CONVS_MODEL)
    tile = profile_conv_family.parse_tile("16,16,16,1,1")
    built = profile_conv_family.cases([str(tmp_path / "tiny.py")], "*8x16x16 -> 8 k3x3*", "fp32", tile,
                                      torch.device(kernel_device))
    assert [label.rsplit(" fp32 ", 1)[1] for label, _ in built] == list(profile_conv_family.VARIANTS)
    plain, stats, prologue, both = (call() for _, call in built)
    assert plain.shape == (4, 8, 16, 16) and stats[1] is not None and prologue[1] is None and both[1] is not None
    with pytest.raises(SystemExit, match="five ints"):
        profile_conv_family.parse_tile("128,64")
