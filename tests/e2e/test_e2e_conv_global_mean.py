"""torch.compile(backend="fusion") end to end for the conv_global_mean family (the seeds suite's
ConvTranspose2d -> global mean -> logsumexp pipeline and friends): one fused op, output and every
gradient equal to eager and to a float64 reference, on the CPU reference and on the Triton kernels
under the interpreter (with CUDA: on the GPU, plus full size)."""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.report import collect_reports
from fusion_backend.testing import Autocast, assert_fused

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


pytestmark = pytest.mark.usefixtures("exact_fp32")


def test_convt2d_global_mean_bias_logsumexp_small(kernels, seed_models):
    model, (x,) = seed_models("convt2d_global_mean_bias_logsumexp_small", shrink=True)
    reports = assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1})
    assert reports[0].near_misses == ()


class Head(nn.Module):
    def __init__(self, conv, body):
        super().__init__()
        torch.manual_seed(2)
        self.conv = conv
        self.a = nn.Parameter(torch.randn(conv.out_channels, *([1] * (len(conv.kernel_size)))))
        self.body = body

    def forward(self, x):
        return self.body(self, self.conv(x))


CASES = {
    "convT2d pad stride affine": (nn.ConvTranspose2d(3, 5, 3, stride=2, padding=1, output_padding=1),
                                  (2, 3, 5, 6), lambda s, y: (y * s.a - 0.5).mean((2, 3), keepdim=True)),
    "conv2d pad dilation groups sum/n": (nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2),
                                         (2, 4, 7, 9), lambda s, y: y.sum((-1, -2)) / 63),
    "conv1d stride operand on the left": (nn.Conv1d(3, 4, 3, stride=2, padding=1), (3, 3, 11),
                                          lambda s, y: (s.a + y).mean(2)),
    "conv2d mean of mean": (nn.Conv2d(3, 4, 3, stride=2), (2, 3, 9, 8), lambda s, y: y.mean(-1).mean(-1)),
    "convT3d adaptive": (nn.ConvTranspose3d(2, 3, 2, stride=2, bias=False), (2, 2, 3, 2, 3),
                         lambda s, y: F.adaptive_avg_pool3d(y * s.a, 1)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_conv_variants(kernels, name):
    conv, shape, body = CASES[name]
    torch.manual_seed(4)
    x = torch.rand(shape)
    model = Head(conv, body)
    assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1})


def test_channels_last_input(kernels, seed_models):
    model, (x,) = seed_models("convt2d_global_mean_bias_logsumexp_small", shrink=True)
    x = x.to(memory_format=torch.channels_last)
    assert_fused(model.to(DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1})


def test_dynamic_shapes_compile_once(kernels, fusion_rewrites, seed_models):
    model, _ = seed_models("convt2d_global_mean_bias_logsumexp_small", shrink=True)
    model = model.to(DEVICE)
    compiled = torch.compile(model, backend="fusion", dynamic=True, options={"strict": True})
    for shape in ((2, 3, 6, 7), (5, 3, 9, 4), (3, 3, 11, 8)):
        x = torch.rand(shape, device=DEVICE)
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert [r.counts() for r in fusion_rewrites] == [{"conv_global_mean": 1}]


def test_autocast_bf16(kernels, seed_models):
    if kernels == "triton":
        pytest.skip("Triton's interpreter has no bf16")
    model, (x,) = seed_models("convt2d_global_mean_bias_logsumexp_small", shrink=True)
    assert_fused(Autocast(model.to(DEVICE), DEVICE), [x.to(DEVICE)], expect={"conv_global_mean": 1}, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", ["convt2d_global_mean_bias_logsumexp",
                                  "convt2d_global_mean_bias_logsumexp_small"])
def test_global_mean_pipeline_on_gpu(name, seed_models):
    model, (x,) = seed_models(name)
    assert_fused(model.cuda(), [x.cuda()], expect={"conv_global_mean": 1})


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_graphs_mode_reduce_overhead_matches_eager_over_steps(seed_models):
    """``mode="reduce-overhead"`` (Inductor's CUDA graphs) captures the fused ops too: their
    launches, cached plans and output allocations must replay correctly on fresh inputs, forward and
    backward, step after step (outputs are cloned: a replay overwrites the previous step's)."""
    torch.manual_seed(0)
    model, (x,) = seed_models("convt2d_global_mean_bias_logsumexp_small")
    model = model.cuda()
    compiled = torch.compile(model, backend="fusion", mode="reduce-overhead")  # mode excludes options
    params = list(model.parameters())
    for step in range(4):
        xs = torch.rand_like(x, device="cuda").requires_grad_()
        torch.compiler.cudagraph_mark_step_begin()
        with collect_reports() as reports, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(xs)
            grad_out = torch.randn_like(out)
            grads = torch.autograd.grad(out, [xs, *params], grad_out)
            got = [out.detach().clone(), *[g.clone() for g in grads]]
        # a kernel failure would fall back to the torch reference with a warning: none may occur
        assert not [w for w in caught if "fusion_backend" in str(w.message)], [str(w.message) for w in caught]
        if step == 0:
            assert [r.counts() for r in reports] == [{"conv_global_mean": 1}]
            assert all(not r.fallbacks for r in reports), [str(r) for r in reports]
        ref_x = xs.detach().double().requires_grad_()
        ref_model = copy.deepcopy(model).double()
        ref_out = ref_model(ref_x)
        want = [ref_out, *torch.autograd.grad(ref_out, [ref_x, *ref_model.parameters()], grad_out.double())]
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g.double(), w.detach(), rtol=1e-4, atol=1e-5, msg=f"step {step}, tensor {i}")


class SquaredMeanBesideAnEpilogue(nn.Module):
    """A 1-d conv whose output is read twice (``y * y``) before a mean over its length, beside a conv ->
    leaky_relu -> max_pool2d region of the same graph."""

    def __init__(self):
        super().__init__()
        self.narrow = nn.Conv1d(2, 1, 2, stride=2)
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, s, x):
        y = self.narrow(s)
        return (y * y).mean(2), F.max_pool2d(F.leaky_relu(self.conv(x), 0.1), 2)


def test_a_conv_output_read_twice_before_the_mean_rewrites_beside_another_region():
    """Both regions are rewritten (the one whose conv output is read twice once failed inside a global-mean
    rewrite, which kept the graph correct but lost the other region's fusion), and the results are eager's."""
    torch.manual_seed(0)
    model = SquaredMeanBesideAnEpilogue()
    inputs = (torch.randn(3, 2, 8), torch.randn(2, 2, 9, 9))
    with collect_reports() as reports:
        got = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True})(*inputs)
    want = model(*inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    assert not any(r.fallbacks for r in reports)
    # a mean of squares is no linear map of the conv: the squared conv output is an epilogue region
    assert sorted(m.pattern for r in reports for m in r.matches) == ["conv_epilogue", "conv_epilogue"]
