"""The physical floor of a workload: the fewest bytes it must move and flops it must do, at measured rates.

Why a floor: a speedup over eager says nothing about how much is left.  The floor says how fast the
workload *could* run on this device, so "3.2x over the floor" tells a reader how much room remains.

Bytes (:func:`count_traffic`), counted from the actual tensors of the reference run:

- infer: every tensor input and every parameter read once, every output written once;
- train: the infer bytes, plus the upstream gradient of every output read, every input and parameter
  re-read by the backward, and the gradient of every input and parameter written once.

Anything else (intermediates, saved activations) is the implementation's choice, not the workload's
need.  Flops (:func:`count_flops`) are counted by ``torch.utils.flop_counter.FlopCounterMode`` during
the reference run: convolutions (transposed too) and matmuls, forward and backward; pointwise ops and
reductions count as zero, which is what their cost is next to the bytes they move.

The floor is the roofline's ``max(bytes / copy bandwidth, flops / matmul rate)`` with rates measured
on the device in the same run (:func:`fusion_backend.bench.measure.measure_device_rates`); the matmul
rate is the one of the unit the convolutions use: bf16 under bf16 autocast, TF32 for fp32 when cuDNN
may use TF32 (PyTorch's default), strict fp32 otherwise.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode


@dataclass(frozen=True)
class DeviceRates:
    """Measured device rates: copy bandwidth (bytes read + written per second) and matmul flop/s by unit.

    ``matmul_flops`` keys are ``"bf16"``, ``"tf32"`` and ``"fp32"`` (strict IEEE fp32).
    """

    copy_bytes_per_s: float
    matmul_flops: dict[str, float]
    copy_bytes: int = 0
    matmul_n: int = 0


@dataclass(frozen=True)
class Traffic:
    """The minimal bytes of one workload x dtype x mode, by term (see the module docstring)."""

    inputs_read: int
    params_read: int
    outputs_written: int
    grad_outputs_read: int = 0
    inputs_reread: int = 0
    params_reread: int = 0
    grads_written: int = 0

    @property
    def total(self) -> int:
        return (self.inputs_read + self.params_read + self.outputs_written + self.grad_outputs_read
                + self.inputs_reread + self.params_reread + self.grads_written)

    def json_extras(self) -> dict[str, int]:
        """Derived values written to the JSON report next to the fields."""
        return {"total": self.total}


@dataclass(frozen=True)
class Roofline:
    """The floor of one workload x dtype x mode.

    ``floor_ms = max(memory_ms, compute_ms)``; ``bound`` says which term wins.  ``compute_unit`` is the
    key of :attr:`DeviceRates.matmul_flops` used.
    """

    traffic: Traffic
    flops: int
    compute_unit: str
    bytes_per_s: float
    flops_per_s: float
    memory_ms: float
    compute_ms: float
    floor_ms: float
    bound: str

    def multiple(self, time_ms: float | None) -> float | None:
        """``time_ms`` as a multiple of the floor (``None`` if either is missing or zero)."""
        if time_ms is None or self.floor_ms <= 0:
            return None
        return time_ms / self.floor_ms


def _nbytes(tensors: Iterable[Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def count_traffic(inputs: Iterable[Any], params: Iterable[torch.Tensor], outputs: Iterable[Any], *,
                  grad_outputs: Iterable[torch.Tensor] = (),
                  grads: Iterable[torch.Tensor | None] = ()) -> Traffic:
    """Minimal bytes of a step, from the reference run's tensors.

    ``inputs`` are the forward's arguments (non-tensors ignored), ``params`` the module's parameters,
    ``outputs`` the forward's outputs (non-tensors ignored).  A training step passes the upstream
    gradients it fed to backward (``grad_outputs``) and the gradients it produced (``grads``, of inputs
    and parameters; ``None`` entries ignored); with neither, the step is inference.  In training, the
    inputs and parameters that require grad are counted as re-read by the backward.
    """
    inputs = [t for t in inputs if isinstance(t, torch.Tensor)]
    params = list(params)
    grad_outputs = list(grad_outputs)
    grads = [g for g in grads if g is not None]
    base = Traffic(inputs_read=_nbytes(inputs), params_read=_nbytes(params), outputs_written=_nbytes(outputs))
    if not grad_outputs and not grads:
        return base
    return dataclasses.replace(
        base,
        grad_outputs_read=_nbytes(grad_outputs),
        inputs_reread=_nbytes(t for t in inputs if t.requires_grad),
        params_reread=_nbytes(p for p in params if p.requires_grad),
        grads_written=_nbytes(grads),
    )


class FlopCount:
    """Context manager counting flops of everything run inside it (``FlopCounterMode`` without the printout).

    >>> conv = torch.nn.Conv2d(2, 3, 3)
    >>> with FlopCount() as fc:
    ...     _ = conv(torch.randn(1, 2, 5, 5))
    >>> fc.total == 2 * 1 * 3 * 3 * 3 * 2 * 3 * 3   # 2 * N * Cout * Hout * Wout * Cin * kh * kw
    True
    """

    def __init__(self) -> None:
        self._mode = FlopCounterMode(display=False)
        self.total = 0

    def __enter__(self) -> FlopCount:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self.total = int(self._mode.get_total_flops())


def count_flops(step: Callable[[], object]) -> int:
    """Flops of one call of ``step`` (convolutions and matmuls, forward and backward)."""
    with FlopCount() as fc:
        step()
    return fc.total


def compute_unit(precision: str, conv_tf32: bool) -> str:
    """The matmul unit whose rate bounds compute for ``precision`` (``"fp32"``/``"bf16"``).

    fp32 convolutions run on TF32 tensor cores when cuDNN is allowed TF32 (``conv_tf32``), which is
    PyTorch's default; otherwise on the strict fp32 units, an order of magnitude slower.
    """
    if precision == "bf16":
        return "bf16"
    if precision == "fp32":
        return "tf32" if conv_tf32 else "fp32"
    raise ValueError(f"no compute unit known for precision {precision!r}")


def roofline(traffic: Traffic, flops: int, rates: DeviceRates, unit: str) -> Roofline:
    """The floor of a workload whose step moves ``traffic`` and does ``flops`` on unit ``unit``."""
    bw = rates.copy_bytes_per_s
    rate = rates.matmul_flops[unit]
    memory_ms = traffic.total / bw * 1e3
    compute_ms = flops / rate * 1e3
    floor_ms = max(memory_ms, compute_ms)
    return Roofline(
        traffic=traffic, flops=flops, compute_unit=unit, bytes_per_s=bw, flops_per_s=rate,
        memory_ms=memory_ms, compute_ms=compute_ms, floor_ms=floor_ms,
        bound="memory" if memory_ms >= compute_ms else "compute",
    )


def describe_rates(rates: DeviceRates) -> str:
    """One line such as ``copy 2.95 TB/s, matmul bf16 760 / tf32 380 / fp32 51 TFLOP/s``."""
    units = " / ".join(f"{k} {v / 1e12:.0f}" for k, v in rates.matmul_flops.items())
    return f"copy {rates.copy_bytes_per_s / 1e12:.2f} TB/s, matmul {units} TFLOP/s"
