"""The Triton conv backward (``kernels/conv_fused_bwd/``) wired into ``fusion::conv_epilogue``.

``FUSION_CONV_IMPL=triton`` forces the fused forward and the Triton backward (behind a max pool the
conv-output gradient is never written full size); the results must match eager and a float64 run
for the output and every gradient (input, weight, bias, multiplier), as the library path does.
On CPU the kernels run under the interpreter (``FUSION_CPU_KERNELS=triton``), on CUDA for real.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fusion_backend.kernels import conv_fused_bwd, conv_phase_aligned_bwd
from fusion_backend.ops import conv_epilogue as ce
from fusion_backend.testing import assert_fused

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class ConvChainPool(nn.Module):
    """conv (any kind) -> leaky -> x per-channel multiplier -> leaky -> optional pool."""

    def __init__(self, conv: nn.Module, channels: int, nd: int, pool=None):
        super().__init__()
        torch.manual_seed(0)
        self.conv = conv
        self.multiplier = nn.Parameter(torch.randn(channels, *(1,) * nd))
        self.pool = pool

    def forward(self, x):
        y = F.leaky_relu(F.leaky_relu(self.conv(x), 0.2) * self.multiplier, 0.2)
        return y if self.pool is None else self.pool(y)


CASES = {
    # the ConvT3d pipeline (convt3d_leaky_mul_leaky_maxpool) in miniature: phase-aligned pool,
    # windows do not overlap
    "convT3d-maxpool2": (
        lambda: ConvChainPool(nn.ConvTranspose3d(4, 6, 3, 2, 1, 1), 6, 3, nn.MaxPool3d(2)),
        (2, 4, 3, 4, 4),
    ),
    # overlapping windows (stride < kernel) with padding and ceil_mode: a position may win twice
    "conv2d-maxpool3s2-ceil": (
        lambda: ConvChainPool(nn.Conv2d(3, 5, 3, padding=1), 5, 2, nn.MaxPool2d(3, 2, 1, ceil_mode=True)),
        (2, 3, 7, 9),
    ),
    # no pool: the dense conv-output gradient, strided conv with groups
    "conv1d-s2-groups-nopool": (
        lambda: ConvChainPool(nn.Conv1d(4, 6, 3, stride=2, groups=2), 6, 1),
        (2, 4, 13),
    ),
}


@pytest.fixture
def forced_triton(monkeypatch, exact_fp32, fresh_plans):
    monkeypatch.setenv("FUSION_CPU_KERNELS", "triton")
    monkeypatch.setenv(ce.CONV_IMPL_ENV, "triton")
    calls = []  # the name of each Triton conv backward module that ran
    for module in (conv_fused_bwd, conv_phase_aligned_bwd):
        real = module.backward_plan
        name = module.__name__.rsplit(".", 1)[1]

        def recording_plan(*a, _real=real, _name=name, **k):
            run = _real(*a, **k)
            return lambda *args: calls.append(_name) or run(*args)

        monkeypatch.setattr(module, "backward_plan", recording_plan)
    return calls


@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_backward_matches_eager(forced_triton, name):
    build, shape = CASES[name]
    torch.manual_seed(1)
    model = build().to(DEVICE)
    assert_fused(model, [torch.randn(shape, device=DEVICE)], expect={"conv_epilogue": 1}, train=True)
    assert forced_triton, "the Triton backward did not run"
    # a transposed conv under a max pool whose stride is the conv's takes the phase-aligned kernels
    assert forced_triton == (["conv_phase_aligned_bwd"] if name == "convT3d-maxpool2" else ["conv_fused_bwd"])


def test_zero_multiplier_ties_route_the_gradient_like_eager(forced_triton):
    """Every window ties on a zero-multiplier channel: eager's first maximal element gets it."""
    build, shape = CASES["convT3d-maxpool2"]
    model = build().to(DEVICE)
    with torch.no_grad():
        model.multiplier[::2] = 0.0
    assert_fused(model, [torch.randn(shape, device=DEVICE)], expect={"conv_epilogue": 1}, train=True)
    assert forced_triton


def test_avg_pool_takes_the_library_backward(forced_triton):
    model = ConvChainPool(nn.Conv2d(3, 4, 3), 4, 2, nn.AvgPool2d(2)).to(DEVICE)
    assert_fused(model, [torch.randn(2, 3, 8, 8, device=DEVICE)], expect={"conv_epilogue": 1}, train=True)
    assert not forced_triton, "an avg pool has no implicit conv-output gradient"
