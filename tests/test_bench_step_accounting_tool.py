"""``tools/bench_step_accounting.py``: the per-call accounting of a benchmark's steps (the GPU run itself
needs CUDA; what is checked here is the bookkeeping)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_step_accounting as tool  # noqa: E402

from fusion_backend.bench.measure import TimedStep  # noqa: E402


def test_each_call_of_a_step_is_accounted_under_its_name_and_phase() -> None:
    accounts = tool.Accounts()
    ran, resets = [], []
    steps = [TimedStep("inductor", lambda: ran.append("i") or 1, lambda: resets.append("i")),
             TimedStep("fusion", lambda: ran.append("f") or [bytearray(1 << 20) for _ in range(4)])]
    tool.in_a_row(steps, 3, accounts, lambda: None)
    rounds = [accounts.accounted(s, "rounds") for s in steps]
    assert rounds[0].run() == 1 and rounds[0].name == "inductor" and rounds[0].reset is steps[0].reset
    assert ran == ["i"] * 3 + ["f"] * 3 + ["i"] and resets == ["i"] * 3
    assert {k: a.calls for k, a in accounts.by_step.items()} == {
        ("inductor", "in a row"): 3, ("fusion", "in a row"): 3, ("inductor", "rounds"): 1, ("fusion", "rounds"): 0}
    account = accounts.by_step[("fusion", "in a row")]
    assert account.wall_s > 0 and account.user_s >= 0 and account.minor_faults >= 0
    table = accounts.table().splitlines()
    assert len(table) == 4 and table[0].startswith("inductor (in a row)") and "faults" in table[0]


def test_bench_arguments_pass_through_and_a_bad_count_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    args, bench = tool.parse_args(["--in-a-row", "5", "--", "--suite", "x.py", "--dtype", "bf16"])
    assert args.in_a_row == 5 and bench == ["--suite", "x.py", "--dtype", "bf16"]
    with pytest.raises(SystemExit):
        tool.parse_args(["--in-a-row", "-1"])
    assert "--in-a-row takes a count >= 0, got -1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU machine's answer")
def test_without_cuda_it_says_so_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert tool.main(["--", "--suite", "demos/seeds"]) == 2
    assert capsys.readouterr().err.strip() == (
        "bench_step_accounting: needs CUDA (the benchmark's rounds are timed on the GPU)")


def test_the_launcher_census_reads_the_loaded_modules() -> None:
    assert all(": {" in line for line in tool.launcher_census())


def test_faults_in_triton_launches_and_faulting_calls_are_counted() -> None:
    """``count_launch_faults`` adds each launch's faults; the account keeps, per call, those taken in
    launches, whether the call took any and the most one call took."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    original = CachingAutotuner.run
    undo = tool.count_launch_faults()
    try:
        assert CachingAutotuner.run is not original
        before = tool._launch_faults[0]
        fake = type("Fake", (), {"fn": type("Fn", (), {"__name__": "triton_poi_fake"})()})()
        with pytest.raises(Exception):  # noqa: B017 (the real run fails on the stand-in; the count still happens)
            CachingAutotuner.run(fake, stream=0)
        assert tool._launches_by_kernel["triton_poi_fake"] >= 1 and tool._launch_faults[0] >= before
    finally:
        undo()
    assert CachingAutotuner.run is original

    def fresh_pages() -> None:  # maps 64 pages and writes one byte to each: one minor fault per page
        import mmap

        fresh = mmap.mmap(-1, 64 * mmap.PAGESIZE)
        for page in range(64):
            fresh[page * mmap.PAGESIZE] = 1
        fresh.close()

    accounts = tool.Accounts()
    touched = accounts.accounted(TimedStep("big", fresh_pages), "in a row")
    for _ in range(3):
        touched.run()
    account = accounts.by_step[("big", "in a row")]
    assert account.faulting_calls == 3 and account.most_faults >= 64 and account.launch_faults == 0
    assert "calls took any" in accounts.table()


def test_fault_sites_name_the_mapping_of_each_sampled_fault() -> None:
    fault_sites = pytest.importorskip("fault_sites")
    try:
        sites = fault_sites.FaultSites()
    except OSError as exc:  # perf_event_open refused (perf_event_paranoid > 2, a sandbox): nothing to read
        pytest.skip(f"no perf events here: {exc}")
    try:
        import mmap

        fresh = mmap.mmap(-1, 256 * mmap.PAGESIZE)
        with sites:
            for page in range(256):  # the first write to each fresh page faults once
                fresh[page * mmap.PAGESIZE] = 1
        assert sum(sites.sites.values()) >= 200, sites.table()
        assert "instruction in" in sites.table()
        fresh.close()
    finally:
        sites.close()
