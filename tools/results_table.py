"""Print a committed bench report as the Markdown table ``docs/perf/RESULTS.md`` shows per suite.

    python tools/results_table.py docs/perf/h100/convnets/bench.json

One row per workload x dtype x mode: eager, Inductor (the verdict's baseline: the copy compiled
after fusion) and fusion warm medians in ms; fusion / Inductor (the verdict's paired ratio); where
the run has a first Inductor copy, the same code compiled first over the baseline (the median over
the rounds of each round's ratio, as fusion's); the first calls (``compile_s``) of the copy compiled
first and of fusion; and the backend's decision for the row's region (from fusion's notes).
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from fusion_backend.bench.output import read_json
from fusion_backend.bench.verdict import verdict_of

#: "...: fused: fused is faster (fused 0.1 ms vs ...)" -> "fused: fused is faster"
_DECISION = re.compile(r": (left to Inductor|fused): (.*?)(?: \((?:fused|GPU|host) .*)?$")


def _decision(notes: list[str]) -> str:
    found = [m for m in map(_DECISION.search, notes) if m]
    if not found:
        return "no region"
    return "; ".join(f"{'fused' if m.group(1) == 'fused' else 'Inductor'}: {m.group(2)}" for m in found)


def _median_ms(item) -> float | None:
    return item.warm.median_ms if item is not None and item.warm else None


def _paired(baseline, other) -> float | None:
    """The median over the rounds of the baseline's round median over ``other``'s."""
    if _median_ms(baseline) is None or _median_ms(other) is None:
        return None
    pairs = [b / o for b, o in zip(baseline.warm.round_medians_ms, other.warm.round_medians_ms, strict=False) if o > 0]
    return statistics.median(pairs) if pairs else None


def _first_inductor_copy(backends: list[str], subject: str, baseline: str) -> str | None:
    """The other Inductor backend of the baseline's compile mode (compiled first in each row)."""
    mode = baseline.partition(":")[2]
    return next((b for b in backends if b not in (baseline, subject) and b.startswith("inductor")
                 and b.partition(":")[2] in ("", mode)), None)  # fmt: skip


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(path: Path) -> str:
    report = read_json(path)
    verdict = verdict_of(report)
    subject, baseline = verdict.subject, verdict.baseline
    first_copy = _first_inductor_copy(list(report.config.backends), subject, baseline)
    ratios = {(r.workload, r.dtype, r.mode): r.ratio for r in verdict.rows}
    head = ["workload", "dtype", "mode", "eager ms", "Inductor ms", "fusion ms", "fusion / Inductor"]
    head += ["1st Inductor copy / Inductor"] if first_copy else []
    head += ["first call s (Inductor / fusion)", "decision"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" if "ms" in h or "/" in h else "---" for h in head) + "|"]  # fmt: skip
    for case in report.cases:
        items = {item.backend: item for item in case.items}
        cells = [case.workload, case.dtype, case.mode]
        cells += [_fmt(_median_ms(items.get(b)), "{:.3f}") for b in ("eager", baseline, subject)]
        cells.append(_fmt(ratios.get((case.workload, case.dtype, case.mode)), "{:.2f}x"))
        if first_copy:
            cells.append(_fmt(_paired(items.get(baseline), items.get(first_copy)), "{:.2f}x"))
        firsts = (items.get(first_copy or baseline), items.get(subject))
        cells.append(" / ".join(_fmt(getattr(item, "compile_s", None), "{:.1f}") for item in firsts))
        cells.append(_decision(items[subject].notes if subject in items else []))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"`{verdict.first_call_line()}`", "", f"`{verdict.line()}`"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a bench.json")
    print(table(parser.parse_args().report))


if __name__ == "__main__":
    main()
