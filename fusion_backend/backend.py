"""The Dynamo backend ``fusion``: rewrite fusible regions into fused ops, give the rest to Inductor.

Registered through the ``torch_dynamo_backends`` entry point, so ``torch.compile(model,
backend="fusion")`` works without importing this package.  ``fusion`` itself is an undecorated
function on purpose: decorating it with ``register_backend(name="fusion")`` as well would make
Dynamo see the name twice.

A rewritten graph that holds only fused ops and glue (casts, views) skips AOTAutograd and Inductor,
which would fuse nothing there: it runs as plain FX code with eager autograd (``runtime/direct.py``; the
report's ``runner`` says which; ``options={"direct": False}`` turns it off).

A region whose decision must be measured is decided a few calls later, once the fused op's kernels
have compiled in the background; until then Inductor's code runs it (``runtime/deferred.py``, option
``defer``).

Nothing the user gave is lost: if normalising, matching, rewriting or compiling the rewritten graph
fails, the untouched graph is compiled by Inductor, one warning names the pattern and the error, and
the report records the fallback.  ``options={"strict": True}`` raises ``RewriteError`` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import math
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from .errors import ConfigurationError, RewriteError
from .frontend.normalize import AUTOCAST_MARKERS
from .kernels import compile_pool
from .match.engine import (
    Candidate,
    Regions,
    default_patterns,
    find_regions,
    registered_patterns,
    rewrite_regions,
)
from .ops.autograd_free import with_autograd_free_pass
from .options import FusionOptions
from .report import Decision, Fallback, GraphCheck, GraphReport, publish
from .runtime import compile_estimate, deferred, graph_timing
from .runtime.decision import (
    PENDING_RULE,
    DecisionBudget,
    cached_entry,
    decide,
    pending_timing,
    state_digest,
    store_entry,
)
from .runtime.direct import direct_module, why_not_direct

log = logging.getLogger("fusion_backend")
#: Where a settle's progress goes: with the decisions' own lines (``bench --log`` and
#: ``tools/first_call.py --log`` show that logger).
decision_log = logging.getLogger("fusion_backend.decision")
_graph_counter = itertools.count()

# Dynamo/AOTAutograd signal "trace again" with these (e.g. to specialise float scalars lifted to
# inputs under dynamic=True).  They are control flow, not failures: never fall back on them.
_CONTROL_FLOW = tuple(
    getattr(torch._dynamo.exc, name)
    for name in ("TensorifyScalarRestartAnalysis", "RestartAnalysis")
    if hasattr(torch._dynamo.exc, name)
)


def fusion(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    mode: Optional[str] = None,
    options: Optional[dict[str, Any]] = None,
) -> Callable[..., Any]:
    """Compile one Dynamo graph.  See the README for ``options``; ``mode`` is Inductor's.

    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU())
    >>> out = torch.compile(model, backend="fusion")(torch.randn(2, 3, 8, 8))
    >>> tuple(out.shape)
    (2, 8, 6, 6)
    """
    compiled_at = time.perf_counter()
    try:
        opts = FusionOptions.parse(options, tuple(registered_patterns()), default_patterns())
    except ConfigurationError as error:
        raise _as_users_error(error) from None
    cuda = next((t.get_device() for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)
    if cuda is not None:  # before any kernel of this graph compiles, here or in a worker
        compile_pool.use_inductors_triton_setup(cuda)
    config_patches = _inductor_patches(mode, opts)
    index = next(_graph_counter)
    # The rewrite works on a copy; where nothing is kept, Dynamo's graph itself goes to Inductor,
    # which may mutate it: nothing reads it after that but a dump, which gets a copy.
    original = _clone(gm) if opts.dump_dir else gm
    before_code = gm.code if opts.dump_dir else ""

    may_defer = opts.defer and deferred.deferrable(gm, example_inputs)
    real = deferred.real_inputs(example_inputs)
    pending = _Pending()
    # Under CUDA graphs nothing is deferred (a kept region runs once before they record): the graph's
    # regions are decided during this compile, within a budget that is a multiple of Inductor's compile
    # of the graph, estimated from the graphs compiled before (``runtime/compile_estimate.py``): the
    # graph compiles once, as it will run.
    cuda_graphs = bool(config_patches.get("triton.cudagraphs"))
    training = _training_graph(example_inputs)
    timed_in_compile = may_defer and real and opts.decide == "measure" and cuda_graphs
    size = compile_estimate.graph_size(gm)  # before Inductor may mutate ``gm``
    budget: Optional[DecisionBudget] = None
    if timed_in_compile:
        fraction = opts.budget_fraction(cuda_graphs=True)
        # no limit (``decide_budget=None``): a region whose kernels are cold is measured too, after the wait for
        # them (``_compile_cold_kernels_first``), so that one process reaches the decisions later ones would settle to
        seconds = math.inf if math.isinf(fraction) else fraction * compile_estimate.expected(
            size, training=training, cuda_graphs=cuda_graphs, cache_dir=opts.cache_dir)
        budget = DecisionBudget(seconds, warm_kernels_only=not math.isinf(seconds))

    def decide_first(graph: fx.GraphModule, candidate: Candidate, decisions: list[Decision]) -> bool:
        timing = None
        if may_defer and not cuda_graphs:
            timing = pending_timing(graph, candidate, policy=opts.decide,
                                    cache_dir=opts.cache_dir, inductor_patches=config_patches)
        if timing is not None:
            pending.admit(graph, candidate, timing, example_inputs if real else None, opts.strict)
            decisions.append(Decision(candidate.pattern, candidate.summary, candidate.nodes[0].name, False,
                                      PENDING_RULE, pending=True))
            return False
        decisions.append(decide(
            graph, candidate, example_inputs, policy=opts.decide,
            margin=opts.decide_margin, cache_dir=opts.cache_dir, inductor_patches=config_patches,
            strict=opts.strict, budget=budget,
        ))  # fmt: skip
        # where the whole graph may still veto it, rewritten below, once the graph's own answer is known
        return decisions[-1].fused and not in_context

    # a region kept alone is checked in the whole graph where the graph can be compiled again later
    in_context = may_defer and opts.decide == "measure" and not cuda_graphs
    caches_before = compile_estimate.inductor_cache_counts()  # whether the compile below is a rate
    keep = decide_first
    decided_first_s = 0.0
    if timed_in_compile and budget is not None:  # decided first: the graph then compiles once, with what they keep
        keep = functools.partial(_replay, _decided_in_compile(gm, example_inputs, opts, config_patches, index,
                                                              decide_first, budget))
        decided_first_s = budget.spent()
    found = _build(gm, example_inputs, opts, config_patches, keep, index)
    if decided_first_s:  # the report's decide stage: the decisions made before the build replayed them
        found.report.stage_seconds["decide"] = found.report.stage_seconds.get("decide", 0.0) + decided_first_s
    decided = {d.anchor: d for d in found.report.decisions}
    checks: list[GraphCheck] = []
    if in_context and any(d.fused for d in decided.values()):
        # the regions kept alone: the whole graph's answer, where a process measured it before
        decided, checks, outcome = _in_context(gm, example_inputs, decided, opts, config_patches, None, None)
        if outcome is _UNKNOWN:  # compile Inductor's graph now, and time the graph with them at the settle
            decided = {a: dataclasses.replace(d, fused=False, pending=True, rule=IN_CONTEXT_RULE) if d.fused else d
                       for a, d in decided.items()}
            pending.in_context = True
    built = found
    if in_context and any(d.fused for d in decided.values()):
        built = _build(gm, example_inputs, opts, config_patches, functools.partial(_replay, decided), index)
    report = dataclasses.replace(built.report, decisions=tuple(decided.values()) if built is found else
                                 built.report.decisions, graph_checks=tuple(checks))
    if pending.regions or pending.in_context:
        # the pending regions are decided later, on the graph as Dynamo gave it: copied before
        # Inductor compiles (and may mutate) that graph
        untouched = _clone(gm)
    compiled = built.compiled
    as_given = compiled is None
    if as_given:  # nothing rewritten: Dynamo's graph as Inductor compiles it
        t0 = time.perf_counter()
        compiled = _compile_inductor(original, example_inputs, config_patches)
        report.stage_seconds["inductor"] = time.perf_counter() - t0
    # the budgets' rate: Inductor's compile of a graph as given, past its caches.  A rewritten graph's compile
    # lowers fused ops, not the nodes they replace: after ResNet-50's, EfficientNet-B0's bf16 inference
    # budget under CUDA graphs read 11.4 s where its measurements needed about 50 (H200)
    if (opts.decide == "measure" and as_given
            and not compile_estimate.served_by_caches(caches_before, compile_estimate.inductor_cache_counts())):
        compile_estimate.record(size, report.stage_seconds["inductor"], training=training, cuda_graphs=cuda_graphs,
                                cache_dir=opts.cache_dir)
    if pending.regions or pending.in_context:
        distributed = _distributed()
        first_compile = _FirstCompile(size, report.stage_seconds.get("inductor", 0.0),
                                      compile_estimate.estimate(size, training=training, cuda_graphs=False,
                                                                cache_dir=opts.cache_dir),
                                      frozenset(a for a, d in decided.items() if d.fused))
        settle = deferred.in_compile_state(
            functools.partial(_settle, untouched, compiled, opts, config_patches, index, distributed, first_compile))
        compiled = deferred.DeferredGraph(
            compiled, pending.preparations, settle, opts.strict, inputs=example_inputs if real else None,
            prepare=None if real else pending.prepare_later(opts.strict), budget_fraction=opts.budget_fraction(cuda_graphs=False),
            settle_at_call=deferred.DISTRIBUTED_SETTLE_CALL if distributed else None, compiled_at=compiled_at,
            decided_in_compile_s=found.report.stage_seconds.get("decide", 0.0))
    report.stage_seconds["total"] = time.perf_counter() - compiled_at
    _publish(report, opts, before_code, built.rewritten, original)
    return compiled


#: The rule of a region kept alone whose graph has not been timed with it yet (``_in_context``).
IN_CONTEXT_RULE = ("faster alone; the whole graph is timed with it once Inductor's code for the graph has "
                   "compiled, and Inductor's code runs the region until then")


class _Pending:
    """The regions of a first compile whose decisions wait (``runtime/deferred.py``), and the
    background compiles they wait for.  One preparation per decision key (regions of one key share
    one measurement), and at most ``PREPARE_PER_KIND`` keys per kind of region: a network repeats one
    kind at many shapes, and where the first of them lose clearly the rest are predicted to lose
    (``decision._predicted_loss``); the others are measured, compiling in this process, if the
    settle's budget lasts.  NOTE: flooding Inductor's compile workers with every region's kernels
    slowed Inductor's own compile of the graph: ResNet-50 inference (bf16, batch 64, H200), fusion's
    first call 21.3 s against Inductor's 16.4 s with all 53 regions' kernels sent."""

    #: Decision keys of one kind of region whose kernels compile in the background at the first compile.
    PREPARE_PER_KIND = 2

    def __init__(self) -> None:
        self.regions: list[tuple[fx.GraphModule, Candidate, Any]] = []
        self.preparations: list[Any] = []
        #: regions kept alone wait for the whole graph's check (``IN_CONTEXT_RULE``)
        self.in_context = False
        self._prepared_keys: set[str] = set()
        self._prepared_kinds: dict[str, int] = {}

    def admit(self, graph: fx.GraphModule, candidate: Candidate, timing: Any, example_inputs: Optional[Sequence[Any]],
              strict: bool) -> None:
        """Let the region wait for the settle, sending its kernels' compiles to the background where
        it is the first of its key and among the first keys of its kind (``example_inputs`` None:
        fake, and the compiles are sent at the first call).  A region whose kernels need no compile
        (or with no worker pool to compile them) waits too: the settle measures it within the budget."""
        self.regions.append((graph, candidate, timing))
        if example_inputs is not None and self._wants_preparation(timing):
            self._note_prepared(timing)
            preparation = deferred.prepare(graph, candidate, example_inputs, strict)
            if preparation is not None:
                self.preparations.append(preparation)

    def _wants_preparation(self, timing: Any) -> bool:
        return (timing.key not in self._prepared_keys
                and self._prepared_kinds.get(timing.region_class, 0) < self.PREPARE_PER_KIND)

    def _note_prepared(self, timing: Any) -> None:
        self._prepared_keys.add(timing.key)
        self._prepared_kinds[timing.region_class] = self._prepared_kinds.get(timing.region_class, 0) + 1

    def prepare_later(self, strict: bool) -> Callable[[Sequence[Any]], list[Any]]:
        """The preparations of a graph compiled on fake inputs, made at its first call on ``args``.
        The regions are read from a copy of the graph they were found in: Inductor may mutate that one."""
        if not self.regions:
            return lambda args: []
        graph = self.regions[0][0]
        copy = _clone(graph)
        named = {n.name: n for n in copy.graph.nodes}
        into_copy = {n: named[n.name] for n in graph.graph.nodes}
        regions = [(c.moved(into_copy), t) for _, c, t in self.regions]

        def prepare(args: Sequence[Any]) -> list[Any]:
            for candidate, timing in regions:
                if self._wants_preparation(timing):  # noted whatever it sends, as ``admit`` does: one
                    self._note_prepared(timing)      # attempt per key (the kernels may all be on disk)
                    preparation = deferred.prepare(copy, candidate, args, strict)
                    if preparation is not None:
                        self.preparations.append(preparation)
            return self.preparations

        return prepare


@dataclass
class _Built:
    """A graph matched, decided and (where something was kept) rewritten and compiled."""

    report: GraphReport
    compiled: Optional[Callable[..., Any]]
    """The rewritten graph's compile; None where nothing was rewritten (or the rewrite fell back)."""
    rewritten: Optional[fx.GraphModule]


def _build(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: FusionOptions, config_patches: dict[str, Any],
           keep: Callable[[fx.GraphModule, Candidate, list[Decision]], bool], index: int,
           compile_graph: bool = True) -> _Built:
    """Find the regions of ``gm`` (on a copy), decide each with ``keep(graph, candidate, decisions)``
    (it appends the candidate's decision; the graph is whole while it decides), rewrite the kept
    ones and compile the result (directly, or through Inductor; ``compile_graph=False``: the rewritten
    graph alone).  A failure at any stage is a fallback: nothing rewritten, noted in the report
    (``strict`` raises)."""
    times: dict[str, float] = {}
    current = {"stage": "normalize", "pattern": None}

    def on_stage(stage: str, pattern: Optional[str]) -> None:
        current.update(stage=stage, pattern=pattern)

    work = _clone(gm)
    _ensure_fake_values(work, example_inputs)
    fallbacks: list[Fallback] = []
    matches, near_misses = [], []
    rewritten: Optional[fx.GraphModule] = None
    decisions: list[Decision] = []

    lap = [time.perf_counter()]

    def timed(stage: str) -> None:  # the seconds since the previous stage ended
        now = time.perf_counter()
        times[stage], lap[0] = times.get(stage, 0.0) + now - lap[0], now

    try:
        regions = find_regions(work, opts.patterns, strict=opts.strict, on_stage=on_stage)
        timed("match")
        on_stage("decide", None)
        kept = _decide_candidates(work, regions, keep, decisions)
        timed("decide")
        matches, near_misses = rewrite_regions(regions, kept, on_stage), regions.near_misses
        timed("rewrite")
        rewritten = work
    except _CONTROL_FLOW:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must fall back, never lose the graph
        fallbacks.append(_fall_back(opts, current["stage"], current["pattern"], exc))
        decisions.clear()  # nothing was rewritten
        timed(current["stage"])

    t0 = time.perf_counter()
    compiled = None
    runner, notes = "inductor", []
    if rewritten is not None and matches and compile_graph:
        why_not = _why_not_direct(rewritten, opts, config_patches)
        if why_not is None:
            try:
                compiled, runner = direct_module(rewritten).forward, "direct"
            except Exception as exc:  # noqa: BLE001 - Inductor can still run the rewritten graph
                fallbacks.append(_fall_back(opts, "direct", None, exc))
        else:
            notes.append(f"runs through Inductor, not directly: {why_not}")
    if compiled is None and rewritten is not None and matches and compile_graph:
        try:
            compiled = _compile_rewritten(rewritten, example_inputs, config_patches)
        except _CONTROL_FLOW:
            raise
        except Exception as exc:  # noqa: BLE001
            patterns = sorted({m.pattern for m in matches})
            fallbacks.append(_fall_back(opts, "compile", ",".join(patterns), exc))
            matches = []
    if compiled is not None:
        times["inductor" if runner == "inductor" else "direct"] = time.perf_counter() - t0
    report = GraphReport(
        graph_index=index,
        graph_name=f"graph_{index}",
        matches=tuple(matches),
        near_misses=tuple(near_misses),
        fallbacks=tuple(fallbacks),
        stage_seconds=times,
        enabled_patterns=opts.patterns,
        notes=tuple(notes),
        decisions=tuple(decisions),
        runner=runner,
    )
    return _Built(report, compiled, rewritten if matches else None)


def _publish(report: GraphReport, opts: FusionOptions, before_code: str, rewritten: Optional[fx.GraphModule],
             original: fx.GraphModule) -> None:
    """Log one line per decision, write the dump (with ``dump_dir``), and hand the report to its sinks."""
    kernels = {(m.pattern, m.nodes[0]): m.kernel for m in report.matches}
    for d in report.decisions:  # one line per decision
        if d.pending:
            log.info("pending %s: %s: %s", d.pattern, d.summary, d)
        elif (d.pattern, d.anchor) in kernels:
            log.info("fused %s: %s (%s): %s", d.pattern, d.summary, kernels[d.pattern, d.anchor], d)
        else:
            log.info("left %s to Inductor: %s: %s", d.pattern, d.summary, d)
    for check in report.graph_checks:
        log.info("whole graph %s: %s", report.graph_name, check)
    for n in report.near_misses:
        log.debug("near miss %s at %s: %s: %s", n.pattern, n.node, n.reason.value, n.message)
    if opts.dump_dir is not None:
        from .dump import write_dump

        write_dump(opts.dump_dir, report, before_code, rewritten, original)
    _emit_trace_artifact(report)
    publish(report)


#: Seconds between two progress lines of a settle that decides many regions.
PROGRESS_EVERY_S = 5.0


@dataclass(frozen=True)
class _FirstCompile:
    """What a settle knows of its graph's first compile: the graph's size in nodes
    (``compile_estimate.graph_size``), the seconds Inductor took (low where its caches served it),
    the estimate from this machine's compile rate (``compile_estimate.estimate``; 0.0 where none is
    known) and the regions compiled in (by anchor: those an earlier process kept and checked in the
    whole graph)."""

    graph_nodes: int
    seconds: float
    estimated_s: float
    regions: frozenset[str]

    def recompile_seconds(self, nodes: int) -> float:
        """A compile of the graph rewritten to ``nodes`` nodes (a fused op is one): the larger of the
        two readings, scaled to them."""
        if self.graph_nodes <= 0:
            return 0.0
        return max(self.seconds, self.estimated_s) * nodes / self.graph_nodes


def _settle(untouched: fx.GraphModule, first: Callable[..., Any], opts: FusionOptions, config_patches: dict[str, Any],
            index: int, distributed: bool, first_compile: _FirstCompile, inputs: Sequence[Any],
            budget: DecisionBudget) -> Optional[Callable[..., Any]]:
    """A deferred graph's settled compile, or None where Inductor's first compile ``first`` stands.

    1. Every region is decided now, on the graph's real ``inputs``, as far as ``budget`` allows
       (``decision.decide``); under ``torch.distributed`` the ranks keep only what all of them keep.
    2. A settle that measured the regions it keeps beyond those ``first`` holds compiles the graph
       again with them only where that compile (estimated from ``first_compile``) fits what is left
       of ``budget``; otherwise they stay with Inductor in this process and a later process, which
       finds them in the cache, compiles the graph with them (``_within_budget``).
    3. Nothing kept: None, with nothing compiled (a graph with nothing fused is exactly Inductor's).
    4. Else the graph is compiled with the kept regions and timed against ``first`` as a whole
       (``_in_context``; not under CUDA graphs, where a replay leaves no host time to see and the
       regions' GPU times decide), the ranks agreeing again on what stayed.  The report says which
       rule decided."""
    decided, decided_report = _decide_regions(untouched, inputs, opts, config_patches, index, budget)
    if opts.decide == "measure" and not config_patches.get("triton.cudagraphs"):
        decided = _within_budget(untouched, inputs, opts, config_patches, index, decided, first_compile, budget)
    if distributed:
        decided = _agree_across_ranks(decided, untouched)
    train = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
    before_code = untouched.code if opts.dump_dir else ""

    def rewrite(decided: dict[str, Decision]) -> _Built:
        return _build(untouched, inputs, opts, config_patches, functools.partial(_replay, decided), index)

    def time_graph(decided: dict[str, Decision]) -> tuple[_Built, Optional[dict[str, float]]]:
        built = rewrite(decided)
        if built.compiled is None:
            return built, None
        return built, graph_timing.compare(built.compiled, first, inputs, train)

    checks: list[GraphCheck] = []
    built: Optional[_Built] = None
    if opts.decide == "measure" and not config_patches.get("triton.cudagraphs"):
        decided, checks, built = _in_context(untouched, inputs, decided, opts, config_patches, budget, time_graph)
    if distributed:  # each rank timed its own graph: keep what every rank kept
        agreed = _agree_across_ranks(decided, untouched)
        if agreed != decided:
            decided, built = agreed, None
    if built is None and any(d.fused for d in decided.values()):
        built = rewrite(decided)  # the whole graph's answer came from the cache
    if built is None or built.compiled is None:
        report = built.report if built is not None else dataclasses.replace(decided_report,
                                                                            decisions=tuple(decided.values()))
        _publish(dataclasses.replace(report, graph_checks=tuple(checks)), opts, before_code, None, untouched)
        return None
    _publish(dataclasses.replace(built.report, graph_checks=tuple(checks)), opts, before_code, built.rewritten,
             untouched)
    return built.compiled


#: ``_in_context``'s outcome where the graph's answer for the regions kept is in no cache and may not be measured.
_UNKNOWN: Any = object()


def _in_context(graph: fx.GraphModule, inputs: Sequence[Any], decided: dict[str, Decision], opts: FusionOptions,
                config_patches: dict[str, Any], budget: Optional[DecisionBudget],
                time_graph: Optional[Callable[[dict[str, Decision]], tuple[_Built, Optional[dict[str, float]]]]],
                ) -> tuple[dict[str, Decision], list[GraphCheck], Any]:
    """Decide in context (``runtime/graph_timing.py``): the graph with the kept regions of ``decided``
    against Inductor's code for the whole graph.  Where it is faster by the margin, they stay;
    otherwise the weakest kept region (the lowest speedup alone) is dropped and the graph checked
    again, and all are dropped once one is left or the ``budget`` is spent.  Each check's times come
    from the cache or from ``time_graph(decided)`` (the rewritten graph's build and its times); with
    ``time_graph`` None (a first compile, which has no Inductor graph to time against yet) a check not
    cached ends the walk with the outcome ``_UNKNOWN``.

    Returns the decisions (dropped ones say why), the checks made, and the outcome: the build of the
    graph with the regions that stayed where ``time_graph`` built it last, None otherwise (nothing
    kept, or an answer from the cache: the caller builds), or ``_UNKNOWN``.  A build whose rewrite
    fell back is returned as it is (its report says why)."""
    decided = dict(decided)
    checks: list[GraphCheck] = []
    state = state_digest(config_patches)
    while True:
        kept = [d for d in decided.values() if d.fused]
        if not kept:
            return decided, checks, None
        key = graph_timing.graph_key(graph, inputs, [d.anchor for d in kept], state)
        entry, built = cached_entry(key, opts.cache_dir), None
        cached = entry is not None
        if entry is None:
            if time_graph is None:
                return decided, checks, _UNKNOWN
            built, times = time_graph(decided)
            if times is None:
                return decided, checks, built
            entry = {"kind": "graph", **times}
            store_entry(key, entry, opts.cache_dir)
        speedup, anchors = entry["speedup"], tuple(d.anchor for d in kept)
        if speedup >= 1 + opts.decide_margin:
            checks.append(GraphCheck(anchors, entry["fused_ms"], entry["inductor_ms"], speedup, True,
                                     "the whole graph is faster with them", cached))
            return decided, checks, built
        last_try = len(kept) == 1 or (budget is not None and budget.spent_all())
        weakest = min(kept, key=lambda d: d.speedup if d.speedup is not None else math.inf)
        dropped = kept if last_try else [weakest]
        why = (f"the whole graph with {'it' if len(kept) == 1 else f'the {len(kept)} kept regions'} ran "
               f"{speedup:.2f}x Inductor's graph (within {opts.decide_margin:.0%} goes to Inductor)")
        checks.append(GraphCheck(anchors, entry["fused_ms"], entry["inductor_ms"], speedup, False,
                                 f"{why}; dropped {'all' if last_try else f'`{weakest.anchor}`, the weakest'}", cached))
        for d in dropped:
            decided[d.anchor] = dataclasses.replace(d, fused=False, rule=f"dropped in context: {why}")


def _decide_candidates(graph: fx.GraphModule, regions: Regions,
                       keep: Callable[[fx.GraphModule, Candidate, list[Decision]], bool],
                       decisions: list[Decision]) -> list[Candidate]:
    """The candidates to rewrite now: each accepted one ``keep`` keeps, then each alternate none of
    whose nodes a region decided fused holds (``Regions.alternates``), decided the same way.
    ``keep`` appends one decision per candidate; a fused decision holds its nodes even where the
    rewrite waits (the whole graph's check, or a settle that replays its decisions)."""
    kept: list[Candidate] = []
    held: set[fx.Node] = set()
    for candidate in [c for _, c in regions.accepted] + regions.alternates:  # the accepted ones first
        if held.intersection(candidate.nodes):
            continue
        if keep(graph, candidate, decisions):
            kept.append(candidate)
        if decisions[-1].fused:
            held.update(candidate.nodes)
    return kept


#: The rule of a region kept alone whose graph would compile again past its decision budget (``_postponed``).
POSTPONED_RULE = ("faster alone ({speedup}), kept from a later process on: compiling the graph with "
                  "{them} ({cost}) does not fit this process's decision budget ({budget}; "
                  "option decide_budget); a later process finds the decision in the cache and compiles "
                  "the graph with {them}")


def _postponed(decided: dict[str, Decision], held: frozenset[str], budget: DecisionBudget,
               compile_seconds: Callable[[], Optional[float]]) -> dict[str, Decision]:
    """``decided`` with the regions it keeps beyond ``held`` (those the graph's compile holds
    anyway) left to Inductor (``POSTPONED_RULE``) where this process measured every one of them
    (``DecisionBudget.measured_anchors``) and compiling the graph with them (``compile_seconds()``;
    None: not known) would not end within ``budget``.  Where one of them was kept by an earlier
    process's measurement, this process is the later one that process's rule promised: it compiles,
    the regions it measured itself included (the one compile costs the same).

    WHY: keeping a region means compiling the graph with it, about as long as Inductor's cold compile
    of the graph, where the decision budget allows a fraction of it; in the process that measured the
    region that compile comes on top (Inductor's caches may hold the graph without it)."""
    new = [d for d in decided.values() if d.fused and d.anchor not in held]
    if not new or any(d.anchor not in budget.measured_anchors for d in new):
        return decided
    if math.isinf(budget.seconds):
        return decided
    seconds = compile_seconds()
    if seconds is not None and seconds <= max(0.0, budget.seconds - budget.spent()):
        return decided
    them = "it" if len(new) == 1 else f"the {len(new)} regions kept"
    cost = f"about {seconds:.1f} s" if seconds is not None else "its time not known yet: no graph of its kind compiled here"
    postponed = dict(decided)
    for d in new:
        speedup = f"{d.speedup:.2f}x" if d.speedup is not None else "by its rule"
        postponed[d.anchor] = dataclasses.replace(d, fused=False, rule=POSTPONED_RULE.format(
            speedup=speedup, them=them, cost=cost, budget=budget.describe()))
    return postponed


def _within_budget(untouched: fx.GraphModule, inputs: Sequence[Any], opts: FusionOptions,
                   config_patches: dict[str, Any], index: int, decided: dict[str, Decision],
                   first_compile: _FirstCompile, budget: DecisionBudget) -> dict[str, Decision]:
    """A settle's ``_postponed``: the regions its first compile holds are held; the compile is the
    graph rewritten with the kept regions (not compiled), by its nodes (``_FirstCompile``); nothing
    is postponed where the rewritten graph runs directly, without Inductor (no compile to wait for)."""
    if not any(d.fused and d.anchor not in first_compile.regions for d in decided.values()):
        return decided
    rewritten = _build(untouched, inputs, dataclasses.replace(opts, dump_dir=None), config_patches,
                       functools.partial(_replay, decided), index, compile_graph=False).rewritten
    if rewritten is None or _why_not_direct(rewritten, opts, config_patches) is None:
        return decided  # nothing to rewrite (the rebuild falls back and says why), or no compile to wait for
    return _postponed(decided, first_compile.regions, budget,
                      lambda: first_compile.recompile_seconds(compile_estimate.graph_size(rewritten)))


def _decided_in_compile(gm: fx.GraphModule, inputs: Sequence[Any], opts: FusionOptions,
                        config_patches: dict[str, Any], index: int,
                        decide: Callable[[fx.GraphModule, Candidate, list[Decision]], bool],
                        budget: DecisionBudget) -> dict[str, Decision]:
    """Under CUDA graphs, every region decided during the graph's compile (``decide`` appends each
    decision, within ``budget``), by anchor: the fused kernels of the regions to be measured compile
    first, all at once (``_compile_cold_kernels_first``), then the regions are measured; the graph
    compiles once, with what they keep.

    WHY nothing is left to a later process: the compile with the kept regions replaces Inductor's
    compile of the graph; where Inductor's caches held the graph as given it costs a cold compile
    once, which any later process keeping them would pay instead (its own caches then serve it)."""
    decided: dict[str, Decision] = {}

    def collect(graph: fx.GraphModule, candidate: Candidate, decisions: list[Decision]) -> bool:
        decide(graph, candidate, decisions)
        decided[decisions[-1].anchor] = decisions[-1]
        return False

    _compile_cold_kernels_first(gm, inputs, opts, config_patches, index, budget)
    _build(gm, inputs, dataclasses.replace(opts, dump_dir=None), config_patches, collect, index, compile_graph=False)
    return decided


#: Decisions of the pass that only sends the fused kernels' compiles (``_compile_cold_kernels_first``).
_PREPARED_RULE = "its fused kernels sent to the compile workers before the regions are measured"


def _compile_cold_kernels_first(gm: fx.GraphModule, inputs: Sequence[Any], opts: FusionOptions,
                                config_patches: dict[str, Any], index: int, budget: DecisionBudget) -> None:
    """Send the fused kernels of every region that will be measured (no cached decision; one region
    per decision key) to the compile workers at once, and wait for them: without a limit for all of
    them (``SETTLE_WAIT_S`` at most), else until ``budget`` is spent; those still compiling then stay
    with their batches in ``budget.compiling`` (their regions are not measured in this process, and
    Triton's disk cache has them for the next).  Where no worker pool runs, nothing is sent and the
    measurements compile the kernels themselves.

    WHY all at once: with every region measured, one measurement after another compiling its own
    kernels made the first call of ResNet-50's bf16 inference graph 46.8 s against Inductor's 12.0 s;
    with the kernels compiled side by side in the workers first, 37.3 s against 11.5 s (H200;
    ``h200/realnets/cudagraphs-decide-all``).

    NOTE: waiting for all of them before the first measurement, not for each region's own as it is
    measured: Inductor's compile of the measured region sends its kernels to the same workers, behind
    every fused kernel sent, so the first measurement took 12.2 s (Inductor 11.8 s of it) and a
    budget of twice Inductor's compile (22.8 s), judged by it, allowed no second: ResNet-50 bf16
    inference under reduce-overhead kept one region (0.98x), where waiting for all first kept 52 of
    53 (1.29x; H200, a fresh machine: ``python -m fusion_backend bench --log --suite
    demos/realnets/resnet50.py --dtype bf16 --mode infer --backends inductor,fusion --compile-mode
    reduce-overhead``)."""
    batches: dict[str, deferred.Preparation] = {}

    def send(graph: fx.GraphModule, candidate: Candidate, decisions: list[Decision]) -> bool:
        timing = pending_timing(graph, candidate, policy=opts.decide, cache_dir=opts.cache_dir,
                                inductor_patches=config_patches)  # fmt: skip
        if timing is not None and timing.key not in batches:  # one region per decision key
            batch = deferred.prepare(graph, candidate, inputs, opts.strict)
            if batch is not None:
                batches[timing.key] = batch
        decisions.append(Decision(candidate.pattern, candidate.summary, candidate.nodes[0].name, False,
                                  _PREPARED_RULE))  # fmt: skip
        return False

    _build(gm, inputs, dataclasses.replace(opts, dump_dir=None), config_patches, send, index, compile_graph=False)
    if not batches:
        return
    if math.isinf(budget.seconds):
        for batch in batches.values():
            batch.collect(max(0.0, deferred.SETTLE_WAIT_S - budget.spent()))
    else:
        while not all(batch.ready() for batch in batches.values()) and not budget.spent_all():
            time.sleep(_COMPILE_POLL_S)
        for key, batch in batches.items():
            if batch.ready():
                batch.collect(0.0)  # its checks (``compile_pool.Batch.collect``)
            else:
                budget.compiling[key] = batch
    log.info("compiled the fused kernels of %d of %d regions in the workers in %.1f s before measuring them",
             len(batches) - len(budget.compiling), len(batches), budget.spent())


#: How often ``_compile_cold_kernels_first`` looks whether the kernels it waits for have compiled.
_COMPILE_POLL_S = 0.05


def _decide_regions(untouched: fx.GraphModule, inputs: Sequence[Any], opts: FusionOptions,
                    config_patches: dict[str, Any], index: int,
                    budget: DecisionBudget) -> tuple[dict[str, Decision], GraphReport]:
    """Every region of the graph decided on ``inputs`` within ``budget``, by anchor in match order,
    and the report of the graph with none rewritten (its near misses); a long settle logs its
    progress."""
    decided: dict[str, Decision] = {}
    began = last_log = time.perf_counter()

    def decide_one(graph: fx.GraphModule, candidate: Candidate, decisions: list[Decision]) -> bool:
        nonlocal last_log
        d = decide(graph, candidate, inputs, policy=opts.decide,
                   margin=opts.decide_margin, cache_dir=opts.cache_dir, inductor_patches=config_patches,
                   strict=opts.strict, budget=budget)
        decided[d.anchor] = d
        decisions.append(d)
        if time.perf_counter() - last_log > PROGRESS_EVERY_S:
            last_log = time.perf_counter()
            decision_log.info("settling graph_%d: %d regions decided in %.1f s (%s)", index, len(decided),
                              last_log - began, budget.describe())
        return False

    built = _build(untouched, inputs, dataclasses.replace(opts, dump_dir=None), config_patches, decide_one, index)
    decision_log.info("settling graph_%d: %d regions decided in %.1f s, %d of them measured (%s)", index,
                      len(decided), time.perf_counter() - began, budget.measured, budget.describe())
    return ({} if built.report.fallbacks else decided), built.report


def _replay(decided: dict[str, Decision], graph: fx.GraphModule, candidate: Candidate,
            decisions: list[Decision]) -> bool:
    """``keep`` for a graph whose regions are decided already: the decision of the candidate's anchor."""
    d = decided.get(candidate.nodes[0].name)
    if d is None:
        d = Decision(candidate.pattern, candidate.summary, candidate.nodes[0].name, False,
                     "not found when the graph was decided; Inductor keeps it")
    decisions.append(d)
    return d.fused


def _distributed() -> bool:
    """Whether this process trains with others (``torch.distributed`` initialised, more than one rank)."""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _agree_across_ranks(decided: dict[str, Decision], graph: fx.GraphModule) -> dict[str, Decision]:
    """Keep a region only where every rank keeps it, so that every rank runs the same graph: the
    ranks exchange their graph's digest and the anchors of the regions they keep (one
    ``all_gather_object``), and a region stays where every rank's list names it.  A region a rank
    did not decide counts as not kept there: which alternates a rank decides follows what it kept
    (an alternate is decided only where no kept region holds its nodes), so the ranks' lists of
    decisions may differ where their graphs do not.  Where the graphs differ, nothing is kept.
    Every rank settles at the same call (``deferred.DISTRIBUTED_SETTLE_CALL``), so the collective
    meets on all of them."""
    dist = torch.distributed
    digest = hashlib.sha256(graph.code.encode()).hexdigest()
    kept = sorted(a for a, d in decided.items() if d.fused)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (digest, kept))
    if any(other_digest != digest for other_digest, _ in everyone):
        return {a: dataclasses.replace(d, fused=False, rule="the ranks' graphs differ: none of their regions is kept")
                if d.fused else d for a, d in decided.items()}
    common = set(kept).intersection(*(set(other_kept) for _, other_kept in everyone))
    return {a: d if (not d.fused or a in common) else dataclasses.replace(
                d, fused=False, rule=f"kept on this rank ({d}) but not on every rank: Inductor keeps it")
            for a, d in decided.items()}


def _why_not_direct(gm: fx.GraphModule, opts: FusionOptions, patches: dict[str, Any]) -> Optional[str]:
    """``None`` when the rewritten graph may skip AOTAutograd and Inductor (``runtime/direct.py``), else why not."""
    if not opts.direct:
        return "option direct=False"
    if opts.inductor:
        return f"Inductor options were given ({', '.join(sorted(opts.inductor))})"
    if patches.get("triton.cudagraphs"):
        return "the mode asks for CUDA graphs, which Inductor provides"
    return why_not_direct(gm)


def _emit_trace_artifact(report: GraphReport) -> None:
    """Put the report into torch's structured trace (``TORCH_TRACE=dir``), where tlparse shows it
    beside Dynamo's and Inductor's artifacts.  A torch without ``trace_structured`` just skips."""
    trace_structured = getattr(getattr(torch, "_logging", None), "trace_structured", None)
    if trace_structured is None:
        return
    import json

    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"fusion_report_{report.graph_name}", "encoding": "json"},
        payload_fn=lambda: json.dumps(report.to_dict(), sort_keys=True),
    )


def _fall_back(opts: FusionOptions, stage: str, pattern: Optional[str], exc: BaseException) -> Fallback:
    what = f"pattern {pattern!r}" if pattern else "the fusion backend"
    message = f"{what} failed during {stage}: {type(exc).__name__}: {exc}"
    if opts.strict:
        raise RewriteError(message + " (strict=True; without it the graph falls back to Inductor)") from exc
    warnings.warn(f"fusion: {message}; compiling this graph with Inductor unchanged", stacklevel=3)
    log.warning("%s\n%s", message, traceback.format_exc())
    return Fallback(stage, pattern, f"{type(exc).__name__}: {exc}")


# What Dynamo puts on its graph module and placeholders outside ``meta`` (torch/_dynamo/output_graph.py).
_DYNAMO_MODULE_ATTRS = ("_param_name_to_source", "_source_to_user_stacks")


def _clone(gm: fx.GraphModule) -> fx.GraphModule:
    """A structural copy: Inductor may mutate the graph it compiles, and the rewrite, a deferred
    decision and a dump need the graph as Dynamo gave it.  Node metadata (fake values) is shared,
    parameters are not copied.

    WHY Dynamo's attributes too (the module's ``meta``, ``_param_name_to_source``, each
    placeholder's ``_dynamo_source``): AOTAutograd reads them to tell a Dynamo graph's parameters,
    which it marks static inputs.  A copy without them compiled with no static inputs: under CUDA
    graphs the parameters were copied into the graph's pool at every replay, and a graph left whole
    to Inductor missed the cache entries ``backend="inductor"`` stored for it (its key holds the
    static inputs)."""
    import copy

    clone = fx.GraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)
    clone.meta = dict(gm.meta)
    for attr in _DYNAMO_MODULE_ATTRS:
        if hasattr(gm, attr):
            setattr(clone, attr, getattr(gm, attr))
    sources = {n.name: n._dynamo_source for n in gm.graph.find_nodes(op="placeholder") if hasattr(n, "_dynamo_source")}
    for node in clone.graph.find_nodes(op="placeholder"):
        if node.name in sources:
            node._dynamo_source = sources[node.name]
    return clone


def _ensure_fake_values(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Graphs that do not come from Dynamo carry no fake values; propagate them from the inputs.

    WHY not for an autocast block's enter and exit alone (Dynamo records a block entered with
    ``enabled=False`` without values; they are no tensors anyway): propagating again runs every op on fake
    tensors, and under ``dynamic=True`` a module's float attribute (a norm's eps) reaches the graph as a
    tensor read with ``.item()``, which fake tensors cannot answer: the whole graph fell back to
    Inductor."""
    if all("example_value" in n.meta or "val" in n.meta for n in gm.graph.nodes
           if n.op != "output" and not (n.op == "call_function" and n.target in AUTOCAST_MARKERS)):
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


@functools.cache
def _passing_through_dynamo(kind: type) -> type:
    """``kind`` made a ``ShortenTraceback`` too: Dynamo lets that through as itself instead of wrapping
    it in ``BackendCompilerFailed``, and cuts its traceback to the backend's frame.  Its text stays the
    one line it was raised with (Dynamo appends hints to an exception's ``args`` on its way out)."""

    def __str__(self: Any) -> str:
        return self.message

    return type(kind.__name__, (kind, torch._dynamo.exc.ShortenTraceback),
                {"__module__": kind.__module__, "__qualname__": kind.__qualname__, "__str__": __str__})


def _as_users_error(error: ConfigurationError) -> ConfigurationError:
    """WHY: a bad option or switch is the user's to fix; Dynamo's wrapper would bury its one-line
    message under a traceback through Dynamo's and our internals."""
    surfaced = _passing_through_dynamo(type(error))(*error.args, first_useful_frame=sys._getframe(1))
    surfaced.message = str(error)
    return surfaced.with_traceback(None)


def _inductor_patches(mode: Optional[str], opts: FusionOptions) -> dict[str, Any]:
    """Inductor config patches: ``mode``'s and the user's Inductor options.  A graph that keeps fused
    ops compiles with the autograd-free pass added (``ops/autograd_free.py``); one that keeps none
    compiles under these alone, as ``backend="inductor"`` would (same code, same cache entries)."""
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode, None))
    patches.update(opts.inductor)
    return patches


def _training_graph(example_inputs: Sequence[Any]) -> bool:
    """Whether AOTAutograd makes a backward for a graph of these inputs: grad mode on and an input (a
    parameter, as Dynamo lifts them, or the user's) that requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)


# NOTE: AOTAutograd compiles a training graph's backward at its first backward call, not with the forward:
# an Inductor failure there (the CPU code generator's assertion on a DeepLab-style pooled branch whose
# upsample's gradient scatters into a fused op's output, torch 2.13) escaped from ``loss.backward()``,
# after the point where the backend falls back to the graph as given.  The rewritten graph's backward is
# therefore compiled with its forward (``tests/e2e/test_backend.py -k backward``).
def _compile_rewritten(gm: fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any]) -> Callable[..., Any]:
    """Inductor's compile of a rewritten graph (the autograd-free ops' pass added), a training graph's
    backward included, so that a failure anywhere in it is the compile's and falls back (NOTE above)."""
    functorch_config = torch._functorch.config
    if _training_graph(example_inputs) and hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        with functorch_config.patch(force_non_lazy_backward_lowering=True):
            return _compile_inductor(gm, example_inputs, with_autograd_free_pass(patches))
    return _compile_inductor(gm, example_inputs, with_autograd_free_pass(patches))


def _compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs), config_patches=patches or None)
