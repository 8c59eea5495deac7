"""Rendering a :class:`BenchReport`: plain-text and Markdown tables, JSON, and a PNG chart.

Everything here returns strings or writes files; printing is the CLI's job.  The tables lead with the
question the benchmark answers — how fast is fusion against what a user would pick instead, and how far
from the floor — so the summary has one row per workload x dtype x mode:

``floor ms``            roofline floor (see :mod:`fusion_backend.bench.roofline`)
``<backend> ms (x)``    warm-L2 median in ms, and in brackets that time as a multiple of the floor
``fusion vs eager``     eager's median over fusion's (>1: fusion is faster); ``fusion vs inductor`` too
``status``              ``ok``, or which backends FAILed the correctness gate or raised an ERROR (a row
                        Inductor failed adds ``not in the verdict``: :mod:`.verdict` leaves it out)

Under ``--compile-mode`` the compared backends are ``fusion:MODE`` and ``inductor:MODE`` (chosen by
:func:`fusion_backend.bench.backends.pick_contenders`).  A FAIL or ERROR cell shows the word instead of
a time: a wrong result is never displayed as a speed.  The verdict line (:mod:`.verdict`) follows the
table.  The details table has one row per item with cold-L2 times, the first call's time (``compile
s``: compilation included), memory and the check's error.  Workloads that ran no row are listed with
why (:func:`skip_line`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .backends import pick_contenders
from .env import describe_code
from .results import BenchReport, CaseResult, ItemResult, Status
from .roofline import describe_rates
from .verdict import inductor_failed, verdict_of

MB = 1024 * 1024


# -- number formatting ----------------------------------------------------------------------------------


def _by_magnitude(value: float, formats: tuple[tuple[float, str], ...], smallest: str) -> str:
    """``value`` in the format of the first ``(floor, format)`` whose floor it reaches, else ``smallest``."""
    for floor, fmt in formats:
        if value >= floor:
            return format(value, fmt)
    return format(value, smallest)


def fmt_ms(ms: float | None) -> str:
    """Milliseconds with about four significant digits: ``0.0312``, ``1.470``, ``23.20``, ``123.4``."""
    if ms is None:
        return "-"
    return _by_magnitude(ms, ((100, ".1f"), (10, ".2f"), (1, ".3f"), (0.001, ".4f")), ".2e")


def fmt_x(x: float | None) -> str:
    """A ratio as ``1.88x`` (``-`` when missing)."""
    if x is None or not math.isfinite(x):
        return "-"
    return _by_magnitude(x, ((100, ".0f"), (10, ".1f")), ".2f") + "x"


def fmt_mb(n: int | None) -> str:
    """Bytes as MiB: ``48.1``, or ``0.021`` below 1 MiB."""
    if n is None:
        return "-"
    return f"{n / MB:.1f}" if n >= MB else f"{n / MB:.3f}"


def fmt_s(s: float | None) -> str:
    return "-" if s is None else f"{s:.1f}"


# -- tables ---------------------------------------------------------------------------------------------


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, markdown: bool = False,
                 right: Sequence[bool] | None = None) -> str:
    """Align ``rows`` under ``headers``; ``right[i]`` right-aligns column ``i`` (numbers)."""
    right = list(right) if right is not None else [False] * len(headers)
    if markdown:
        def esc(cell: str) -> str:
            return cell.replace("|", "\\|")

        lines = ["| " + " | ".join(esc(h) for h in headers) + " |",
                 "|" + "|".join("---:" if r else "---" for r in right) + "|"]
        lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
        return "\n".join(lines)
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right, strict=True)]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def _backend_cell(case: CaseResult, item: ItemResult | None, check_only: bool) -> str:
    if item is None:
        return "-"
    if item.status is not Status.OK:
        return item.status.value
    if check_only or item.median_ms is None:
        return f"ok ({item.check.max_rel_err:.0e})" if item.check else "ok"
    multiple = case.floor_multiple(item.backend)
    return fmt_ms(item.median_ms) + (f" ({fmt_x(multiple)})" if multiple is not None else "")


def case_status(case: CaseResult) -> str:
    """``ok``, or e.g. ``FAIL: fusion; ERROR: inductor`` (``ERROR: reference`` if nothing could run)."""
    if case.error:
        return "ERROR: reference"
    parts = []
    for status in (Status.FAIL, Status.ERROR):
        names = [i.backend for i in case.items if i.status is status]
        if names:
            parts.append(f"{status.value}: {', '.join(names)}")
    return "; ".join(parts) or "ok"


def summary_table(report: BenchReport, *, markdown: bool = False) -> str:
    """One row per workload x dtype x mode: per-backend medians, fusion's speedups, floor, status."""
    backends = list(report.config.backends)
    check_only = report.config.check_only
    subject, inductor = pick_contenders(backends)
    speedup_cols = [b for b in ("eager", inductor) if b in backends] if subject else []
    headers = ["workload", "dtype", "mode"]
    right = [False, False, False]
    if not check_only:
        headers.append("floor ms")
        right.append(True)
    headers += [b if check_only else f"{b} ms (x floor)" for b in backends]
    right += [True] * len(backends)
    if not check_only:
        headers += [f"{subject} vs {b}" for b in speedup_cols]
        right += [True] * len(speedup_cols)
    headers.append("status")
    right.append(False)
    rows = []
    for case in report.cases:
        row = [case.workload, case.dtype, case.mode]
        if not check_only:
            row.append(fmt_ms(case.roofline.floor_ms) if case.roofline else "-")
        row += [_backend_cell(case, case.item(b), check_only) for b in backends]
        if not check_only:
            row += [fmt_x(case.speedup(subject, b)) for b in speedup_cols]
        left_out = (not check_only and subject is not None and inductor is not None
                    and inductor_failed(case, inductor))
        row.append(case_status(case) + ("; not in the verdict" if left_out else ""))
        rows.append(row)
    return render_table(headers, rows, markdown=markdown, right=right)


def details_table(report: BenchReport, *, markdown: bool = False) -> str:
    """One row per item: status, compile time, warm and cold medians, multiples, memory, check error.

    ``host ms`` is the median host time of a timed repetition (``TimingStats.host_median_ms``): where it
    is close to ``warm ms`` the step is host-bound and its reading follows the host's speed.

    Memory columns (MiB): ``peak`` is the step's peak beyond the model and inputs, including what the
    backend keeps ``resident`` between steps; ``held`` is what the forward leaves allocated for the
    backward (saved activations and outputs).
    """
    headers = ["workload", "dtype", "mode", "backend", "status", "compile s", "warm ms", "p20-p80 ms",
               "host ms", "cold ms", "x floor", "x floor cold", "reps", "peak MB", "held MB", "resident MB",
               "max rel err", "breaks"]
    right = [False] * 5 + [True] * 13
    rows = []
    for case in report.cases:
        for item in case.items:
            w, mem = item.warm, item.memory
            rows.append([
                item.workload, item.dtype, item.mode, item.backend, item.status.value,
                fmt_s(item.compile_s), fmt_ms(item.median_ms),
                f"{fmt_ms(w.p20_ms)}-{fmt_ms(w.p80_ms)}" if w else "-",
                fmt_ms(w.host_median_ms if w else None), fmt_ms(item.cold_median_ms), fmt_x(case.floor_multiple(item.backend)),
                fmt_x(case.floor_multiple(item.backend, cold=True)), str(w.reps) if w else "-",
                fmt_mb(mem.total_peak_bytes if mem else None), fmt_mb(mem.held_bytes if mem else None),
                fmt_mb(mem.resident_bytes if mem else None),
                _rel_err_cell(item),
                "-" if item.graph_breaks is None else str(item.graph_breaks),
            ])
    return render_table(headers, rows, markdown=markdown, right=right)


def _rel_err_cell(item: ItemResult) -> str:
    if item.check is None:
        return "-"
    return f"{item.check.max_rel_err:.1e}" + ("*" if item.check.passed_by_fp64 else "")


def gate_line(report: BenchReport) -> str:
    """The correctness rule the run applied, with the tolerances in effect per precision."""
    tolerances: dict[str, float] = {}
    for item in report.items:
        if item.check is not None:
            tolerances.setdefault(item.dtype, item.check.tolerance)
    tols = ", ".join(f"{d} {t:.0e}" for d, t in tolerances.items()) or "-"
    line = f"gate: ||backend - eager|| / ||eager|| <= {tols}, per output and gradient"
    if report.config.fp64_check:
        line += "; beyond that, passes if within 2x (bf16: 3x) eager's own error vs a float64 run (marked *)"
    return line


def roofline_table(report: BenchReport, *, markdown: bool = False) -> str:
    """One row per case: minimal MB moved, GFLOP, the two time bounds, the floor and what bounds it."""
    headers = ["workload", "dtype", "mode", "min MB", "GFLOP", "unit", "memory ms", "compute ms", "floor ms",
               "bound"]
    right = [False] * 3 + [True, True, False, True, True, True, False]
    rows = []
    for case in report.cases:
        r = case.roofline
        if r is None:
            continue
        rows.append([case.workload, case.dtype, case.mode, fmt_mb(r.traffic.total), f"{r.flops / 1e9:.2f}",
                     r.compute_unit, fmt_ms(r.memory_ms), fmt_ms(r.compute_ms), fmt_ms(r.floor_ms), r.bound])
    return render_table(headers, rows, markdown=markdown, right=right)


def notes_text(report: BenchReport) -> str:
    """Every item's notes, one line each (empty string if none)."""
    return "\n".join(f"- {i.workload} {i.dtype} {i.mode} {i.backend}: {note}"
                     for i in report.items for note in i.notes)


def failures_text(report: BenchReport) -> str:
    """Every FAIL/ERROR item with its full message (empty string if none)."""
    lines = []
    for item in report.items:
        if item.status is not Status.OK:
            lines.append(f"- {item.workload} {item.dtype} {item.mode} {item.backend}: {item.status.value}: "
                         f"{item.error}")
    return "\n".join(lines)


def skip_line(workload: str, reason: str) -> str:
    """``resnet50: skipped (needs torchvision, not installed)``."""
    return f"{workload}: skipped ({reason})"


def skipped_text(report: BenchReport) -> str:
    """One :func:`skip_line` per workload that ran no row (empty string if none)."""
    return "\n".join(skip_line(name, reason) for name, reason in report.skipped.items())


def environment_lines(report: BenchReport) -> list[str]:
    """Short human description of where and when the run happened."""
    env = report.environment
    partial = [] if report.complete else ["PARTIAL REPORT: the run was interrupted; finished cases only"]
    gpu = env.get("gpu")
    gpu_name = gpu.get("name") if isinstance(gpu, dict) else env.get("device", "?")
    tf32 = env.get("tf32", {}) if isinstance(env.get("tf32"), dict) else {}
    lines = [
        f"device: {gpu_name}; torch {env.get('torch')}, triton {env.get('triton')}, CUDA {env.get('cuda')}, "
        f"cuDNN {env.get('cudnn')}",
        f"TF32: cuDNN conv {tf32.get('conv_uses_tf32')}, matmul allow_tf32 {tf32.get('cuda.matmul.allow_tf32')}"
        f" (PyTorch defaults, left alone)",
        gate_line(report),
        f"date: {env.get('date_utc')}; wall time {report.wall_s:.0f} s",
        f"command: {env.get('command')}",
        f"code: {describe_code(env)}",
    ]
    if report.rates is not None:
        lines.append(f"measured rates: {describe_rates(report.rates)}")
    return partial + lines


NOTE_FLOOR = ("x floor: warm median over the roofline floor, max(minimal bytes / copy bandwidth, flops of the "
              "convolutions as written / matmul rate); speedups are medians of the rounds' paired ratios of warm medians.")
NOTE_BELOW_FLOOR = ("x floor below 1: the data fit in L2 (compare the cold column of the details), or the backend "
                    "does fewer flops than the convolutions as written (an algebraic rewrite); the memory term "
                    "of the roofline table still binds.")


def _any_below_floor(report: BenchReport) -> bool:
    return any((case.floor_multiple(i.backend) or 2.0) < 1.0 for case in report.cases for i in case.items)


def format_report(report: BenchReport) -> str:
    """The full plain-text report: environment, summary, roofline, details, failures."""
    judged = verdict_of(report)
    first_calls = judged.first_call_line()
    skipped = skipped_text(report)
    parts = ["\n".join(environment_lines(report)), "", summary_table(report), "",
             *([skipped, ""] if skipped else []), *([first_calls] if first_calls else []), judged.line()]
    if not report.config.check_only:
        parts += ["", NOTE_FLOOR]
        if _any_below_floor(report):
            parts.append(NOTE_BELOW_FLOOR)
        if any(c.roofline for c in report.cases):
            parts += ["", "Roofline", roofline_table(report)]
    parts += ["", "Details", details_table(report)]
    if notes_text(report):
        parts += ["", "Notes", notes_text(report)]
    failures = failures_text(report)
    if failures:
        parts += ["", "Failures (never timed)", failures]
    return "\n".join(parts) + "\n"


def format_markdown(report: BenchReport) -> str:
    """The report as Markdown, ready to paste into the README's performance section."""
    env_lines = "\n".join(f"- {line}" for line in environment_lines(report))
    judged = verdict_of(report)
    first_calls = judged.first_call_line()
    skipped = "\n".join(f"- {line}" for line in skipped_text(report).splitlines())
    parts = [env_lines, "", summary_table(report, markdown=True), "",
             *([f"**Skipped:**\n\n{skipped}", ""] if skipped else []),
             *([f"**First calls:** {first_calls}", ""] if first_calls else []),
             f"**Verdict:** {judged.line()}"]
    if any(c.roofline for c in report.cases):
        parts += ["", NOTE_FLOOR]
        if _any_below_floor(report):
            parts.append(NOTE_BELOW_FLOOR)
        parts += ["", roofline_table(report, markdown=True)]
    parts += ["", "<details><summary>Per-backend details</summary>", "", details_table(report, markdown=True),
              "", "</details>"]
    if notes_text(report):
        parts += ["", "Notes:", "", notes_text(report)]
    failures = failures_text(report)
    if failures:
        parts += ["", "Failures (never timed):", "", failures]
    return "\n".join(parts) + "\n"


# -- JSON -----------------------------------------------------------------------------------------------


def write_json(report: BenchReport, path: Path) -> Path:
    """Write ``report.to_dict()`` as indented strict JSON."""
    path.write_text(json.dumps(report.to_dict(), indent=2, allow_nan=False) + "\n")
    return path


def read_json(path: Path) -> BenchReport:
    """Read a report written by :func:`write_json`."""
    return BenchReport.from_dict(json.loads(Path(path).read_text()))


# -- chart ----------------------------------------------------------------------------------------------


#: Fixed colours so a backend looks the same in every chart; others take the remaining tab10 colours.
COLOURS = {"eager": "#7f7f7f", "inductor": "#ff7f0e", "inductor-max-autotune": "#d62728", "fusion": "#1f77b4",
           "fusion-max-autotune": "#17becf"}


def _colour(backend: str, index: int) -> str:
    if backend in COLOURS:
        return COLOURS[backend]
    spare = ["#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22"]
    return spare[index % len(spare)]


def write_chart(report: BenchReport, path: Path) -> str | None:
    """Draw speedups over eager per case and backend, with the roofline's bound, into a PNG.

    One panel per mode; per workload x dtype a group of bars (speedup of each backend over eager's warm
    median, value on top), FAIL/ERROR written in red where a bar would be, and a black dash at the
    roofline bound (eager's time over the floor: the largest speedup physically possible).  Without
    eager in the run, the first backend is the baseline.  Bounds far
    above the bars are drawn at the top edge with their value, so they do not squash the bars.

    Returns ``None`` on success or the reason nothing was drawn (matplotlib missing — it is an optional
    extra, ``pip install fusion-backend[plot]`` — or nothing timed).
    """
    if report.config.check_only or not any(i.median_ms for i in report.items):
        return "no timings to chart"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); chart skipped"

    modes = [m for m in report.config.modes if any(c.mode == m for c in report.cases)]
    backends = list(report.config.backends)
    base = "eager" if "eager" in backends else backends[0]
    per_mode = max(sum(1 for c in report.cases if c.mode == m) for m in modes)
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(7.0, 1.15 * per_mode + 1.5), 3.6 * len(modes)),
                             squeeze=False)
    width = 0.8 / max(1, len(backends))
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        cases = [c for c in report.cases if c.mode == mode]
        speeds = [s for c in cases for b in backends if (s := c.speedup(b, base)) is not None]
        low = min(0.5, min(speeds, default=1.0) / 1.6)
        high = max(4.0, max(speeds, default=1.0) * 2.5)
        for j, backend in enumerate(backends):
            offset = (j - (len(backends) - 1) / 2) * width
            xs, ys = [], []
            for k, case in enumerate(cases):
                item, speed = case.item(backend), case.speedup(backend, base)
                if item is not None and item.status is not Status.OK:
                    ax.text(k + offset, 1.0, item.status.value, rotation=90, ha="center", va="bottom",
                            fontsize=7, color="red")
                elif speed is not None:
                    xs.append(k + offset)
                    ys.append(speed)
                    ax.text(k + offset, speed * 1.05, f"{speed:.2g}", ha="center", va="bottom", fontsize=6)
            ax.bar(xs, ys, width, label=backend, color=_colour(backend, j))
        first_bound = True
        for k, case in enumerate(cases):
            reference = case.item(base)
            if case.roofline is None or reference is None or not reference.median_ms:
                continue
            bound = reference.median_ms / case.roofline.floor_ms
            shown = min(bound, high / 1.1)
            ax.plot([k - 0.45, k + 0.45], [shown, shown], color="black", linewidth=1.5,
                    label="roofline bound" if first_bound else None)
            first_bound = False
            ax.text(k, shown / 1.04, f"bound {bound:.2g}x" if bound < 100 else f"bound {bound:.0f}x",
                    ha="center", va="top", fontsize=6)
        ax.set_yscale("log")
        ax.set_ylim(low, high)
        ticks = [2.0**e for e in range(-6, 14) if low <= 2.0**e <= high]
        ax.set_yticks(ticks)
        ax.set_yticklabels([f"{t:g}x" for t in ticks], fontsize=7)
        ax.minorticks_off()
        ax.axhline(1.0, color="gray", linewidth=0.6)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{c.workload}\n{c.dtype}" for c in cases], fontsize=7)
        ax.set_ylabel(f"speedup over {base}", fontsize=8)
        ax.set_title(mode, fontsize=9)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=7, frameon=False,
               bbox_to_anchor=(0.5, 0.955))
    env = report.environment
    gpu = env.get("gpu")
    gpu_name = gpu.get("name") if isinstance(gpu, dict) else env.get("device")
    fig.suptitle(f"fusion bench, warm medians: {gpu_name}, torch {env.get('torch')}, "
                 f"{str(env.get('date_utc', ''))[:10]}", fontsize=9)
    fig.tight_layout(rect=(0.0, 0.0, 1.0, 0.93))
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return None


# -- all files ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReportFiles:
    """Where :func:`write_reports` wrote things; ``chart`` is ``None`` when skipped, with ``chart_note`` why."""

    json: Path
    text: Path
    markdown: Path
    chart: Path | None
    chart_note: str = ""


def write_reports(report: BenchReport, out_dir: Path, *, chart: bool = True) -> ReportFiles:
    """Write ``bench.json``, ``bench.txt``, ``bench.md`` and (optionally) ``bench.png`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = write_json(report, out_dir / "bench.json")
    text_path = out_dir / "bench.txt"
    text_path.write_text(format_report(report))
    md_path = out_dir / "bench.md"
    md_path.write_text(format_markdown(report))
    chart_path: Path | None = None
    note = "chart disabled (--no-chart)"
    if chart:
        png = out_dir / "bench.png"
        reason = write_chart(report, png)
        chart_path, note = (png, "") if reason is None else (None, reason)
    return ReportFiles(json=json_path, text=text_path, markdown=md_path, chart=chart_path, chart_note=note)


def plan_lines(workloads: Sequence[Any], config: Any, backends: Sequence[Any]) -> list[str]:
    """What a run would do (for ``--dry-run``): one line per workload (with the rows its file declares,
    or why it will be skipped), then the matrix size."""
    width = max((len(w.name) for w in workloads), default=0)
    lines, n, skipped, declared = [], 0, 0, False
    for w in workloads:
        reason = w.skip_reason(config.dtypes, config.modes)
        rows = [] if reason else w.rows(config.dtypes, config.modes)
        own = w.dtypes is not None or w.modes is not None
        declared = declared or own
        n += len(rows) * len(backends)
        skipped += bool(reason)
        what = (f"  (skipped: {reason})" if reason else
                f"  (rows {', '.join(f'{d} {m}' for d, m in rows)})" if own else "")
        lines.append(f"{w.name:<{width}}  {w.path}{what}")
    notes = (["rows as the files declare"] if declared else []) + ([f"{skipped} skipped"] if skipped else [])
    lines.append(f"{len(workloads)} workload(s) x dtypes {','.join(config.dtypes)} x modes "
                 f"{','.join(config.modes)} x backends {','.join(b.name for b in backends)} = {n} item(s)"
                 + (f" ({'; '.join(notes)})" if notes else ""))
    lines += [f"  {b.name:<24} {b.description}" for b in backends]
    return lines
