"""Test helpers for pattern authors (also used by this project's own tests).

* ``assert_fused(model, inputs, expect={"conv_epilogue": 1}, train=True)`` compiles with ``fusion``
  (strict), asserts the exact rewrite counts, and compares the output and every gradient (inputs and
  parameters) with eager and with a float64 reference under per-dtype tolerances (see ``compare``).  On failure the message holds the report (what
  matched, what was rejected and why), the largest mismatches with their indices and the reference used:
  a model that cannot run in float64 (its own casts to float32 meet float64 parameters) is compared
  with eager alone (``reference_run``).
* ``assert_not_fused(model, inputs, pattern, reason=...)`` for negative tests.
* ``dry_run(model, inputs)`` runs only the find phase (no rewrite, no fused op) and returns what
  would be fused and the near misses.
* ``FusionRewrites``: the ``fusion_rewrites`` fixture's list of reports, with totals over them.
* Every pattern name these take is checked against the registered families (``UnknownPatternError``,
  naming the closest one): a misspelled name would otherwise make a negative test pass.
* ``forget_call_plans()`` makes the next call of every fused op plan, compile and measure again, as a
  first call does (a test of first-call behaviour, or one that changes an environment switch).
"""

from __future__ import annotations

import contextlib
import copy
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .report import GraphReport, NearMiss, ReasonKind, collect_reports

#: Norm-wise relative tolerance ``||got - want|| / ||want||`` per dtype of the compared tensors.
TOLERANCES = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}


class Autocast(torch.nn.Module):
    """``inner`` run under ``torch.autocast(device_type, dtype)``, so ``assert_fused`` can test a
    model the way mixed-precision training runs it (the autocast region is part of the graph)."""

    def __init__(self, inner: torch.nn.Module, device_type: str, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.inner, self.device_type, self.dtype = inner, device_type, dtype

    def forward(self, *args: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.inner(*args)


def _check_patterns(names: Any, what: str) -> None:
    from .match.engine import registered_patterns
    from .options import check_pattern_names

    check_pattern_names(tuple(names), tuple(registered_patterns()), what)


class FusionRewrites(list):
    """Every ``GraphReport`` produced while a test runs (the ``fusion_rewrites`` fixture's value), in
    order; a graph whose decision was deferred appears again when it settles."""

    def counts(self) -> dict[str, int]:
        """Fused regions per pattern in the latest report of each graph (a settled graph's report
        replaces its first one)."""
        latest = {r.graph_name: r for r in self}
        out: dict[str, int] = {}
        for r in latest.values():
            for k, v in r.counts().items():
                out[k] = out.get(k, 0) + v
        return out

    def fused(self, pattern: str) -> int:
        """How many regions of ``pattern`` were fused (see ``counts``); an unknown name raises."""
        _check_patterns([pattern], "pattern")
        return self.counts().get(pattern, 0)


@dataclass(frozen=True)
class DryRun:
    regions: tuple[tuple[str, str, tuple[str, ...]], ...]
    """(pattern, summary, node names) of every region that would be fused."""
    near_misses: tuple[NearMiss, ...]

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pattern, _, _ in self.regions:
            out[pattern] = out.get(pattern, 0) + 1
        return out


def forget_call_plans() -> None:
    """Make the next call of every fused op signature plan, compile and measure again, as a first call
    does (``kernels.host.forget_call_plans``)."""
    from .kernels.host import forget_call_plans as forget

    forget()


def dry_run(model: Any, inputs: Sequence[Any], patterns: Optional[Sequence[str]] = None, **compile_kwargs: Any) -> DryRun:
    """What ``fusion`` would fuse in ``model(*inputs)``, without rewriting or running fused ops:
    ``patterns`` the families to run (default: those the backend runs by default,
    ``match.engine.default_patterns``)."""
    from .match.engine import default_patterns, find_regions

    if patterns is not None:
        _check_patterns([patterns] if isinstance(patterns, str) else patterns, "pattern")
        patterns = [patterns] if isinstance(patterns, str) else patterns
    enabled = tuple(patterns) if patterns is not None else default_patterns()
    regions: list[tuple[str, str, tuple[str, ...]]] = []
    misses: list[NearMiss] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        found = find_regions(gm, enabled)
        regions.extend((p.name, c.summary, tuple(n.name for n in c.nodes)) for p, c in found.accepted)
        misses.extend(found.near_misses)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, **compile_kwargs)(*inputs)
    return DryRun(tuple(regions), tuple(misses))


def _leaves(model: Any, inputs: Sequence[Any]) -> list[tuple[str, torch.Tensor]]:
    named = [(f"input[{i}]", t) for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    if isinstance(model, torch.nn.Module):
        named += [(f"param {n}", p) for n, p in model.named_parameters() if p.requires_grad]
    return named


def run_and_backward(
    fn: Any, inputs: Sequence[Any], train: bool, model: Any, autocast: Any = None
) -> tuple[Any, dict[str, Optional[torch.Tensor]]]:
    """Run ``fn(*inputs)`` (inside ``autocast`` if given) and, with ``train``, backward with a fixed
    random output gradient (seeded, so every run of the same shapes uses the same one: not all ones,
    which would hide errors that cancel).  Returns the output and the gradients of the inputs that
    require grad (``"input[i]"``) and of ``model``'s parameters (``"param NAME"``); ``fn`` may be
    ``model``'s compiled wrapper, whose parameter names differ."""
    with autocast if autocast is not None else contextlib.nullcontext():
        out = fn(*inputs)
    grads: dict[str, Optional[torch.Tensor]] = {}
    if train:
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor) and o.requires_grad]
        gen = torch.Generator().manual_seed(1234)
        grad_outs = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o) for o in outs]
        torch.autograd.backward(outs, grad_outs)
        for name, leaf in _leaves(model, inputs):
            grads[name] = None if leaf.grad is None else leaf.grad.detach().clone()
    return out, grads


def run_settled(fn: Any, inputs: Sequence[Any], train: bool, model: Any, autocast: Any = None
                ) -> tuple[Any, dict[str, Optional[torch.Tensor]], list[GraphReport]]:
    """``run_and_backward`` of a model compiled with ``backend="fusion"``, on the code it settles on:
    where the first call left decisions pending (the option ``defer``), they are settled
    (``fusion_backend.settle``), ``model``'s gradients cleared and the step run again.  Returns the
    output, the gradients and the reports that stand (``runtime.deferred.settled_reports``)."""
    from .runtime.deferred import any_pending, settled_reports

    with collect_reports() as first:
        out, grads = run_and_backward(fn, inputs, train, model, autocast)
    if not any_pending(first):
        return out, grads, list(first)
    reports = settled_reports(first)
    if isinstance(model, torch.nn.Module):
        model.zero_grad(set_to_none=True)
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.grad = None
    out, grads = run_and_backward(fn, inputs, train, model, autocast)
    return out, grads, reports


def stable_seed(key: Any) -> int:
    """A seed for the random inputs of a test case named by ``key``, the same in every process: the
    CRC-32 of ``repr(key)``.  WHY: ``hash`` of a string (or of a dataclass holding one) is salted per
    process, so a case seeded by it drew other inputs in every run and a failing draw could not be
    run again."""
    return zlib.crc32(repr(key).encode())


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in float64; NaNs and equal infinities ignored (``compare`` checks
    their positions first)."""
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    mask = torch.isnan(g) | torch.isnan(w) | (torch.isinf(w) & (g == w))
    g, w = g.masked_fill(mask, 0), w.masked_fill(mask, 0)
    return (g - w).norm().item() / max(w.norm().item(), 1e-30)


def compare(
    name: str,
    got: torch.Tensor,
    want: torch.Tensor,
    tol: Optional[float] = None,
    reference: Optional[torch.Tensor] = None,
) -> Optional[str]:
    """``None`` if ``got`` matches eager's ``want``, else a sentence with the error and the five
    largest mismatches with their indices.

    Shape, dtype, NaN positions and infinities (positions and signs) must equal eager's.  Without ``reference`` the norm-wise relative
    error of ``got`` vs ``want`` must be at most ``tol`` (default: ``TOLERANCES[want.dtype]``).  With a
    float64 ``reference`` (the same computation in float64), ``got`` is measured against it and may be
    off by ``max(tol, 2 * eager's own error)``: a reduction summed in another order than eager's can
    be closer to the truth than eager and still differ from eager by more than ``tol``.  Against a
    truth that is zero everywhere (a model whose terms cancel exactly, e.g. ``(c - y) + y``, has a
    zero input gradient) a relative error means nothing: there ``got``'s largest magnitude must be at
    most ``tol`` (in fp32 the cancelled terms leave rounding residue around 1e-9, not 0).  The same
    holds where the float64 truth is itself only residue (around 1e-16) and eager has no correct
    digit of it (its error relative to the truth above 1; e.g. the conv bias's gradient through a
    normalization without affine, mathematically zero): there the bound is ``max(tol, 2 * eager's
    largest magnitude)``.
    """
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != eager's {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype} != eager's {want.dtype}"
    tol = TOLERANCES.get(want.dtype, 1e-5) if tol is None else tol
    nan_g, nan_w = torch.isnan(got.detach().cpu()), torch.isnan(want.detach().cpu())
    if not torch.equal(nan_g, nan_w):
        idx = torch.nonzero(nan_g != nan_w)[:5].tolist()
        return f"{name}: NaN positions differ from eager at {idx}"
    inf_g, inf_w = got.detach().cpu().isinf(), want.detach().cpu().isinf()
    if not (torch.equal(inf_g, inf_w) and torch.equal(got.detach().cpu()[inf_g], want.detach().cpu()[inf_w])):
        idx = torch.nonzero((inf_g != inf_w) | (inf_g & (got.detach().cpu() != want.detach().cpu())))[:5].tolist()
        return f"{name}: infinities differ from eager's at {idx}"
    truth = want if reference is None else reference
    finite = got.detach().isfinite() & truth.detach().isfinite()
    eager_err = None if reference is None else relative_error(want, reference)
    cancelled = eager_err is not None and eager_err > 1  # eager has no correct digit: residue
    if finite.any() and (cancelled or not truth.detach()[finite].any()):  # a zero truth: absolute
        largest = got.detach()[finite].abs().max().item()
        bound = max(tol, 2 * want.detach()[finite].abs().max().item()) if cancelled else tol
        if largest <= bound:
            return None
        return f"{name}: largest magnitude {largest:.3g} where the truth is zero everywhere > {bound:.3g}"
    err = relative_error(got, truth)
    bound = tol if eager_err is None else max(tol, 2 * eager_err)
    if err <= bound:
        return None
    g, w = got.detach().double().cpu(), truth.detach().double().cpu()
    skip = g.isnan() | w.isnan() | (w.isinf() & (g == w))
    g, w = g.masked_fill(skip, 0), w.masked_fill(skip, 0)
    diff = (g - w).abs().flatten()
    worst = torch.topk(diff, min(5, diff.numel())).indices
    rows = []
    for flat in worst.tolist():
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        rows.append(f"    at {index}: got {g.flatten()[flat].item():.6g}, {'eager' if reference is None else 'fp64'} {w.flatten()[flat].item():.6g}")
    against = "eager" if reference is None else "the float64 reference"
    return f"{name}: relative error {err:.3g} vs {against} > {bound:.3g}; largest mismatches:\n" + "\n".join(rows)


def float64_reference(model: Any, inputs: Sequence[Any], train: bool) -> tuple[Any, dict[str, Optional[torch.Tensor]]]:
    """Output and gradients of ``model`` run in float64 (no autocast): a copy of ``model`` with its
    floating parameters and buffers promoted to float64, on float64 copies of the floating inputs;
    other inputs (integer images, indices, masks) are passed as they are, so the model's own casts
    (``x.float()`` of a uint8 input) run as written.  Raises whatever the model raises in float64."""
    ref_model = copy.deepcopy(model).double() if isinstance(model, torch.nn.Module) else model
    ref_inputs = [t.detach().double().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) and t.is_floating_point()
                  else t for t in inputs]
    with torch.autocast("cuda", enabled=False), torch.autocast("cpu", enabled=False):
        return run_and_backward(ref_model, ref_inputs, train, ref_model)


@dataclass(frozen=True)
class Reference:
    """What a parity check measures the compiled result against: the float64 run's output and
    gradients (``output``, ``grads``), or, where the model cannot run in float64, eager alone
    (``output`` ``None``, ``grads`` empty, ``why`` the float64 run's error in one line)."""

    output: Any
    grads: dict[str, Optional[torch.Tensor]]
    why: Optional[str] = None

    @property
    def is_float64(self) -> bool:
        return self.why is None

    def outputs(self, count: int) -> list[Any]:
        """``count`` per-output references (``None`` each where eager is the reference)."""
        if not self.is_float64:
            return [None] * count
        return list(self.output) if isinstance(self.output, (tuple, list)) else [self.output]

    def describe(self) -> str:
        if self.is_float64:
            return "float64 (parameters, buffers and floating inputs promoted to float64)"
        return f"eager (the model does not run in float64: {self.why})"


def reference_run(model: Any, inputs: Sequence[Any], train: bool) -> Reference:
    """``float64_reference`` where the model runs in float64; else (its own casts to float32 meet
    float64 parameters, or it refuses float64) a ``Reference`` that says eager is the reference, with
    the reason: the model's float64 failure is never raised from here."""
    try:
        output, grads = float64_reference(model, inputs, train)
    except Exception as exc:  # noqa: BLE001 - whatever the model raises in float64 means: compare with eager
        text = str(exc).strip()
        return Reference(None, {}, f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}".rstrip(": "))
    return Reference(output, grads)


def assert_fused(
    model: Any,
    inputs: Sequence[Any],
    expect: Mapping[str, int],
    train: bool = True,
    dtype: Optional[torch.dtype] = None,
    tol: Optional[float] = None,
    options: Optional[Mapping[str, Any]] = None,
    **compile_kwargs: Any,
) -> list[GraphReport]:
    """Compile ``model`` with ``fusion`` (strict), check rewrite counts and parity with eager.

    ``dtype`` converts the model's floating parameters and the floating inputs first.  ``train``
    also runs backward with a fixed random output gradient and compares every gradient of inputs
    that require grad and of parameters, against the float64 reference where the model runs in
    float64, else against eager (``reference_run``; a failure's message says which).  Returns the reports.
    """
    _check_patterns(expect, "pattern in expect")
    if isinstance(model, torch.nn.Module):
        model.zero_grad(set_to_none=True)  # gradients left by an earlier run would be added to ours
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype) if isinstance(model, torch.nn.Module) else model
        inputs = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    eager_model = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model

    def fresh(ts: Sequence[Any]) -> list[Any]:
        return [t.detach().clone().requires_grad_(t.requires_grad or (train and t.is_floating_point()))
                if isinstance(t, torch.Tensor) else t for t in ts]

    eager_inputs, compiled_inputs = fresh(inputs), fresh(inputs)
    want, want_grads = run_and_backward(eager_model, eager_inputs, train, eager_model)
    reference = reference_run(eager_model, fresh(inputs), train)

    torch._dynamo.reset()
    opts = {"strict": True, "decide": "fuse", **(options or {})}
    compiled = torch.compile(model, backend="fusion", options=opts, **compile_kwargs)
    with collect_reports() as reports:
        got, got_grads = run_and_backward(compiled, compiled_inputs, train, model)

    problems = []
    counts: dict[str, int] = {}
    for r in reports:
        for k, v in r.counts().items():
            counts[k] = counts.get(k, 0) + v
    if counts != dict(expect):
        problems.append(f"rewrites: expected {dict(expect)}, got {counts}")
    outs_got = list(got) if isinstance(got, (tuple, list)) else [got]
    outs_want = list(want) if isinstance(want, (tuple, list)) else [want]
    outs_ref = reference.outputs(len(outs_want))
    if len(outs_got) != len(outs_want):
        problems.append(f"outputs: {len(outs_got)} values, eager returns {len(outs_want)}")
    for i, (g, w, r) in enumerate(zip(outs_got, outs_want, outs_ref, strict=False)):
        if isinstance(w, torch.Tensor):
            problems.append(compare(f"output[{i}]", g, w, tol, reference=r))
    for name, w in want_grads.items():
        g = got_grads.get(name)
        if (g is None) != (w is None):
            problems.append(f"grad of {name}: {'missing' if g is None else 'unexpected'} (eager has {'none' if w is None else 'one'})")
        elif w is not None:
            problems.append(compare(f"grad of {name}", g, w, tol, reference=reference.grads.get(name)))
    problems = [p for p in problems if p]
    if problems:
        text = "\n".join(str(r) for r in reports) or "(no graph was compiled)"
        raise AssertionError("fusion parity check failed:\n  " + "\n  ".join(problems)
                             + f"\n\nReference: {reference.describe()}\n\nReport:\n" + text)
    return list(reports)


def assert_not_fused(
    model: Any,
    inputs: Sequence[Any],
    pattern: str,
    reason: Optional[Union[ReasonKind, str]] = None,
    **compile_kwargs: Any,
) -> tuple[NearMiss, ...]:
    """Assert ``pattern`` fuses nothing in ``model(*inputs)``; with ``reason``, also that a near miss
    of that pattern carries that ``ReasonKind`` (or a ``ReasonKind`` value string).  Returns the
    pattern's near misses.  An unknown ``pattern`` name raises ``UnknownPatternError``."""
    _check_patterns([pattern], "pattern")
    result = dry_run(model, inputs, **compile_kwargs)
    fused = [r for r in result.regions if r[0] == pattern]
    misses = tuple(n for n in result.near_misses if n.pattern == pattern)
    listing = "\n".join(f"  {n.node}: {n.reason.value}: {n.message}" for n in misses) or "  (none)"
    if fused:
        raise AssertionError(f"expected {pattern!r} to fuse nothing, but it fused: {[r[1] for r in fused]}\nnear misses:\n{listing}")
    if reason is not None:
        wanted = ReasonKind(reason)
        if not any(n.reason is wanted for n in misses):
            raise AssertionError(f"expected a near miss of {pattern!r} with reason {wanted.value!r}; near misses:\n{listing}")
    return misses
