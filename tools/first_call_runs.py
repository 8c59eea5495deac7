"""Row by row, the first calls of several runs of one suite: each run's fusion / Inductor first call,
their median, and the row's budget (3x, or 1.2x where Inductor's graphs came from its disk caches).

One first call of about 0.1 s (a small row on warm caches) moves by tens of ms from one process to the
next, both backends alike, so a single run's ratio on such a row is a sample against a 1.2x budget;
the median over runs on caches of their own (e.g. one cold run and its warm rerun per GPU) is the
row's first call.  The last line counts the rows whose median is above their budget.

    python tools/first_call_runs.py RUN_A/bench.json RUN_B/bench.json RUN_C/bench.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from fusion_backend.bench.output import read_json
from fusion_backend.bench.verdict import verdict_of


def table(paths: list[Path]) -> str:
    """The Markdown table (one row per workload x dtype x mode with a measured pair in every run) and
    the summary line.  Raises ``ValueError`` where the runs' rows differ or a row's budget differs
    between runs (a cold run beside warm reruns: compare like with like)."""
    runs = [{(r.workload, r.dtype, r.mode): r for r in verdict_of(read_json(p)).rows if r.first_call_ratio is not None}
            for p in paths]  # fmt: skip
    keys = list(runs[0])
    if any(list(run) != keys for run in runs[1:]):
        raise ValueError("the runs hold different rows with a first call on both backends: give runs of one suite")
    lines = ["| workload | dtype | mode | " + " | ".join(f"run {i + 1}" for i in range(len(runs))) + " | median | budget |",
             "|---|---|---|" + "---:|" * (len(runs) + 2)]  # fmt: skip
    medians = {}
    for key in keys:
        rows = [run[key] for run in runs]
        budgets = {row.first_call_budget for row in rows}
        if len(budgets) != 1:
            raise ValueError(f"{rows[0].label}: the runs hold it under different budgets {sorted(budgets)}")
        medians[key] = (statistics.median(row.first_call_ratio for row in rows), budgets.pop())
        cells = [*key, *(f"{row.first_call_ratio:.2f}x" for row in rows), f"{medians[key][0]:.2f}x", f"{medians[key][1]:g}x"]
        lines.append("| " + " | ".join(cells) + " |")
    over = [key for key, (median, budget) in medians.items() if median > budget]
    low, high = min(m for m, _ in medians.values()), max(m for m, _ in medians.values())
    highest = f", the highest {' '.join(max(over, key=lambda k: medians[k][0] / medians[k][1]))}" if over else ""
    lines += ["", f"`median first call fusion / inductor over {len(runs)} runs {low:.2f}-{high:.2f}x; "
                  f"{len(over)}/{len(medians)} rows above their budget{highest}`"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, nargs="+", help="bench.json of each run")
    print(table(parser.parse_args(argv).reports))


if __name__ == "__main__":
    main()
