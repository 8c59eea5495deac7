"""Where autocast's casts around a fused region happen.

A region whose result only autocast's convs read is written in their dtype.  Under bf16 autocast a
GroupNorm (or LayerNorm) runs in fp32, and the conv after it casts its input to bf16 as it takes it.  A
fused ``conv -> group_norm -> silu`` region feeding such a conv writes its result in bf16 itself
(``match.rewrite.narrow_read_dtype``): the same value the conv reads, rounded once, with no fp32 tensor
written and no cast pass.  Where anything else reads the result (the graph's output, a pointwise op, a
conv in fp32) it keeps eager's dtype.

A region's own fp32 input, without gradients, is cast in the graph where Inductor's code writes it (its
kernel stores the bf16 copy: ``match.rewrite.written_by_inductor``), else by the op as it loads it.

Every case against float64 with eager's own error as the yardstick (``assert_fused``), forward and
every gradient.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.ops.conv_group_norm import ConvGroupNormConfig
from fusion_backend.testing import assert_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytestmark = [pytest.mark.usefixtures("exact_fp32"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]  # fmt: skip


class TwoConvs(nn.Module):
    """``conv2(silu(group_norm(conv1(x))))``, conv2 under bf16 autocast (``autocast="conv2"``: the region
    computes in fp32 and conv2 casts its result to bf16) or all of it (``"all"``: CUDA's autocast runs
    the conv in bf16 and the norm in fp32, the CPU's the norm in bf16 too) or none of it (``"none"``); ``also``: another reader
    of the norm's result."""

    def __init__(self, also: str = "none", autocast: str = "conv2", norm: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 6, 3, padding=1)
        self.norm = nn.GroupNorm(2, 8) if norm is None else norm
        self.also, self.autocast = also, autocast

    def forward(self, x):
        device = x.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.autocast == "all"):
            h = F.silu(self.norm(self.conv1(x)))
            with torch.autocast(device, dtype=torch.bfloat16, enabled=self.autocast != "none"):
                y = self.conv2(h)
                if self.also == "second conv":
                    y = y + self.conv2(h).flip(-1)
            if self.also == "output":
                return y, h
            if self.also == "pointwise":
                return y + h.mean()
            return y


def _group_norm_config(reports) -> ConvGroupNormConfig:
    (match,) = [m for r in reports for m in r.matches if m.pattern == "conv_group_norm"]
    return ConvGroupNormConfig.from_json(match.config)


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
@pytest.mark.parametrize("channels_last", [False, True], ids=["contiguous", "channels-last"])
@pytest.mark.parametrize("also", ["none", "second conv"])
def test_a_result_read_only_by_autocast_convs_is_written_in_their_dtype(kernels, train, channels_last, also):
    torch.manual_seed(31)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = TwoConvs(also).to(DEVICE, memory_format=fmt).train(train)
    x = torch.randn(2, 4, 9, 7, device=DEVICE).to(memory_format=fmt)
    reports = assert_fused(model, [x], expect={"conv_group_norm": 1}, train=train, tol=3e-2)
    assert _group_norm_config(reports).out_dtype == "bfloat16"


@pytest.mark.parametrize("family", ["conv_batch_norm", "conv_layer_norm", "conv_epilogue"])
def test_every_family_writes_a_result_read_only_by_autocast_convs_in_their_dtype(kernels, family):
    """The rule is the rewrite's, so every family follows it: a training BatchNorm, a LayerNorm over
    (C, H, W), an eval BatchNorm folded into the conv's epilogue."""
    torch.manual_seed(37)
    norm = {"conv_batch_norm": nn.BatchNorm2d(8), "conv_layer_norm": nn.LayerNorm([8, 6, 5]),
            "conv_epilogue": nn.BatchNorm2d(8).eval()}[family]  # fmt: skip
    model = TwoConvs(norm=norm).to(DEVICE)
    train = family != "conv_epilogue"
    reports = assert_fused(model, [torch.randn(2, 4, 6, 5, device=DEVICE)], expect={family: 1}, train=train, tol=3e-2)
    (match,) = [m for r in reports for m in r.matches]
    assert json.loads(match.config)["out_dtype"] == "bfloat16"


@pytest.mark.skipif(DEVICE != "cuda", reason="the CPU's autocast runs GroupNorm in bf16")
@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_under_cuda_autocast_a_fp32_norm_s_result_is_written_in_the_conv_s_bf16(train):
    torch.manual_seed(34)
    model = TwoConvs(autocast="all").to(DEVICE, memory_format=torch.channels_last).train(train)
    x = torch.randn(2, 4, 9, 7, device=DEVICE).to(memory_format=torch.channels_last)
    reports = assert_fused(model, [x], expect={"conv_group_norm": 1}, train=train, tol=3e-2)
    cfg = _group_norm_config(reports)
    assert cfg.norm_dtype == "float32" and cfg.out_dtype is None  # (None: the conv's own bf16)


@pytest.mark.parametrize("also", ["output", "pointwise"])
def test_a_result_read_by_anything_else_keeps_eager_s_dtype(kernels, also):
    torch.manual_seed(32)
    model = TwoConvs(also).to(DEVICE).eval()
    with torch.no_grad():
        reports = assert_fused(model, [torch.randn(2, 4, 6, 5, device=DEVICE)],
                               expect={"conv_group_norm": 1, **({"conv_epilogue": 1} if also == "pointwise" else {})},
                               train=False)  # (conv2 -> add: a region of its own)
    assert _group_norm_config(reports).out_dtype is None  # the conv's fp32


def test_without_autocast_nothing_is_narrowed(kernels):
    torch.manual_seed(33)
    model = TwoConvs(autocast="none").to(DEVICE)
    reports = assert_fused(model, [torch.randn(2, 4, 6, 5, device=DEVICE)], expect={"conv_group_norm": 1})
    cfg = _group_norm_config(reports)
    assert cfg.out_dtype is None and cfg.norm_dtype is None


def test_the_region_is_timed_writing_what_the_graph_reads_of_it(monkeypatch, tmp_path):
    """Measured against Inductor's code, the region's copy ends in the narrowing cast, so Inductor's
    candidate writes the bf16 tensor alone, as it would in the graph; the fused candidate writes it
    so itself (the cast after it does nothing)."""
    from fusion_backend.report import collect_reports
    from fusion_backend.runtime import decision, region_timing

    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))  # a fresh decision cache, measuring on
    monkeypatch.delenv("FUSION_DECIDE", raising=False)
    decision.forget_in_memory()
    extracted = []
    real = region_timing.extract_region
    monkeypatch.setattr(region_timing, "extract_region", lambda gm, nodes: extracted.append(real(gm, nodes)) or extracted[-1])
    torch.manual_seed(35)
    model, x = TwoConvs().eval(), torch.randn(1, 4, 6, 5)
    with torch.no_grad():
        want = model(x)
        with decision.timing_override(None, measure_on=("cpu",)), collect_reports() as reports:
            out = torch.compile(model, backend="fusion", options={"defer": False})(x)
    (d,) = [d for r in reports for d in r.decisions]
    assert d.pattern == "conv_group_norm" and d.fused_ms and d.inductor_ms, d.rule
    assert extracted
    for region in extracted:
        (result,) = region.graph.output_node().args[0]
        assert result.op == "call_method" and result.target == "to" and result.args[1] == torch.bfloat16
    torch.testing.assert_close(out, want, rtol=2e-2, atol=2e-2)
    decision.forget_in_memory()


class ConvRelu(nn.Module):
    """``relu(conv(producer(x)))`` under bf16 autocast, without gradients."""

    def __init__(self, producer: str) -> None:
        super().__init__()
        self.conv, self.producer = nn.Conv2d(4, 6, 3, padding=1), producer

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            if self.producer == "pointwise":
                x = torch.sigmoid(x) * 2.0
            elif self.producer == "pointwise, then a view":
                x = (torch.sigmoid(x) * 2.0).reshape(x.shape)
            return torch.relu(self.conv(x))


@pytest.mark.parametrize("producer", ["graph input", "pointwise", "pointwise, then a view"])
def test_without_gradients_the_input_cast_goes_where_it_costs_no_pass(kernels, producer):
    """Where Inductor's code writes the conv's fp32 input, the cast stays in the graph (its kernel
    stores the bf16 copy); where nothing of Inductor's does (a graph input), the op casts it as it
    loads it (the config names the compute dtype)."""
    torch.manual_seed(36)
    model = ConvRelu(producer).to(DEVICE).requires_grad_(False)
    with torch.no_grad():
        reports = assert_fused(model, [torch.randn(2, 4, 6, 5, device=DEVICE)], expect={"conv_epilogue": 1},
                               train=False, tol=3e-2)  # fmt: skip
    (match,) = [m for r in reports for m in r.matches]
    absorbed = json.loads(match.config)["compute_dtype"]
    assert absorbed == ("bfloat16" if producer == "graph input" else None)


def test_a_region_copy_s_inputs_say_whether_inductor_s_code_writes_them():
    """Timed on its own, a region's input is a placeholder: it carries what wrote it in the graph, so
    the fused candidate casts it where the graph will (``written_by_inductor``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from fusion_backend.frontend.normalize import normalize_node
    from fusion_backend.match.rewrite import WRITTEN_BY_INDUCTOR, inductor_writes
    from fusion_backend.runtime import region_timing

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

        def forward(self, x):
            return torch.relu(self.a(torch.sigmoid(x).reshape(x.shape))) + torch.relu(self.b(x))

    gm = torch.fx.symbolic_trace(Two())
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(mode.from_tensor(torch.randn(1, 4, 5, 5)))
    nodes = {n.name: n for n in gm.graph.nodes}
    for conv, written in (("a", True), ("b", False)):
        region = region_timing.extract_region(gm, [nodes[conv], nodes["relu" if conv == "a" else "relu_1"]])
        (placeholder,) = [n for n in region.graph.nodes if n.op == "placeholder"]
        assert placeholder.meta[WRITTEN_BY_INDUCTOR] is written, conv
        assert inductor_writes(placeholder, normalize_node) is written, conv


@pytest.mark.parametrize("shape", [(2, 4, 6, 5), (3, 4, 7, 9)])
def test_under_dynamic_shapes_the_narrowed_region_fuses(kernels, shape):
    """``dynamic=True`` turns the norm's eps into a tensor read with ``.item()``, and an autocast block
    entered with ``enabled=False`` carries no fake value in Dynamo's graph: the backend does not
    propagate fake values again for that (which failed on the ``.item()`` and left the graph to Inductor)."""
    torch.manual_seed(38)
    reports = assert_fused(TwoConvs().to(DEVICE), [torch.randn(*shape, device=DEVICE)], expect={"conv_group_norm": 1},
                           tol=3e-2, dynamic=True)  # fmt: skip
    assert _group_norm_config(reports).out_dtype == "bfloat16"


class NormThenFusedConv(nn.Module):
    """``relu(conv2(silu(group_norm(conv1(x)))))``, conv2 under bf16 autocast: two regions, the second
    reading the first's narrowed result; the graph holds fused ops alone and runs directly."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.norm, self.conv2 = nn.Conv2d(4, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Conv2d(8, 6, 3, padding=1)

    def forward(self, x):
        h = F.silu(self.norm(self.conv1(x)))
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            return torch.relu(self.conv2(h))


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_a_fused_op_reads_the_narrowed_result_of_the_one_before(kernels, train):
    torch.manual_seed(39)
    reports = assert_fused(NormThenFusedConv().to(DEVICE), [torch.randn(2, 4, 6, 5, device=DEVICE)],
                           expect={"conv_group_norm": 1, "conv_epilogue": 1}, train=train, tol=3e-2)  # fmt: skip
    assert _group_norm_config(reports).out_dtype == "bfloat16"
    assert all(str(r).splitlines()[0].endswith("runs direct") for r in reports)
