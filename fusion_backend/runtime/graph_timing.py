"""Decide in context: the settled graph with its kept regions against Inductor's code for the whole graph.

WHY: a region measured alone can win and still make the model slower.  The code around it (the rest
of Inductor's graph, Dynamo's guards, the caller) adds host time the region's timing does not see,
and an opaque fused op splits Inductor's fusions around it (measured: ``compare``).  So after a deferred graph's regions are decided, the graph compiled with
the kept ones is timed against the graph Inductor compiled first (``runtime/deferred.py``), on the
graph's own inputs, forward or forward + backward as the graph runs; it replaces Inductor's code
only where the whole graph is faster by the margin, else the weakest region is dropped and the graph
compiled again, while the decision budget lasts (``backend._settle``).

Contract of :func:`compare`: ``fused`` and ``inductor`` are compiled graphs called as Dynamo calls
them (``fn(*inputs)``); ``inputs`` are the graph's real example inputs.  Neither candidate touches the
user's tensors: inputs that do not require grad (data, buffers such as running statistics, which a
training graph updates in place) are copied for each candidate, and gradients are taken with
``torch.autograd.grad``, which accumulates nothing into ``.grad``.  The rounds alternate the two
candidates, each round's time per call being back-to-back calls ended by a synchronisation (what a
host-bound step waits for, and a GPU-bound one too); the speedup is the median of the rounds'
ratios (Inductor's time over the fused graph's), as for regions (``decision.summarise_rounds``).

Results are kept in the one measurement cache beside the region decisions (``fusion_backend.measurements``,
through ``decision.cached_entry``), keyed by the whole
graph's computation, its inputs, the regions kept and the state a region's key holds: a later
process that finds the answer does not time again.
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import measurements

#: Rounds per candidate (interleaved), the length one round aims at, the fewest and most calls in one.
ROUNDS = 7
ROUND_MS = 40.0
MIN_CALLS = 2
MAX_CALLS = 50

#: ``timer(steps) -> {"fused": [ms per round], "inductor": [ms per round]}``; ``time_rounds`` unless
#: a test replaces it (``timing_override``).
GraphTimer = Callable[[Mapping[str, Callable[[], None]]], Mapping[str, Sequence[float]]]
_timer: GraphTimer | None = None


@contextlib.contextmanager
def timing_override(timer: GraphTimer | None) -> Iterator[None]:
    """Within the block, whole graphs are timed by ``timer`` (``None``: the real timer).  For tests:
    a fake timer answers without running either candidate."""
    global _timer
    saved, _timer = _timer, timer
    try:
        yield
    finally:
        _timer = saved


def graph_key(gm: fx.GraphModule, example_inputs: Sequence[Any], kept: Sequence[str], region_state: str) -> str:
    """The cache key of a whole-graph comparison: the graph's computation (node names included: the
    kept regions are named by their first node), its inputs' shapes, strides and dtypes, the anchors
    of the kept regions and ``region_state`` (the state a region's key holds: environment, grad mode,
    autocast, TF32, Inductor options)."""
    from . import region_timing

    signature = [(tuple(t.shape), tuple(t.stride()), str(t.dtype), bool(t.requires_grad))
                 if isinstance(t, torch.Tensor) else repr(t) for t in example_inputs]
    lines = [f"{n.name} {n.op} {region_timing.target_text(n.target)} {n.args!r} {n.kwargs!r}" for n in gm.graph.nodes]
    parts = {"graph": hashlib.sha256("\n".join(lines).encode()).hexdigest(), "inputs": signature,
             "kept": sorted(kept), "state": region_state}
    return measurements.key("graph", parts)


# NOTE: two regions of a RegNet-style network measured 1.27x and 1.28x faster alone made the whole
# model's inference 0.73x Inductor's (H200, torch 2.11, bf16, a held-out network timed with the
# benchmark's whole-model step): the reason the whole graph is timed before kept regions stay.
def compare(fused: Callable[..., Any], inductor: Callable[..., Any], inputs: Sequence[Any],
            train: bool) -> dict[str, float]:
    """``fused_ms``, ``inductor_ms`` (each one's median round per call) and ``speedup`` (the median
    of the rounds' ratios, Inductor's time over the fused graph's); see the module docstring."""
    steps = {"fused": graph_step(fused, inputs, train), "inductor": graph_step(inductor, inputs, train)}
    rounds = (_timer or time_rounds)(steps)
    f, i = [float(t) for t in rounds["fused"]], [float(t) for t in rounds["inductor"]]
    if len(f) != len(i) or not f:
        raise ValueError(f"the two graphs were timed in {len(f)} and {len(i)} rounds")
    return {"fused_ms": statistics.median(f), "inductor_ms": statistics.median(i),
            "speedup": statistics.median(b / a for a, b in zip(f, i, strict=True))}


def graph_step(fn: Callable[..., Any], inputs: Sequence[Any], train: bool) -> Callable[[], None]:
    """A zero-argument call of ``fn`` on its own copies of the inputs that do not require grad, and
    with ``train`` the gradients of its outputs that require grad (fixed random upstream
    gradients) with respect to the inputs that do, by ``torch.autograd.grad``."""
    args = [t.detach().clone() if isinstance(t, torch.Tensor) and not t.requires_grad else t for t in inputs]
    leaves = [t for t in args if isinstance(t, torch.Tensor) and t.requires_grad]
    upstream: list[torch.Tensor] = []

    def step() -> None:
        out = fn(*args)
        if not train or not leaves:
            return
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs:
            return
        if not upstream:
            upstream.extend(torch.randn_like(t) for t in outs)
        torch.autograd.grad(outs, leaves, upstream, allow_unused=True)

    return step


def time_rounds(steps: Mapping[str, Callable[[], None]]) -> dict[str, list[float]]:
    """Milliseconds per call of each step, one number per round, the steps taking turns (see the
    module docstring); two warm-up calls each first."""
    from .region_timing import calls_per_round, time_per_call

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    calls = calls_per_round(steps, sync, ROUND_MS, MIN_CALLS, MAX_CALLS)
    rounds: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(ROUNDS):
        for name, step in steps.items():
            rounds[name].append(time_per_call(step, calls[name], sync))
    return rounds
