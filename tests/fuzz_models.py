"""Random conv pipelines for the model fuzzer (``test_fuzz.py``): a hypothesis strategy of
:class:`Pipeline` specs, the module each one builds, and the check that compiles it with
``backend="fusion"`` and compares the output and every gradient with eager (float64 as the referee).

A pipeline is a 1-3 d conv or transposed conv (random kernel, stride, padding, dilation, groups,
output padding, bias), then a chain of steps mixing ops the patterns fuse and ops they do not, each
written in one of its spellings (``F.relu`` / ``torch.relu`` / ``.relu()`` / ``nn.ReLU`` / in place),
an optional branch that reuses the conv output, and an optional tail (max or avg pool, global mean).
Inputs come contiguous, channels-last or as a strided slice; every parameter requires grad or not.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import assume, reject
from hypothesis import strategies as st
from hypothesis.errors import UnsatisfiedAssumption

from fusion_backend.ir.shapes import conv_output_length
from fusion_backend.testing import compare, float64_reference, run_and_backward

#: Chain steps: (name, spellings).  Steps on per-channel parameters draw a (C, 1, ...) tensor.
STEPS = {
    "relu": ("F.relu", "torch.relu", "method", "module", "inplace"),
    "leaky_relu": ("F", "module"),
    "gelu": ("none", "tanh"),
    "sigmoid": ("torch", "method"),
    "tanh": ("torch", "method"),
    "silu": ("F",),
    "hardtanh": ("F",),
    "clamp": ("torch", "method"),
    "mul_param": ("operator", "torch.mul", "reversed"),
    "add_param": ("operator", "reversed"),
    "mul_scalar": ("operator", "reversed", "inplace"),
    "add_scalar": ("operator", "reversed"),
    "sub_scalar": ("operator", "rsub"),
    "div_scalar": ("operator",),
    "square": ("y*y",),              # reads its input twice
    "softmax_channels": ("torch",),  # a reduction over channels
    "abs": ("torch",),
}
BRANCHES = ("none", "add_conv_output", "return_conv_output")
TAILS = ("none", "max_pool", "avg_pool", "global_mean")
LAYOUTS = ("contiguous", "channels_last", "sliced")


@dataclass(frozen=True)
class Pipeline:
    nd: int
    transposed: bool
    batch: int
    c_in: int
    c_out: int
    groups: int
    size: tuple[int, ...]
    kernel: int
    stride: int
    padding: int
    dilation: int
    output_padding: int
    bias: bool
    steps: tuple[tuple[str, str, float, bool], ...]
    """(name, spelling, a constant, whether its parameter requires grad)"""
    branch: str
    tail: str
    ceil_mode: bool
    layout: str
    conv_grad: bool

    def conv_output(self) -> list[int]:
        return [conv_output_length(s, self.kernel, self.stride, self.padding, self.dilation, self.transposed,
                                   self.output_padding) for s in self.size]


@st.composite
def pipelines(draw: Any) -> Pipeline:
    nd = draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 1, 2]))
    c_in = groups * draw(st.integers(1, 3))
    c_out = groups * draw(st.integers(1, 3))
    kernel = draw(st.integers(1, 3))
    stride = draw(st.integers(1, 2))
    dilation = draw(st.integers(1, 2))
    padding = draw(st.integers(0, (dilation * (kernel - 1)) // 2))
    output_padding = draw(st.integers(0, max(stride, dilation) - 1)) if transposed else 0
    size = tuple(draw(st.integers(3, {1: 10, 2: 7, 3: 4}[nd])) for _ in range(nd))
    steps = tuple(
        (name, draw(st.sampled_from(STEPS[name])), draw(st.sampled_from([0.5, -1.5, 2.0, 0.1])), draw(st.booleans()))
        for name in draw(st.lists(st.sampled_from(sorted(STEPS)), max_size=4))
    )
    spec = Pipeline(nd, transposed, draw(st.integers(1, 3)), c_in, c_out, groups, size, kernel, stride, padding,
                    dilation, output_padding, draw(st.booleans()), steps, draw(st.sampled_from(BRANCHES)),
                    draw(st.sampled_from(TAILS)), draw(st.booleans()),
                    draw(st.sampled_from(LAYOUTS if nd > 1 else ("contiguous", "sliced"))), draw(st.booleans()))
    out = spec.conv_output()
    assume(all(o >= 1 for o in out))
    if spec.tail in ("max_pool", "avg_pool"):
        assume(nd > 1 or spec.tail == "max_pool")  # avg_pool1d is not among the fused pools; keep it 2-d/3-d
        assume(all(o >= 2 for o in out))
    return spec


class FuzzModel(nn.Module):
    """The module a :class:`Pipeline` describes."""

    def __init__(self, spec: Pipeline) -> None:
        super().__init__()
        self.spec = spec
        conv_cls = {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (3, False): nn.Conv3d,
                    (1, True): nn.ConvTranspose1d, (2, True): nn.ConvTranspose2d, (3, True): nn.ConvTranspose3d}
        kwargs: dict[str, Any] = dict(stride=spec.stride, padding=spec.padding, dilation=spec.dilation,
                                      groups=spec.groups, bias=spec.bias)
        if spec.transposed:
            kwargs["output_padding"] = spec.output_padding
        self.conv = conv_cls[spec.nd, spec.transposed](spec.c_in, spec.c_out, spec.kernel, **kwargs)
        self.conv.requires_grad_(spec.conv_grad)
        shape = (spec.c_out,) + (1,) * spec.nd
        self.params = nn.ParameterList(
            nn.Parameter(torch.randn(shape) * 0.5 + (1.0 if name == "mul_param" else 0.0), requires_grad=grad)
            for name, _, _, grad in spec.steps if name.endswith("_param"))
        self.relu = nn.ReLU()
        self.leaky = nn.LeakyReLU(0.2)

    def forward(self, x: torch.Tensor) -> Any:
        spec = self.spec
        y0 = self.conv(x)
        y = y0
        params = iter(self.params)
        for name, how, c, _ in spec.steps:
            y = self._step(y, name, how, c, params)
        if spec.branch == "add_conv_output":
            y = y + y0
        y = self._tail(y)
        return (y, y0) if spec.branch == "return_conv_output" else y

    def _step(self, y: torch.Tensor, name: str, how: str, c: float, params: Any) -> torch.Tensor:
        if name == "relu":
            return {"F.relu": lambda: F.relu(y), "torch.relu": lambda: torch.relu(y), "method": lambda: y.relu(),
                    "module": lambda: self.relu(y), "inplace": lambda: F.relu(y, inplace=True)}[how]()
        if name == "leaky_relu":
            return F.leaky_relu(y, 0.2) if how == "F" else self.leaky(y)
        if name == "gelu":
            return F.gelu(y, approximate=how)
        if name in ("sigmoid", "tanh"):
            return getattr(torch, name)(y) if how == "torch" else getattr(y, name)()
        if name == "silu":
            return F.silu(y)
        if name == "hardtanh":
            return F.hardtanh(y, -abs(c), abs(c) + 0.5)
        if name == "clamp":
            return torch.clamp(y, min=-abs(c)) if how == "torch" else y.clamp(max=abs(c))
        if name == "mul_param":
            p = next(params)
            return {"operator": lambda: y * p, "torch.mul": lambda: torch.mul(y, p), "reversed": lambda: p * y}[how]()
        if name == "add_param":
            p = next(params)
            return y + p if how == "operator" else p + y
        if name == "mul_scalar":
            return {"operator": lambda: y * c, "reversed": lambda: c * y, "inplace": lambda: y.mul_(c)}[how]()
        if name == "add_scalar":
            return y + c if how == "operator" else c + y
        if name == "sub_scalar":
            return y - c if how == "operator" else c - y
        if name == "div_scalar":
            return y / c
        if name == "square":
            return y * y
        if name == "softmax_channels":
            return torch.softmax(y, 1)
        if name == "abs":
            return torch.abs(y)
        raise AssertionError(name)

    def _tail(self, y: torch.Tensor) -> torch.Tensor:
        spec, nd = self.spec, self.spec.nd
        if spec.tail == "max_pool":
            return getattr(F, f"max_pool{nd}d")(y, 2, 2, 0, 1, spec.ceil_mode)
        if spec.tail == "avg_pool":
            # NOTE: no ceil_mode here: Inductor's avg-pool backward divides a window that ceil_mode lets
            # overhang by the whole kernel (pytorch/pytorch#198119, torch 2.13 CPU: 0.34 max error on a
            # 3x5 input), and a pool left to Inductor inherits that.
            return getattr(F, f"avg_pool{nd}d")(y, 2, 2, 0, False)
        if spec.tail == "global_mean":
            return y.mean(tuple(range(2, 2 + nd)), keepdim=spec.ceil_mode)
        return y


def make_input(spec: Pipeline, device: str) -> torch.Tensor:
    """The conv's input in the spec's layout (a leaf that requires grad)."""
    shape = (spec.batch, spec.c_in, *spec.size)
    if spec.layout == "sliced":
        x = torch.randn(*shape[:-1], shape[-1] * 2 + 1, device=device)[..., 1::2]
        return x.detach().requires_grad_(True)
    x = torch.randn(shape, device=device)
    if spec.layout == "channels_last":
        x = x.to(memory_format=torch.channels_last if spec.nd == 2 else torch.channels_last_3d)
    return x.requires_grad_(True)


def check(spec: Pipeline, device: str, backend: str = "fusion") -> Optional[str]:
    """Compile the spec's model with ``backend`` and compare with eager: ``None`` when the output and
    every gradient match (within the project's yardstick) and nothing fell back (a fusion warning that
    a rewrite or a kernel failed), else what differs or fell back.  (``backend="inductor"``
    tells a failure of the fusion backend from one it inherits from the graph it hands to Inductor.)"""
    torch.manual_seed(0)
    model = FuzzModel(spec).to(device)
    x = make_input(spec, device)
    try:
        want, want_grads = run_and_backward(model, [x], True, model)
    except RuntimeError as e:
        if "modified by an inplace operation" not in str(e):
            raise
        reject()  # an in-place step overwrote a value eager's autograd saved: not a valid model
    ref, ref_grads = float64_reference(model, [x], True)
    for leaf in [x, *model.parameters()]:
        leaf.grad = None
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend=backend)
        got, got_grads = run_and_backward(compiled, [x], True, model)
    # A fallback keeps the result right but loses what the user asked for: a rewrite or a kernel that
    # failed is a problem too, not only a wrong number.
    problems = [f"fell back: {str(w.message).splitlines()[0]}" for w in caught
                if str(w.message).startswith("fusion") and " failed" in str(w.message)]
    outs = lambda v: list(v) if isinstance(v, tuple) else [v]  # noqa: E731
    for i, (g, w, r) in enumerate(zip(outs(got), outs(want), outs(ref), strict=True)):
        problem = compare(f"output[{i}]", g, w, reference=r)
        if problem:
            problems.append(problem)
    if set(got_grads) != set(want_grads):
        problems.append(f"gradients of {sorted(got_grads)} != eager's {sorted(want_grads)}")
    for name, w in want_grads.items():
        g, r = got_grads.get(name), ref_grads.get(name)
        if (g is None) != (w is None):
            problems.append(f"{name}: gradient {'missing' if g is None else 'unexpected'}")
        elif w is not None:
            problem = compare(name, g, w, reference=r)
            if problem:
                problems.append(problem)
    return "\n".join(problems) or None


def outcome(spec: Pipeline, device: str, backend: str = "fusion") -> Optional[str]:
    """:func:`check`, with an exception raised while compiling or running turned into its one-line
    description (so two backends' failures can be compared)."""
    try:
        return check(spec, device, backend)
    except UnsatisfiedAssumption:
        raise
    except Exception as e:  # noqa: BLE001 - any failure is an outcome to report
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
