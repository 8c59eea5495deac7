"""Test helpers for pattern authors (also used by this project's own tests).

* ``assert_fused(model, inputs, expect={"conv_epilogue": 1}, train=True)`` compiles with ``fusion``
  (strict), asserts the exact rewrite counts, and compares the output and every gradient (inputs and
  parameters) with eager under per-dtype tolerances.  On failure the message holds the report (what
  matched, what was rejected and why) and the largest mismatches with their indices.
* ``assert_not_fused(model, inputs, pattern, reason=...)`` for negative tests.
* ``dry_run(model, inputs)`` runs only the find phase (no rewrite, no fused op) and returns what
  would be fused and the near misses.
"""

from __future__ import annotations

import copy
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


def dry_run(model: Any, inputs: Sequence[Any], patterns: Optional[Sequence[str]] = None, **compile_kwargs: Any) -> DryRun:
    """What ``fusion`` would fuse in ``model(*inputs)``, without rewriting or running fused ops."""
    from .engine import find_regions, registered_patterns

    enabled = tuple(patterns) if patterns is not None else tuple(registered_patterns())
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


def _run(fn: Any, inputs: Sequence[Any], train: bool, model: Any) -> tuple[Any, dict[str, Optional[torch.Tensor]]]:
    """Run ``fn(*inputs)`` and, with ``train``, backward; gradients are read off ``model``'s
    parameters (``fn`` may be its compiled wrapper, whose parameter names differ)."""
    out = fn(*inputs)
    grads: dict[str, Optional[torch.Tensor]] = {}
    if train:
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor) and o.requires_grad]
        # A fixed, non-trivial output gradient (not all ones) exercises the backward properly.
        gen = torch.Generator().manual_seed(1234)
        grad_outs = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o) for o in outs]
        torch.autograd.backward(outs, grad_outs)
        for name, leaf in _leaves(model, inputs):
            grads[name] = None if leaf.grad is None else leaf.grad.detach().clone()
    return out, grads


def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: Optional[float] = None) -> Optional[str]:
    """``None`` if ``got`` matches ``want`` (shape, dtype, NaN positions, relative error), else a
    sentence with the error and the five largest mismatches with their indices."""
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != eager's {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"{name}: dtype {got.dtype} != eager's {want.dtype}"
    tol = TOLERANCES.get(want.dtype, 1e-5) if tol is None else tol
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    nan_g, nan_w = torch.isnan(g), torch.isnan(w)
    if not torch.equal(nan_g, nan_w):
        idx = torch.nonzero(nan_g != nan_w)[:5].tolist()
        return f"{name}: NaN positions differ from eager at {idx}"
    g, w = g.masked_fill(nan_g, 0), w.masked_fill(nan_w, 0)
    err = (g - w).norm().item() / max(w.norm().item(), 1e-30)
    if err <= tol:
        return None
    diff = (g - w).abs().flatten()
    worst = torch.topk(diff, min(5, diff.numel())).indices
    rows = []
    for flat in worst.tolist():
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), g.shape))
        rows.append(f"    at {index}: got {g.flatten()[flat].item():.6g}, eager {w.flatten()[flat].item():.6g}")
    return f"{name}: relative error {err:.3g} > {tol:g}; largest mismatches:\n" + "\n".join(rows)


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
    that require grad and of parameters.  Returns the reports.
    """
    if dtype is not None:
        model = copy.deepcopy(model).to(dtype) if isinstance(model, torch.nn.Module) else model
        inputs = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    eager_model = copy.deepcopy(model) if isinstance(model, torch.nn.Module) else model

    def fresh(ts: Sequence[Any]) -> list[Any]:
        return [t.detach().clone().requires_grad_(t.requires_grad or (train and t.is_floating_point()))
                if isinstance(t, torch.Tensor) else t for t in ts]

    eager_inputs, compiled_inputs = fresh(inputs), fresh(inputs)
    want, want_grads = _run(eager_model, eager_inputs, train, eager_model)

    torch._dynamo.reset()
    opts = {"strict": True, **(options or {})}
    compiled = torch.compile(model, backend="fusion", options=opts, **compile_kwargs)
    with collect_reports() as reports:
        got, got_grads = _run(compiled, compiled_inputs, train, model)

    problems = []
    counts: dict[str, int] = {}
    for r in reports:
        for k, v in r.counts().items():
            counts[k] = counts.get(k, 0) + v
    if counts != dict(expect):
        problems.append(f"rewrites: expected {dict(expect)}, got {counts}")
    outs_got = list(got) if isinstance(got, (tuple, list)) else [got]
    outs_want = list(want) if isinstance(want, (tuple, list)) else [want]
    if len(outs_got) != len(outs_want):
        problems.append(f"outputs: {len(outs_got)} values, eager returns {len(outs_want)}")
    for i, (g, w) in enumerate(zip(outs_got, outs_want, strict=False)):
        if isinstance(w, torch.Tensor):
            problems.append(compare(f"output[{i}]", g, w, tol))
    for name, w in want_grads.items():
        g = got_grads.get(name)
        if (g is None) != (w is None):
            problems.append(f"grad of {name}: {'missing' if g is None else 'unexpected'} (eager has {'none' if w is None else 'one'})")
        elif w is not None:
            problems.append(compare(f"grad of {name}", g, w, tol))
    problems = [p for p in problems if p]
    if problems:
        text = "\n".join(str(r) for r in reports) or "(no graph was compiled)"
        raise AssertionError("fusion parity check failed:\n  " + "\n  ".join(problems) + "\n\nReport:\n" + text)
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
    pattern's near misses."""
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
