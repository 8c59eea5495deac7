"""torch.compile(backend="fusion") end to end for the conv_group_norm family: the ``families`` suite's
GroupNorm decoder layer at a small size and a few blocks (instance norm, 3d, channels-last, chains on
both sides, a max or avg pool ending the region, autocast), one fused op each, output and every gradient equal to eager and to a float64
reference (``fusion_backend.testing.assert_fused``, which forces ``decide="fuse"`` and ``strict``), on
the CPU reference and on the Triton kernels under the interpreter (with CUDA: on the GPU); on CUDA also
the bench workload at full size."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.testing import Autocast, assert_fused

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DEMO = "convt2d_64_32_k4_s2_groupnorm_silu"

pytestmark = [pytest.mark.usefixtures("exact_fp32"),
              pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")]  # fmt: skip


def test_groupnorm_silu_demo(kernels, demo_model):
    model = demo_model("families", DEMO)
    x = torch.randn(2, 64, 5, 6)
    reports = assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_group_norm": 1})
    assert reports[0].near_misses == () and "runs direct" in str(reports[0])


class Block(nn.Module):
    def __init__(self, conv, norm, body):
        super().__init__()
        torch.manual_seed(3)
        self.conv, self.norm = conv, norm
        self.p = nn.Parameter(torch.randn(1, conv.out_channels, *([1] * len(conv.kernel_size))))
        self.s = nn.Parameter(torch.tensor(-1.3))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


#: name -> (conv and norm factories, x's shape, the body).  Built inside the test after seeding, so
#: the weights do not depend on what ran before in the process.  The instance norm's conv has no bias:
#: the norm subtracts each channel's mean, so that bias's gradient is zero up to rounding, which no
#: relative comparison can judge.
CASES = {
    "conv1d instance norm affine, leaky": (lambda: (nn.Conv1d(3, 4, 3, padding=1, bias=False), nn.InstanceNorm1d(4, affine=True)),
                                           (2, 3, 9), lambda s, y: F.leaky_relu(s.norm(y), 0.2)),
    "conv3d pre-chain, group norm, dag post-chain": (lambda: (nn.Conv3d(2, 6, 3), nn.GroupNorm(3, 6)), (1, 2, 4, 5, 5),
                                                     lambda s, y: (lambda z: z * torch.sigmoid(z) * s.s)(s.norm(y * s.p))),
    "conv2d channels-last group norm no affine, gelu": (lambda: (nn.Conv2d(4, 6, 3), nn.GroupNorm(2, 6, affine=False)),
                                                        (2, 4, 7, 6), lambda s, y: F.gelu(s.norm(y)) + s.p),
    "conv2d channels-last group norm, silu, max pool 3/2/1": (
        lambda: (nn.Conv2d(3, 6, 3, padding=1), nn.GroupNorm(3, 6)), (2, 3, 9, 11),
        lambda s, y: F.max_pool2d(F.silu(s.norm(y)), 3, 2, 1)),
    "conv1d instance norm affine, relu, avg pool ceil_mode": (
        lambda: (nn.Conv1d(3, 4, 3, bias=False), nn.InstanceNorm1d(4, affine=True)), (2, 3, 12),
        lambda s, y: F.avg_pool1d(F.relu(s.norm(y)), 3, 2, ceil_mode=True)),
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
    reports = assert_fused(Block(conv, norm, body).to(DEVICE), [x.to(DEVICE)], expect={"conv_group_norm": 1},
                           options={"direct": direct})  # fmt: skip
    assert ("runs direct" if direct else "runs inductor") in str(reports[0])


def test_autocast_bf16_norm_in_fp32(kernels, demo_model):
    """Under autocast the conv runs in bf16 and the norm (and the chain after it) in fp32, as eager does."""
    model = Autocast(demo_model("families", DEMO), DEVICE)
    x = torch.randn(2, 64, 4, 5)
    assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_group_norm": 1}, tol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_bench_workload_at_full_size_on_gpu(autocast, demo_model):
    model = demo_model("families", DEMO).cuda()
    if autocast:
        model = Autocast(model, "cuda")
    x = torch.randn(16, 64, 64, 64)  # the demo's get_inputs()
    reports = assert_fused(model, [x.cuda()], expect={"conv_group_norm": 1}, tol=3e-2 if autocast else None)
    assert "triton" in str(reports[0])


class DecoderBlock(nn.Module):
    """The SD VAE decoder's resnet half on a channels-last model: GroupNorm -> SiLU -> conv -> GroupNorm ->
    SiLU, the conv's input contiguous, as torch's CUDA GroupNorm writes its result whatever its input's
    layout (made so here on any device), with a channels-last weight: eager's conv copies it into
    channels-last."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.norm1, self.conv, self.norm2 = nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8)

    def forward(self, x):
        return F.silu(self.norm2(self.conv(F.silu(self.norm1(x)).contiguous())))


def test_a_contiguous_input_is_relaid_in_the_graph_where_eager_s_conv_relays_it(tmp_path):
    """The rewrite hands the fused op its input channels-last (``match.rewrite.in_conv_layout``), a
    relayout Inductor writes in the producer's kernel, instead of the op's conv copying it; outputs and
    gradients are eager's (a graph rewrite: the op's implementation on the device as the suite sets it)."""
    model = DecoderBlock().to(DEVICE).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 6, 5, device=DEVICE).to(memory_format=torch.channels_last)
    assert_fused(model, [x], expect={"conv_group_norm": 1}, options={"dump_dir": str(tmp_path)})
    after = "\n".join(p.read_text() for p in tmp_path.glob("graph_*/after.py"))
    assert "contiguous(memory_format = torch.channels_last)" in after, after
