"""``kernels/compile_pool.py``: a compile captured from Triton's launch path, run by a worker, is the
launch's cache hit; and ``compile_ahead`` sends its calls (and the speculative ones) there.

The tests compile for sm_90 with Triton's real compiler (no GPU needed): the hook is called as
Triton's ``JITFunction._do_compile`` calls it, the job runs in a worker process, and another process
then compiles the same specialization as its launch would, which must find it in the cache.  Every
compile runs in a spawned process (``compile_pool_kernel.py`` says why).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import os
import pickle
import threading
from concurrent.futures import Future, ProcessPoolExecutor

import compile_pool_kernel
import pytest
import torch
import triton
import triton.language as tl
from compile_pool_kernel import add_offset
from triton import knobs
from triton.runtime.jit import JITFunction, JitFunctionInfo

from fusion_backend.kernels import compile_pool, launch

pytest.importorskip("triton.backends.nvidia", reason="compiles for sm_90 with Triton's NVIDIA backend")
from triton._C.libtriton import get_cache_invalidating_env_vars  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import make_backend  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


@pytest.fixture(scope="module")
def worker():
    """A worker process, as Inductor's pool would run our jobs (a fresh interpreter: spawned)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.fixture(scope="module")
def launcher():
    """Another process, standing in for the one whose launch looks the compile up."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def _specialization(block: int, name: str = "add_offset") -> dict:
    """What Triton's launch path hands ``jit_cache_hook`` for ``add_offset`` (``compile=...``; ``name``:
    the kernel's, which has its signature)."""
    options = make_backend(TARGET).parse_options({})
    signature = {"x_ptr": "*fp32", "n": "i32", "offset": "fp32", "BLOCK": "constexpr"}
    constants, attrs = {(3,): block}, {(0,): [["tt.divisibility", 16]]}
    data = json.dumps({"name": name, "signature": signature, "options": options.__dict__})
    return {"key": (name, block), "signature": signature, "constants": constants, "configs": [attrs],
            "specialization_data": data, "options": options}  # fmt: skip


def _call_hook(kernel: JITFunction, block: int):
    """Call the installed ``jit_cache_hook`` as ``JITFunction._do_compile`` does."""
    spec = _specialization(block, kernel.fn.__name__)
    return knobs.runtime.jit_cache_hook(
        key=spec["key"], repr=kernel.fn.__name__, fn=JitFunctionInfo(kernel.fn.__module__, kernel.fn.__qualname__,
                                                                      kernel),  # fmt: skip
        compile={k: spec[k] for k in ("key", "signature", "constants", "configs", "specialization_data")},
        is_manual_warmup=True, already_compiled=False,
    )  # fmt: skip


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh Triton cache folder, and the state ``capturing`` would read from a CUDA device; the
    runtime knobs (the hooks) are restored afterwards."""
    with knobs.cache.scope(), knobs.runtime.scope():
        knobs.cache.dir = str(tmp_path)
        monkeypatch.setattr(compile_pool, "_process_state", lambda: (
            str(tmp_path), dict(get_cache_invalidating_env_vars()), (TARGET.backend, TARGET.arch, TARGET.warp_size),
            compile_pool.assembler(TARGET.arch)))
        yield tmp_path


def test_a_captured_compile_run_by_a_worker_is_the_launchs_cache_hit(cache_dir, worker, launcher):
    with compile_pool.capturing() as jobs:
        assert _call_hook(add_offset, 64) is True  # Triton skips its own compile
        assert _call_hook(add_offset, 64) is True  # the same specialization again: one job
        assert _call_hook(add_offset, 128) is True
    assert len(jobs) == 2
    assert {job.name for job in jobs.values()} == {"compile_pool_kernel.add_offset"}
    for job in jobs.values():
        assert worker.submit(compile_pool.compile_job, job).result() == compile_pool.key_parts(job)
    assert len(os.listdir(cache_dir)) == 2
    for job in jobs.values():
        assert launcher.submit(compile_pool_kernel.compile_as_the_launch_would, job).result()
    assert len(os.listdir(cache_dir)) == 2
    (job,) = [j for j in jobs.values() if j.constexprs[(3,)] == 64]
    other = compile_pool.Job(**{**vars(job), "constexprs": {(3,): 32}})  # never compiled: the check can fail
    assert not launcher.submit(compile_pool_kernel.compile_as_the_launch_would, other).result()


def test_the_worker_assembles_with_this_processs_ptxas_and_names_its_version(cache_dir, monkeypatch):
    """Inductor's workers may be pointed at another ``ptxas``, and a process may name in its keys the
    version of the one it found first: the job carries both, and the worker compiles and keys with them."""
    from triton.backends.nvidia import compiler as nvidia

    with compile_pool.capturing() as jobs:
        _call_hook(add_offset, 64)
    (job,) = jobs.values()
    path, version = job.assembler
    assert (path, version) == compile_pool.assembler(TARGET.arch) and os.path.exists(path)
    used = []
    monkeypatch.setattr(triton, "compile", lambda *args, **kwargs: used.append(compile_pool.assembler(TARGET.arch)))
    (cache_dir / "bin").mkdir()
    elsewhere = str(cache_dir / "bin" / os.path.basename(path))
    os.symlink(path, elsewhere)
    parts = compile_pool.compile_job(compile_pool.Job(**{**vars(job), "assembler": (elsewhere, "named version")}))
    assert used == [(elsewhere, "named version")]
    assert parts == {**compile_pool.key_parts(job), "compiler": make_backend(TARGET).hash().replace(version, "named version")}
    assert compile_pool.assembler(TARGET.arch) == (path, version)  # the worker's own, restored
    assert nvidia.get_ptxas_version(TARGET.arch) == version


def test_outside_the_capture_the_hook_defers_to_the_previous_one(cache_dir):
    seen = []

    def previous(**kwargs):
        seen.append(kwargs["key"])
        return None

    knobs.runtime.jit_cache_hook = previous
    with compile_pool.capturing() as jobs:
        other: list = []
        thread = threading.Thread(target=lambda: other.append(_call_hook(add_offset, 64)))
        thread.start()
        thread.join()
        assert other == [None] and seen == [("add_offset", 64)]  # another thread compiles as before
        assert _call_hook(add_offset, 128) is True
    assert len(jobs) == 1 and seen == [("add_offset", 64)]
    assert knobs.runtime.jit_cache_hook is previous


def test_a_kernel_a_worker_cannot_import_is_compiled_here(cache_dir):
    def local_kernel(x_ptr, n, offset, BLOCK: tl.constexpr):
        pass

    with compile_pool.capturing() as jobs:
        assert _call_hook(JITFunction(local_kernel), 64) is None  # Triton compiles it itself
    assert jobs == {}


def test_a_worker_with_other_triton_environment_variables_compiles_nothing(cache_dir):
    with compile_pool.capturing() as jobs:
        _call_hook(add_offset, 64)
    (job,) = jobs.values()
    other = pickle.loads(pickle.dumps(job))
    object.__setattr__(other, "env_vars", {**job.env_vars, "TRITON_NOT_A_REAL_SETTING": "1"})
    assert "environment" in compile_pool.compile_job(other)
    assert os.listdir(cache_dir) == []


def test_compile_all_counts_what_compiled_and_a_failing_job_turns_the_workers_off(cache_dir, worker, monkeypatch):
    monkeypatch.setattr(compile_pool, "_workers_off", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with compile_pool.capturing() as jobs:
        _call_hook(add_offset, 16)
    (job,) = jobs.values()
    broken = compile_pool.Job(**{**vars(job), "qualname": "no_such_kernel"})
    assert compile_pool.compile_all(worker, [job, broken]) == 1
    assert len(os.listdir(cache_dir)) == 1
    assert "no_such_kernel" in compile_pool._workers_off
    assert compile_pool.ready_pool() is None


def test_a_worker_filing_under_another_key_turns_the_workers_off(cache_dir, monkeypatch):
    monkeypatch.setattr(compile_pool, "_workers_off", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    class OtherKeyPool:
        def submit(self, fn, job):
            future: Future = Future()
            future.set_result({**compile_pool.key_parts(job), "options": "other"})
            return future

    with compile_pool.capturing() as jobs:
        _call_hook(add_offset, 64)
    assert compile_pool.compile_all(OtherKeyPool(), list(jobs.values())) == 0
    assert "options" in compile_pool._workers_off
    assert compile_pool.ready_pool() is None


class StartingPool:
    """A pool whose workers are still starting: ``submit`` blocks (a full pipe) until ``up`` is set,
    then compiles nothing, reporting the key its caller computes."""

    def __init__(self):
        self.up = threading.Event()
        self.sent = []

    def submit(self, fn, job):
        self.up.wait(30)
        self.sent.append(job)
        future: Future = Future()
        future.set_result(compile_pool.key_parts(job))
        return future


def test_sending_to_a_pool_still_starting_never_blocks_the_caller(cache_dir, monkeypatch):
    monkeypatch.setattr(compile_pool, "_workers_off", None)
    with compile_pool.capturing() as jobs:
        _call_hook(add_offset, 32)
    pool = StartingPool()
    batch = compile_pool.submit_all(pool, list(jobs.values()))  # returns although every send blocks
    assert not batch.ready() and pool.sent == []
    pool.up.set()
    assert batch.collect(30) == 1 and batch.ready()
    assert compile_pool._workers_off is None


def test_a_pool_that_takes_no_compile_in_time_turns_the_workers_off(cache_dir, monkeypatch):
    monkeypatch.setattr(compile_pool, "_workers_off", None)
    with compile_pool.capturing() as jobs:
        _call_hook(add_offset, 32)
    pool = StartingPool()
    try:
        assert compile_pool.submit_all(pool, list(jobs.values())).collect(0.2) == 0
        assert "had not taken the compiles" in compile_pool._workers_off
    finally:
        pool.up.set()


def test_compile_ahead_sends_calls_and_speculative_calls_to_the_workers(cache_dir, monkeypatch, worker):
    sent = []

    class RecordingPool:
        def submit(self, fn, job):
            sent.append(job)
            return worker.submit(fn, job)

    monkeypatch.setattr(launch, "INTERPRETER", False)
    monkeypatch.setattr(compile_pool, "ready_pool", lambda: RecordingPool())
    ran = []

    def call(block):
        def run():
            ran.append((block, launch.compiling_ahead()))
            _call_hook(add_offset, block)  # what a launch inside compile_ahead reaches
        return run

    assert launch.compile_ahead([call(64)], [call(128)])
    assert ran == [(64, True), (128, True)]
    assert sorted(job.constexprs[(3,)] for job in sent) == [64, 128]
    assert len(os.listdir(cache_dir)) == 2


def test_without_workers_compile_ahead_leaves_the_speculative_calls_out(monkeypatch):
    pytest.importorskip("triton.runtime._async_compile", reason="this Triton has no AsyncCompileMode")
    monkeypatch.setattr(launch, "INTERPRETER", False)
    monkeypatch.setattr(compile_pool, "ready_pool", lambda: None)
    ran = []
    assert launch.compile_ahead([lambda: ran.append("call")], [lambda: ran.append("speculative")])
    assert ran == ["call"]


def test_no_worker_pool_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert compile_pool.ready_pool() is None


def test_a_background_compile_returns_at_once_and_its_batch_checks_what_compiled(cache_dir, monkeypatch, worker):
    monkeypatch.setattr(launch, "INTERPRETER", False)
    monkeypatch.setattr(compile_pool, "_workers_off", None)
    monkeypatch.setattr(compile_pool, "ready_pool", lambda starting=False: worker if starting else None)
    ran = []

    def call():
        ran.append((launch.compiling_ahead(), launch.compiling_every_candidate()))
        _call_hook(add_offset, 32)  # what a launch inside the background compile reaches

    batch = launch.compile_in_background([call])
    assert ran == [(True, True)] and not launch.compiling_every_candidate()
    assert batch is not None and batch.collect(60) == 1 and batch.ready()
    assert len(os.listdir(cache_dir)) == 1 and compile_pool._workers_off is None
    assert launch.compile_in_background([lambda: None]) is None  # nothing to compile: nothing to wait for
    # a later process's launch misses its own kernel cache again; on disk, the kernel is not sent
    assert launch.compile_in_background([call]) is None and len(ran) == 2


@pytest.mark.skipif(compile_pool_kernel.gluon_add_offset is None, reason="this Triton has no Gluon")
def test_a_gluon_kernel_compiles_in_a_worker_under_the_key_its_launch_looks_up(cache_dir, worker, launcher):
    """A Gluon kernel (the TMA forward is one) compiles from Gluon's own source in the worker (Triton's
    ``ASTSource`` cannot parse it) and is filed under the key its launch here looks up."""
    with compile_pool.capturing() as jobs:
        assert _call_hook(compile_pool_kernel.gluon_add_offset, 64) is True
    (job,) = jobs.values()
    assert job.name == "compile_pool_kernel.gluon_add_offset"
    assert worker.submit(compile_pool.compile_job, job).result() == compile_pool.key_parts(job)
    assert compile_pool.compiled_on_disk(job)
    assert launcher.submit(compile_pool_kernel.compile_as_the_launch_would, job).result()


def test_a_job_is_on_disk_once_compiled_under_the_key_this_processs_launch_looks_up(cache_dir, worker, launcher):
    with compile_pool.capturing() as jobs:
        _call_hook(add_offset, 64)
    (job,) = jobs.values()
    other = compile_pool.Job(**{**vars(job), "constexprs": {(3,): 32}})
    assert not compile_pool.compiled_on_disk(job)
    worker.submit(compile_pool.compile_job, job).result()
    assert compile_pool.compiled_on_disk(job) and not compile_pool.compiled_on_disk(other)
    assert launcher.submit(compile_pool_kernel.compile_as_the_launch_would, job).result()  # the same key
    elsewhere = compile_pool.Job(**{**vars(job), "cache_dir": str(cache_dir / "elsewhere")})
    assert not compile_pool.compiled_on_disk(elsewhere)
    with knobs.compilation.scope():
        knobs.compilation.always_compile = True  # Triton compiles anyway: not a cache hit to count on
        assert not compile_pool.compiled_on_disk(job)


def test_a_pool_whose_workers_are_still_starting_takes_only_background_compiles(monkeypatch):
    from torch._inductor.async_compile import AsyncCompile

    monkeypatch.setattr(compile_pool, "_workers_off", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pool = object()
    monkeypatch.setattr(AsyncCompile, "process_pool", staticmethod(lambda: pool))
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: False))
    monkeypatch.setattr(AsyncCompile, "_ready_future", Future(), raising=False)  # its first job not back yet
    assert compile_pool.ready_pool() is None and compile_pool.ready_pool(starting=True) is pool
    monkeypatch.setattr(AsyncCompile, "_ready_future", None)  # no pool allowed: none was started
    assert compile_pool.ready_pool(starting=True) is None
    monkeypatch.setattr(AsyncCompile, "use_process_pool", classmethod(lambda cls: True))
    assert compile_pool.ready_pool() is pool



@pytest.mark.parametrize("set_by_user", [False, True], ids=["unset", "set-by-the-user"])
def test_triton_is_set_up_as_inductor_sets_it_up_before_its_own_triton_work(monkeypatch, tmp_path, set_by_user):
    """Inductor points ``TRITON_CACHE_DIR`` at its own folder and ``TRITON_PTXAS_PATH`` at torch's
    ``ptxas`` only where it builds Triton kernels itself; the backend does the same before a CUDA graph
    compiles (what the user set stays), so a process whose Inductor graphs all came from its caches
    files and keys the fused ops' kernels as one that compiled them: the assembler version Triton
    remembered from before is forgotten (the GPU test
    ``test_a_second_process_finds_every_fused_kernel_the_first_compiled`` checks the cache hits)."""
    from torch._inductor.runtime import compile_tasks
    from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
    from triton.backends.nvidia import compiler as nvidia

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    if set_by_user:
        monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    else:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    calls = []
    monkeypatch.setattr(compile_tasks, "_set_triton_ptxas_path", lambda: calls.append("ptxas"))

    @functools.lru_cache
    def ptxas_version(arch: int = 80) -> str:  # Triton's: remembered from the first question
        calls.append("version")
        return f"version {calls.count('version')}"

    monkeypatch.setattr(nvidia, "get_ptxas_version", ptxas_version)
    assert ptxas_version(90) == "version 1"  # asked before the assembler was set
    compile_pool.use_inductors_triton_setup.cache_clear()
    try:
        compile_pool.use_inductors_triton_setup(1)
    finally:
        compile_pool.use_inductors_triton_setup.cache_clear()
    want = str(tmp_path / "mine") if set_by_user else str(tmp_path / "inductor" / "triton" / "1")
    assert os.environ["TRITON_CACHE_DIR"] == want == triton_cache_dir(1)
    assert ptxas_version(90) == "version 2" and calls == ["version", "ptxas", "version"]  # asked again, after
