"""A batch of 0: the region is left to Inductor's code with an ``empty_tensor`` near miss, and the result
is eager's (an empty tensor of the right shape), whatever the family and even with ``decide="fuse"``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from fusion_backend.report import ReasonKind, collect_reports


class ChannelLogSumExp(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)

    def forward(self, x):
        return torch.logsumexp(self.conv(x), dim=1)


MODELS = {
    "conv_epilogue": (lambda: nn.Sequential(nn.Conv3d(2, 4, 3, padding=1), nn.LeakyReLU(0.1), nn.MaxPool3d(2)),
                      (0, 2, 4, 4, 4)),
    "conv_group_norm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4), nn.SiLU()), (0, 2, 8, 8)),
    "conv_batch_norm": (lambda: nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4), nn.ReLU()), (0, 2, 8, 8)),
    "conv_layer_norm": (lambda: nn.Sequential(nn.Conv2d(2, 6, 3), nn.LayerNorm(6)), (0, 2, 8, 8)),
    "conv_global_mean": (lambda: nn.Sequential(nn.ConvTranspose2d(2, 4, 3), nn.AdaptiveAvgPool2d(1)), (0, 2, 8, 8)),
    "conv_channel_reduce": (ChannelLogSumExp, (0, 2, 8, 8)),
}


@pytest.mark.parametrize("family", sorted(MODELS))
def test_an_empty_batch_runs_inductors_code_and_gives_eagers_result(family):
    make, shape = MODELS[family]
    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape)
    torch._dynamo.reset()
    with torch.no_grad(), collect_reports() as reports:
        out = torch.compile(model, backend="fusion", options={"decide": "fuse", "strict": True})(x)
        want = model(x)
    torch._dynamo.reset()
    assert out.shape == want.shape and out.numel() == 0
    assert not any(r.matches for r in reports)
    misses = [m for r in reports for m in r.near_misses if m.reason is ReasonKind.EMPTY_TENSOR]
    assert any(m.pattern == family for m in misses), [(m.pattern, m.reason.value) for r in reports for m in r.near_misses]
    assert running_stats_unchanged(model)


def running_stats_unchanged(model: nn.Module) -> bool:
    """Eager leaves a batch norm's running statistics as they were on an empty batch."""
    return all(torch.equal(m.running_mean, torch.zeros_like(m.running_mean))
               and torch.equal(m.running_var, torch.ones_like(m.running_var))
               for m in model.modules() if isinstance(m, nn.BatchNorm2d))
