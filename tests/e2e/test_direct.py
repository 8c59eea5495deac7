"""The direct runner (``fusion_backend/runtime/direct.py``): graphs of only fused ops and glue skip
AOTAutograd and Inductor, run as plain FX code whose fused calls go to their direct implementations.

Every case checks the runner the report names, and parity with eager (outputs and every gradient,
through ``assert_fused``, which also checks against a float64 reference), on the CPU reference and on
the Triton kernels under the interpreter (with CUDA: on the GPU).
"""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_backend.backend as backend
from fusion_backend.errors import InvalidOptionError
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.report import collect_reports
from fusion_backend.runtime import direct
from fusion_backend.testing import Autocast, assert_fused

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

pytestmark = pytest.mark.usefixtures("exact_fp32")


def on_device(model, *inputs):
    return model.to(DEVICE), [t.to(DEVICE) for t in inputs]


class MeanOnly(nn.Module):
    """conv_transpose2d -> mean over H, W: one conv_global_mean and nothing else."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.ConvTranspose2d(3, 5, 3, stride=2)

    def forward(self, x):
        return self.conv(x).mean((2, 3))


class WithTail(nn.Module):
    """The ConvT3d pipeline's chain, then an add after the pool: the add is Inductor's, so no direct run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.ConvTranspose3d(4, 6, 3, stride=2, padding=1, output_padding=1)
        self.m = nn.Parameter(torch.randn(6, 1, 1, 1))

    def forward(self, x):
        y = F.max_pool3d(F.leaky_relu(F.leaky_relu(self.conv(x), 0.2) * self.m, 0.2), 2)
        return y + 1.0


def _runners(reports):
    return [r.runner for r in reports]


def _convt3d_pipeline(seed_models):
    """The ``seeds`` suite's ConvT3d pipeline (shrunk), half its multipliers negative."""
    model, inputs = seed_models("convt3d_leaky_mul_leaky_maxpool", shrink=True)
    with torch.no_grad():
        model.multiplier[::2].neg_()  # negative multipliers flip which window element wins
    return on_device(model, *inputs)


def test_convt3d_pipeline_runs_directly_and_matches_eager(kernels, seed_models):
    reports = assert_fused(*_convt3d_pipeline(seed_models), expect={"conv_epilogue": 1}, options={"direct": True})
    assert _runners(reports) == ["direct"]


def test_convt3d_pipeline_with_direct_off_runs_through_inductor_and_matches_eager(seed_models):
    """``direct=False``: the same graph through AOTAutograd and Inductor, on the CPU reference (with
    CUDA: the GPU kernels).  The Triton kernels under the interpreter through Inductor, this pipeline's
    chain and pool with a backward: ``test_a_graph_with_other_ops_goes_to_inductor_and_says_which``."""
    reports = assert_fused(*_convt3d_pipeline(seed_models), expect={"conv_epilogue": 1}, options={"direct": False})
    assert _runners(reports) == ["inductor"]
    assert any("direct=False" in note for note in reports[0].notes)


def test_convt3d_pipeline_channels_last_and_only_some_inputs_require_grad(kernels, seed_models):
    model, (x,) = seed_models("convt3d_leaky_mul_leaky_maxpool", shrink=True)
    model.conv_transpose.bias.requires_grad_(False)  # no bias gradient asked for
    x = x.to(memory_format=torch.channels_last_3d)
    reports = assert_fused(*on_device(model, x), expect={"conv_epilogue": 1})
    assert _runners(reports) == ["direct"]


def test_autocast_casts_run_as_glue(kernels, seed_models):
    if kernels == "triton":
        pytest.skip("Triton's interpreter has no bf16")
    model, (x,) = seed_models("conv2d_mul_leaky_gelu_small", shrink=True)
    model, (x,) = on_device(model, x)
    reports = assert_fused(Autocast(model, DEVICE), [x], expect={"conv_epilogue": 1}, tol=2e-2)
    assert _runners(reports) == ["direct"]


def test_dynamic_shapes_run_directly_without_recompiling(kernels, seed_models):
    model, (x,) = seed_models("convt3d_leaky_mul_leaky_maxpool", shrink=True)
    model = model.to(DEVICE)
    with collect_reports() as reports:
        compiled = torch.compile(model, backend="fusion", dynamic=True, options={"strict": True})
        for size in ((2, 16, 3, 5, 4), (3, 16, 4, 3, 6)):
            xi = torch.rand(size, device=DEVICE, requires_grad=True)
            out = compiled(xi)
            g = torch.randn_like(out)
            (gx,) = torch.autograd.grad(out, xi, g)
            xe = xi.detach().requires_grad_(True)
            want = model(xe)
            (gxe,) = torch.autograd.grad(want, xe, g)
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(gx, gxe, rtol=1e-4, atol=1e-5)
    assert _runners(reports) == ["direct"]  # one graph for both sizes


def test_expanded_output_gradient(kernels, seed_models):
    """``out.sum().backward()`` hands the backward a stride-0 gradient (AOTAutograd would have made
    it contiguous; the direct implementation passes it as autograd gives it)."""
    model, (x,) = seed_models("convt3d_leaky_mul_leaky_maxpool", shrink=True)
    model, (x,) = on_device(model, x)
    compiled = torch.compile(model, backend="fusion", options={"strict": True})
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = compiled(xc)
    assert type(out.grad_fn).__name__ == "Direct_conv_epilogueBackward"  # the direct implementation ran
    out.sum().backward()
    got = [xc.grad, *(p.grad.clone() for p in model.parameters())]
    model.zero_grad()
    model(xe).sum().backward()
    want = [xe.grad, *(p.grad for p in model.parameters())]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_no_grad_saves_no_backward_state(kernels, seed_models, monkeypatch):
    model, (x,) = seed_models("convt3d_leaky_mul_leaky_maxpool", shrink=True)
    model, (x,) = on_device(model, x)
    saves = []
    real = ce.CONV_EPILOGUE.forward_impl

    def spy(*args):
        saves.append(args[-1])
        return real(*args)

    monkeypatch.setattr(ce.CONV_EPILOGUE, "forward_impl", spy)
    compiled = torch.compile(model, backend="fusion", options={"strict": True})
    with torch.no_grad():
        out = compiled(x)
    assert saves == [False] and out.grad_fn is None
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-5)


def test_conv_global_mean_alone_runs_directly(kernels):
    reports = assert_fused(*on_device(MeanOnly(), torch.rand(2, 3, 5, 4)), expect={"conv_global_mean": 1})
    assert _runners(reports) == ["direct"]


def test_a_graph_with_other_ops_goes_to_inductor_and_says_which(kernels):
    reports = assert_fused(*on_device(WithTail(), torch.rand(2, 4, 3, 5, 4)), expect={"conv_epilogue": 1})
    assert _runners(reports) == ["inductor"]
    (note,) = reports[0].notes
    assert "besides the fused ops" in note and "add" in note


def test_inductor_options_or_cuda_graph_modes_keep_inductor():
    model, x = MeanOnly(), torch.rand(2, 3, 5, 4)
    with collect_reports() as reports:
        torch.compile(model, backend="fusion", options={"max_autotune": False})(x)
        torch._dynamo.reset()
        torch.compile(model, backend="fusion", mode="reduce-overhead")(x)
    assert _runners(reports) == ["inductor", "inductor"]
    assert "Inductor options" in reports[0].notes[0] and "CUDA graphs" in reports[1].notes[0]


def test_a_failing_direct_build_falls_back_to_inductor(monkeypatch):
    def broken(gm):
        raise RuntimeError("direct build broke")

    monkeypatch.setattr(backend, "direct_module", broken)
    model, x = MeanOnly(), torch.rand(2, 3, 5, 4)
    with pytest.warns(UserWarning, match="direct build broke"), collect_reports() as reports:
        out = torch.compile(model, backend="fusion")(x)
    torch.testing.assert_close(out, model(x))
    assert _runners(reports) == ["inductor"] and reports[0].fallbacks[0].stage == "direct"
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="direct build broke"):
        torch.compile(model, backend="fusion", options={"strict": True})(x)


def test_direct_option_must_be_a_bool():
    with pytest.raises(InvalidOptionError, match="'direct' must be a bool"):
        backend.fusion(torch.fx.symbolic_trace(MeanOnly()), [torch.rand(2, 3, 5, 4)], options={"direct": "yes"})


def test_why_not_direct_on_a_graph_without_fused_ops():
    gm = torch.fx.symbolic_trace(lambda x: x.to(torch.float16))
    assert direct.why_not_direct(gm) == "the graph holds no fused op"


@pytest.mark.parametrize("runner", ["direct", "inductor"])
@pytest.mark.parametrize("family", ["conv_epilogue", "conv_global_mean"])
def test_profiler_shows_the_fused_op_forward_and_backward_in_every_runner(family, runner):
    """A graph run by the direct runner calls no dispatcher op for its fused op: the direct implementation
    opens ``record_function`` ranges named like the custom ops.  Through Inductor, the autograd-free ops
    are dispatcher ops of their own (``fusion::<op>_noautograd``).  Either way a profiled step shows the
    forward and the backward."""
    from fusion_backend.report import collect_reports

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 4, 3)
    if family == "conv_epilogue":
        def fn(x):
            return torch.relu(conv(x))
    else:
        def fn(x):
            return conv(x).mean((2, 3))
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    compiled = torch.compile(fn, backend="fusion", options={"decide": "fuse", "direct": runner == "direct"})
    with collect_reports() as reports:
        compiled(x).sum().backward()  # compiles
    assert reports[0].runner == runner
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        compiled(x).sum().backward()
    names = {e.name for e in prof.events()}
    suffix = "" if runner == "direct" else "_noautograd"
    assert {f"fusion::{family}_fwd{suffix}", f"fusion::{family}_bwd{suffix}"} <= names, sorted(n for n in names if "fusion" in n)
