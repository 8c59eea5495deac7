"""The distinct convolutions of benchmark model files, as the conv family's benchmark times them.

A model file (the benchmark layout: ``Model``, ``get_inputs``, ``get_init_inputs``) is built as the
benchmark builds it (``fusion_backend.bench.suite.load_workload(path).build(seed=0)``) and run forward
once with a forward pre-hook on every ``nn.Conv1d/2d/3d`` and ``nn.ConvTranspose1d/2d/3d``.  Each conv
module's call gives one :class:`ConvShape` (input and weight shapes, stride, padding, dilation, groups,
bias), the key that decides whether two convs are the same problem for a kernel; the same shape met in
several models (or several times in one) is one entry that lists them all.

Why a pre-hook on modules, not a trace: the hook sees the exact input the conv gets at the model's
benchmark batch size, for any model code (torchvision, diffusers), without Dynamo.  What it misses: a
conv called functionally (``F.conv2d`` in a model's ``forward``) is not a module and is not seen.

Why the ``meta`` device first: the shapes are all that is needed, and ResNet-50 at batch 64 or the SD VAE
decoder at 512x512 cost seconds to minutes of CPU in a real forward.  On ``meta`` the build and the
forward allocate nothing.  A model whose forward needs real values (an op without a meta kernel, a
``.item()``) is built again on ``fallback_device`` and run for real.

Transposed convs are collected in their own list (:attr:`Collection.transposed`): the family runs them
as a dgrad, which the benchmark does not time as such yet.  A model whose library is missing (the
file's ``REQUIRES``, or the ``ImportError`` its build raises) is skipped with a one-line reason.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fusion_backend.bench.suite import SuiteError, Workload, import_skip_reason, load_workload

_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


@dataclass(frozen=True)
class ConvShape:
    """One convolution problem: ``x`` (N, C_in, *spatial) and ``weight`` (C_out, C_in/groups, *k), one
    stride / padding / dilation per spatial dim (symmetric zero padding, as ``aten.convolution``
    takes it), ``groups``, and whether it has a bias."""

    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    bias: bool

    @property
    def dims(self) -> int:
        return len(self.x_shape) - 2

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The output's shape, as ``F.conv{1,2,3}d`` gives it."""
        size = tuple((i + 2 * p - d * (k - 1) - 1) // s + 1 for i, k, s, p, d in
                     zip(self.x_shape[2:], self.w_shape[2:], self.stride, self.padding, self.dilation, strict=True))  # fmt: skip
        return (self.x_shape[0], self.w_shape[0], *size)

    @property
    def macs(self) -> int:
        """Multiply-adds of the forward (as many for dgrad and wgrad)."""
        return math.prod(self.out_shape) * math.prod(self.w_shape[1:])

    def label(self) -> str:
        """``conv2d 64x256x56x56 -> 64 k1x1 s1 p0 g1 +bias``: short, readable, unique per shape."""
        dims = "x".join(map(str, self.w_shape[2:]))
        parts = [f"conv{self.dims}d", "x".join(map(str, self.x_shape)), f"-> {self.w_shape[0]}", f"k{dims}"]
        for name, values, default in (("s", self.stride, 1), ("p", self.padding, None), ("d", self.dilation, 1)):
            if default is None or any(v != default for v in values):
                parts.append(name + ("x".join(map(str, values)) if len(set(values)) > 1 else str(values[0])))
        parts.append(f"g{self.groups}")
        if self.bias:
            parts.append("+bias")
        return " ".join(parts)

    def params(self) -> dict[str, Any]:
        """The shape's parameters as JSON values."""
        return {"x": list(self.x_shape), "weight": list(self.w_shape), "out": list(self.out_shape),
                "stride": list(self.stride), "padding": list(self.padding), "dilation": list(self.dilation),
                "groups": self.groups, "bias": self.bias}  # fmt: skip


@dataclass
class Collection:
    """What :func:`collect` found: ``shapes`` maps each distinct conv to the models it occurs in (one
    entry per occurrence, so a count is ``len``); ``transposed`` lists ``(model, description)`` of the
    transposed convs (left out of the family's rows); ``skipped`` lists ``(model, reason)``;
    ``notes`` lists ``(model, note)`` (a conv left out, a fallback taken)."""

    shapes: dict[ConvShape, list[str]] = field(default_factory=dict)
    transposed: list[tuple[str, str]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)

    def models_of(self, shape: ConvShape) -> list[str]:
        """The distinct models ``shape`` occurs in, in order of appearance."""
        return list(dict.fromkeys(self.shapes[shape]))


def _explicit_padding(module: nn.modules.conv._ConvNd, x_spatial: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | str:
    """``(padding per dim, the spatial sizes the conv kernel sees)`` of a conv module for an input of
    ``x_spatial``, or why it has no symmetric zero-padding form (a string).

    ``padding="same"`` is symmetric when every ``dilation * (k - 1)`` is even; a ``padding_mode`` other
    than ``"zeros"`` pads ``x`` before an unpadded conv (``nn.Conv*d._conv_forward``), so the kernel sees
    the padded size and no padding."""
    k, d = module.kernel_size, module.dilation
    if isinstance(module.padding, str):
        if module.padding == "valid":
            return (0,) * len(k), tuple(x_spatial)
        totals = [di * (ki - 1) for ki, di in zip(k, d, strict=True)]
        if any(t % 2 for t in totals):
            return "asymmetric padding='same'"
        padding = tuple(t // 2 for t in totals)
    else:
        padding = tuple(module.padding)
    if module.padding_mode != "zeros":
        return (0,) * len(k), tuple(s + 2 * p for s, p in zip(x_spatial, padding, strict=True))
    return padding, tuple(x_spatial)


def shape_of_call(module: nn.Module, x: torch.Tensor) -> ConvShape | str:
    """The :class:`ConvShape` of ``module`` (an ``nn.Conv1d/2d/3d``) called on ``x``, or why it has
    none (a string)."""
    if x.dim() != module.weight.dim():  # an unbatched call: the conv sees a batch of one
        x = x.unsqueeze(0)
    explicit = _explicit_padding(module, x.shape[2:])
    if isinstance(explicit, str):
        return explicit
    padding, spatial = explicit
    return ConvShape(x_shape=(x.shape[0], x.shape[1], *spatial), w_shape=tuple(module.weight.shape),
                     stride=tuple(module.stride), padding=padding, dilation=tuple(module.dilation),
                     groups=module.groups, bias=module.bias is not None)  # fmt: skip


def _describe_transposed(module: nn.Module, x: torch.Tensor) -> str:
    return (f"{type(module).__name__} x{tuple(x.shape)} w{tuple(module.weight.shape)} s{tuple(module.stride)} "
            f"p{tuple(module.padding)} op{tuple(module.output_padding)} g{module.groups}")  # fmt: skip


def convs_of(model: nn.Module, inputs: Sequence[Any]) -> tuple[list[ConvShape | str], list[str]]:
    """Run ``model(*inputs)`` once (no grad) with a pre-hook on every conv module: per conv call its
    :class:`ConvShape` (or the reason it has none), and a description of every transposed conv call.
    Raises what the forward raises."""
    found: list[ConvShape | str] = []
    transposed: list[str] = []

    def hook(module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0]
        if isinstance(module, _TRANSPOSED):
            transposed.append(_describe_transposed(module, x))
        else:
            found.append(shape_of_call(module, x))

    handles = [m.register_forward_pre_hook(hook) for m in model.modules() if isinstance(m, _CONVS + _TRANSPOSED)]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for h in handles:
            h.remove()
    return found, transposed


def _run_on(workload: Workload, device: torch.device) -> tuple[list[ConvShape | str], list[str]]:
    """Build the workload's model and inputs (seed 0) with ``device`` the default device and run its
    forward in eval mode."""
    with torch.device(device):
        model, inputs = workload.build(seed=0)
        model = model.to(device).eval()
        inputs = [t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs]
        return convs_of(model, inputs)


def collect(paths: Iterable[str | Path], fallback_device: str | torch.device = "cpu") -> Collection:
    """The distinct convs of the model files ``paths`` (module docstring), in order of first
    appearance.  A file that cannot be loaded raises ``SuiteError``; one whose library is missing is
    skipped (:attr:`Collection.skipped`); one whose forward fails on ``meta`` and on ``fallback_device``
    too is skipped with the error."""
    result = Collection()
    for path in map(Path, paths):
        workload = load_workload(path)
        name = workload.name
        missing = workload.missing()
        if missing:
            result.skipped.append((name, f"needs {' and '.join(missing)}, not installed"))
            continue
        try:
            try:
                found, transposed = _run_on(workload, torch.device("meta"))
            except ImportError:
                raise
            except Exception as exc:  # an op without a meta kernel, a value read: run it for real
                result.notes.append((name, f"meta forward failed ({type(exc).__name__}); ran on {fallback_device}"))
                found, transposed = _run_on(workload, torch.device(fallback_device))
        except ImportError as exc:
            result.skipped.append((name, import_skip_reason(exc)))
            continue
        except SuiteError:
            raise
        except Exception as exc:
            result.skipped.append((name, f"forward failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
            continue
        for shape in found:
            if isinstance(shape, str):
                result.notes.append((name, f"a conv left out: {shape}"))
            else:
                result.shapes.setdefault(shape, []).append(name)
        result.transposed.extend((name, t) for t in transposed)
    return result
