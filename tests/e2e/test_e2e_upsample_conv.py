"""torch.compile(backend="fusion") end to end for a nearest upsample folded into the conv after it
(``ops/upsample_fold.py``; ``conv_epilogue``'s region ``upsample(2) -> conv2d``): the region's fused op
is the transposed conv on the small input, output and every gradient against float64 with eager's
error the yardstick (``assert_fused``), however the upsample was spelled; what does not fold is
left as it was.

Each CPU case runs on the plain-torch reference and on the Triton paths under the interpreter
(``kernels``); with CUDA on the GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.ops.config import ConvEpilogueConfig
from fusion_backend.testing import Autocast, assert_fused, dry_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = pytest.mark.usefixtures("exact_fp32")


class UpConv(nn.Module):
    """A decoder's upsampling step, ``conv(upsample(x))``, then ``tail`` (e.g. an activation)."""

    def __init__(self, c_in=6, c_out=5, dims=2, spelling="scale_factor", tail=None, **conv):
        super().__init__()
        conv = {"kernel_size": 3, "padding": 1, **conv}
        self.conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dims](c_in, c_out, **conv)
        self.upsample = nn.Upsample(scale_factor=2) if spelling == "module" else None
        self.spelling, self.tail = spelling, tail

    def forward(self, x):
        if self.spelling == "module":
            up = self.upsample(x)
        elif self.spelling == "size":
            up = F.interpolate(x, size=[2 * s for s in x.shape[2:]])
        else:
            up = F.interpolate(x, scale_factor=2.0, mode="nearest")
        y = self.conv(up)
        return y if self.tail is None else self.tail(y)


def _summaries(model, x):
    return [summary for _, summary, _ in dry_run(model, [x], patterns=["conv_epilogue"]).regions]


@pytest.mark.parametrize(("spelling", "tail", "summary"), [
    ("scale_factor", None, "upsample(2) -> conv2d"),
    ("module", nn.SiLU(), "upsample(2) -> conv2d -> silu"),
    ("size", nn.ReLU(), "upsample(2) -> conv2d -> relu"),
], ids=["F.interpolate, the conv alone", "nn.Upsample, then silu", "a size, then relu"])
@pytest.mark.parametrize("layout", ["contiguous", "channels-last"])
def test_an_upsample_then_conv_trains_as_one_transposed_conv(kernels, spelling, tail, summary, layout):
    torch.manual_seed(41)
    model = UpConv(spelling=spelling, tail=tail).to(DEVICE)
    x = torch.randn(2, 6, 5, 7, device=DEVICE)
    if layout == "channels-last":
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    assert _summaries(model, x) == [summary]
    (report,) = assert_fused(model, [x], expect={"conv_epilogue": 1})
    (match,) = report.matches
    spec = ConvEpilogueConfig.from_json(match.config).conv
    assert spec.transposed and spec.stride == (2, 2) and spec.padding == (1, 1)  # the fold's transposed conv


def test_a_contiguous_input_before_a_channels_last_weight_is_relaid_in_the_graph(tmp_path):
    """Where eager's conv would copy its contiguous input into channels-last (its weight is), the
    rewrite relays the upsample's source in the graph (``match.rewrite.in_conv_layout``), where
    Inductor writes it from the producer's kernel."""
    torch.manual_seed(46)
    model = UpConv(tail=nn.ReLU()).to(DEVICE).to(memory_format=torch.channels_last)
    x = torch.randn(2, 6, 5, 7, device=DEVICE)
    assert_fused(model, [x], expect={"conv_epilogue": 1}, options={"dump_dir": str(tmp_path)})
    after = "\n".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert "contiguous(memory_format = torch.channels_last)" in after, after


def test_a_centred_family_takes_the_upsample_in_too(kernels):
    """A UNet's ``upsample -> conv -> group_norm -> silu``: ``conv_group_norm``'s region, its conv the
    folded transposed conv, trained."""
    torch.manual_seed(45)
    model = UpConv(6, 8, tail=nn.Sequential(nn.GroupNorm(4, 8), nn.SiLU())).to(DEVICE)
    x = torch.randn(2, 6, 4, 5, device=DEVICE)
    found = dry_run(model, [x], patterns=["conv_group_norm"])
    assert [summary for _, summary, _ in found.regions] == ["upsample(2) -> conv2d -> group_norm(4) -> silu"]
    assert_fused(model, [x], expect={"conv_group_norm": 1})


@pytest.mark.parametrize("case", ["1-d, kernel 5", "3-d, groups 2", "1x1 conv", "a 1x1 input, pad 0 kernel 2"])
def test_the_fold_s_variants_are_within_eager_s_error_of_float64(kernels, case):
    torch.manual_seed(42)
    model, shape = {
        "1-d, kernel 5": (UpConv(3, 5, dims=1, kernel_size=5, padding=2), (2, 3, 7)),
        "3-d, groups 2": (UpConv(4, 6, dims=3, groups=2), (1, 4, 3, 2, 3)),
        "1x1 conv": (UpConv(4, 3, kernel_size=1, padding=0), (2, 4, 3, 5)),
        "a 1x1 input, pad 0 kernel 2": (UpConv(3, 4, kernel_size=2, padding=0), (2, 3, 1, 1)),
    }[case]
    assert_fused(model.to(DEVICE), [torch.randn(shape, device=DEVICE)], expect={"conv_epilogue": 1})


def test_under_autocast_the_region_folds_and_stays_within_eager_s_error():
    """bf16 autocast (CPU's, or CUDA's on the GPU): the folded weight is rounded once to bf16 where eager
    rounds each tap: the gate is float64 with eager's own error the yardstick."""
    torch.manual_seed(43)
    model = Autocast(UpConv(8, 8), DEVICE, torch.bfloat16).to(DEVICE)
    assert_fused(model, [torch.randn(2, 8, 6, 6, device=DEVICE)], expect={"conv_epilogue": 1})


def test_dynamic_shapes_fold_an_upsample_that_gives_its_scale():
    torch.manual_seed(44)
    model = UpConv().to(DEVICE)
    compiled = torch.compile(model, backend="fusion", dynamic=True, options={"decide": "fuse", "strict": True})
    for size in ((5, 7), (6, 4)):
        x = torch.randn(2, 6, *size, device=DEVICE)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    found = dry_run(model, [torch.randn(2, 6, 5, 7, device=DEVICE)], patterns=["conv_epilogue"], dynamic=True)
    assert [summary for _, summary, _ in found.regions] == ["upsample(2) -> conv2d"]
    sized = UpConv(spelling="size", tail=nn.ReLU()).to(DEVICE)  # a size of symbols: no scale to fold
    found = dry_run(sized, [torch.randn(2, 6, 5, 7, device=DEVICE)], patterns=["conv_epilogue"], dynamic=True)
    assert [summary for _, summary, _ in found.regions] == ["conv2d -> relu"]
    assert any("its size is not known when compiling" in m.message for m in found.near_misses), found.near_misses


class Unfoldable(nn.Module):
    def __init__(self, case: str):
        super().__init__()
        self.case = case
        self.conv = nn.Conv2d(4, 4, 3, padding=1, stride=2 if case == "a strided conv" else 1)

    def forward(self, x):
        mode = "bilinear" if self.case == "bilinear" else "nearest"
        up = F.interpolate(x, scale_factor=3 if self.case == "scale 3" else 2, mode=mode)
        y = self.conv(up)
        return y + up.mean() if self.case == "the upsample read twice" else y


@pytest.mark.parametrize(("case", "why"), [
    ("bilinear", None),
    ("scale 3", "scale (3, 3) is not a power of two"),
    ("a strided conv", "the conv after the upsample has stride (2, 2)"),
    ("the upsample read twice", "its result is read outside the conv too"),
])
def test_what_does_not_fold_is_left_as_it_was_and_a_nearest_upsample_says_why(case, why):
    """A bilinear upsample (no nearest one: nothing to say), a scale whose reciprocal is inexact, a
    strided conv, an upsample something else reads: no region takes the upsample; the region that
    opens at the conv (with a relu after it) carries the near miss."""
    model = Unfoldable(case)
    model.conv = nn.Sequential(model.conv, nn.ReLU())
    found = dry_run(model, [torch.randn(2, 4, 5, 5)], patterns=["conv_epilogue"])
    assert not any("upsample" in summary for _, summary, _ in found.regions), found.regions
    said = [m.message for m in found.near_misses if "upsample" in m.message]
    assert len(said) == (0 if why is None else 1), said
    assert why is None or (said[0].startswith("the nearest upsample `up` is not folded into the conv: ") and why in said[0])
