"""The front end's spellings (``frontend/normalize.py``, ``frontend/idioms.py``): every way a user may
write a pointwise op, and the spelled-out activations it folds, reach the matcher as the same
canonical op.  Only the find phase runs (``dry_run``: Dynamo + the matcher, no rewrite)."""

import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from chain_models import X2, Chain, regions

from fusion_backend.testing import dry_run

SPELLINGS = {
    "x*m": (lambda s, y: y * s.m, "mul"),
    "m*x": (lambda s, y: s.m * y, "mul"),
    "torch.mul": (lambda s, y: torch.mul(y, s.m), "mul"),
    "x.mul(m)": (lambda s, y: y.mul(s.m), "mul"),
    "x.mul_(m)": (lambda s, y: y.mul_(s.m), "mul"),
    "operator.imul": (lambda s, y: operator.imul(y, s.m4), "mul"),
    "x*2.5": (lambda s, y: y * 2.5, "mul"),
    "x*0-d": (lambda s, y: y * s.s, "mul"),
    "x+m": (lambda s, y: y + s.m, "add"),
    "m+x": (lambda s, y: s.m + y, "add"),
    "torch.add alpha": (lambda s, y: torch.add(y, 3.0, alpha=2), "add"),
    "x-m": (lambda s, y: y - s.m, "sub"),
    "m-x": (lambda s, y: s.m - y, "rsub"),
    "torch.sub": (lambda s, y: torch.sub(y, s.m), "sub"),
    "x/m": (lambda s, y: y / s.m, "div"),
    "2/x": (lambda s, y: 2.0 / y, "rdiv"),
    "x.div_": (lambda s, y: y.div_(4.0), "div"),
    "-x": (lambda s, y: -y, "mul"),
    "F.relu": (lambda s, y: F.relu(y), "relu"),
    "F.relu inplace": (lambda s, y: F.relu(y, inplace=True), "relu"),
    "torch.relu": (lambda s, y: torch.relu(y), "relu"),
    "x.relu_()": (lambda s, y: y.relu_(), "relu"),
    "nn.ReLU": (lambda s, y: nn.ReLU()(y), "relu"),
    "F.leaky_relu pos": (lambda s, y: F.leaky_relu(y, 0.3), "leaky_relu"),
    "F.leaky_relu kw": (lambda s, y: F.leaky_relu(y, negative_slope=0.3, inplace=True), "leaky_relu"),
    "F.leaky_relu_": (lambda s, y: F.leaky_relu_(y, 0.1), "leaky_relu"),
    "nn.LeakyReLU": (lambda s, y: nn.LeakyReLU(0.2)(y), "leaky_relu"),
    "F.gelu": (lambda s, y: F.gelu(y), "gelu"),
    "F.gelu tanh": (lambda s, y: F.gelu(y, approximate="tanh"), "gelu_tanh"),
    "nn.GELU": (lambda s, y: nn.GELU()(y), "gelu"),
    "F.silu": (lambda s, y: F.silu(y), "silu"),
    "nn.SiLU inplace": (lambda s, y: nn.SiLU(inplace=True)(y), "silu"),
    "torch.sigmoid": (lambda s, y: torch.sigmoid(y), "sigmoid"),
    "x.sigmoid()": (lambda s, y: y.sigmoid(), "sigmoid"),
    "torch.tanh": (lambda s, y: torch.tanh(y), "tanh"),
    "x.tanh_()": (lambda s, y: y.tanh_(), "tanh"),
    "F.hardtanh": (lambda s, y: F.hardtanh(y, -0.5, 0.5), "hardtanh"),
    "F.relu6": (lambda s, y: F.relu6(y), "hardtanh"),
    "torch.clamp": (lambda s, y: torch.clamp(y, min=-1, max=2), "clamp"),
    "x.clamp(min)": (lambda s, y: y.clamp(-1), "clamp_min"),
    "x.clamp_(max=)": (lambda s, y: y.clamp_(max=1.5), "clamp_max"),
    "torch.clip": (lambda s, y: torch.clip(y, -1, 1), "clamp"),
    "F.hardswish": (lambda s, y: F.hardswish(y), "hardswish"),
    "F.mish": (lambda s, y: F.mish(y), "mish"),
    "torch.minimum": (lambda s, y: torch.minimum(y, s.m), "minimum"),
    "m.maximum(x)": (lambda s, y: s.m.maximum(y), "maximum"),
    "torch.min(x, 0-d)": (lambda s, y: torch.min(y, s.s), "minimum"),
    "x.max(m)": (lambda s, y: y.max(s.m4), "maximum"),
}


@pytest.mark.parametrize("spelling", ["torch.max(x, 1)", "x.min(dim=1)"])
def test_min_and_max_over_a_dim_are_reductions_not_minimum(spelling):
    body = {"torch.max(x, 1)": lambda s, y: torch.max(y, 1)[0], "x.min(dim=1)": lambda s, y: y.min(dim=1).values}[spelling]
    assert regions(Chain(body)) == ()


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_every_spelling_of_a_pointwise_op_fuses(name):
    body, kind = SPELLINGS[name]
    (region,) = regions(Chain(body))
    assert region[1] == f"conv2d -> {kind}"


def test_long_chain_in_mixed_spellings_is_one_region():
    def body(s, y):
        y = s.m * y
        y = F.leaky_relu(y, 0.2)
        y = y.mul_(2.0)
        y = torch.tanh(y)
        y = F.gelu(y)
        y = y - s.m4
        return F.hardswish(y)

    (region,) = regions(Chain(body))
    assert region[1] == "conv2d -> mul -> leaky_relu -> mul -> tanh -> gelu -> sub -> hardswish"


IDIOMS = {
    "y*sigmoid(y)": (lambda s, y: y * torch.sigmoid(y), "silu"),
    "sigmoid(y)*y": (lambda s, y: y.sigmoid() * y, "silu"),
    "torch.mul(y, F.sigmoid(y))": (lambda s, y: torch.mul(y, F.sigmoid(y)), "silu"),
    "y*tanh(softplus(y))": (lambda s, y: y * torch.tanh(F.softplus(y)), "mish"),
    "tanh(F.softplus(y, beta=1))*y": (lambda s, y: torch.tanh(F.softplus(y, beta=1)) * y, "mish"),
    "where(y>0, y, a*y)": (lambda s, y: torch.where(y > 0, y, 0.2 * y), "leaky_relu"),
    "where(0<y, y, y*a)": (lambda s, y: torch.where(0 < y, y, y * 0.1), "leaky_relu"),
    "y.where(y>0, a*y)": (lambda s, y: y.where(y > 0, 0.3 * y), "leaky_relu"),
}


@pytest.mark.parametrize("name", list(IDIOMS))
def test_spelled_out_activations_fold_into_the_chain(name):
    body, kind = IDIOMS[name]
    (region,) = regions(Chain(lambda s, y: body(s, F.relu(y * s.m))))
    assert region[1] == f"conv2d -> mul -> relu -> {kind}"


#: Look-alikes: (body, the region they make as written, or None where the chain stops as shared).
NOT_IDIOMS = {
    # y >= 0 sends the gradient at 0 to the identity branch: not leaky_relu's backward
    "where(y>=0, y, a*y)": (lambda s, y: torch.where(y >= 0, y, 0.2 * y), None),
    # a tensor slope, and a product of two different tensors
    "where(y>0, y, m*y)": (lambda s, y: torch.where(y > 0, y, s.m * y), None),
    # not SiLU, but a chain that reads the conv output again
    "y*sigmoid(relu(y))": (lambda s, y: y * torch.sigmoid(torch.relu(y)), "conv2d -> relu -> sigmoid -> mul(conv2d)"),
    # softplus with another beta is not Mish's
    "y*tanh(softplus(y, beta=2))": (lambda s, y: y * torch.tanh(F.softplus(y, beta=2)), None),
    # the kept branch is the scaled one
    "where(y>0, a*y, y)": (lambda s, y: torch.where(y > 0, 0.2 * y, y), None),
}


@pytest.mark.parametrize("name", list(NOT_IDIOMS))
def test_look_alikes_are_not_folded(name):
    body, summary = NOT_IDIOMS[name]
    found = dry_run(Chain(body), X2, patterns=["conv_epilogue"])
    assert [s for _, s, _ in found.regions] == ([summary] if summary else [])
    if summary is None:
        assert any(m.reason.value == "shared_intermediate" for m in found.near_misses)


def test_a_sigmoid_with_another_user_is_not_folded():
    def body(s, y):
        sig = torch.sigmoid(y)
        return y * sig + sig

    found = dry_run(Chain(body), X2, patterns=["conv_epilogue"])
    assert all("silu" not in summary for _, summary, _ in found.regions)
