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

import itertools
import logging
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.fx as fx

from .errors import RewriteError
from .kernels import compile_pool
from .match.engine import Candidate, registered_patterns, run_patterns
from .ops.autograd_free import with_autograd_free_pass
from .options import FusionOptions
from .report import Decision, Fallback, GraphReport, publish
from .runtime import deferred
from .runtime.decision import PENDING_RULE, decide, needs_timing
from .runtime.direct import direct_module, why_not_direct

log = logging.getLogger("fusion_backend")
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
    opts = FusionOptions.parse(options, tuple(registered_patterns()))
    cuda = next((t.get_device() for t in example_inputs if isinstance(t, torch.Tensor) and t.is_cuda), None)
    if cuda is not None:  # before any kernel of this graph compiles, here or in a worker
        compile_pool.use_inductors_triton_setup(cuda)
    config_patches = _inductor_patches(mode, opts)
    index = next(_graph_counter)
    times: dict[str, float] = {}
    # The rewrite works on a copy (``work``); where nothing is kept, Dynamo's graph itself goes to
    # Inductor, which may mutate it: nothing reads it after that but a dump, which gets a copy.
    original = _clone(gm) if opts.dump_dir else gm
    before_code = gm.code if opts.dump_dir else ""

    current = {"stage": "normalize", "pattern": None}

    def on_stage(stage: str, pattern: Optional[str]) -> None:
        current.update(stage=stage, pattern=pattern)

    work = _clone(gm)
    _ensure_fake_values(work, example_inputs)
    fallbacks: list[Fallback] = []
    matches, near_misses = [], []
    rewritten: Optional[fx.GraphModule] = None
    decisions: list[Decision] = []

    preparations: list[Any] = []
    may_defer = opts.defer and deferred.deferrable(gm, example_inputs)

    def keep(graph: fx.GraphModule, candidate: Candidate) -> bool:
        if may_defer and needs_timing(graph, candidate.pattern, candidate.nodes, policy=opts.decide,
                                       cache_dir=opts.cache_dir, inductor_patches=config_patches):
            preparation = deferred.prepare(graph, candidate.pattern, candidate.nodes, example_inputs, opts.strict)
            if preparation is not None:
                preparations.append(preparation)
                decisions.append(Decision(candidate.pattern, candidate.summary, candidate.nodes[0].name, False,
                                          PENDING_RULE, pending=True))
                return False
        decisions.append(decide(
            graph, candidate.pattern, candidate.summary, candidate.nodes, example_inputs, policy=opts.decide,
            margin=opts.decide_margin, cache_dir=opts.cache_dir, inductor_patches=config_patches,
            strict=opts.strict,
        ))  # fmt: skip
        return decisions[-1].fused

    t0 = time.perf_counter()
    try:
        result = run_patterns(work, opts.patterns, strict=opts.strict, on_stage=on_stage, keep=keep)
        matches, near_misses = result.matches, result.near_misses
        rewritten = work
    except _CONTROL_FLOW:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure must fall back, never lose the graph
        fallbacks.append(_fall_back(opts, current["stage"], current["pattern"], exc))
        decisions.clear()  # nothing was rewritten
        preparations.clear()
    times["match+decide+rewrite"] = time.perf_counter() - t0
    # the pending regions are decided later, on the graph as Dynamo gave it: copied before Inductor
    # compiles (and may mutate) that graph
    untouched = _clone(gm) if preparations else None

    t0 = time.perf_counter()
    compiled = None
    runner, notes = "inductor", []
    if rewritten is not None and matches:
        why_not = _why_not_direct(rewritten, opts, config_patches)
        if why_not is None:
            try:
                compiled, runner = direct_module(rewritten).forward, "direct"
            except Exception as exc:  # noqa: BLE001 - Inductor can still run the rewritten graph
                fallbacks.append(_fall_back(opts, "direct", None, exc))
        else:
            notes.append(f"runs through Inductor, not directly: {why_not}")
    if compiled is None and rewritten is not None and matches:
        try:
            compiled = _compile_inductor(rewritten, example_inputs, with_autograd_free_pass(config_patches))
        except _CONTROL_FLOW:
            raise
        except Exception as exc:  # noqa: BLE001
            patterns = sorted({m.pattern for m in matches})
            fallbacks.append(_fall_back(opts, "compile", ",".join(patterns), exc))
            matches = []
    if compiled is None:
        compiled = _compile_inductor(original, example_inputs, config_patches)
    times["inductor" if runner == "inductor" else "direct"] = time.perf_counter() - t0
    if untouched is not None:
        settled_options = {**(options or {}), "defer": False}
        decide_later = deferred.in_compile_state(lambda: fusion(untouched, example_inputs, mode, settled_options))
        compiled = deferred.DeferredGraph(compiled, preparations, decide_later, opts.strict)

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
    kernels = {(m.pattern, m.nodes[0]): m.kernel for m in report.matches}
    for d in report.decisions:  # one line per decision
        if d.pending:
            log.info("pending %s: %s: %s", d.pattern, d.summary, d)
        elif (d.pattern, d.anchor) in kernels:
            log.info("fused %s: %s (%s): %s", d.pattern, d.summary, kernels[d.pattern, d.anchor], d)
        else:
            log.info("left %s to Inductor: %s: %s", d.pattern, d.summary, d)
    for n in report.near_misses:
        log.debug("near miss %s at %s: %s: %s", n.pattern, n.node, n.reason.value, n.message)
    if opts.dump_dir is not None:
        from .dump import write_dump

        write_dump(opts.dump_dir, report, before_code, rewritten if matches else None, original)
    _emit_trace_artifact(report)
    publish(report)
    return compiled


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
    """Graphs that do not come from Dynamo carry no fake values; propagate them from the inputs."""
    if all("example_value" in n.meta or "val" in n.meta for n in gm.graph.nodes if n.op not in ("output",)):
        return
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    FakeTensorProp(gm, mode).propagate(*example_inputs)


def _inductor_patches(mode: Optional[str], opts: FusionOptions) -> dict[str, Any]:
    """Inductor config patches: ``mode``'s and the user's Inductor options.  A graph that keeps fused
    ops compiles with the autograd-free pass added (``ops/autograd_free.py``); one that keeps none
    compiles under these alone, as ``backend="inductor"`` would (same code, same cache entries)."""
    patches: dict[str, Any] = {}
    if mode and mode != "default":
        patches.update(torch._inductor.list_mode_options(mode, None))
    patches.update(opts.inductor)
    return patches


def _compile_inductor(gm: fx.GraphModule, example_inputs: Sequence[Any], patches: dict[str, Any]) -> Callable[..., Any]:
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, list(example_inputs), config_patches=patches or None)
