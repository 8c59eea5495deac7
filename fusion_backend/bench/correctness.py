"""The correctness gate: a backend's output and gradients against eager's, before anything is timed.

Rule 1, against eager.  Per tensor, the norm-wise relative error ``||actual - eager||_2 / ||eager||_2``
must not exceed the precision's tolerance.  One number per tensor does not blow up on elements near
zero (as element-wise ``rtol`` does after a GELU or a cancelling sum) and still catches a uniform
offset or one wrong element in a small tensor.  A tensor whose reference norm is zero is compared by
its absolute error norm.

Rule 2, against the exact answer, consulted only for a tensor that fails rule 1 numerically.  Two
correct implementations can legitimately differ by more than the tolerance from *each other* while
being equally close to the exact result: in bf16, a 2x2x2 max-pool whose window holds two values
within one bf16 rounding of each other picks a different winner when the values are rounded in a
different order, and routes that gradient elsewhere (measured on ``convt3d_leaky_mul_leaky_maxpool``:
Inductor's input gradient is 2.6e-2 from eager's).  So, as Inductor's own accuracy checker does
(``torch._dynamo.utils.same`` with ``fp64_ref``), the model is run in float64 and the tensor passes
if its error from the float64 result is at most ``multiplier`` times eager's own error from it, plus
a tenth of the tolerance.  The float64 run is made lazily, only when some tensor needs it.

Beyond the numbers, a check fails on any structural difference: shape, dtype or output structure, a
gradient present on one side only, or non-finite values in other places than the reference.  Every
failure names the tensor (``output[0]``, ``grad inputs[0]``, ``grad param conv.weight``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class TensorCheck:
    """One compared tensor (rule 2: the float64 comparison, module docstring)."""

    name: str
    rel_err: float
    """The relative error against eager (``inf`` for a structural mismatch)."""
    problem: str = ""
    """Why the check failed; empty when it passed."""
    fp64_err: float | None = None
    """When rule 2 was consulted: this backend's relative error from the float64 result."""
    eager_fp64_err: float | None = None
    """When rule 2 was consulted: eager's relative error from the float64 result."""

    @property
    def ok(self) -> bool:
        """Whether the check passed (no ``problem``)."""
        return not self.problem

    def json_extras(self) -> dict[str, object]:
        """Derived values written to the JSON report next to the fields."""
        return {"ok": self.ok}


@dataclass(frozen=True)
class CheckResult:
    """All comparisons of one item against the reference; ``tolerance`` is rule 1's."""

    tolerance: float
    checks: tuple[TensorCheck, ...]

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def max_rel_err(self) -> float:
        """Largest finite relative error against eager among the checks (0.0 with no checks)."""
        errs = [c.rel_err for c in self.checks if math.isfinite(c.rel_err)]
        return max(errs, default=0.0)

    @property
    def failures(self) -> tuple[TensorCheck, ...]:
        return tuple(c for c in self.checks if not c.ok)

    @property
    def passed_by_fp64(self) -> tuple[str, ...]:
        """Names of tensors that failed rule 1 but passed rule 2."""
        return tuple(c.name for c in self.checks if c.ok and c.fp64_err is not None)

    def json_extras(self) -> dict[str, object]:
        """Derived values written to the JSON report next to the fields."""
        return {"ok": self.ok, "max_rel_err": self.max_rel_err, "passed_by_fp64": list(self.passed_by_fp64)}

    def summary(self) -> str:
        """``"ok (max rel err 3.1e-06)"`` or the failed tensors, e.g. ``"output[0]: rel err 1.0e-02 > 1.0e-04"``."""
        if self.ok:
            extra = f"; {len(self.passed_by_fp64)} tensor(s) passed against float64" if self.passed_by_fp64 else ""
            return f"ok (max rel err {self.max_rel_err:.1e}{extra})"
        parts = [f"{c.name}: {c.problem}" for c in self.failures]
        shown = "; ".join(parts[:3])
        more = f"; and {len(parts) - 3} more" if len(parts) > 3 else ""
        return shown + more


@dataclass(frozen=True)
class Fp64Reference:
    """The float64 result of a step and eager's distance from it, for rule 2.

    ``tensors`` maps check names (see :func:`named_results`) to float64 tensors; ``eager_errors`` the
    same names to eager's relative error from them.  ``error`` is set instead when the float64 run
    failed (e.g. a model that builds fp32 tensors inside its forward), so rule 2 cannot rescue anything.
    """

    tensors: Mapping[str, Any]
    eager_errors: Mapping[str, float]
    multiplier: float
    error: str = ""


def named_results(outputs: Any, grads: Mapping[str, torch.Tensor | None] | None = None) -> dict[str, Any]:
    """Name every leaf of a step's result: ``output[i]`` for output leaves, ``grad NAME`` for gradients."""
    named: dict[str, Any] = {f"output[{i}]": leaf for i, leaf in enumerate(pytree.tree_leaves(outputs))}
    for name, grad in (grads or {}).items():
        named[f"grad {name}"] = grad
    return named


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 over finite positions (absolute if the norm is 0)."""
    a = actual.detach().to(device=expected.device, dtype=torch.float64)
    e = expected.detach().to(dtype=torch.float64)
    finite = torch.isfinite(a) & torch.isfinite(e)
    diff = torch.linalg.vector_norm(torch.where(finite, a - e, 0.0)).item()
    ref = torch.linalg.vector_norm(torch.where(finite, e, 0.0)).item()
    return diff / ref if ref > 0 else diff


def compare_tensor(name: str, actual: torch.Tensor | None, expected: torch.Tensor | None,
                   tolerance: float) -> TensorCheck:
    """Rule 1 for one tensor, plus the structural checks (see the module docstring)."""
    if expected is None and actual is None:
        return TensorCheck(name, 0.0)
    if expected is None or actual is None:
        side = "backend" if actual is None else "reference"
        return TensorCheck(name, math.inf, f"missing on the {side} side")
    if actual.shape != expected.shape:
        return TensorCheck(name, math.inf, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    if actual.dtype != expected.dtype:
        return TensorCheck(name, math.inf, f"dtype {actual.dtype} != {expected.dtype}")
    a = actual.detach().to(device=expected.device)
    e = expected.detach()
    a_fin, e_fin = torch.isfinite(a), torch.isfinite(e)
    if not torch.equal(a_fin, e_fin):
        count = int((a_fin != e_fin).sum())
        return TensorCheck(name, math.inf, f"non-finite values differ from the reference at {count} "
                           "element(s)")
    if not bool(a_fin.all()):
        a_nan, e_nan = torch.isnan(a), torch.isnan(e)
        if not torch.equal(a_nan, e_nan) or not torch.equal(a[~a_fin & ~a_nan], e[~e_fin & ~e_nan]):
            return TensorCheck(name, math.inf, "inf/nan values differ from the reference")
    rel = relative_error(a, e)
    if math.isnan(rel) or rel > tolerance:
        return TensorCheck(name, rel, f"rel err {rel:.1e} > {tolerance:.1e}")
    return TensorCheck(name, rel)


def _compare_leaf(name: str, actual: Any, expected: Any, tolerance: float) -> TensorCheck:
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        if not (isinstance(actual, torch.Tensor) or actual is None) or not (
                isinstance(expected, torch.Tensor) or expected is None):
            return TensorCheck(name, math.inf, "tensor on one side only")
        return compare_tensor(name, actual, expected, tolerance)
    if actual is None and expected is None:
        return TensorCheck(name, 0.0)
    if actual != expected:
        return TensorCheck(name, math.inf, f"{actual!r} != reference {expected!r}")
    return TensorCheck(name, 0.0)


def _rescue(check: TensorCheck, actual: torch.Tensor, fp64: Fp64Reference, tolerance: float) -> TensorCheck:
    """Rule 2 for a tensor that failed rule 1 numerically."""
    if fp64.error:
        return TensorCheck(check.name, check.rel_err,
                           f"{check.problem} (float64 check unavailable: {fp64.error})")
    exact = fp64.tensors.get(check.name)
    eager_err = fp64.eager_errors.get(check.name)
    if not isinstance(exact, torch.Tensor) or eager_err is None:
        return check
    err = relative_error(actual, exact)
    bound = fp64.multiplier * eager_err + tolerance / 10
    if err <= bound:
        return TensorCheck(check.name, check.rel_err, "", err, eager_err)
    return TensorCheck(check.name, check.rel_err,
                       f"{check.problem}, and vs float64 {err:.1e} > {fp64.multiplier:g} x eager's "
                       f"{eager_err:.1e} + {tolerance / 10:.0e}", err, eager_err)


def check_against_reference(actual_out: Any, expected_out: Any, tolerance: float, *,
                            actual_grads: Mapping[str, torch.Tensor | None] | None = None,
                            expected_grads: Mapping[str, torch.Tensor | None] | None = None,
                            fp64: Callable[[], Fp64Reference] | None = None) -> CheckResult:
    """The full gate: rule 1 on outputs and every gradient named on either side, then rule 2 (via the
    lazily called ``fp64``) on tensors that failed rule 1 numerically."""
    a_leaves, a_spec = pytree.tree_flatten(actual_out)
    e_leaves, e_spec = pytree.tree_flatten(expected_out)
    if a_spec != e_spec:
        return CheckResult(tolerance, (TensorCheck("output", math.inf,
                                                   f"structure {a_spec} != reference {e_spec}"),))
    actual = named_results(actual_out, actual_grads)
    expected = named_results(expected_out, expected_grads)
    names = list(dict.fromkeys([*expected, *actual]))
    checks = [_compare_leaf(n, actual.get(n), expected.get(n), tolerance) for n in names]
    numeric_failures = [i for i, c in enumerate(checks) if not c.ok and math.isfinite(c.rel_err)]
    if numeric_failures and fp64 is not None:
        reference = fp64()
        for i in numeric_failures:
            checks[i] = _rescue(checks[i], actual[checks[i].name], reference, tolerance)
    return CheckResult(tolerance=tolerance, checks=tuple(checks))


def fp64_reference(outputs64: Any, grads64: Mapping[str, torch.Tensor | None], eager_out: Any,
                   eager_grads: Mapping[str, torch.Tensor | None], multiplier: float) -> Fp64Reference:
    """Assemble rule 2's reference from a float64 run and eager's run of the same step."""
    exact = named_results(outputs64, grads64)
    eager = named_results(eager_out, eager_grads)
    errors = {}
    for name, value in exact.items():
        mine = eager.get(name)
        if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor) and value.shape == mine.shape:
            errors[name] = relative_error(mine, value)
    return Fp64Reference(tensors=exact, eager_errors=errors, multiplier=multiplier)
