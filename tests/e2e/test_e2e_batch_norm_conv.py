"""batch_norm_conv end to end: torch.compile(backend="fusion") over three training steps of ResNet's
bottleneck against eager (output, every gradient, running statistics, num_batches_tracked), with the
reference and the interpreted kernels, through Inductor and the direct runner, with dynamic shapes;
the family opt-in; the region it takes from ``conv_batch_norm`` and the alternate that leaves (the
decision's region timing on copies of the running statistics: ``test_e2e_conv_batch_norm.py``); eval mode (no match: the norm folds
into the producer's chain); autocast on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from train_parity import train_steps

from fusion_backend.match.engine import find_regions, registered_patterns
from fusion_backend.patterns.corpus.batch_norm_conv import bottleneck
from fusion_backend.testing import Autocast, assert_fused, dry_run

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.usefixtures("exact_fp32"),
]


#: Three steps of one input shape of the bottleneck.
STEPS = [(2, 16, 6, 5)] * 3


def test_bottleneck_trains_as_eager_with_both_norms_applied_by_the_convs_that_read_them(kernels, kernel_device,
                                                                                         monkeypatch) -> None:  # fmt: skip
    monkeypatch.setenv("FUSION_CONV_IMPL", "family")
    _, _, reports = train_steps(bottleneck(), STEPS, kernel_device, options={"patterns": "all"})
    assert reports[0].counts() == {"batch_norm_conv": 2}
    assert [m.summary for m in reports[0].matches] == ["batch_norm(train) -> relu -> conv2d"] * 2
    assert all(m.kernel.startswith("triton" if kernels != "reference" else "reference") for m in reports[0].matches)


def test_dynamic_shapes_train_as_eager(kernels, kernel_device, monkeypatch) -> None:
    """``dynamic=True``: batch and spatial sizes change between steps."""
    monkeypatch.setenv("FUSION_CONV_IMPL", "family")
    _, _, reports = train_steps(bottleneck(), [(2, 16, 6, 5), (3, 16, 7, 9)], kernel_device, options={"patterns": "all"},
                          dynamic=True)  # fmt: skip
    assert all(r.counts() == {"batch_norm_conv": 2} for r in reports) and reports


def test_the_family_is_opt_in_and_conv_batch_norm_takes_the_norms_without_it(kernel_device, monkeypatch) -> None:
    """By default (and where it is left out) the producers take the norms."""
    for options in ({}, {"patterns": "all", "disable_patterns": ["batch_norm_conv"]}):
        _, _, reports = train_steps(bottleneck(), STEPS[:1], kernel_device, options=options)
        assert reports[0].counts() == {"conv_batch_norm": 2}
    monkeypatch.setenv("FUSION_PATTERNS", "batch_norm_conv")
    _, _, reports = train_steps(bottleneck(), STEPS[:1], kernel_device)
    assert reports[0].counts() == {"batch_norm_conv": 2}


class FunctionalChain(nn.Module):
    """conv -> F.batch_norm -> relu -> conv -> F.batch_norm, traceable by ``fx.symbolic_trace``."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(4, 8, 1), nn.Conv2d(8, 8, 3, padding=1)
        for i in (1, 2):
            self.register_buffer(f"rm{i}", torch.zeros(8))
            self.register_buffer(f"rv{i}", torch.ones(8))

    def forward(self, x):
        a = torch.relu(F.batch_norm(self.c1(x), self.rm1, self.rv1, None, None, True, 0.1, 1e-5))
        return F.batch_norm(self.c2(a), self.rm2, self.rv2, None, None, True, 0.1, 1e-5)


def test_the_producers_region_of_a_norm_this_family_took_is_an_alternate() -> None:
    from fusion_backend.backend import _ensure_fake_values

    gm = torch.fx.symbolic_trace(FunctionalChain().train())
    _ensure_fake_values(gm, [torch.randn(2, 4, 6, 6)])
    regions = find_regions(gm, list(registered_patterns()))
    assert [(c.pattern, c.summary) for _, c in regions.accepted] == [
        ("batch_norm_conv", "batch_norm(train) -> relu -> conv2d")]
    # each conv's own region, its chain stopped where the accepted region begins
    assert [(c.pattern, [n.name for n in c.nodes]) for c in regions.alternates] == [
        ("conv_batch_norm", ["c1", "batch_norm"]), ("conv_batch_norm", ["c2", "batch_norm_1"])]


def test_eval_mode_is_not_this_family() -> None:
    found = dry_run(bottleneck().eval(), [torch.randn(2, 16, 6, 5)], patterns=list(registered_patterns()))
    assert not any(pattern == "batch_norm_conv" for pattern, _, _ in found.regions)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_bottleneck_under_autocast_channels_last_on_the_gpu(dtype) -> None:
    """What mixed-precision training runs: the convs and norms in bf16 / fp16 with fp32 parameters."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = Autocast(bottleneck(), "cuda", dtype).cuda().to(memory_format=torch.channels_last)
    x = torch.randn(8, 16, 28, 28, device="cuda").to(memory_format=torch.channels_last)
    assert_fused(model, [x], {"batch_norm_conv": 2}, options={"patterns": "all"})


def test_a_bf16_model_with_fp32_norm_inputs_is_a_near_miss() -> None:
    model = Autocast(nn.Sequential(nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 4, 3)).train(), "cpu")
    found = dry_run(model, [torch.randn(2, 4, 6, 6)], patterns=["batch_norm_conv"])
    assert [m.reason.value for m in found.near_misses if m.pattern == "batch_norm_conv"] == ["unsupported_dtype"]


class FunctionalPreActivation(nn.Module):
    """``conv(relu(F.batch_norm(x)))`` with the module's own buffers: no ``num_batches_tracked``, so the
    rewritten graph holds only the fused op and runs directly (no Inductor)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(6, 4, 3, padding=1)
        self.register_buffer("rm", torch.zeros(6))
        self.register_buffer("rv", torch.ones(6))
        self.gamma = nn.Parameter(torch.rand(6) + 0.5)

    def forward(self, x):
        return self.conv(torch.relu(F.batch_norm(x, self.rm, self.rv, self.gamma, None, True, 0.3, 1e-3)))


def test_the_direct_runner_trains_as_eager(kernels, kernel_device, monkeypatch) -> None:
    monkeypatch.setenv("FUSION_CONV_IMPL", "family")
    _, _, reports = train_steps(FunctionalPreActivation(), [(2, 6, 5, 7)] * 3, kernel_device, options={"patterns": "all"})
    assert reports[0].counts() == {"batch_norm_conv": 1} and reports[0].runner == "direct"
