"""``python -m fusion_backend bench``: argument parsing and everything the user sees.

This is the output layer: the only module of the harness that writes to stdout/stderr.  Progress lines
(or a tqdm bar when tqdm is installed) go to stderr; the summary table, the list of written files and,
last, the verdict line (:mod:`.verdict`) go to stdout, so ``... bench > table.txt`` captures the result
alone and ``... bench | tail -1`` the verdict.

Exit status: 0 when every item passed (or when there is no CUDA and nothing was timed); 1 when any item
FAILed the correctness gate or raised; 2 for bad arguments (unknown suite/file/backend/dtype); 130 when
interrupted.  A workload skipped because a library it needs is not installed, or because the run asks
for none of the rows its file declares, leaves no item and does not change the status; it is named in a
``NAME: skipped (REASON)`` line on stderr as the run reaches it (before the no-CUDA note where nothing
runs) and again on stdout after the table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

import torch

from .affinity import pin_to_device_node
from .backends import BUILTIN_BACKENDS, resolve_backends, with_compile_mode
from .config import DEFAULT_BACKENDS, MODES, PRECISIONS, BenchConfig, MeasureConfig
from .env import collect_environment
from .errors import BenchError, ConfigError
from .measure import CudaEventTimer, cuda_instruments, measure_device_rates
from .merge import merge_reports, read_report
from .output import fmt_ms, plan_lines, skip_line, skipped_text, summary_table, write_reports
from .results import BenchReport
from .roofline import describe_rates
from .runner import ProgressEvent, Runner
from .suite import SUITES, filter_workloads, resolve_suite
from .verdict import TIE_RATIO, nothing_timed, verdict_of

PROG = "python -m fusion_backend bench"

EPILOG = f"""\
suites (folders under the repository's demos/, or $FUSION_DEMOS_DIR):
{chr(10).join(f'  {k}: {v.description} (demos/{v.folder}/, {len(v.files)} files)' for k, v in SUITES.items())}
  or a model file, or a folder of model files (defining Model, get_inputs() and get_init_inputs())
backends:
  {', '.join(BUILTIN_BACKENDS)};
  any torch.compile backend name; NAME:MODE passes a torch.compile mode;
  --compile-mode MODE passes it to every compiled backend (inductor:MODE, fusion:MODE, ...)
Every backend is checked against eager (output, and every gradient in train mode) before it is timed;
a mismatch is reported as FAIL and never timed.  Writes bench.json, bench.txt, bench.md and bench.png
(needs matplotlib) into --out.  The last line printed is the verdict: on how many rows (workload x
dtype x mode) fusion's warm median is at least Inductor's ({TIE_RATIO:g}x counts as a tie; a row where
fusion failed never counts and is named worst; a row Inductor failed is left out and named), the worst
row, and the geometric mean of Inductor's time over fusion's.  Exit status 1 if any item failed.
A model file may declare DTYPES, MODES (its rows, intersected with --dtype/--mode) and REQUIRES (the
packages it needs); a workload whose package is missing is skipped with a line saying so.

examples:
  {PROG} --suite seeds --dtype fp32,bf16 --mode infer,train --out bench-results/h100
  {PROG} --suite convnets --backends inductor,fusion --compile-mode reduce-overhead
"""


def cuda_available() -> bool:
    """Whether CUDA can be used (a module-level function so tests can pretend either way)."""
    return torch.cuda.is_available()


def _csv(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _tolerances(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in _csv(text):
        name, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected DTYPE=TOL, got {part!r}")
        try:
            out[name.strip()] = float(value)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"tolerance {value!r} is not a number") from exc
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``bench`` argument parser."""
    p = argparse.ArgumentParser(prog=PROG, description="Check, then time eager vs Inductor vs fusion on "
                                "conv workloads, with memory and the roofline floor.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="seeds",
                   help="suite name, model file or folder; comma-separated for several (default: seeds)")
    p.add_argument("--dtype", default="fp32,bf16", type=_csv,
                   help=f"comma-separated precisions from {', '.join(PRECISIONS)} (default: fp32,bf16)")
    p.add_argument("--mode", default="infer,train", type=_csv,
                   help=f"comma-separated modes from {', '.join(MODES)} (default: infer,train)")
    p.add_argument("--backends", default=",".join(DEFAULT_BACKENDS), type=_csv,
                   help=f"comma-separated backends (default: {','.join(DEFAULT_BACKENDS)})")
    p.add_argument("--compile-mode", default=None, metavar="MODE",
                   help="torch.compile mode for every compiled backend, e.g. reduce-overhead (CUDA graphs "
                   "for Inductor and fusion alike); same as NAME:MODE on each, and an error where a backend "
                   "names another mode")
    p.add_argument("--out", default=None,
                   help="output folder (default: bench-results/<UTC date-time>)")
    p.add_argument("--merge", nargs="+", default=None, metavar="REPORT",
                   help="merge these runs (folders holding bench.json, or the files) into one report in --out, "
                   "with one verdict; nothing is run.  They must share every setting, the device and the "
                   "git commit")
    p.add_argument("--merge-across-commits", action="store_true",
                   help="with --merge: let the parts come from different commits (a part rerun after a change "
                   "that cannot touch the others' rows); the report lists each part's commit")
    p.add_argument("--filter", default=None,
                   help="keep workloads whose name contains any comma-separated pattern (globs allowed)")
    p.add_argument("--reps", type=int, default=None,
                   help="fixed timed repetitions per round (default: adaptive, ~--target-ms over all rounds)")
    p.add_argument("--target-ms", type=float, default=300.0,
                   help="adaptive repetitions aim for this much timed time per measurement, all rounds "
                   "together (default: 300)")
    p.add_argument("--rounds", type=int, default=6,
                   help="each backend of a row is timed this many times, interleaved with the row's other "
                   "backends; its time is the median of its quietest round (default: 6)")
    p.add_argument("--extra-rounds", type=int, default=6,
                   help="while a backend's two quietest rounds of a row differ by more than 3%%, or the "
                   "middle half of the row's paired fusion / Inductor round ratios holds the tie, the row's "
                   "backends are timed once more, at most this many more times (default: 6)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed repetitions before each measurement (default: 3)")
    p.add_argument("--consecutive", type=int, default=1, metavar="K",
                   help="a round runs each backend's repetitions in blocks of K in a row, as a loop calls one "
                   "model, before the next backend's (default: 1, one repetition each in turn)")
    p.add_argument("--no-cold", action="store_true", help="skip the cold-L2 measurement")
    p.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    p.add_argument("--no-chart", action="store_true", help="do not draw bench.png")
    p.add_argument("--no-pin", action="store_true",
                   help="leave the process on every CPU it may use (by default it is pinned to the CPUs of the "
                        "GPU's NUMA node, where those span several nodes; the report's environment says which)")
    p.add_argument("--steady-state-budget", type=float, default=None, metavar="X",
                   help="hold each row's time to steady state (fusion's first call and settle over Inductor's "
                   "first call) to X in the first-call line (whole networks: 1.25; default: not judged)")
    p.add_argument("--seed", type=int, default=0, help="seed of weights, inputs and upstream gradients")
    p.add_argument("--tol", type=_tolerances, default=None,
                   help="override the gate's tolerances vs eager, e.g. fp32=1e-4,bf16=2e-2 (norm-wise relative "
                   "error; defaults: fp32 1e-4, or 2e-3 while cuDNN may use TF32, bf16 2e-2)")
    p.add_argument("--no-fp64-check", action="store_true",
                   help="judge by the tolerance vs eager alone; by default a tensor beyond it still passes "
                   "if it is no farther from a float64 run than 2x (bf16: 3x) eager is")
    p.add_argument("--check-only", action="store_true",
                   help="run only the correctness gate (no timing); without CUDA it runs on CPU")
    p.add_argument("--dry-run", action="store_true",
                   help="load the suite, resolve backends, print the plan, run nothing")
    p.add_argument("-v", "--verbose", action="store_true", help="log tracebacks of failed items to stderr")
    p.add_argument("--log", action="store_true",
                   help="log to stderr what the fusion backend's first calls compile and time (its decisions, "
                        "per-shape choices and kernel compiles), each line with the seconds since the run started")
    return p


#: The loggers ``--log`` turns on at INFO: what makes a fusion first call long.
FIRST_CALL_LOGGERS = ("fusion_backend.decision", "fusion_backend.impl_choice", "fusion_backend.launch")


class _LineProgress:
    """Two lines per item on a stream, when it starts and when it is finished (the items of a case are
    timed together, after all of them compiled): ``[ 7/60] convt3d_leaky_mul_leaky_maxpool bf16 train
    inductor: ok 0.780 ms``."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, ev: ProgressEvent) -> None:
        if ev.phase == "skipped":
            self.stream.write(skip_line(ev.workload, ev.reason) + "\n")
            self.stream.flush()
            return
        if ev.phase not in ("start", "done") or ev.phase == "done" and ev.result is None:
            return
        width = len(str(ev.total))
        what = "compiling and checking" if ev.phase == "start" else describe_item(ev.result)
        self.stream.write(f"[{ev.index:>{width}}/{ev.total}] {ev.workload} {ev.dtype} {ev.mode} {ev.backend}: {what}\n")
        self.stream.flush()


class _TqdmProgress:
    """A tqdm bar with the current item as its description and a line per finished item above it."""

    def __init__(self, stream: TextIO, tqdm_cls: Any) -> None:
        self.stream = stream
        self.tqdm_cls = tqdm_cls
        self.bar: Any = None

    def __call__(self, ev: ProgressEvent) -> None:
        if self.bar is None:
            self.bar = self.tqdm_cls(total=ev.total, file=self.stream, unit="item", dynamic_ncols=True)
        if ev.phase == "skipped":
            self.bar.total = ev.total  # a workload skipped once built takes its items off the total
            self.bar.refresh()
            self.bar.write(skip_line(ev.workload, ev.reason), file=self.stream)
        elif ev.phase == "start":
            self.bar.set_description(f"{ev.workload} {ev.dtype} {ev.mode} {ev.backend}")
        elif ev.result is not None:
            self.bar.write(f"{ev.workload} {ev.dtype} {ev.mode} {ev.backend}: {describe_item(ev.result)}",
                           file=self.stream)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def describe_item(item: Any) -> str:
    """Short result of an item for progress output."""
    if not item.ok:
        first = item.error.splitlines()[0] if item.error else ""
        return f"{item.status.value}: {first[:200]}"
    parts = ["ok"]
    if item.compile_s is not None:
        parts.append(f"first call {item.compile_s:.1f} s")
    if item.settle_s is not None:
        parts.append(f"settled {item.settle_s:.1f} s later")
    if item.median_ms is not None:
        parts.append(f"{fmt_ms(item.median_ms)} ms")
    if item.cold_median_ms is not None:
        parts.append(f"cold {fmt_ms(item.cold_median_ms)} ms")
    return ", ".join(parts)


def _make_progress(stream: TextIO) -> Any:
    if not stream.isatty():  # a bar redrawn with carriage returns makes a log file unreadable
        return _LineProgress(stream)
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return _LineProgress(stream)
    return _TqdmProgress(stream, tqdm)


def _normalise_argv(argv: list[str] | None) -> list[str]:
    if argv is None:
        argv = sys.argv[1:]
        if argv[:1] == ["bench"]:  # ``python -m fusion_backend bench ...`` routed without stripping
            argv = argv[1:]
    return list(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the ``bench`` command with ``argv`` (the arguments after ``bench``); return the exit status."""
    argv = _normalise_argv(argv)
    args = build_parser().parse_args(argv)
    out, err = sys.stdout, sys.stderr
    logger = logging.getLogger("fusion_backend.bench")
    handler = logging.StreamHandler(err)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    first_call = logging.StreamHandler(err)
    began = time.perf_counter()
    first_call.addFilter(lambda record: setattr(record, "run_s", time.perf_counter() - began) or True)
    first_call.setFormatter(logging.Formatter("%(run_s)8.1f s %(name)s: %(message)s"))
    levels = {name: logging.getLogger(name).level for name in FIRST_CALL_LOGGERS}
    if args.log:
        for name in FIRST_CALL_LOGGERS:
            logging.getLogger(name).addHandler(first_call)
            logging.getLogger(name).setLevel(logging.INFO)
    try:
        return _run(args, argv, out, err)
    except KeyboardInterrupt:
        err.write("\ninterrupted before any result; no report written\n")
        return 130
    finally:
        logger.removeHandler(handler)
        for name, level in levels.items():
            logging.getLogger(name).removeHandler(first_call)
            logging.getLogger(name).setLevel(level)


def _run(args: argparse.Namespace, argv: list[str], out: TextIO, err: TextIO) -> int:
    if args.merge:
        return _merge(args, out, err)
    try:
        measure = MeasureConfig(warmup=args.warmup, target_ms=args.target_ms, reps=args.reps,
                                cold=not (args.no_cold or args.check_only), rounds=args.rounds,
                                extra_rounds=args.extra_rounds, consecutive=args.consecutive)
        backend_names = tuple(with_compile_mode(args.backends, args.compile_mode))
        config = BenchConfig(dtypes=args.dtype, modes=args.mode, backends=backend_names, seed=args.seed,
                             check_only=args.check_only, memory=not args.no_memory, measure=measure,
                             tolerances=args.tol or {}, fp64_check=not args.no_fp64_check,
                             steady_state_budget=args.steady_state_budget)
        backends = resolve_backends(config.backends)
        workloads = filter_workloads(resolve_suite(args.suite), args.filter)
        if not workloads:
            raise ConfigError(f"no workload of suite {args.suite!r} matches --filter {args.filter!r}")
    except BenchError as exc:
        err.write(f"{PROG}: error: {exc}\n")
        return 2

    if args.dry_run:
        out.write("\n".join(plan_lines(workloads, config, backends)) + "\n")
        return 0

    cuda = cuda_available()
    if not cuda and not args.check_only:
        for workload in workloads:
            reason = workload.skip_reason(config.dtypes, config.modes)
            if reason:
                err.write(skip_line(workload.name, reason) + "\n")
        err.write(
            f"{PROG}: timing needs CUDA, and no CUDA device is visible (torch {torch.__version__}, "
            f"CUDA build: {torch.version.cuda or 'none'}). Nothing was timed and no report was written.\n"
            "  --dry-run shows the plan; --check-only runs the correctness gate on CPU.\n"
        )
        out.write(nothing_timed("no CUDA device", config.backends).line() + "\n")
        return 0

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        err.write("no CUDA: running the correctness gate only, on CPU\n")
    cpu_affinity = ("not pinned: no CUDA device" if not cuda else "not pinned: --no-pin" if args.no_pin
                    else pin_to_device_node(device))
    instruments = cuda_instruments(device, config.measure) if cuda else None
    rates = None
    if cuda and not config.check_only:
        err.write("measuring device copy bandwidth and matmul rates ...\n")
        rates_timer = CudaEventTimer(device, MeasureConfig(warmup=2, target_ms=100.0, min_reps=5))
        rates = measure_device_rates(device, rates_timer)
        err.write(f"  {torch.cuda.get_device_name(device)}: {describe_rates(rates)}\n")

    environment = {**collect_environment(device, argv), "cpu_affinity": cpu_affinity}
    out_dir = Path(args.out) if args.out else (
        Path("bench-results") / _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S"))
    progress = _make_progress(err)
    try:
        with _sigterm_as_interrupt() as stop:
            runner = Runner(config, backends, device=device, instruments=instruments, rates=rates,
                            progress=progress, stop_requested=stop.is_set)
            report = runner.run(workloads, environment)
    finally:
        if isinstance(progress, _TqdmProgress):
            progress.close()

    return _write_and_summarise(report, out_dir, args, out)


def _write_and_summarise(report: BenchReport, out_dir: Path, args: argparse.Namespace, out: TextIO) -> int:
    """Write ``report``'s files to ``out_dir``, print its table and verdict; the exit status (130 for a
    partial report, 1 when an item failed, else 0)."""
    files = write_reports(report, out_dir, chart=not args.no_chart)
    out.write("\n" + summary_table(report) + "\n")
    if report.skipped:
        out.write("\n" + skipped_text(report) + "\n")
    judged = verdict_of(report)
    first_calls = judged.first_call_line()
    verdict = f"{first_calls}\n{judged.line()}" if first_calls else judged.line()
    if not report.complete:
        out.write(f"\ninterrupted: partial report of the {len(report.cases)} finished case(s) in {out_dir}\n")
        out.write(f"\n{verdict} (finished rows only)\n")
        return 130
    failed = [i for i in report.items if not i.ok]
    if failed:
        out.write(f"\n{len(failed)} item(s) failed the correctness gate or raised; see the Failures section "
                  f"of {files.text}\n")
    out.write(f"\nwrote {files.json}, {files.text}, {files.markdown}")
    out.write(f", {files.chart}\n" if files.chart else f"\n(no chart: {files.chart_note})\n")
    out.write(f"\n{verdict}\n")
    return 1 if failed else 0


def _merge(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``--merge``: the parts' reports as one (``bench/merge.py``), written to ``--out``."""
    if not args.out:
        err.write(f"{PROG}: error: --merge needs --out\n")
        return 2
    try:
        report = merge_reports([read_report(path) for path in args.merge], args.merge_across_commits)
    except BenchError as exc:
        err.write(f"{PROG}: error: {exc}\n")
        return 2
    return _write_and_summarise(report, Path(args.out), args, out)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[threading.Event]:
    """SIGTERM (what ``timeout``, job schedulers and CI send) ends the run as Ctrl-C does: the runner
    stops and the finished cases are written as a partial report.  Yields the event the signal sets,
    for the runner to ask after each item: the handler's ``KeyboardInterrupt`` is lost where Python
    runs the handler inside a finalizer.  Only in the main thread (the one place Python lets a handler
    be installed); elsewhere SIGTERM keeps its default action."""
    import signal

    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def interrupt(signum: int, frame: Any) -> None:
        stop.set()
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
