"""``impl_choice``: measured once per key, remembered in memory and on disk, default on ties."""

from __future__ import annotations

import contextlib
import json
import time

import pytest
import torch

from fusion_backend import environment, impl_choice, measurements
from fusion_backend.kernels.host import BoundedCache


def cache_file():
    return environment.cache_dir() / measurements.FILE


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(impl_choice.CACHE_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(impl_choice.MEASURE_ENV, raising=False)
    monkeypatch.setattr(impl_choice, "_fast", BoundedCache(8))
    measurements.forget_in_memory()
    yield
    measurements.forget_in_memory()


def fake_timer(times):
    calls = []

    def timer(fn):
        name = fn()
        calls.append(name)
        return times[name]

    return timer, calls


CANDIDATES = {"fast": lambda: "fast", "library": lambda: "library"}


def test_faster_candidate_wins_and_is_cached_in_memory_and_on_disk(monkeypatch):
    timer, calls = fake_timer({"fast": 1.0, "library": 2.0})
    assert impl_choice.choose("k", CANDIDATES, "library", timer=timer) == "fast"
    assert impl_choice.choose("k", CANDIDATES, "library", timer=timer) == "fast"
    assert calls == ["fast", "library"], "measured once"
    stored = json.loads(cache_file().read_text())["entries"]
    assert list(stored.values()) == [{"kind": "impl", "choice": "fast", "what": "k"}]
    assert next(iter(stored)) == impl_choice._full_key("k")
    # A new process (empty memory) reads the file instead of measuring.
    impl_choice.forget_in_memory()
    timer2, calls2 = fake_timer({"fast": 9.0, "library": 1.0})
    assert impl_choice.choose("k", CANDIDATES, "library", timer=timer2) == "fast"
    assert calls2 == []


def test_near_tie_keeps_the_default():
    timer, _ = fake_timer({"fast": 0.99, "library": 1.0})
    assert impl_choice.choose("tie", CANDIDATES, "library", timer=timer) == "library"


def test_measuring_off_returns_the_default_without_timing(monkeypatch):
    monkeypatch.setenv(impl_choice.MEASURE_ENV, "0")
    timer, calls = fake_timer({"fast": 1.0, "library": 2.0})
    assert impl_choice.choose("off", CANDIDATES, "library", timer=timer) == "library"
    assert calls == []


def test_a_failing_candidate_falls_back_to_the_default():
    def broken():
        raise RuntimeError("boom")

    timer, _ = fake_timer({"fast": 1.0, "library": 2.0})
    assert impl_choice.choose("bad", {"fast": broken, "library": lambda: "library"}, "library", timer=timer) == "library"


def test_unreadable_cache_file_only_costs_a_measurement():
    cache_file().write_text("{not json")
    timer, calls = fake_timer({"fast": 1.0, "library": 2.0})
    assert impl_choice.choose("k2", CANDIDATES, "library", timer=timer) == "fast"
    assert calls == ["fast", "library"]


def test_unknown_default_is_refused():
    with pytest.raises(ValueError, match="default 'nope'"):
        impl_choice.choose("k", CANDIDATES, "nope")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the real timer uses CUDA events")
def test_timer_charges_gpu_time_whatever_the_host_time():
    """The timer measures the candidates' GPU work: host time before the GPU work (a slow host, a
    long Python path) is not charged, and a call with no GPU work costs ~nothing, so the answer
    does not move with the host's speed (a wall-time timer once flipped the ConvT3d pipeline's bf16
    forward between two runs on the same H100)."""
    a = torch.randn(2048, 2048, device="cuda")

    def gpu_only():
        for _ in range(4):
            a @ a

    def host_then_gpu():
        time.sleep(1e-3)
        gpu_only()

    impl_choice.gpu_ms_per_call(gpu_only)  # cuBLAS warm-up
    gpu = impl_choice.gpu_ms_per_call(gpu_only)
    assert gpu > 0.1, f"four 2048^3 matmuls take more than 0.1 ms (got {gpu:.3f} ms)"
    slow_host = impl_choice.gpu_ms_per_call(host_then_gpu)
    # Charging the 1 ms host sleep would add >= 1 ms; the rest is GPU-time noise (the suite shares
    # the GPU between workers).
    assert slow_host < gpu + 0.4, f"host sleep charged: {slow_host:.3f} vs {gpu:.3f} ms"
    assert impl_choice.gpu_ms_per_call(lambda: time.sleep(1e-3)) < 0.1, "a call without GPU work is charged ~0"


def test_only_settled_answers_are_kept_under_the_fast_key(monkeypatch):
    """``fast_key``: an answer given without a measurement (measuring off) is not kept, so turning
    measuring on later is honoured; a settled answer is kept under the cheap key, and the string
    key (a callable) is built only until the answer is settled."""
    built = []

    def key():
        built.append(1)
        return "op-key"

    monkeypatch.setenv(impl_choice.MEASURE_ENV, "0")
    assert impl_choice.choose(key, CANDIDATES, "library", fast_key=("k",)) == "library"
    assert impl_choice._fast.peek(("k",)) is None
    monkeypatch.delenv(impl_choice.MEASURE_ENV)
    measurements.remember(impl_choice._full_key("op-key"), {"kind": "impl", "choice": "fast"})  # as if measured earlier
    assert impl_choice.choose(key, CANDIDATES, "library", fast_key=("k",)) == "fast"
    assert impl_choice.choose(key, CANDIDATES, "library", fast_key=("k",)) == "fast"
    assert impl_choice._fast.peek(("k",)) == "fast"
    assert len(built) == 1, "the string key is built only until the answer is settled"


def test_a_candidate_whose_results_disagree_is_never_picked():
    timer, calls = fake_timer({"fast": 1.0, "library": 2.0})
    results = {"fast": lambda: "fast", "library": lambda: "library"}
    disagree = lambda got, want: None if got == want else f"{got} != {want}"  # noqa: E731
    assert impl_choice.choose("k", results, "library", timer=timer, agree=disagree) == "library"
    assert calls == ["library"], "the disagreeing candidate is not even timed"
    remembered = measurements.lookup(impl_choice._full_key("k"), environment.cache_dir())
    assert remembered["choice"] == "library", "the answer is remembered"
    agree = lambda got, want: None  # noqa: E731
    assert impl_choice.choose("k2", results, "library", timer=timer, agree=agree) == "fast"


def test_a_probe_far_behind_screens_its_candidate_out_untuned():
    """The probe (the candidate on its first tile) is timed after the unprobed candidates; beyond
    ``SCREEN`` times the best of them the candidate itself never runs (its tuning never compiles)."""
    timer, calls = fake_timer({"fast": 1.0, "fast-probe": 1.1 * 1.6 * impl_choice.SCREEN, "library": 1.6})
    probes = {"fast": lambda: "fast-probe"}
    assert impl_choice.choose("k", CANDIDATES, "library", timer=timer, probes=probes) == "library"
    assert calls == ["library", "fast-probe"]


def test_a_probe_within_the_screen_lets_its_candidate_be_tuned_and_win():
    timer, calls = fake_timer({"fast": 1.0, "fast-probe": 1.5, "library": 1.6})
    probes = {"fast": lambda: "fast-probe"}
    assert impl_choice.choose("k", CANDIDATES, "library", timer=timer, probes=probes) == "fast"
    assert calls == ["library", "fast-probe", "fast"]


def test_the_agreement_check_runs_the_probe_not_the_tuned_candidate():
    timer, _ = fake_timer({"fast": 1.0, "fast-probe": 1.0, "library": 2.0})
    ran = []
    candidates = {"fast": lambda: ran.append("fast") or "fast", "library": lambda: "library"}
    probes = {"fast": lambda: ran.append("probe") or "fast-probe"}
    agree = lambda got, want: None  # noqa: E731
    impl_choice.choose("k", candidates, "library", timer=timer, agree=agree, probes=probes)
    assert ran[0] == "probe", "the agreement check must not tune the candidate before it is screened"


def test_probes_must_name_other_candidates_than_the_default():
    with pytest.raises(ValueError, match="probes"):
        impl_choice.choose("k", CANDIDATES, "library", probes={"library": lambda: "library"})
    with pytest.raises(ValueError, match="probes"):
        impl_choice.choose("k", CANDIDATES, "library", probes={"other": lambda: "x"})


def test_a_choice_asked_while_compiling_ahead_is_the_default_and_not_remembered(monkeypatch):
    from fusion_backend.kernels import launch

    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no AsyncCompileMode")
    monkeypatch.setattr(launch, "INTERPRETER", False)
    answers = []

    def ask():
        answers.append(impl_choice.choose("compile-ahead-test", {"a": lambda: 1, "b": lambda: 2}, default="a",
                                          timer=lambda fn: {1: 5.0, 2: 1.0}[fn()], fast_key=("compile-ahead",)))  # fmt: skip

    launch.compile_ahead([ask])
    assert answers == ["a"]
    assert not impl_choice.is_final(("compile-ahead",))


class Pool:
    """A worker pool that runs nothing: ``compile_in_background`` only needs it to be up."""

    def submit(self, fn, *args):
        raise AssertionError("no kernel was captured, so nothing is sent")


def test_a_background_compile_runs_every_candidate_and_probe_and_remembers_nothing(monkeypatch):
    from fusion_backend.kernels import compile_pool, launch

    monkeypatch.setattr(launch, "INTERPRETER", False)
    monkeypatch.setattr(compile_pool, "ready_pool", lambda starting=False: Pool())
    monkeypatch.setattr(compile_pool, "capturing", contextlib.contextmanager(lambda: (yield {})))  # no Triton driver on CPU
    ran, answers = [], []
    candidates = {name: (lambda name=name: ran.append(name)) for name in ("library", "fast", "tuned")}

    def broken():
        raise RuntimeError("a candidate that cannot run is skipped")

    def ask():
        answers.append(impl_choice.choose("background-test", {**candidates, "broken": broken}, default="library",
                                          timer=lambda fn: 1.0, fast_key=("background",),
                                          probes={"tuned": lambda: ran.append("tuned probe")}))  # fmt: skip

    assert launch.compile_in_background([ask]) is None  # nothing was captured: nothing to wait for
    assert answers == ["library"] and sorted(ran) == ["fast", "library", "tuned", "tuned probe"]
    assert not impl_choice.is_final(("background",)) and not measurements.entries(environment.cache_dir())


def test_nothing_compiles_in_the_background_without_a_worker_pool(monkeypatch):
    from fusion_backend.kernels import compile_pool, launch

    monkeypatch.setattr(compile_pool, "ready_pool", lambda starting=False: None)
    ran = []
    assert launch.compile_in_background([lambda: ran.append(1)]) is None and ran == []


def test_every_autotuned_kernel_times_its_tiles_with_the_short_bench(monkeypatch):
    """The tiles of a new key are timed by ``host.tile_bench`` (``TILE_BENCH_MS``), not Triton's
    default 25 + 100 ms per tile: every ``triton.autotune`` of the package passes it."""
    import importlib
    import pkgutil

    import triton.testing
    from triton.runtime.autotuner import Autotuner

    from fusion_backend import kernels
    from fusion_backend.kernels import host

    tuned = {}
    for info in pkgutil.walk_packages(kernels.__path__, kernels.__name__ + "."):
        module = importlib.import_module(info.name)
        tuned.update({f"{info.name}.{n}": v for n, v in vars(module).items() if isinstance(v, Autotuner)})
    assert len(tuned) >= 6, sorted(tuned)
    assert {name for name, kernel in tuned.items() if kernel.do_bench is not host.tile_bench} == set()
    calls = []
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kw: calls.append(kw) or [1.0, 1.0, 1.0])
    assert host.tile_bench(lambda: None, quantiles=(0.5, 0.2, 0.8)) == [1.0, 1.0, 1.0]
    warmup, rep = host.TILE_BENCH_MS
    assert calls == [dict(warmup=warmup, rep=rep, quantiles=(0.5, 0.2, 0.8))]
