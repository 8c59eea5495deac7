"""The ``realnets`` suite and what it relies on, on CPU in seconds: model files that declare their rows
(``DTYPES`` / ``MODES``) and the libraries they need (``REQUIRES``), workloads skipped where a library is
missing, and rows that Inductor itself fails left out of the verdict.

No real network is built here (the libraries are hidden, or tiny stand-in model files are written);
the GPU runs the suite itself.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from fusion_backend.bench import cli
from fusion_backend.bench.backends import BenchBackend, resolve_backend
from fusion_backend.bench.config import BenchConfig, MeasureConfig
from fusion_backend.bench.errors import SuiteError
from fusion_backend.bench.measure import Instruments, MemoryStats, TimedStep, TimingStats
from fusion_backend.bench.output import read_json, summary_table
from fusion_backend.bench.results import BenchReport, CaseResult, ItemResult, Status
from fusion_backend.bench.runner import ProgressEvent, Runner
from fusion_backend.bench.suite import SUITES, load_workload, resolve_suite
from fusion_backend.bench.verdict import verdict_of

LIBRARIES = ("torchvision", "torchaudio", "diffusers")

#: The suite's files, their declared precisions and what they need.
REALNETS = {
    "resnet50": (("fp32", "bf16"), ("torchvision",)),
    "efficientnet_b0": (("bf16",), ("torchvision",)),
    "r3d_18": (("bf16",), ("torchvision",)),
    "wav2vec2_base": (("bf16",), ("torchaudio",)),
    "sd_vae_decoder": (("fp32", "bf16"), ("diffusers",)),
    "dcgan_generator": (("bf16",), ()),
}

TINY = """
import torch
import torch.nn as nn
{head}

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        {build}
        self.conv = nn.Conv2d(2, 3, 3)

    def forward(self, x):
        return torch.relu(self.conv(x))


def get_inputs():
    return [torch.rand(2, 2, 6, 6)]


def get_init_inputs():
    return []
"""

CPU = torch.device("cpu")
EAGER = resolve_backend("eager")


def model_file(folder: Path, name: str, head: str = "", build: str = "pass") -> Path:
    """A tiny conv -> relu model file with ``head`` at file level and ``build`` first in ``__init__``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(TINY).format(head=head, build=build))
    return path


@pytest.fixture
def without_libraries(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchvision, torchaudio and diffusers not installed, whether or not they are."""
    for name in LIBRARIES:
        monkeypatch.setitem(sys.modules, name, None)


class _Timer:
    """Every step takes 1 ms, untouched: the verdict's arithmetic is not what these tests look at."""

    def time(self, steps: Sequence[TimedStep], *, cold: bool = False) -> list[TimingStats | Exception]:
        return [TimingStats.from_samples([1.0]) for _ in steps]


class _Memory:
    def allocated(self, *, drop_workspaces: bool = False) -> int:
        return 0

    def measure(self, forward: Callable[[], Any], backward: Callable[[Any], None] | None = None, *,
                before: Callable[[], None] | None = None) -> MemoryStats:
        return MemoryStats(baseline_bytes=0, peak_bytes=0, held_bytes=0)


def run(workloads: list[Any], backends: list[BenchBackend], dtypes: tuple[str, ...], modes: tuple[str, ...],
        *, check_only: bool = True, events: list[ProgressEvent] | None = None) -> BenchReport:
    config = BenchConfig(dtypes=dtypes, modes=modes, backends=tuple(b.name for b in backends),
                         check_only=check_only, memory=False, fp64_check=False,
                         measure=MeasureConfig(rounds=1, extra_rounds=0, cold=False, warmup=0))
    # ``release`` would collect garbage after every case: 0.15 s or more each, and nothing to free here.
    instruments = Instruments(timer=_Timer(), memory=_Memory(), release=lambda: None)
    runner = Runner(config, backends, device=CPU, instruments=instruments,
                    progress=events.append if events is not None else None)
    return runner.run(workloads, environment={"device": "cpu", "command": "test"})


# -- the suite -----------------------------------------------------------------------------------------------


def test_the_realnets_suite_resolves_to_its_six_networks_with_their_declared_rows() -> None:
    """bf16 inference and training for every network, fp32 too for ResNet-50 and the VAE decoder."""
    assert "realnets" in SUITES
    workloads = resolve_suite("realnets")
    assert [w.name for w in workloads] == list(REALNETS)
    for w in workloads:
        dtypes, requires = REALNETS[w.name]
        assert (w.dtypes, w.modes, w.requires) == (dtypes, ("infer", "train"), requires), w.name
        expected = [(d, m) for d in ("fp32", "bf16") if d in dtypes for m in ("infer", "train")]
        assert w.rows(("fp32", "bf16"), ("infer", "train")) == expected


def test_every_realnets_file_loads_without_its_library_and_building_it_raises_import_error(
        without_libraries: None) -> None:
    """Each library is imported when the model is built, not when the file loads: the suite loads on a
    machine without them, each file knows what it misses, and building one says which module is absent."""
    for w in resolve_suite("realnets"):
        assert w.missing() == REALNETS[w.name][1]
        if w.requires:
            with pytest.raises(ImportError):
                w.module.Model(*w.module.get_init_inputs())
    assert not any(sys.modules.get(name) for name in LIBRARIES)


# -- skipping what cannot run --------------------------------------------------------------------------------


def test_a_workload_whose_library_is_missing_is_skipped_with_a_line_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Missing by its REQUIRES (known before building), missing when built (no REQUIRES), or installed
    without a name it should have: each is skipped with why, the tiny model still runs, exit status 0."""
    folder = tmp_path / "models"
    model_file(folder, "a_declared", head='REQUIRES = ("fusion_absent_library",)')
    model_file(folder, "b_undeclared", build="import fusion_absent_library_b  # noqa: F401")
    model_file(folder, "c_too_old", build="raise ImportError(\"cannot import name 'thing' from 'lib'\")")
    model_file(folder, "d_runs")
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    out_dir = tmp_path / "out"
    args = ["--suite", str(folder), "--backends", "eager", "--dtype", "fp32", "--mode", "infer", "--no-chart"]
    assert cli.main([*args, "--check-only", "--out", str(out_dir)]) == 0
    captured = capsys.readouterr()
    lines = ["a_declared: skipped (needs fusion_absent_library, not installed)",
             "b_undeclared: skipped (needs fusion_absent_library_b, not installed)",
             "c_too_old: skipped (importing a library failed: cannot import name 'thing' from 'lib')"]
    assert [line for line in captured.err.splitlines() if "skipped" in line] == lines
    assert "\n".join(lines) in captured.out and "d_runs" in captured.out
    report = read_json(out_dir / "bench.json")
    assert [c.workload for c in report.cases] == ["d_runs"] and report.all_ok
    assert report.skipped == {line.partition(":")[0]: line.partition("(")[2][:-1] for line in lines}
    assert "\n".join(lines) in (out_dir / "bench.txt").read_text()

    # Without CUDA nothing is built, but what REQUIRES names is known: the line comes before the note.
    assert cli.main(args) == 0
    err = capsys.readouterr().err
    assert err.startswith(lines[0] + "\n") and "timing needs CUDA" in err


def test_realnets_on_a_machine_without_cuda_or_the_libraries_names_each_skip_and_exits_0(
        without_libraries: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "cuda_available", lambda: False)
    assert cli.main(["--suite", "realnets"]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if "skipped" in line] == [
        f"{name}: skipped (needs {requires[0]}, not installed)" for name, (_, requires) in REALNETS.items()
        if requires]
    assert captured.out == "nothing was timed (no CUDA device): no fusion-vs-inductor verdict\n"


# -- declared rows -------------------------------------------------------------------------------------------


def test_declared_dtypes_and_modes_are_intersected_with_the_run_s_and_a_file_without_runs_them_all(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    head = 'DTYPES = ("bf16",)\nMODES = ("train", "infer")'
    declared = load_workload(model_file(tmp_path, "declared", head=head))
    plain = load_workload(model_file(tmp_path, "plain"))
    events: list[ProgressEvent] = []
    report = run([declared, plain], [EAGER], ("fp32", "bf16"), ("infer", "train"), events=events)
    rows = [(c.workload, c.dtype, c.mode) for c in report.cases]
    assert rows == [("declared", "bf16", "infer"), ("declared", "bf16", "train"),  # the run's order
                    ("plain", "fp32", "infer"), ("plain", "fp32", "train"),
                    ("plain", "bf16", "infer"), ("plain", "bf16", "train")]
    assert report.all_ok and {e.total for e in events} == {6}

    only_fp32 = run([declared, plain], [EAGER], ("fp32",), ("infer",), events=events)
    assert [c.workload for c in only_fp32.cases] == ["plain"]
    assert only_fp32.skipped == {"declared": "its file declares DTYPES bf16; the run asks for fp32"}
    assert any(e.phase == "skipped" and e.workload == "declared" for e in events)

    assert cli.main(["--suite", f"{tmp_path / 'declared.py'},{tmp_path / 'plain.py'}", "--backends", "eager",
                     "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "(rows bf16 infer, bf16 train)" in out and "= 6 item(s) (rows as the files declare)" in out


@pytest.mark.parametrize("head, message", [
    ('DTYPES = ("fp8",)', "DTYPES names 'fp8'; choose from fp32, bf16"),
    ('MODES = "train"', "MODES must be a non-empty tuple of strings"),
    ("MODES = ()", "MODES must be a non-empty tuple of strings"),
    ('REQUIRES = ("a", "a")', "REQUIRES names an entry twice"),
])
def test_a_bad_declaration_is_an_error_naming_the_file(tmp_path: Path, head: str, message: str) -> None:
    with pytest.raises(SuiteError, match="bad.py: " + message.replace("(", r"\(")):
        load_workload(model_file(tmp_path, "bad", head=head))


# -- rows Inductor fails -------------------------------------------------------------------------------------


def _report(rows: list[tuple[str, dict[str, float | Status]]], error: str = "") -> BenchReport:
    """bf16 training rows run by nothing: per row each backend's warm median in ms or its failure (1 ms
    where the row names none); ``error``: the eager reference's failure, set on every case."""
    backends = ("eager", "inductor", "fusion")
    cases = []
    for workload, results in rows:
        items = tuple(
            ItemResult(workload, "bf16", "train", b, result, error="synthetic") if isinstance(result, Status)
            else ItemResult(workload, "bf16", "train", b, Status.OK, warm=TimingStats.from_samples([result]))
            for b in backends for result in [results.get(b, 1.0)])
        cases.append(CaseResult(workload, "bf16", "train", None, items, error=error))
    return BenchReport(config=BenchConfig(backends=backends), environment={}, rates=None, workloads={},
                       cases=tuple(cases))


def test_a_row_inductor_fails_is_left_out_of_the_verdict_and_named() -> None:
    """Inductor FAILed or raised: the row is not among the N/M rows, not the worst and not in the geomean,
    whatever fusion did; the line says how many such rows there are and names them (three at most), the
    table marks them.  A row whose eager reference failed is no Inductor failure: it still counts."""
    report = _report([
        ("fast", {"inductor": 2.0, "fusion": 1.0}),
        ("dcgan", {"inductor": Status.FAIL, "fusion": 1.0}),
        ("both", {"inductor": Status.ERROR, "fusion": Status.ERROR}),
        ("slow", {"inductor": 0.5, "fusion": 1.0}),
    ])
    verdict = verdict_of(report)
    assert [r.baseline_failed for r in verdict.rows] == [False, True, True, False]
    assert (verdict.at_least_baseline, verdict.compared, len(verdict.counted)) == (1, 2, 2)
    assert verdict.line() == (
        "fusion >= inductor on 1/2 rows (0.97x counts as a tie; 2 rows left out as inductor failed them: "
        "dcgan bf16 train (FAIL), both bf16 train (ERROR; fusion ERROR)); worst: slow bf16 train 0.50x; "
        "geomean vs inductor 1.00x")
    extras = json.loads(json.dumps(verdict.json_extras()))
    assert extras["total_rows"] == 2 and [r["workload"] for r in extras["left_out"]] == ["dcgan", "both"]
    status = {line.split()[0]: line for line in summary_table(report).splitlines()[2:]}
    assert status["dcgan"].endswith("FAIL: inductor; not in the verdict")
    assert status["slow"].endswith("ok")

    many = _report([(f"w{i}", {"inductor": Status.FAIL}) for i in range(5)])
    assert "5 rows left out as inductor failed them: w0 bf16 train (FAIL), w1 bf16 train (FAIL), " \
           "w2 bf16 train (FAIL), 2 more)" in verdict_of(many).line()

    reference_failed = _report([("ref", {b: Status.ERROR for b in ("eager", "inductor", "fusion")})], "boom")
    assert verdict_of(reference_failed).line().startswith(
        "fusion >= inductor on 0/1 rows (0.97x counts as a tie; 1 row without both timings counted as "
        "not >=)")


def test_a_run_where_inductor_gets_a_row_wrong_leaves_that_row_out(tmp_path: Path) -> None:
    """Through the runner: an Inductor stand-in that is wrong on one model FAILs there; that row is left
    out and the other row decides the verdict alone."""
    ok = load_workload(model_file(tmp_path, "ok"))
    wrong = load_workload(model_file(tmp_path, "wrong_for_inductor", build="self.breaks_inductor = True"))

    def compile_inductor(module: torch.nn.Module) -> Callable[..., Any]:
        if getattr(module, "breaks_inductor", False):
            return lambda *args: module(*args) + 1.0
        return module

    inductor = BenchBackend("inductor", compile_inductor, "wrong on one model", uses_dynamo=False)
    fusion = BenchBackend("fusion", lambda m: m, "eager standing in for fusion", uses_dynamo=False)
    report = run([ok, wrong], [EAGER, inductor, fusion], ("fp32",), ("infer",), check_only=False)
    assert report.cases[1].item("inductor").status is Status.FAIL and report.cases[1].item("fusion").ok
    assert verdict_of(report).line() == (
        "fusion >= inductor on 1/1 rows (0.97x counts as a tie; 1 row left out as inductor failed it: "
        "wrong_for_inductor fp32 infer (FAIL)); worst: ok fp32 infer 1.00x; geomean vs inductor 1.00x")


MODE_SPY = """
import torch
import torch.nn as nn

{head}
SEEN = []


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 2, 3)

    def forward(self, x):
        SEEN.append(self.training)
        return self.conv(x)


def get_inputs():
    return [torch.rand(2, 2, 6, 6)]


def get_init_inputs():
    return []
"""


@pytest.mark.parametrize("infer_eval", [True, False])
def test_infer_eval_runs_the_inference_rows_in_eval_mode_and_the_training_rows_in_training_mode(
        tmp_path: Path, infer_eval: bool) -> None:
    path = tmp_path / "spy.py"
    path.write_text(MODE_SPY.format(head="INFER_EVAL = True" if infer_eval else ""))
    workload = load_workload(path)
    assert workload.infer_eval is infer_eval
    report = run([workload], [EAGER], ("fp32",), ("infer", "train"))
    assert report.all_ok
    modes = set(workload.module.SEEN[:2]), set(workload.module.SEEN[2:])  # the reference, then eager, per row
    assert modes == (({False}, {True}) if infer_eval else ({True}, {True}))


def test_set_mode_is_the_state_the_benchmark_runs_a_row_in(tmp_path: Path) -> None:
    path = tmp_path / "spy_set_mode.py"
    path.write_text(MODE_SPY.format(head="INFER_EVAL = True"))
    workload = load_workload(path)
    model, _ = workload.build(seed=0)
    assert workload.set_mode(model, "infer") is model and not model.training
    assert workload.set_mode(model, "train").training


@pytest.mark.parametrize("infer_eval", [True, False])
@pytest.mark.parametrize("mode", ["infer", "train"])
def test_tools_first_call_runs_the_row_in_the_mode_the_benchmark_runs_it(tmp_path: Path, capsys, infer_eval: bool,
                                                                          mode: str) -> None:  # fmt: skip
    """``tools/first_call.py`` (as the other tools that run one row) takes the row's model state from
    ``Workload.set_mode``: with ``INFER_EVAL`` an inference row runs in eval mode.  Dynamo's ``eager``
    backend: nothing compiled."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import first_call

    path = tmp_path / f"spy_{infer_eval}_{mode}.py"
    path.write_text(MODE_SPY.format(head="INFER_EVAL = True" if infer_eval else ""))
    first_call.child(str(path), "eager", mode, "fp32", False, "cpu")
    assert '"first_call_s"' in capsys.readouterr().out
    (module,) = [m for m in list(sys.modules.values()) if getattr(m, "__file__", None) == str(path)]
    assert set(module.SEEN) == {not (infer_eval and mode == "infer")}


def test_a_bad_infer_eval_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text(MODE_SPY.format(head='INFER_EVAL = "yes"'))
    with pytest.raises(SuiteError, match="bad.py: INFER_EVAL must be True or False"):
        load_workload(path)
