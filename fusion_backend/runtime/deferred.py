"""Deferred decisions: a first call as cheap as Inductor's, the measured rewrite a few calls later.

A region whose decision must be measured (``decision.pending_timing``: the ``measure`` policy on a
measured device, no answer cached, no prediction that it loses; without CUDA graphs) costs its first call
the compiles of the fused op's Triton kernels (seconds each for a conv kernel) and the timing.  With
the option ``defer`` (default True) the backend does not wait for them:

1. the region is left to Inductor for now (its decision reads "pending"), and the graph compiles as
   it would with every pending region left to Inductor, so the first call costs what
   ``backend="inductor"``'s does;
2. the fused op's kernels of the first regions of each decision key (``backend._Pending``) go to
   Inductor's compile worker processes (``prepare_fused``: the rewritten region runs once with its
   launches replaced by compile submissions, ``kernels.launch.compile_in_background``), which compile
   them into Triton's disk cache while the model runs;
3. the next call after they have all compiled (a non-blocking check per call; never the first call
   itself, whose caller already waits for the compile), or ``settle()``, settles the graph
   (``backend._settle``): the regions are measured within the decision budget, and where some are
   kept the graph compiled with them replaces Inductor's only where the whole graph is faster; where
   none is kept, Inductor's first compile runs on.  A settle that measured the regions it keeps
   compiles the graph again only where that compile fits the rest of the budget; else the next
   process, finding them in the cache, does.  That call also publishes the graph's new report.

WHY: a conv kernel's compile takes seconds where Inductor compiles a small graph in under one, so a
first call that waited for them would cost several times Inductor's (measured: ``DeferredGraph``); in
a training loop, Inductor's code runs the steps meanwhile.

A region with nothing to compile in the background (no worker pool, kernels compiled already) waits
too: the settle measures it within the budget.  A pool whose workers are still starting (a fresh
process's first graph) takes the compiles: they run once the workers are up.  Graphs with symbolic
shapes are not deferred (``deferrable``): their compile needs the context Dynamo compiles them in,
which a later call does not have.  A graph compiled on fake inputs (DDPOptimizer's pieces) is prepared
and decided on its first call's real tensors.  Only the forward's kernels are prepared: a backward
runs on autograd's own threads, out of reach of the capture; its kernels compile when the decision
runs it.

The graph keeps its example inputs (the first call's tensors) and a copy of the graph until it
settles: the decision times the region on them.  Settling runs in the compile-time grad mode and
autocast state (Dynamo guards on them, and the decision's cache key holds them), whichever thread
calls.  A settle that fails keeps Inductor's code (one warning); with ``strict=True`` it raises.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.fx as fx

from ..ir.fakes import fake_of

if TYPE_CHECKING:
    from .decision import DecisionBudget

log = logging.getLogger("fusion_backend.decision")


class Preparation(Protocol):
    """Background work a pending decision waits for (``kernels.compile_pool.Batch``)."""

    def ready(self) -> bool: ...

    def collect(self, timeout: float) -> int: ...


#: ``(gm, candidate, example_inputs, strict) -> Preparation | None`` (``candidate``: a region of ``gm``,
#: ``decision.Region``); ``prepare_fused`` unless a test replaces it (``preparing_with``).
Preparer = Callable[[fx.GraphModule, Any, Sequence[Any], bool], "Preparation | None"]

#: Seconds ``settle`` waits for a preparation, and a graph stays pending at most, before deciding
#: anyway (the decision then compiles what is missing itself).
SETTLE_WAIT_S = 120.0

_preparer: Preparer | None = None
_pending: weakref.WeakSet[DeferredGraph] = weakref.WeakSet()


def deferrable(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> bool:
    """Whether the graph can be compiled again later, outside Dynamo's compile: static shapes (no
    symbolic input, no symbolic size among the placeholders' fake values).  Fake example inputs
    (DDPOptimizer's pieces) are fine: the graph is then decided on its first call's real tensors
    (``DeferredGraph``'s ``inputs``)."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
    if any(isinstance(x, symbolic) for x in example_inputs):
        return False
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("example_value", node.meta.get("val"))
        if isinstance(value, symbolic) or (isinstance(value, torch.Tensor) and free_symbols(value)):
            return False
    return True


def real_inputs(example_inputs: Sequence[Any]) -> bool:
    """Whether no example input is a fake tensor (DDPOptimizer compiles its pieces on fake activations)."""
    from torch._subclasses.fake_tensor import is_fake

    return not any(isinstance(x, torch.Tensor) and is_fake(x) for x in example_inputs)


def prepare_fused(gm: fx.GraphModule, candidate: Any, example_inputs: Sequence[Any],
                  strict: bool) -> Preparation | None:
    """Send the compiles of the kernels the fused op would run on the region ``candidate`` of ``gm``
    (rewritten as the decision rewrites it, with the consumers it times it with) to
    the worker processes; None where nothing was sent (a region off the GPU, no worker pool, nothing
    left to compile).  Raises where the region does not rewrite alone (``prepare`` logs it)."""
    from ..kernels import launch
    from . import region_timing
    from .decision import rewritten_region

    nodes = candidate.nodes
    result = fake_of(nodes[-1])
    if not isinstance(result, torch.Tensor) or result.device.type != "cuda":
        return None  # no Triton kernel compiles for a region off the GPU
    region = region_timing.extract_region(gm, region_timing.with_consumers(gm, nodes))
    inputs = region_timing.region_inputs(region, gm, example_inputs)
    fused = rewritten_region(region, candidate, strict)
    return launch.compile_in_background([lambda: fused(*inputs)])


def prepare(gm: fx.GraphModule, candidate: Any, example_inputs: Sequence[Any], strict: bool) -> Preparation | None:
    """``prepare_fused`` (or the test's preparer); None also where preparing failed (logged): the
    decision is then made at once."""
    try:
        return (_preparer or prepare_fused)(gm, candidate, example_inputs, strict)
    except Exception as exc:  # noqa: BLE001 - deciding at once is always possible
        log.info("decision %s at %s: not deferred (%s: %s)", candidate.pattern, candidate.nodes[0].name,
                 type(exc).__name__, exc)
        return None


@contextlib.contextmanager
def preparing_with(preparer: Preparer | None) -> Iterator[None]:
    """Within the block, pending decisions wait for ``preparer``'s work (``None``: the real one).
    For tests: on CPU no worker pool compiles anything, so nothing would be deferred."""
    global _preparer
    saved, _preparer = _preparer, preparer
    try:
        yield
    finally:
        _preparer = saved


#: ``(inputs, budget) -> compiled graph | None``: the settled compile (``backend._settle``), None where
#: Inductor's first compile stands.
Decide = Callable[[Sequence[Any], "DecisionBudget"], "Callable[..., Any] | None"]

#: Where processes train together (``torch.distributed``), every graph settles at this call (the
#: first is the compile's), waiting for its preparations: the same call on every rank, so that the
#: ranks can agree on the decisions (``backend._agree_across_ranks``).
DISTRIBUTED_SETTLE_CALL = 3


# NOTE: a first call that compiled conv kernels took 3-8x Inductor's in the benchmark's process, where
# Inductor compiled the same small graph in 0.4-0.9 s, while the kernels' compiles took 2.2-2.9 s in the
# workers (``python -m fusion_backend bench --log --suite convnets``, H100).
class DeferredGraph:
    """The compiled graph while decisions are pending: calls run ``first`` (Inductor's code for the
    pending regions) until every preparation is ready (or ``SETTLE_WAIT_S`` have passed: a worker
    that never answers must not keep the graph and its example inputs pending), then ``settle`` asks
    ``decide`` for the settled compile, which replaces ``first`` for good; where ``decide`` returns
    None (no region kept), ``first`` itself runs on: a graph with nothing fused runs exactly the code
    Inductor compiled for it, nothing compiled twice.

    ``inputs``: the graph's real example inputs, or None where its compile saw fake ones (DDPOptimizer's
    pieces): the first call's arguments are kept instead, and ``prepare(args)`` sends the
    preparations then, outside the compile's fake mode (where it sends none, the graph settles at
    that call, as a graph with nothing to wait for is decided at its compile).  ``budget_fraction``: the graph's decisions
    may take this fraction of its first call (from ``compiled_at`` to the second call, or to
    ``settle()`` where that comes first), those its compile made included (``decided_in_compile_s``:
    sending the kernels' compiles): the settle gets what is left; ``math.inf`` for no limit.  ``settle_at_call``: settle at
    exactly that call, waiting for the preparations (``DISTRIBUTED_SETTLE_CALL``); None: at the first
    call after they are ready."""

    def __init__(self, first: Callable[..., Any], preparations: Sequence[Preparation], decide: Decide, strict: bool,
                 *, inputs: Sequence[Any] | None = (), prepare: Callable[[Sequence[Any]], Sequence[Preparation]] | None = None,
                 budget_fraction: float = math.inf, settle_at_call: int | None = None,
                 compiled_at: float | None = None, decided_in_compile_s: float = 0.0) -> None:
        self._current = first
        self._preparations: tuple[Preparation, ...] | None = tuple(preparations)
        self._decide: Decide | None = decide
        self._strict = strict
        self._inputs: list[Any] | None = None if inputs is None else list(inputs)
        self._prepare = prepare
        self._budget_fraction = budget_fraction
        self._settle_at_call = settle_at_call
        self._compiled_at = time.perf_counter() if compiled_at is None else compiled_at
        self._decided_in_compile_s = decided_in_compile_s
        self._first_call_s: float | None = None
        self._lock = threading.Lock()
        self._since = time.perf_counter()
        #: calls so far; the first call (the one Dynamo compiled for) never settles, even where the compiles
        #: finished while Inductor compiled: its caller waits for the compile already and must not wait for timing too
        self._calls = 0
        _pending.add(self)

    @property
    def settled(self) -> bool:
        return self._preparations is None

    def __call__(self, *args: Any) -> Any:
        if self._preparations is not None and (self._inputs is not None or real_inputs(args)):
            # (DDPOptimizer runs each compiled piece once on fake tensors, to trace the next piece:
            # no call of the graph's own)
            self._calls += 1
            if self._inputs is None:  # the first call with real tensors
                self._inputs = list(args)
                self._preparations = tuple(self._prepare(args)) if self._prepare is not None else ()
                if not self._preparations:  # nothing compiles in the background: decide now, as at a compile
                    self.settle(wait_s=0.0)
            elif self._first_call_s is None:
                self._first_call_s = time.perf_counter() - self._compiled_at
            if self._calls > 1:
                if self._settle_at_call is not None:
                    if self._calls >= self._settle_at_call:
                        self.settle()
                elif (all(p.ready() for p in self._preparations)
                      or time.perf_counter() - self._since > SETTLE_WAIT_S):
                    self.settle(wait_s=0.0)  # ready, or waited for long enough already
        return self._current(*args)

    def settle(self, wait_s: float | None = None) -> None:
        """Wait for the preparations (at most ``wait_s`` seconds, default ``SETTLE_WAIT_S``, and at
        most the decision budget), collect those that are ready, measure the decisions and swap in
        their compile, then wait for the preparations still compiling (at most ``wait_s``, and at most
        as long as the graph's first call took, in which they were sent); nothing when already
        settled (or settling on another thread), or while no call has brought real inputs.

        WHY the last wait: compiles still running in Inductor's workers take the host's cores from
        the steps that follow, and an explicit settle (a benchmark's, before it times) should return
        with the process quiet."""
        if self._preparations is None or self._inputs is None or not self._lock.acquire(blocking=False):
            return
        try:
            preparations, decide = self._preparations, self._decide
            if preparations is None or decide is None:
                return
            from .decision import DecisionBudget

            wait_s = SETTLE_WAIT_S if wait_s is None else wait_s
            first_call_s = self._first_call_s or time.perf_counter() - self._compiled_at
            budget = DecisionBudget(max(0.0, self._budget_fraction * first_call_s - self._decided_in_compile_s))
            _wait_until_ready(preparations, min(wait_s, budget.seconds))
            for preparation in preparations:
                if preparation.ready():  # one not ready compiles on; the launch that needs it finds it, or compiles
                    preparation.collect(0.0)
            laps = {"waited": budget.spent()}
            try:
                settled = decide(self._inputs, budget)
                if settled is not None:
                    self._current = settled
                laps["decided"] = budget.spent() - laps["waited"]
                # an explicit settle returns in the steady state: compiles it sent to the background and
                # did not wait for, still running, would take the host's cores from the first steps
                _wait_until_ready(preparations, min(wait_s, first_call_s))
                laps["waited after"] = budget.spent() - laps["waited"] - laps["decided"]
            except Exception as exc:
                if self._strict:
                    from ..errors import RewriteError

                    raise RewriteError(f"the deferred decision failed: {type(exc).__name__}: {exc} (strict=True)") from exc
                warnings.warn(f"fusion: the deferred decision failed ({type(exc).__name__}: {exc}); "
                              "Inductor's code keeps running the graph", stacklevel=2)
            log.info("settled a deferred graph in %.1f s (%s; first call %.1f s)", budget.spent(),
                     ", ".join(f"{name} {s:.1f} s" for name, s in laps.items()), first_call_s)
            self._preparations = self._decide = self._inputs = None
            _pending.discard(self)
        finally:
            self._lock.release()


def _wait_until_ready(preparations: Sequence[Preparation], wait_s: float) -> None:
    """Wait until every preparation is ready, at most ``wait_s`` seconds.

    WHY not ``collect(wait_s)``: a batch's collect takes compiles still running after its timeout
    for a worker pool that does not answer, and turns the workers off for the process; a settle
    whose budget is shorter than a compile is no such sign."""
    deadline = time.perf_counter() + wait_s
    while not all(p.ready() for p in preparations) and time.perf_counter() < deadline:
        time.sleep(min(0.02, max(0.0, deadline - time.perf_counter())))


def settle() -> int:
    """Settle every graph of this process whose decisions are pending (see the module docstring):
    wait for their kernels' compiles, measure, and swap in the result.  Returns how many graphs it
    settled.  A benchmark calls it after the first call so that what it times is the settled code;
    a training loop need not: each graph settles at its next call after its compiles are done."""
    graphs = list(_pending)
    for graph in graphs:
        graph.settle()
    return sum(graph.settled for graph in graphs)


def any_pending(reports: Sequence[Any]) -> bool:
    """Whether one of these ``GraphReport``s has a decision left pending."""
    return any(d.pending for r in reports for d in r.decisions)


def settled_reports(reports: Sequence[Any]) -> list[Any]:
    """Settle every pending graph (``settle``) and return the ``GraphReport``s that now stand: those
    of ``reports`` without a pending decision, then the settled graphs' new ones.  For tools that
    report on a first call (``explain``, the benchmark)."""
    from ..report import collect_reports

    if not any_pending(reports):
        return list(reports)
    with collect_reports() as settled:
        settle()
    return [r for r in reports if not any_pending([r])] + settled


def in_compile_state(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` to be run later in this moment's grad mode and autocast state (the state a Dynamo graph
    was compiled in, which its guards and the decision's cache key hold), with the arguments it is
    then given."""
    grad = torch.is_grad_enabled()
    autocast = {device: torch.get_autocast_dtype(device) for device in ("cuda", "cpu")
                if torch.is_autocast_enabled(device)}

    def run(*args: Any) -> Any:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            for device in ("cuda", "cpu"):
                if device in autocast:
                    stack.enter_context(torch.autocast(device, dtype=autocast[device]))
                elif torch.is_autocast_enabled(device):
                    stack.enter_context(torch.autocast(device, enabled=False))
            return fn(*args)

    return run
