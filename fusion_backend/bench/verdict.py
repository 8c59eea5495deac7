"""The run's verdict: on how many rows is fusion at least as fast as Inductor, which row is worst, and
by how much fusion is faster on average.

A row is one workload x dtype x mode.  Its ratio is the Inductor backend's warm median over the fusion
backend's (the statistic the summary table shows; above 1: fusion is faster).  Which two backends are
compared is :func:`fusion_backend.bench.backends.pick_contenders`'s choice (``fusion`` and ``inductor``,
or their ``:MODE`` variants under ``--compile-mode``).  The rules:

- a ratio of :data:`TIE_RATIO` or more counts as fusion >= Inductor: differences of a few percent are
  within the run-to-run noise of GPU timings;
- a row where fusion FAILed the correctness gate, raised, or was not timed never counts as >=, and it
  is the worst row ahead of any slow one (the first such row in run order): a wrong or crashing
  fusion is worse than a slow one;
- a row where Inductor itself FAILed the correctness gate or raised (the eager reference having run) is
  left out: it is not among the N/M rows counted, nor the worst row, nor in the geometric mean, whatever
  fusion did there (fusion's own failure still shows in the table and the exit status); the line says how
  many rows were left out so and names them (:func:`inductor_failed`).  A row compares fusion with
  Inductor, and where Inductor has no correct result there is nothing to compare with (e.g. torch
  2.11's Inductor on the DCGAN generator's channels-last training step);
- a row where Inductor passed but was not timed counts as not >=, since nothing shows fusion is at
  least as fast there, but it is never the worst row;
- the geometric mean is over the counted rows with both timings, and the line says over how many when
  that is not every counted row;
- a row whose fusion item rewrote no region (``ItemResult.fused_regions == 0``) runs Inductor's code
  in both columns; the line says how many of the rows below the tie are such rows, and marks the
  worst row if it is one: their ratio is the measurement's noise, not a choice of the backend;
- where the run has a second copy of the baseline (another Inductor backend of the same mode, e.g.
  ``inductor`` next to ``inductor:default``), the line ends with how far apart the two copies of the
  same compiled code read over the rows (lowest and highest ratio): the run's own measure of its noise,
  next to which a row's ratio can be read.  It changes no count.

The verdict is the last line the command prints, and is stored in ``bench.json`` (``"verdict"``),
``bench.txt`` and ``bench.md``.

First calls (:meth:`Verdict.first_call_line`, the line before the verdict): per row, fusion's first
call (``compile_s``: compiling included) over Inductor's, where Inductor's is the copy of the baseline
compiled first in the row (the later copy reuses the code Dynamo compiled for the first), against the
budget :data:`FIRST_CALL_BUDGET`, or :data:`WARM_FIRST_CALL_BUDGET` where that copy's graphs all came from
Inductor's disk caches (``ItemResult.from_inductor_caches``: a run on warm caches), and, where fusion
decided regions after its first call (its option ``defer``), how long after it the rows settled
(``settle_s``), and, where the run holds rows to ``BenchConfig.steady_state_budget`` (``bench
--steady-state-budget``), each row's time to steady state (first call and settle) over Inductor's first
call against it.  It changes no count of the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .backends import BASELINE_COMPILER, pick_contenders, split_backend_name

if TYPE_CHECKING:  # results imports this module to write the verdict into the JSON report
    from .results import BenchReport, CaseResult, ItemResult

#: A ratio (Inductor's time over fusion's) at or above this counts as fusion >= Inductor.
TIE_RATIO = 0.97

#: The timing statistic the ratios are taken from (the one the summary table shows).
STATISTIC = "warm median"

#: How many of the rows Inductor failed the verdict line names (it counts them all).
NAMED_LEFT_OUT = 3

#: The most a fusion first call may take, as a multiple of Inductor's in the same row.
FIRST_CALL_BUDGET = 3.0
#: The same where Inductor's first call found its graphs in its disk caches (a second process).
WARM_FIRST_CALL_BUDGET = 1.2


@dataclass(frozen=True)
class RowRatio:
    """One workload x dtype x mode of the verdict.

    ``ratio`` is the baseline's warm median over the subject's, ``None`` unless both were timed;
    ``problem`` then says why (``"fusion FAIL"``, ``"inductor ERROR"``, ``"fusion not timed"``), and
    ``subject_failed`` whether the subject failed.  ``baseline_failed``: Inductor FAILed or raised there,
    so the row is left out of the verdict's counts (module docstring).  ``same_code``: the subject rewrote no
    region, so both columns ran Inductor's code for the whole graph.  ``first_call_ratio``: the
    subject's ``compile_s`` over Inductor's (``None`` unless both first calls were measured);
    ``steady_state_ratio``: the subject's ``compile_s + settle_s`` over Inductor's ``compile_s``.
    """

    workload: str
    dtype: str
    mode: str
    ratio: float | None
    problem: str = ""
    subject_failed: bool = False
    same_code: bool = False
    #: the subject's first call over the baseline's first-compiled copy's (see the module docstring)
    first_call_ratio: float | None = None
    #: seconds from the subject's first call to its first step on settled code (``ItemResult.settle_s``)
    settle_s: float | None = None
    #: the reference's first call found every graph in Inductor's disk caches: the warm budget applies
    warm_first_call: bool = False
    #: Inductor FAILed or raised in this row: it is left out of the counts
    baseline_failed: bool = False
    steady_state_ratio: float | None = None

    @property
    def first_call_budget(self) -> float:
        return WARM_FIRST_CALL_BUDGET if self.warm_first_call else FIRST_CALL_BUDGET

    @property
    def label(self) -> str:
        """``"conv1d_80_256_k5_gelu fp32 infer"``."""
        return f"{self.workload} {self.dtype} {self.mode}"

    def outcome(self) -> str:
        """The ratio as ``"0.91x"`` (marked where both columns ran Inductor's code), or the problem."""
        if self.ratio is None:
            return self.problem
        return _fmt_ratio(self.ratio) + (" (Inductor's code in both columns)" if self.same_code else "")


@dataclass(frozen=True)
class Verdict:
    """Fusion against Inductor over a run's rows (rules in the module docstring).

    ``subject`` and ``baseline`` are the backend names compared (``None`` if the run lacks one);
    ``note`` is set instead of a verdict when there is nothing to judge, and says why.
    """

    subject: str | None
    baseline: str | None
    rows: tuple[RowRatio, ...] = ()
    tie_ratio: float = TIE_RATIO
    statistic: str = STATISTIC
    note: str = ""
    #: the other copy of the baseline and the lowest and highest ratio between the two copies (the
    #: baseline's time over the copy's, over the rows where both were timed); ``None`` without one
    copy: str | None = None
    copies_spread: tuple[float, float] | None = None
    #: the Inductor backend whose first calls the subject's are compared with
    first_call_reference: str | None = None
    #: ``BenchConfig.steady_state_budget``: the rows' time to steady state held to it (``None``: not judged)
    steady_state_budget: float | None = None

    @property
    def counted(self) -> tuple[RowRatio, ...]:
        """The rows the verdict counts: every row but those Inductor failed."""
        return tuple(r for r in self.rows if not r.baseline_failed)

    @property
    def left_out(self) -> tuple[RowRatio, ...]:
        """The rows Inductor failed, left out of every count."""
        return tuple(r for r in self.rows if r.baseline_failed)

    @property
    def at_least_baseline(self) -> int:
        """Counted rows where the subject is at least as fast as the baseline (tie included)."""
        return sum(1 for r in self.counted if r.ratio is not None and r.ratio >= self.tie_ratio)

    @property
    def compared(self) -> int:
        """Counted rows with both timings."""
        return sum(1 for r in self.counted if r.ratio is not None)

    @property
    def geomean(self) -> float | None:
        """Geometric mean of the ratios of the counted rows with both timings (``None`` if there are none)."""
        ratios = [r.ratio for r in self.counted if r.ratio is not None]
        if not ratios:
            return None
        return math.exp(sum(math.log(x) for x in ratios) / len(ratios))

    @property
    def worst(self) -> RowRatio | None:
        """The first counted row where the subject failed, else the counted row of the lowest ratio, else
        ``None``."""
        failed = [r for r in self.counted if r.subject_failed]
        if failed:
            return failed[0]
        timed = [r for r in self.counted if r.ratio is not None]
        return min(timed, key=lambda r: r.ratio) if timed else None  # type: ignore[arg-type, return-value]

    def line(self) -> str:
        """One line, e.g. ``fusion >= inductor on 38/40 rows (0.97x counts as a tie); worst:
        conv1d_80_256_k5_gelu fp32 infer 0.91x; geomean vs inductor 1.34x``."""
        if self.note:
            return self.note
        total, compared = len(self.counted), self.compared
        tie = f"{self.tie_ratio:g}x counts as a tie"
        if compared < total:
            tie += f"; {_rows(total - compared)} without both timings counted as not >="
        if self.left_out:
            tie += f"; {self._left_out_text()}"
        worst = self.worst
        geomean = self.geomean
        mean = "-: no row has both timings" if geomean is None else _fmt_ratio(geomean)
        if geomean is not None and compared < total:
            mean += f" over {_rows(compared)}"
        below = [r for r in self.counted if r.ratio is not None and r.ratio < self.tie_ratio]
        same = sum(1 for r in below if r.same_code)
        if same:
            tie += f"; of the {_rows(len(below))} below, {same} ran Inductor's code in both columns"
        spread = ""
        if self.copies_spread is not None:
            low, high = self.copies_spread
            spread = f"; {self.copy} and {self.baseline} (the same code) read {low:.2f}-{high:.2f}x apart"
        return (f"{self.subject} >= {self.baseline} on {self.at_least_baseline}/{total} rows ({tie}); "
                f"worst: {f'{worst.label} {worst.outcome()}' if worst else '-'}; "
                f"geomean vs {self.baseline} {mean}{spread}")

    def _left_out_text(self) -> str:
        """``2 rows left out as inductor failed them: a bf16 train (FAIL), b bf16 train (ERROR; fusion
        ERROR)``: at most :data:`NAMED_LEFT_OUT` rows named, then how many more."""
        rows = self.left_out
        named = ", ".join(f"{r.label} ({r.problem.removeprefix(f'{self.baseline} ')})"
                          for r in rows[:NAMED_LEFT_OUT])
        more = f", {len(rows) - NAMED_LEFT_OUT} more" if len(rows) > NAMED_LEFT_OUT else ""
        them = "it" if len(rows) == 1 else "them"
        return f"{_rows(len(rows))} left out as {self.baseline} failed {them}: {named}{more}"

    def first_call_line(self) -> str:
        """One line on the rows' first calls, e.g. ``first call fusion / inductor 0.9-5.1x; 2/20 rows
        above the 3x budget, the highest conv_a fp32 train`` (empty without a measured pair).  Where
        Inductor's first calls came from its disk caches, those rows' budget is the warm one, and the
        line says on how many rows: ``... 1/20 rows above the budget (3x, 1.2x where Inductor's graphs
        came from its caches: 8 rows), the highest ...`` (the highest: the furthest over its budget)."""
        rows = [r for r in self.rows if r.first_call_ratio is not None]
        if self.note or not rows:
            return ""
        ratios = [r.first_call_ratio for r in rows]
        over = [r for r in rows if r.first_call_ratio > r.first_call_budget]  # type: ignore[operator]
        highest = max(rows, key=lambda r: r.first_call_ratio / r.first_call_budget)  # type: ignore[operator]
        where = f", the highest {highest.label}" if over else ""
        warm = sum(r.warm_first_call for r in rows)
        budget = (f"the {FIRST_CALL_BUDGET:g}x budget" if not warm else
                  f"the budget ({FIRST_CALL_BUDGET:g}x, {WARM_FIRST_CALL_BUDGET:g}x where Inductor's graphs came "
                  f"from its caches: {_rows(warm)})")
        settles = [r.settle_s for r in rows if r.settle_s is not None]
        settled = (f"; {len(settles)} rows decided after their first call, settled {min(settles):.1f}-"
                   f"{max(settles):.1f} s later" if settles else "")
        return (f"first call {self.subject} / {self.first_call_reference} {min(ratios):.1f}-{max(ratios):.1f}x; "  # type: ignore[type-var]
                f"{len(over)}/{len(rows)} rows above {budget}{where}{settled}{self._steady_state_clause(rows)}")

    def _steady_state_clause(self, rows: list[RowRatio]) -> str:
        """``; time to steady state 0.2-1.5x, 1/9 rows above the 1.25x budget, the highest r3d bf16 infer``
        where the run holds rows to ``steady_state_budget`` (empty otherwise)."""
        budget = self.steady_state_budget
        judged = [(r.steady_state_ratio, r) for r in rows if r.steady_state_ratio is not None]
        if budget is None or not judged:
            return ""
        ratios = [x for x, _ in judged]
        over = [(x, r) for x, r in judged if x > budget]
        where = f", the highest {max(over, key=lambda pair: pair[0])[1].label}" if over else ""
        return (f"; time to steady state {min(ratios):.1f}-{max(ratios):.1f}x, {len(over)}/{len(judged)} rows above "
                f"the {budget:g}x budget{where}")

    def json_extras(self) -> dict[str, object]:
        """Derived values written to the JSON report next to the fields."""
        worst = self.worst
        return {"at_least_baseline": self.at_least_baseline, "compared": self.compared,
                "total_rows": len(self.counted), "geomean": self.geomean,
                "left_out": [{"workload": r.workload, "dtype": r.dtype, "mode": r.mode, "problem": r.problem}
                             for r in self.left_out],
                "worst": None if worst is None else {"workload": worst.workload, "dtype": worst.dtype,
                                                     "mode": worst.mode, "ratio": worst.ratio,
                                                     "problem": worst.problem, "same_code": worst.same_code},
                "copies_spread": None if self.copies_spread is None else list(self.copies_spread),
                "line": self.line(), "first_call_line": self.first_call_line()}


def _fmt_ratio(x: float) -> str:
    return f"{x:.2f}x"


def _rows(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def nothing_timed(reason: str, backends: tuple[str, ...] | list[str] = ()) -> Verdict:
    """The verdict of a run that timed nothing (``reason``: e.g. ``"no CUDA device"``, ``"--check-only"``)."""
    subject, baseline = pick_contenders(list(backends))
    return Verdict(subject, baseline, note=f"nothing was timed ({reason}): no fusion-vs-inductor verdict")


def verdict_of(report: BenchReport) -> Verdict:
    """Judge ``report``'s rows (see the module docstring)."""
    backends = list(report.config.backends)
    subject, baseline = pick_contenders(backends)
    if report.config.check_only:
        return nothing_timed("--check-only", backends)
    if subject is None or baseline is None:
        lacking = " and ".join(n for n, b in (("fusion", subject), ("inductor", baseline)) if b is None)
        return Verdict(subject, baseline, note=f"no fusion-vs-inductor verdict: the run has no {lacking} "
                       f"backend (backends: {', '.join(backends)})")
    if not report.cases:
        return Verdict(subject, baseline, note="no fusion-vs-inductor verdict: no row finished")
    copy = _second_copy(backends, baseline)
    reference = _compiled_first(backends, baseline, copy)
    rows = []
    for case in report.cases:
        ratio = case.speedup(subject, baseline)
        mine, theirs = case.item(subject), case.item(baseline)
        baseline_failed = inductor_failed(case, baseline)
        problem, subject_failed = "", False
        if ratio is None:
            subject_failed = mine is None or not mine.ok or mine.median_ms is None
            if baseline_failed:
                problem = f"{baseline} {_why_untimed(theirs)}"
                if subject_failed:
                    problem += f"; {subject} {_why_untimed(mine)}"
            elif subject_failed:
                problem = f"{subject} {_why_untimed(mine)}"
                if case.error:
                    problem += " (the eager reference failed)"
            else:
                problem = f"{baseline} {_why_untimed(theirs)}"
        same_code = mine is not None and mine.fused_regions == 0
        first = case.item(reference)
        first_call = _first_call_ratio(mine, first)
        steady = None if first_call is None else first_call * (1.0 + (mine.settle_s or 0.0) / mine.compile_s)
        rows.append(RowRatio(case.workload, case.dtype, case.mode, ratio, problem, subject_failed, same_code,
                             first_call, mine.settle_s if mine else None,
                             warm_first_call=bool(first and first.from_inductor_caches),
                             baseline_failed=baseline_failed, steady_state_ratio=steady))
    spread = None
    if copy is not None:
        ratios = [r for r in (case.speedup(copy, baseline) for case in report.cases) if r is not None]
        spread = (min(ratios), max(ratios)) if ratios else None
    return Verdict(subject, baseline, rows=tuple(rows), copy=copy if spread else None, copies_spread=spread,
                   first_call_reference=reference, steady_state_budget=report.config.steady_state_budget)


def inductor_failed(case: CaseResult, baseline: str) -> bool:
    """Whether the baseline (the Inductor backend compared with) FAILed the correctness gate or raised in
    ``case`` while the eager reference ran: such a row is left out of the verdict (module docstring)."""
    theirs = case.item(baseline)
    return not case.error and theirs is not None and not theirs.ok


def _compiled_first(backends: list[str], baseline: str, copy: str | None) -> str:
    """Of the baseline and its second copy, the one compiled first in each row (run order)."""
    if copy is None:
        return baseline
    return min((baseline, copy), key=backends.index)


def _first_call_ratio(mine: ItemResult | None, theirs: ItemResult | None) -> float | None:
    """The subject's first call over the reference's, where both were measured and passed."""
    if mine is None or theirs is None or not (mine.ok and theirs.ok):
        return None
    if not mine.compile_s or not theirs.compile_s:
        return None
    return mine.compile_s / theirs.compile_s


def _second_copy(backends: list[str], baseline: str) -> str | None:
    """Another backend compiling the same code as ``baseline``: Inductor in the same mode, no options.

    >>> _second_copy(["eager", "inductor", "fusion", "inductor:default"], "inductor:default")
    'inductor'
    >>> _second_copy(["eager", "inductor", "fusion"], "inductor") is None
    True
    """
    compiler, mode = split_backend_name(baseline)
    for name in backends:
        other, other_mode = split_backend_name(name)
        if name != baseline and other == compiler == BASELINE_COMPILER and (other_mode or "default") == (mode or "default"):
            return name
    return None


def _why_untimed(item: ItemResult | None) -> str:
    if item is None:
        return "missing"
    return "not timed" if item.ok else item.status.value
