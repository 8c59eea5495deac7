"""torch.compile(backend="fusion") end to end for the conv_layer_norm family: the ``families`` suite's
LayerNorm workload built small and a few blocks (a layer norm over the last dim of a 1d conv and of a
ConvTranspose3d output whose W is its channel count, over the channels and spatial dims of a
channels-last output, chains on both sides, autocast), one fused op each, output and every gradient
equal to eager and to a float64 reference (``fusion_backend.testing.assert_fused``, which forces
``decide="fuse"`` and ``strict``), on the CPU reference and on the Triton kernels under the
interpreter (with CUDA: on the GPU); on CUDA also the bench workload at full size."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import load_demo_module

from fusion_backend.report import collect_reports
from fusion_backend.runtime import decision
from fusion_backend.testing import Autocast, assert_fused

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DEMO = "conv2d_64_k3_layernorm_chw_relu"

pytestmark = [pytest.mark.usefixtures("exact_fp32"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]  # fmt: skip


def small_demo():
    """The demo's model with 8 channels over 6 x 5 (its layer norm fixes the spatial size), seeded."""
    module = load_demo_module("families", DEMO)
    torch.manual_seed(0)
    model = module.Model(8, 6, 5)
    with torch.no_grad():  # an affine that is not the identity
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.normal_()
    return model


def test_layernorm_relu_demo(kernels):
    reports = assert_fused(small_demo().to(DEVICE), [torch.randn(2, 8, 6, 5).to(DEVICE)], expect={"conv_layer_norm": 1})
    assert reports[0].near_misses == () and "runs direct" in str(reports[0])


class Block(nn.Module):
    def __init__(self, conv, norm, body):
        super().__init__()
        self.conv, self.norm = conv, norm
        self.p = nn.Parameter(torch.randn(1, conv.out_channels, *([1] * len(conv.kernel_size))))
        self.s = nn.Parameter(torch.tensor(-1.3))
        if getattr(norm, "weight", None) is not None:
            with torch.no_grad():
                norm.weight.uniform_(0.5, 1.5)
                norm.bias.normal_()
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


#: name -> (conv and norm factories, x's shape, the body).  Built inside the test after seeding, so
#: the weights do not depend on what ran before in the process.  A row of one channel holds one conv
#: bias value, which the norm takes out (its gradient is zero up to rounding, which no relative
#: comparison judges): those convs have no bias, or a chain before the norm.
CASES = {
    "conv1d over L, leaky before": (lambda: (nn.Conv1d(3, 4, 3, padding=1), nn.LayerNorm(9)), (2, 3, 9),
                                    lambda s, y: s.norm(F.leaky_relu(y * s.p, 0.2))),
    "conv_transpose3d over W (= C), gelu, scale": (
        lambda: (nn.ConvTranspose3d(2, 4, 3, stride=2, padding=1, output_padding=1, bias=False), nn.LayerNorm(4)),
        (1, 2, 2, 3, 2), lambda s, y: F.gelu(s.norm(y)) * s.s),
    "conv2d channels-last over (C, H, W) no affine, dag after": (
        lambda: (nn.Conv2d(4, 6, 3), nn.LayerNorm([6, 5, 4], elementwise_affine=False)), (2, 4, 7, 6),
        lambda s, y: (lambda z: z * torch.sigmoid(z) + s.p)(s.norm(y))),
}


@pytest.mark.parametrize("name", list(CASES))
def test_blocks(kernels, name):
    modules, shape, body = CASES[name]
    torch.manual_seed(4)
    conv, norm = modules()
    x = torch.randn(shape)
    if "channels-last" in name:
        x = x.to(memory_format=torch.channels_last)
    direct = "3d" not in name  # the 3d block through Inductor (the compiled graphs call the autograd-free ops)
    reports = assert_fused(Block(conv, norm, body).to(DEVICE), [x.to(DEVICE)], expect={"conv_layer_norm": 1},
                           options={"direct": direct})  # fmt: skip
    assert ("runs direct" if direct else "runs inductor") in str(reports[0])


def test_autocast_bf16():
    """Under autocast the conv runs in bf16 and the norm in what eager runs it in (fp32 on CUDA, bf16
    on the CPU): the fused op follows (the reference on the CPU: the interpreter has no bf16)."""
    model = Autocast(small_demo(), DEVICE)
    assert_fused(model.to(DEVICE), [torch.randn(2, 8, 6, 5).to(DEVICE)], expect={"conv_layer_norm": 1}, tol=3e-2)


def test_the_region_goes_through_the_decision_against_inductor(tmp_path, monkeypatch):
    """Measured like every family's (a fake timer here; the decision's own tests cover the timing and
    a region left to Inductor, whose CPU compile is slow): kept where the fused op wins."""
    fused_ms, inductor_ms, kept = 1.0, 1.5, True
    monkeypatch.setenv("FUSION_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("FUSION_DECIDE", raising=False)
    decision.forget_in_memory()
    model, x = small_demo(), torch.randn(2, 8, 6, 5)
    want = model(x)
    with decision.timing_override(lambda steps: {"fused": fused_ms, "inductor": inductor_ms}), \
            collect_reports() as reports:  # fmt: skip
        out = torch.compile(model, backend="fusion", options={"defer": False})(x)
    decision.forget_in_memory()
    (report,) = reports
    (d,) = report.decisions
    assert d.fused is kept and d.rule == "fused is faster" and report.counts() == {"conv_layer_norm": 1}
    assert "fused is faster (fused 1.000 ms vs Inductor 1.500 ms" in str(report)
    torch.testing.assert_close(out, want)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_bench_workload_at_full_size_on_gpu(autocast, demo_model):
    model = demo_model("families", DEMO).cuda()
    if autocast:
        model = Autocast(model, "cuda")
    x = torch.randn(32, 64, 64, 64)  # the demo's get_inputs()
    reports = assert_fused(model, [x.cuda()], expect={"conv_layer_norm": 1}, tol=3e-2 if autocast else None)
    assert "triton" in str(reports[0])
