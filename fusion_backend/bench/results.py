"""Results of a run as frozen dataclasses, and their exact JSON round-trip.

Shape of a report: one :class:`CaseResult` per workload x dtype x mode (with its roofline), holding one
:class:`ItemResult` per backend.  An item's :class:`Status` is the first thing to read: only ``ok``
items carry timings, so a wrong or crashing backend can never appear as a speedup.

JSON: :meth:`BenchReport.to_dict` writes every dataclass field (plus a few derived numbers marked by
``json_extras``, a flat ``rows`` list for spreadsheets and pandas, and the ``verdict`` of
:mod:`fusion_backend.bench.verdict`); :meth:`BenchReport.from_dict` rebuilds an equal report from it,
driven by the dataclasses' type hints, ignoring the derived keys.  Non-finite floats are
written as the strings ``"inf"``, ``"-inf"``, ``"nan"`` so the file is strict JSON.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import statistics
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from .backends import pick_contenders
from .config import BenchConfig
from .correctness import CheckResult
from .measure import MemoryStats, TimingStats
from .roofline import DeviceRates, Roofline
from .verdict import verdict_of

SCHEMA_VERSION = 1


class Status(str, enum.Enum):
    """Outcome of one item.

    ``OK``: matched the reference and was measured.  ``FAIL``: ran, but its output or a gradient differs
    from eager beyond tolerance; never timed.  ``ERROR``: raised (compile error, unsupported op, out of
    memory); the message is kept.
    """

    OK = "ok"
    FAIL = "FAIL"
    ERROR = "ERROR"


@dataclass(frozen=True)
class ItemResult:
    """One backend on one workload x dtype x mode.

    ``compile_s`` is the wall time of the first call (forward, plus backward in train mode), which is
    where ``torch.compile`` compiles; for eager it is just a first call.  ``warm``/``cold`` are the
    timings with L2 warm / flushed; ``memory`` the step's memory; ``graph_breaks`` Dynamo's count for
    compiled backends.  ``error`` holds the failed checks (FAIL) or the exception (ERROR); ``notes``
    says why a number is missing (e.g. memory under CUDA graphs) and what the fusion backend decided.
    ``settle_s``: where the fusion backend deferred decisions past the first call (its option ``defer``),
    the seconds from the first call's end until a step had run on the settled code (background compiles
    waited for, decisions measured, graph recompiled, one step; ``runner._settled_step``); None otherwise.
    ``from_inductor_caches``: whether every graph Inductor compiled during the first call came from its
    disk caches (True: a warm first call), or at least one was compiled (False); None where Inductor
    compiled nothing there (eager, the fusion backend's direct runner).
    ``fused_regions`` is how many regions the fusion backend rewrote when it compiled the item
    (``None`` for other backends): with 0 the item runs Inductor's code for the whole graph, so its
    time differs from Inductor's only by the measurement's noise.
    """

    workload: str
    dtype: str
    mode: str
    backend: str
    status: Status
    error: str = ""
    check: CheckResult | None = None
    compile_s: float | None = None
    settle_s: float | None = None
    from_inductor_caches: bool | None = None
    warm: TimingStats | None = None
    cold: TimingStats | None = None
    memory: MemoryStats | None = None
    graph_breaks: int | None = None
    notes: tuple[str, ...] = ()
    fused_regions: int | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    @property
    def median_ms(self) -> float | None:
        """Warm median in ms, only for ``ok`` items that were timed."""
        return self.warm.median_ms if self.ok and self.warm is not None else None

    @property
    def cold_median_ms(self) -> float | None:
        return self.cold.median_ms if self.ok and self.cold is not None else None


@dataclass(frozen=True)
class CaseResult:
    """Every backend on one workload x dtype x mode, with the workload's roofline there.

    ``error`` is set when the case could not run at all (model build or the eager reference failed);
    its items then all carry ``ERROR``.
    """

    workload: str
    dtype: str
    mode: str
    roofline: Roofline | None
    items: tuple[ItemResult, ...]
    error: str = ""

    def item(self, backend: str) -> ItemResult | None:
        return next((i for i in self.items if i.backend == backend), None)

    def speedup(self, backend: str, baseline: str, *, cold: bool = False) -> float | None:
        """How many times faster ``backend`` ran than ``baseline`` (``None`` unless both are ok and
        timed): the median over the rounds of each round's ratio (``baseline``'s round median over
        ``backend``'s) where both were timed in the same rounds, else the ratio of their medians.

        WHY paired rounds: the backends of a case are timed repetition by repetition in each round
        (``runner.py``), so a round's two medians come from the same stretch of host time, and their
        ratio cancels the host's drift between rounds; the ratio of each one's quietest round
        compares two different stretches.  NOTE: on host-bound convnets rows where fusion runs
        Inductor's own code, the quietest-round ratio read 0.94-0.95x where the paired one read
        0.98-1.00x (``docs/perf/h100/convnets/bench.json``, ``round_medians_ms``)."""
        a, b = self.item(backend), self.item(baseline)
        if a is None or b is None:
            return None
        sa, sb = (a.cold, b.cold) if cold else (a.warm, b.warm)
        if sa is None or sb is None or not (a.ok and b.ok) or sa.median_ms <= 0:
            return None
        ra, rb = sa.round_medians_ms, sb.round_medians_ms
        if len(ra) > 1 and len(ra) == len(rb) and min(ra) > 0:
            return statistics.median(y / x for x, y in zip(ra, rb, strict=True))
        return sb.median_ms / sa.median_ms

    def floor_multiple(self, backend: str, *, cold: bool = False) -> float | None:
        """``backend``'s median as a multiple of the roofline floor."""
        item = self.item(backend)
        if item is None or self.roofline is None:
            return None
        return self.roofline.multiple(item.cold_median_ms if cold else item.median_ms)


@dataclass(frozen=True)
class BenchReport:
    """A whole run: what was asked (``config``, ``workloads`` name -> file), where (``environment``,
    ``rates``), when (``started``/``finished`` ISO-8601 UTC, ``wall_s``) and what came out (``cases``).
    ``complete`` is false when the run was interrupted: ``cases`` then holds the finished ones only.
    ``skipped``: the workloads that ran no row, each with why (a library not installed, no declared row
    asked for; ``runner.py``); they have no case."""

    config: BenchConfig
    environment: dict[str, Any]
    rates: DeviceRates | None
    workloads: dict[str, str]
    cases: tuple[CaseResult, ...]
    started: str = ""
    finished: str = ""
    wall_s: float = 0.0
    complete: bool = True
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def items(self) -> tuple[ItemResult, ...]:
        return tuple(i for c in self.cases for i in c.items)

    @property
    def all_ok(self) -> bool:
        return all(i.ok for i in self.items)

    def rows(self) -> list[dict[str, Any]]:
        """One flat dict per item: the numbers a spreadsheet wants, derived ones included.

        ``speedup_vs_inductor`` is against the run's Inductor backend that the verdict compares with
        (``inductor``, or ``inductor:MODE`` under ``--compile-mode``; see ``pick_contenders``).
        """
        _, inductor = pick_contenders(self.config.backends)
        out = []
        for case in self.cases:
            for item in case.items:
                mem = item.memory
                out.append({
                    "workload": item.workload, "dtype": item.dtype, "mode": item.mode,
                    "backend": item.backend, "status": item.status.value, "error": item.error,
                    "compile_s": item.compile_s, "settle_s": item.settle_s,
                    "from_inductor_caches": item.from_inductor_caches,
                    "median_ms": item.median_ms, "cold_median_ms": item.cold_median_ms,
                    "reps": item.warm.reps if item.warm else None,
                    "host_median_ms": item.warm.host_median_ms if item.warm else None,
                    "floor_ms": case.roofline.floor_ms if case.roofline else None,
                    "x_floor": case.floor_multiple(item.backend),
                    "x_floor_cold": case.floor_multiple(item.backend, cold=True),
                    "speedup_vs_eager": case.speedup(item.backend, "eager"),
                    "speedup_vs_inductor": case.speedup(item.backend, inductor) if inductor else None,
                    "total_peak_bytes": mem.total_peak_bytes if mem else None,
                    "step_peak_bytes": mem.step_peak_bytes if mem else None,
                    "held_bytes": mem.held_bytes if mem else None,
                    "resident_bytes": mem.resident_bytes if mem else None,
                    "max_rel_err": item.check.max_rel_err if item.check else None,
                    "graph_breaks": item.graph_breaks,
                })
        return out

    def to_dict(self) -> dict[str, Any]:
        """Strict-JSON-ready dict of the whole report (see the module docstring)."""
        data = encode(self)
        data["schema_version"] = SCHEMA_VERSION
        data["rows"] = encode(self.rows())
        data["verdict"] = encode(verdict_of(self))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchReport:
        """Inverse of :meth:`to_dict` (derived keys are ignored)."""
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"report schema version {version!r}; this reader understands {SCHEMA_VERSION}")
        return decode(cls, data)


# ---------------------------------------------------------------------------------------------------------
# Generic dataclass <-> JSON codec, driven by type hints.


def _encode_float(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def encode(obj: Any) -> Any:
    """Turn dataclasses, enums, paths, tuples and non-finite floats into strict-JSON values.

    A dataclass may define ``json_extras() -> dict`` to add derived values; they are written next to its
    fields and ignored by :func:`decode`.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = {f.name: encode(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        extras = getattr(obj, "json_extras", None)
        if callable(extras):
            out.update({k: encode(v) for k, v in extras().items()})
        return out
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, bool) or obj is None or isinstance(obj, (int, str)):
        return obj
    if isinstance(obj, float):
        return _encode_float(obj)
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): encode(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [encode(v) for v in obj]
    return str(obj)


def decode(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` from :func:`encode`'s output."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return data
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(tp)
        if data is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1:
            return decode(non_none[0], data)
        return data
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        kwargs = {f.name: decode(hints[f.name], data[f.name])
                  for f in dataclasses.fields(tp) if f.init and f.name in data}
        return tp(**kwargs)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if tp is float:
        return float(data)
    if tp in (int, str, bool):
        return data
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v) for v in data)
        return tuple(decode(a, v) for a, v in zip(args, data, strict=True))
    if origin is list:
        (arg,) = typing.get_args(tp)
        return [decode(arg, v) for v in data]
    if origin is dict:
        _, value_type = typing.get_args(tp)
        return {k: decode(value_type, v) for k, v in data.items()}
    return data
