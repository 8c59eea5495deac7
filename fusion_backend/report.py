"""Structured records of what the backend decided, per compiled graph.

Everything here is a frozen dataclass of plain values (node *names*, not ``fx.Node`` objects), so a
report survives the graph it describes, prints readably, and round-trips through JSON
(``GraphReport.to_dict`` / ``GraphReport.from_dict``).

Reports reach their readers through sinks: ``collect_reports()`` is a context manager that gathers
every report produced while it is open (used by ``fusion_backend.explain`` and the pytest fixture).
"""

from __future__ import annotations

import contextlib
import enum
import re
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch.fx as fx


class ReasonKind(str, enum.Enum):
    """Why a candidate region was not (entirely) fused.  A closed set: tests and tools switch on it."""

    UNSUPPORTED_OP = "unsupported_op"
    """The value flows into an op no pattern can fuse (e.g. ``softmax``)."""
    SHARED_INTERMEDIATE = "shared_intermediate"
    """An intermediate is also used outside the chain (or is a graph output), so it must be produced."""
    UNSUPPORTED_OPERAND = "unsupported_operand"
    """A second operand is neither a number, a 0-d tensor nor a per-channel tensor."""
    UNSUPPORTED_ARGUMENT = "unsupported_argument"
    """A known op with an argument the fused kernels do not implement (``return_indices=True``...)."""
    DIMENSION_MISMATCH = "dimension_mismatch"
    """E.g. a 2-d pool after a 3-d conv, or a mean that does not cover every spatial dim."""
    UNSUPPORTED_DTYPE = "unsupported_dtype"
    """Integer, complex or otherwise unsupported element type."""
    CHAIN_TOO_LONG = "chain_too_long"
    """The chain reached the fused op's maximum length; the rest stays outside."""
    CLAIMED = "claimed"
    """The nodes were already taken by a pattern that precedes this one (``match.engine.Precedence``)."""
    NO_EPILOGUE = "no_epilogue"
    """A conv with nothing fusible after it."""
    MISSING_METADATA = "missing_metadata"
    """The graph carries no shape/dtype metadata for a node the decision depends on."""
    EMPTY_TENSOR = "empty_tensor"
    """A tensor of the region has no elements (e.g. a batch of 0): nothing to fuse, Inductor's code
    runs it as eager does."""


@dataclass(frozen=True)
class SourceLine:
    """Where in the user's code a node came from (the innermost frame of its stack trace), and the
    path of the innermost module that ran it (``net.3`` inside ``self.net = nn.Sequential(...)``),
    where Dynamo recorded one: every layer of a ``Sequential`` has the same source line."""

    file: str
    line: int
    code: str = ""
    module: str = ""

    @property
    def location(self) -> str:
        """``model.py:10``, or ``model.py:10 (net.3)`` with the module path."""
        short = self.file.rsplit("/", 1)[-1]
        return f"{short}:{self.line}" + (f" ({self.module})" if self.module else "")

    def __str__(self) -> str:
        return self.location + (f"  `{self.code}`" if self.code else "")


@dataclass(frozen=True)
class Match:
    """A region rewritten into one fused op call."""

    pattern: str
    nodes: tuple[str, ...]
    source_lines: tuple[SourceLine, ...]
    fused_op: str
    config: str
    kernel: str
    """``"triton"`` or ``"reference: <why>"``: what will run for the example inputs' device/dtype."""
    summary: str
    """One line, e.g. ``conv_transpose3d -> leaky_relu -> mul -> leaky_relu -> max_pool3d``."""


@dataclass(frozen=True)
class NearMiss:
    """A candidate that stopped short: ``node`` is where matching stopped and ``reason`` why."""

    pattern: str
    anchor: str
    node: str
    reason: ReasonKind
    message: str
    source_line: Optional[SourceLine] = None


@dataclass(frozen=True)
class Decision:
    """Whether a matched region was rewritten, and the rule that decided (``runtime/decision.py``).

    ``fused_ms`` / ``inductor_ms``: the measured milliseconds per call of the fused op and of
    Inductor's code for the region (forward, or forward + backward where gradients flow; the median
    of the timing rounds); ``None`` when the policy decided without timing.  ``speedup``: Inductor's
    time over the fused op's (the median of the rounds' ratios; ``inductor_ms / fused_ms`` when not
    given).  ``fused_gpu_ms`` / ``inductor_gpu_ms`` / ``gpu_speedup``: the same on the GPU, with the
    host ahead of the device (``runtime/region_timing.py``); ``None`` where not measured.
    ``fused_host_ms`` / ``inductor_host_ms``: the host time per call of each; ``in_step_speedup``:
    Inductor's time over the fused op's in a host-bound step (``decision.in_step_speedup``, the median
    of the rounds').  ``cached``: the times came from the cache."""

    pattern: str
    summary: str
    anchor: str
    fused: bool
    rule: str
    fused_ms: Optional[float] = None
    inductor_ms: Optional[float] = None
    cached: bool = False
    speedup: Optional[float] = None
    fused_gpu_ms: Optional[float] = None
    inductor_gpu_ms: Optional[float] = None
    gpu_speedup: Optional[float] = None
    fused_host_ms: Optional[float] = None
    inductor_host_ms: Optional[float] = None
    in_step_speedup: Optional[float] = None
    pending: bool = False
    """Not decided yet: Inductor's code runs the region until the fused op's kernels have compiled
    in the background (``runtime/deferred.py``); the graph's next report has the decision."""

    def __str__(self) -> str:
        verdict = "pending" if self.pending else "fused" if self.fused else "left to Inductor"
        if self.fused_ms is None or self.inductor_ms is None:
            return f"{verdict}: {self.rule}"
        source = ", cached" if self.cached else ""
        speedup = self.speedup if self.speedup is not None else self.inductor_ms / self.fused_ms
        other_times = ""
        if self.fused_gpu_ms is not None and self.inductor_gpu_ms is not None and self.gpu_speedup is not None:
            other_times = f"; GPU {self.fused_gpu_ms:.3f} vs {self.inductor_gpu_ms:.3f} ms, {self.gpu_speedup:.2f}x"
        if self.fused_host_ms is not None and self.inductor_host_ms is not None:
            other_times += f"; host {self.fused_host_ms:.3f} vs {self.inductor_host_ms:.3f} ms"
        return (f"{verdict}: {self.rule} (fused {self.fused_ms:.3f} ms vs Inductor {self.inductor_ms:.3f} ms, "
                f"{speedup:.2f}x{other_times}{source})")


@dataclass(frozen=True)
class GraphCheck:
    """The graph compiled with the regions ``kept`` (their anchors), timed against Inductor's code for
    the whole graph (``runtime/graph_timing.py``): milliseconds per call of each (forward, or forward +
    backward), ``speedup`` (the median of the rounds' ratios, Inductor's time over the fused graph's),
    whether that graph was kept, and the rule that decided.  ``cached``: the times came from the cache."""

    kept: tuple[str, ...]
    fused_ms: float
    inductor_ms: float
    speedup: float
    fused: bool
    rule: str
    cached: bool = False

    def __str__(self) -> str:
        return (f"{'kept' if self.fused else 'dropped'}: {self.rule} (with {len(self.kept)} fused region(s): "
                f"{self.fused_ms:.3f} ms vs Inductor's graph {self.inductor_ms:.3f} ms, {self.speedup:.2f}x"
                f"{', cached' if self.cached else ''})")


@dataclass(frozen=True)
class Fallback:
    """The graph (or a region) was compiled without the rewrite because ``stage`` failed."""

    stage: str
    pattern: Optional[str]
    error: str


@dataclass(frozen=True)
class GraphReport:
    """Everything decided for one graph Dynamo handed to the backend."""

    graph_index: int
    graph_name: str
    matches: tuple[Match, ...] = ()
    near_misses: tuple[NearMiss, ...] = ()
    fallbacks: tuple[Fallback, ...] = ()
    stage_seconds: dict[str, float] = field(default_factory=dict)
    enabled_patterns: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    decisions: tuple[Decision, ...] = ()
    """One per matched region, rewritten or not, in match order."""
    runner: str = "inductor"
    """What runs the compiled graph: ``"inductor"`` (AOTAutograd + Inductor) or ``"direct"`` (only
    fused ops and glue, run as plain FX code with eager autograd: ``fusion_backend/runtime/direct.py``)."""
    graph_checks: tuple[GraphCheck, ...] = ()
    """A settled graph's whole-graph comparisons with Inductor's code, in the order they were made
    (``runtime/graph_timing.py``): each one dropped a region or kept the graph."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for nm in d["near_misses"]:
            nm["reason"] = nm["reason"].value if isinstance(nm["reason"], ReasonKind) else nm["reason"]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GraphReport:
        def line(x: Optional[dict[str, Any]]) -> Optional[SourceLine]:
            return None if x is None else SourceLine(**x)

        return GraphReport(
            graph_index=d["graph_index"],
            graph_name=d["graph_name"],
            matches=tuple(
                Match(**{**m, "nodes": tuple(m["nodes"]), "source_lines": tuple(SourceLine(**s) for s in m["source_lines"])})
                for m in d["matches"]
            ),
            near_misses=tuple(
                NearMiss(**{**n, "reason": ReasonKind(n["reason"]), "source_line": line(n["source_line"])})
                for n in d["near_misses"]
            ),
            fallbacks=tuple(Fallback(**f) for f in d["fallbacks"]),
            stage_seconds=dict(d["stage_seconds"]),
            enabled_patterns=tuple(d["enabled_patterns"]),
            notes=tuple(d["notes"]),
            decisions=tuple(Decision(**x) for x in d.get("decisions", ())),
            runner=d.get("runner", "inductor"),
            graph_checks=tuple(GraphCheck(**{**c, "kept": tuple(c["kept"])}) for c in d.get("graph_checks", ())),
        )

    def counts(self) -> dict[str, int]:
        """Number of matches per pattern name."""
        out: dict[str, int] = {}
        for m in self.matches:
            out[m.pattern] = out.get(m.pattern, 0) + 1
        return out

    def __str__(self) -> str:
        left = [d for d in self.decisions if not d.fused]
        lines = [f"graph {self.graph_index} ({self.graph_name}): {len(self.matches)} fused, "
                 + (f"{len(left)} left to Inductor, " if left else "")
                 + f"{len(self.near_misses)} near miss(es), {len(self.fallbacks)} fallback(s); runs {self.runner}"]
        decided = {(d.pattern, d.anchor): d for d in self.decisions}
        for m in self.matches:
            lines.append(f"  [fused] {m.pattern}: {m.summary}  -> {m.fused_op} ({m.kernel})")
            decision = decided.get((m.pattern, m.nodes[0]))
            if decision is not None:
                lines.append(f"          {decision}")
            for s in m.source_lines:
                lines.append(f"          {s}")
        for d in left:
            lines.append(f"  [inductor] {d.pattern}: {d.summary} from `{d.anchor}`: {d}")
        for n in self.near_misses:
            where = f"  at {n.source_line}" if n.source_line else ""
            lines.append(f"  [miss]  {n.pattern} from `{n.anchor}` stopped at `{n.node}`: {n.reason.value}: {n.message}{where}")
        for f in self.fallbacks:
            lines.append(f"  [fallback] {f.stage}" + (f" ({f.pattern})" if f.pattern else "") + f": {f.error}")
        for check in self.graph_checks:
            lines.append(f"  [graph] {check}")
        for note in self.notes:
            lines.append(f"  [note] {note}")
        if self.stage_seconds:
            lines.append("  time: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in self.stage_seconds.items()))
        return "\n".join(lines)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


_ROOT = re.compile(r"^L\['self'\]\.?")


def module_path_of(node: fx.Node) -> str:
    """The innermost module's path under the compiled module (``net.3``) from the node's
    ``nn_module_stack`` (Dynamo records it, keys like ``L['self'].net.3``); ``""`` where none is
    recorded or the node ran in the compiled module's own ``forward``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    innermost = list(stack.values())[-1]
    path = innermost[0] if isinstance(innermost, tuple) else str(innermost)
    return _ROOT.sub("", str(path))


def source_line_of(node: fx.Node) -> Optional[SourceLine]:
    """The innermost user frame recorded in ``node.meta["stack_trace"]`` (Dynamo sets it), with the
    node's module path (:func:`module_path_of`)."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    lines = trace.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        m = _FRAME.search(lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.search(lines[i + 1]) else ""
            return SourceLine(m.group("file"), int(m.group("line")), code, module_path_of(node))
    return None


def source_lines_of(nodes: list[fx.Node]) -> tuple[SourceLine, ...]:
    """The distinct user source lines of ``nodes``, in order of first appearance; a line without a
    module path is left out where the same line is listed with one (``F.gelu(self.conv(x))``: the
    conv ran in ``conv``, the gelu in the model's own forward)."""
    seen: dict[SourceLine, None] = {}
    for node in nodes:
        line = source_line_of(node)
        if line is not None:
            seen.setdefault(line, None)
    with_module = {(s.file, s.line) for s in seen if s.module}
    return tuple(s for s in seen if s.module or (s.file, s.line) not in with_module)


# ------------------------------------------------------------------------------------------------
# Sinks

_local = threading.local()


def _sinks() -> list[list[GraphReport]]:
    if not hasattr(_local, "sinks"):
        _local.sinks = []
    return _local.sinks


@contextlib.contextmanager
def collect_reports(into: Optional[list[GraphReport]] = None) -> Iterator[list[GraphReport]]:
    """Collect every ``GraphReport`` produced (in this thread) while the block runs, into ``into``
    (a new list where not given).

    >>> with collect_reports() as reports:  # doctest: +SKIP
    ...     torch.compile(model, backend="fusion")(x)
    >>> reports[0].counts()  # doctest: +SKIP
    {'conv_epilogue': 1}
    """
    bucket: list[GraphReport] = [] if into is None else into
    _sinks().append(bucket)
    try:
        yield bucket
    finally:
        # by identity: ``list.remove`` compares by ``==``, and a nested block's bucket holding the
        # same reports would take the outer one's place
        sinks = _sinks()
        del sinks[next(i for i, b in enumerate(sinks) if b is bucket)]


def publish(report: GraphReport) -> None:
    """Hand a finished report to every open sink."""
    for bucket in _sinks():
        bucket.append(report)
