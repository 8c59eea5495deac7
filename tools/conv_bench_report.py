"""The conv family benchmark's results: rows, their summaries, ``bench.json`` and ``bench.md``.

A :class:`Row` is one (conv shape, dtype, pass, hooks) measurement: the family kernel's median ms,
cuDNN's for the same pass without hooks, and for a hooked row ``unfused_ms``, cuDNN plus the separate
Inductor passes the hooks replace.  Nothing here times anything; ``tools/bench_conv.py`` fills the rows.

Summaries, per pass and dtype (:func:`summaries`), over the rows whose check passed:

* ``cudnn/ms geomean``: the geometric mean of ``cudnn_ms / ms`` over the plain rows (above 1: the
  family's kernel is faster than cuDNN);
* ``worst``: the plain row with the lowest ``cudnn_ms / ms``;
* ``hooked/plain geomean``: the geometric mean of a hooked row's ``ms`` over the plain row's of the same
  shape: what the hooks cost inside the kernel;
* ``beat unfused``: how many hooked rows have ``ms < unfused_ms``, of how many were timed.

A row whose check failed keeps its times in the JSON but shows ``MISMATCH`` in the markdown and is left
out of every summary: a wrong result is never counted as a speed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fusion_backend.bench.env import describe_code
from fusion_backend.bench.output import fmt_ms, fmt_x, render_table

PASSES = ("fprop", "dgrad", "wgrad")

#: What each pass's hooked row fuses (the ``hooks`` value of its rows).
HOOKS = {
    "fprop": "prologue bn+relu, epilogue stats",
    "dgrad": "relu' + bn-backward sums",
    "wgrad": "prologue bn+relu recomputed",
}


@dataclass
class Row:
    """One measurement (module docstring).  ``shape`` is ``ConvShape.label()``, ``params`` its
    ``params()``; ``hooks`` is ``"none"`` or a value of :data:`HOOKS`; times in ms (None: not
    measured or failed, ``error`` says why); ``ok``: the result matched the reference within
    ``tolerance`` (``rel_err``: the worst relative error of its outputs), None when unchecked.
    ``tile``: the family kernel's tile (``TileConfig.label``; None: not known, e.g. its plan was built
    before); ``tile_ms``: each candidate's ms where the choice timed them (this run or a cached one);
    ``kernels`` (``--profile``): per step of the row, the family's and the reference's, each GPU kernel's
    microseconds per call (``torch.profiler``), slowest first."""

    op: str
    shape: str
    params: dict[str, Any]
    models: list[str]
    dtype: str
    hooks: str
    ms: float | None = None
    cudnn_ms: float | None = None
    unfused_ms: float | None = None
    ok: bool | None = None
    rel_err: float | None = None
    tolerance: float | None = None
    error: str | None = None
    round_medians_ms: dict[str, list[float]] = field(default_factory=dict)
    tile: str | None = None
    tile_ms: dict[str, float] = field(default_factory=dict)
    kernels: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str, str, str]:
        """What identifies a row across runs (``--append`` replaces a row with the same key)."""
        return (self.op, self.shape, self.dtype, self.hooks)

    @property
    def plain(self) -> bool:
        return self.hooks == "none"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def _geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(map(math.log, values)) / len(values)) if values else None


@dataclass(frozen=True)
class Summary:
    """One pass and dtype's summary (module docstring)."""

    op: str
    dtype: str
    rows: int
    mismatches: int
    cudnn_over_ms: float | None
    worst: str | None
    worst_ratio: float | None
    hooked_over_plain: float | None
    beat_unfused: int
    hooked_timed: int


def summaries(rows: Sequence[Row]) -> list[Summary]:
    """Per pass (in :data:`PASSES` order) and dtype, the summary of ``rows``."""
    out = []
    groups = dict.fromkeys((r.op, r.dtype) for r in sorted(rows, key=lambda r: (PASSES.index(r.op), r.dtype)))
    for op, dtype in groups:
        mine = [r for r in rows if r.op == op and r.dtype == dtype]
        good = [r for r in mine if r.ok is not False and r.error is None]
        plain = [r for r in good if r.plain and r.ms and r.cudnn_ms]
        ratios = [(r.cudnn_ms / r.ms, r) for r in plain]
        worst = min(ratios, key=lambda t: t[0]) if ratios else None
        plain_ms = {r.shape: r.ms for r in plain}
        hooked = [r for r in good if not r.plain and r.ms]
        cost = [r.ms / plain_ms[r.shape] for r in hooked if r.shape in plain_ms]
        timed = [r for r in hooked if r.unfused_ms]
        out.append(Summary(op, dtype, len(mine), sum(r.ok is False for r in mine), _geomean([t[0] for t in ratios]),
                           worst[1].shape if worst else None, worst[0] if worst else None, _geomean(cost),
                           sum(r.ms < r.unfused_ms for r in timed), len(timed)))  # fmt: skip
    return out


def _status(row: Row) -> str:
    if row.error is not None:
        return "ERROR"
    return {True: "ok", False: "MISMATCH", None: "-"}[row.ok]


def rows_table(rows: Sequence[Row], *, markdown: bool = False) -> str:
    """One line per row: pass, dtype, shape, hooks, the three times, cuDNN/ms, unfused/ms, the check,
    the models and the kernel's tile."""
    headers = ["pass", "dtype", "shape", "hooks", "ms", "cudnn ms", "unfused ms", "cudnn/ms", "unfused/ms",
               "check", "models", "tile"]  # fmt: skip
    lines = []
    for r in rows:
        bad = r.ok is False or r.error is not None
        lines.append([r.op, r.dtype, r.shape, r.hooks, fmt_ms(r.ms), fmt_ms(r.cudnn_ms), fmt_ms(r.unfused_ms),
                      "-" if bad else fmt_x(_ratio(r.cudnn_ms, r.ms)), "-" if bad else fmt_x(_ratio(r.unfused_ms, r.ms)),
                      _status(r) + (f" {r.rel_err:.1e}" if r.rel_err is not None else ""), ",".join(r.models),
                      r.tile or "-"])  # fmt: skip
    right = [False] * 4 + [True] * 5 + [False] * 3
    return render_table(headers, lines, markdown=markdown, right=right)


def summary_table(rows: Sequence[Row], *, markdown: bool = False) -> str:
    """One line per pass and dtype (module docstring)."""
    headers = ["pass", "dtype", "rows", "mismatch", "cudnn/ms geomean", "worst (cudnn/ms)", "hooked/plain geomean",
               "hooked beat unfused"]  # fmt: skip
    lines = [[s.op, s.dtype, str(s.rows), str(s.mismatches), fmt_x(s.cudnn_over_ms),
              f"{s.worst} ({fmt_x(s.worst_ratio)})" if s.worst else "-", fmt_x(s.hooked_over_plain),
              f"{s.beat_unfused}/{s.hooked_timed}"] for s in summaries(rows)]  # fmt: skip
    return render_table(headers, lines, markdown=markdown, right=[False, False, True, True, True, False, True, True])


def format_markdown(rows: Sequence[Row], environment: dict[str, Any], notes: Sequence[str] = ()) -> str:
    """``bench.md``: how it was run, the summaries, the notes (skipped models, transposed convs), the rows."""
    gpu = environment.get("gpu")
    gpu_name = gpu.get("name") if isinstance(gpu, dict) else gpu
    lines = [
        "# Conv family kernels against cuDNN",
        "",
        f"Command: `{environment.get('command', '-')}`",
        "",
        f"GPU {gpu_name or '-'}, torch {environment.get('torch', '-')}, triton {environment.get('triton', '-')}, "
        f"cuDNN {environment.get('cudnn', '-')}, {describe_code(environment)}, "
        f"{environment.get('date_utc', '-')}.",
        "",
        "GPU ms per call (calls queued behind a GPU spin: the host's launch cost left out, as under CUDA "
        "graphs), median over rounds, L2 warm. "
        "`cudnn/ms` and `unfused/ms` above 1: the family's kernel is faster. A hooked row's `unfused ms` is "
        "cuDNN plus the Inductor passes its hooks replace; its `cudnn ms` is the plain pass's. `tile`: the "
        "family kernel's tile (M x N x K, warps, pipeline stages, the box load's rows x columns), the fastest "
        "of its candidates (their times in `bench.json`'s `tile_ms`).",
        "",
        "## Summary",
        "",
        summary_table(rows, markdown=True),
        "",
    ]
    if notes:
        lines += ["## Notes", "", *(f"- {n}" for n in notes), ""]
    lines += ["## Rows", "", rows_table(rows, markdown=True), ""]
    return "\n".join(lines)


def report_json(rows: Sequence[Row], environment: dict[str, Any], notes: Sequence[str] = ()) -> dict[str, Any]:
    """The ``bench.json`` document: ``environment`` (with ``command``), ``notes``, ``summaries``, ``rows``."""
    return {"environment": environment, "notes": list(notes),
            "summaries": [asdict(s) for s in summaries(rows)], "rows": [asdict(r) for r in rows]}  # fmt: skip


def read_rows(path: Path) -> list[Row]:
    """The rows of an existing ``bench.json`` (for ``--append``)."""
    return [Row(**r) for r in json.loads(path.read_text())["rows"]]


def merge_rows(old: Sequence[Row], new: Sequence[Row]) -> list[Row]:
    """``old`` with every row of ``new`` replacing the one of the same :attr:`Row.key` (or appended)."""
    merged = {r.key: r for r in old}
    merged.update((r.key, r) for r in new)
    return list(merged.values())


def write_reports(rows: Sequence[Row], environment: dict[str, Any], out_dir: Path,
                  notes: Sequence[str] = ()) -> tuple[Path, Path]:  # fmt: skip
    """Write ``bench.json`` and ``bench.md`` into ``out_dir`` (created); returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / "bench.json", out_dir / "bench.md"
    js.write_text(json.dumps(report_json(rows, environment, notes), indent=1) + "\n")
    md.write_text(format_markdown(rows, environment, notes))
    return js, md
