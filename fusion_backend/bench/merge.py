"""One report from several runs of one suite: ``python -m fusion_backend bench --merge DIR DIR ... --out DIR``.

WHY: a suite's whole matrix (every workload in fp32 and bf16, inference and training) can take longer
than one sitting allows, so it runs in parts (``--filter`` or a list of
model files), merged into the one ``bench.json`` the suite is read from, with one verdict over all rows.

Contract of :func:`merge_reports`: the reports must come from the same configuration (backends,
seed, tolerances, measurement settings), the same GPU, software, TF32 flags and git commit, and no
(workload, dtype, mode) row may appear twice; otherwise :class:`ConfigError` names the difference.
The parts may cover other precisions and modes (one part the fp32 rows, another the bf16 ones): the
merged report's configuration lists the union, in the order the parts name them.  With ``across_commits`` (``--merge-across-commits``) the parts may come from
different commits, for a part rerun after a change that cannot touch the other parts' rows: the
merged report's ``git_commit`` is then ``None`` and ``part_git_commits`` lists each part's, in the
order of ``merged_from``; parts run on different working trees (``env.git_code``) likewise leave
``git_tree`` ``None`` and list ``part_git_trees``.  Rows keep their order (the reports' order, then
each report's); the merged run started when the first began and finished when the last ended, its wall
time is the sum, and it is complete only if every part is.  A workload skipped in a part stays skipped unless another part ran it.
Each row was timed within its own run, with all of its backends: merging never compares numbers
across runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from .errors import ConfigError
from .output import read_json
from .results import BenchReport

#: The configuration's fields a part may set apart from the others: which rows it ran.
_PER_PART = ("dtypes", "modes")
#: What the parts' environments must share: the GPU, the software, the TF32 flags and the code.
_SAME_ENVIRONMENT = ("gpu", "device", "torch", "triton", "cuda", "cudnn", "tf32", "git_commit")


def _environment_value(report: BenchReport, key: str) -> object:
    value = report.environment.get(key)
    return value.get("name") if key == "gpu" and isinstance(value, dict) else value


def read_report(path: str | Path) -> BenchReport:
    """The report in ``path``: a ``bench.json`` file or a folder holding one."""
    path = Path(path)
    file = path / "bench.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"no bench.json at {path}")
    return read_json(file)


def merge_reports(reports: Sequence[BenchReport], across_commits: bool = False) -> BenchReport:
    """The reports as one run (see the module docstring)."""
    if len(reports) < 2:
        raise ConfigError(f"--merge needs at least two reports, got {len(reports)}")
    first = reports[0]
    seen: set[tuple[str, str, str]] = set()
    for i, report in enumerate(reports):
        differ = [f.name for f in dataclasses.fields(first.config) if f.name not in _PER_PART
                  and getattr(report.config, f.name) != getattr(first.config, f.name)]  # fmt: skip
        if differ:
            raise ConfigError(f"report {i + 1} was run with other settings than report 1 ({', '.join(differ)})")
        for key in _SAME_ENVIRONMENT:
            if key == "git_commit" and across_commits:
                continue
            if _environment_value(report, key) != _environment_value(first, key):
                raise ConfigError(f"report {i + 1} has {key} {_environment_value(report, key)!r}, "
                                  f"report 1 {_environment_value(first, key)!r}")  # fmt: skip
        for case in report.cases:
            key = (case.workload, case.dtype, case.mode)
            if key in seen:
                raise ConfigError(f"row {' '.join(key)} is in more than one report")
            seen.add(key)
    workloads: dict[str, str] = {}
    for report in reports:
        workloads.update(report.workloads)
    environment = dict(first.environment)
    environment["merged_from"] = [r.environment.get("command", "") for r in reports]
    commits = [r.environment.get("git_commit") for r in reports]
    if len(set(commits)) > 1:
        environment["git_commit"], environment["part_git_commits"] = None, commits
    trees = [r.environment.get("git_tree") for r in reports]
    if len(set(trees)) > 1:  # parts run on other working trees (``env.git_code``): each part's, in order
        environment["git_tree"], environment["part_git_trees"] = None, trees
        environment["git_local_changes"] = any(r.environment.get("git_local_changes") for r in reports)
    ran = {case.workload for report in reports for case in report.cases}
    skipped = {name: reason for report in reports for name, reason in report.skipped.items()
               if name not in ran}
    union = {name: tuple(dict.fromkeys(v for r in reports for v in getattr(r.config, name))) for name in _PER_PART}
    return BenchReport(
        config=dataclasses.replace(first.config, **union),
        environment=environment,
        rates=first.rates,
        workloads=workloads,
        cases=tuple(case for report in reports for case in report.cases),
        started=min(r.started for r in reports),
        finished=max(r.finished for r in reports),
        wall_s=sum(r.wall_s for r in reports),
        complete=all(r.complete for r in reports),
        skipped=skipped,
    )
