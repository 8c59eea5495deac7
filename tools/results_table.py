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


def _fmt(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def table(path: Path) -> str:
    report = read_json(path)
    verdict = verdict_of(report)
    subject, baseline = verdict.subject, verdict.baseline
    # the Inductor copy compiled first in each row (the first-call reference), where the run has two
    first_copy = verdict.first_call_reference if verdict.first_call_reference != baseline else None
    head = ["workload", "dtype", "mode", "eager ms", "Inductor ms", "fusion ms", "fusion / Inductor"]
    head += ["1st Inductor copy / Inductor"] if first_copy else []
    head += ["first call s (Inductor / fusion)", "decision"]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---:" if "ms" in h or "/" in h else "---" for h in head) + "|"]  # fmt: skip
    for case in report.cases:
        items = {b: case.item(b) for b in ("eager", baseline, subject, first_copy or baseline)}
        cells = [case.workload, case.dtype, case.mode]
        cells += [_fmt(items[b].median_ms if items[b] else None, "{:.3f}") for b in ("eager", baseline, subject)]
        cells.append(_fmt(case.speedup(subject, baseline), "{:.2f}x"))  # the verdict's ratio
        if first_copy:
            cells.append(_fmt(case.speedup(first_copy, baseline), "{:.2f}x"))
        firsts = (items[first_copy or baseline], items[subject])
        cells.append(" / ".join(_fmt(item.compile_s if item else None, "{:.1f}") for item in firsts))
        cells.append(_decision(items[subject].notes if items[subject] else []))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"`{verdict.first_call_line()}`", "", f"`{verdict.line()}`"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, help="a bench.json")
    print(table(parser.parse_args().report))


if __name__ == "__main__":
    main()
