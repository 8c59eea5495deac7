"""Compile Triton kernels in Inductor's compile worker processes: :func:`capturing` and :func:`compile_all`.

WHY processes: Triton's compiler holds the GIL for much of a compile (its Python front end, and
more), so compiles on a thread pool overlap little, and a pool of processes compiles the same kernels
about twice as fast as one of threads (``docs/perf/RESULTS.md``, *Kernel design measurements*).  Inductor keeps a pool of worker processes for its own Triton compiles
(``torch._inductor.config.compile_threads`` of them); a first call with a new shape uses it too.

How:

* :func:`capturing`: within it, on this thread (a ``ContextVar``), a Triton launch that would compile
  a ``JITFunction`` compiles nothing: Triton's ``jit_cache_hook`` records a :class:`Job` (the kernel's
  module and qualified name, the signature, constexprs, attributes and options Triton was about to
  compile, the target, and this process's cache folder and assembler) and tells Triton to skip the
  compile.  Launches on other threads (an Inductor compile running at the same time) go on as before.
* :func:`compile_all`: every job runs :func:`compile_job` in a worker process, which compiles the
  kernel into Triton's on-disk cache and reports the parts of the key it filed it under.  The launch
  that then runs for real computes the same key and loads the compiled kernel from disk.
  :func:`submit_all` sends the jobs and returns at once (a :class:`Batch`), for compiles that run
  while the caller goes on (``kernels.launch.compile_in_background``).

A job can only make a later launch cheaper, never change it: a kernel that is not importable by its
module and name (defined in a function) is not sent; a worker whose Triton environment variables
differ compiles nothing; and any job that does not come back compiled under this process's key
turns the workers off for the process.  What the workers did not compile, the launch compiles here
as before (and raises there if it really does not compile).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("fusion_backend.launch")

#: Seconds to wait for a batch of worker compiles before leaving the rest to their launches (a batch
#: is at most a few kernels per worker, each compiled in seconds).
WAIT_S = 60.0

#: Why the workers' compiles are not used in this process (set by :func:`compile_all`), or None.
_workers_off: str | None = None

#: The jobs of the :func:`capturing` block running on this thread, or None outside of one.
_captured: contextvars.ContextVar[dict[str, Job] | None] = contextvars.ContextVar("fusion_captured_compiles", default=None)


@dataclass(frozen=True)
class Job:
    """One compile, as Triton was about to run it (:func:`compile_source`'s source of the kernel,
    signature, constexprs and attrs, compiled for ``target`` with ``options``), and the process state
    its cache key depends on.
    Picklable: the kernel travels as its module and qualified name."""

    module: str
    qualname: str
    signature: dict[str, Any]
    constexprs: dict[Any, Any]
    attrs: dict[Any, Any]
    options: dict[str, Any]  #: the fields of Triton's options object (``CUDAOptions``)
    target: tuple[str, int, int]  #: ``(backend, arch, warp_size)``
    cache_dir: str
    env_vars: dict[str, str]
    #: ``(path, version)`` of the assembler this process's compiles run and the version its cache keys
    #: name (see :func:`_assembler`); None: the worker's own
    assembler: tuple[str, str] | None

    @property
    def name(self) -> str:
        return f"{self.module}.{self.qualname}"


def _jit_function(module: str, qualname: str) -> Any:
    """The ``JITFunction`` that module ``module`` names ``qualname`` (unwrapping an autotuner)."""
    from triton.runtime.jit import JITFunction

    value: Any = importlib.import_module(module)
    for part in qualname.split("."):
        value = getattr(value, part)
    while not isinstance(value, JITFunction) and hasattr(value, "fn"):
        value = value.fn
    return value


def compile_source(kernel: Any, signature: dict[str, Any], constexprs: dict[Any, Any], attrs: dict[Any, Any]) -> Any:
    """The source ``triton.compile`` takes for a specialisation of ``kernel``, as Triton's launch builds
    it: Gluon's (``GluonASTSource``, its own front end) for a Gluon kernel, ``ASTSource`` for the
    others.  WHY one place: the worker's compile and this process's key must read the same source, or
    the worker files the kernel under a key the launch never looks up (or fails to parse a Gluon kernel
    at all); ``tools/kernel_compile.py`` compiles through it too."""
    if getattr(kernel, "is_gluon", lambda: False)():
        from triton.experimental.gluon._runtime import GluonASTSource as source
    else:
        from triton.compiler import ASTSource as source
    return source(kernel, signature, constexprs, attrs)


def key_parts(job: Job, kernel: Any = None) -> dict[str, str]:
    """The parts of the cache key ``triton.compile`` files ``job`` under, in this process (Triton's
    own ``get_cache_key``: Triton's build, the kernel's source with what it depends on, the target's
    compiler, the options, the environment)."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # where older Triton versions keep it
        from triton.compiler.compiler import triton_key

    kernel = kernel if kernel is not None else _jit_function(job.module, job.qualname)
    src = compile_source(kernel, job.signature, job.constexprs, job.attrs)
    backend = make_backend(GPUTarget(*job.target))
    options = backend.parse_options(dict(job.options, **src.parse_options()))
    return {"Triton": triton_key(), "kernel source": src.hash(), "compiler": backend.hash(), "options": options.hash(),
            "environment": str(sorted(dict(get_cache_invalidating_env_vars()).items()))}  # fmt: skip


def compiled_on_disk(job: Job) -> bool:
    """Whether Triton's on-disk cache (``job.cache_dir``) holds ``job`` compiled, under the key this
    process's launch of it looks up (``triton.compile``'s own key, :func:`key_parts`): its launch
    then loads it in milliseconds.  False where that cannot be told (Triton's internals drifted, a
    stage-inspection hook changes the key): the job is then treated as not compiled.

    WHY: Triton's launch path asks ``jit_cache_hook`` on every miss of the process's own kernel
    cache, so to :func:`capturing` every kernel of a new process looks uncompiled, those a worker
    (or an earlier process) put on disk included."""
    import hashlib

    from triton import knobs
    from triton.runtime.cache import get_cache_manager

    try:
        if getattr(knobs.runtime, "add_stages_inspection_hook", None) or getattr(knobs.compilation, "always_compile", False):
            return False
        kernel = _jit_function(job.module, job.qualname)
        key = "-".join(key_parts(job, kernel).values())  # get_cache_key's format
        with knobs.cache.scope():
            knobs.cache.dir = job.cache_dir
            manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
            name = f"{kernel.__name__[:150]}.json"  # triton.compile's metadata file: the kernel's name, cut
            return bool((manager.get_group(name) or {}).get(name))
    except Exception as err:  # noqa: BLE001 - unknown: compile it
        log.debug("could not tell whether %s is on disk: %s: %s", job.name, type(err).__name__, err)
        return False


def compile_job(job: Job) -> dict[str, str] | str:
    """Compile ``job`` into Triton's on-disk cache (runs in a worker process): the parts of the key it
    was filed under (:func:`key_parts`), or why it was not compiled."""
    import triton
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget

    if dict(get_cache_invalidating_env_vars()) != job.env_vars:
        return "the worker's Triton environment variables differ"
    kernel = _jit_function(job.module, job.qualname)
    with knobs.cache.scope(), _assembler(job.assembler):
        knobs.cache.dir = job.cache_dir
        triton.compile(compile_source(kernel, job.signature, job.constexprs, job.attrs),
                       target=GPUTarget(*job.target), options=dict(job.options))  # fmt: skip
        return key_parts(job, kernel)


@contextlib.contextmanager
def _assembler(named: tuple[str, str] | None) -> Iterator[None]:
    """Within: Triton's NVIDIA backend assembles with this process's ``ptxas`` and puts the version
    this process's keys name into the key.  WHY: the version is part of the cache key, Inductor may
    point its workers (and this process) at another ``ptxas`` than Triton's bundled one, and Triton
    remembers the version per process from its first compile, so a process may assemble with one and
    name another.  NOTE: on the H100 host (torch 2.11, Triton 3.6) the workers
    named CUDA 13.0's assembler and this process Triton's 12.8, which made every worker's compile a
    miss here (the key check in :func:`compile_all` found it).  The worker's own state is restored."""
    if named is None:
        yield
        return
    from triton import knobs
    from triton.backends.nvidia import compiler as nvidia

    path, version = named
    remembered = nvidia.get_ptxas_version
    with knobs.nvidia.scope():
        for name in ("ptxas", "ptxas_blackwell"):
            if name in vars(type(knobs.nvidia)):  # the knob (a descriptor on the class)
                setattr(knobs.nvidia, name, path)
        nvidia.get_ptxas_version = lambda *args, **kwargs: version
        try:
            yield
        finally:
            nvidia.get_ptxas_version = remembered


def _importable(kernel: Any) -> bool:
    """Whether a worker can find ``kernel`` by its module and qualified name."""
    try:
        return _jit_function(kernel.fn.__module__, kernel.fn.__qualname__) is kernel
    except Exception:  # noqa: BLE001 - a kernel defined in a function, or a module that does not import
        return False


def _options(compile: dict[str, Any], caller: Any) -> dict[str, Any]:
    """The fields of the options object Triton compiles with: its ``_call_hook``'s ``options``
    (tuples kept as tuples, so that the worker's options hash the same), else the fields Triton
    serialized for the hook (JSON: a tuple comes back as a list at the top level only)."""
    options = caller.f_locals.get("options") if caller is not None else None
    if dataclasses.is_dataclass(options) and not isinstance(options, type):
        return dict(vars(options))
    fields = json.loads(compile["specialization_data"])["options"]
    return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def _process_state() -> tuple[str, dict[str, str], tuple[str, int, int], tuple[str, str] | None]:
    """What a worker's compile must share with this process for the same cache key: Triton's cache
    folder, its cache-invalidating environment variables, the current device's target, and the
    assembler for it."""
    from triton import knobs
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return (str(knobs.cache.dir), dict(get_cache_invalidating_env_vars()),
            (target.backend, int(target.arch), int(target.warp_size)), assembler(int(target.arch)))  # fmt: skip


@functools.cache
def use_inductors_triton_setup(device: int) -> None:
    """Set Triton up in this process as Inductor does before its own Triton work on CUDA device
    ``device``, each only where it is not set already: the cache folder (``TRITON_CACHE_DIR``:
    Inductor's ``<its cache folder>/triton/<device>``) and the assembler (``TRITON_PTXAS_PATH``: the
    ``ptxas`` bundled with torch, and the version Triton keys kernels with read from it).  The backend
    calls it before anything of a CUDA graph compiles.

    WHY: where Triton files a compiled kernel, and the assembler version in its key, then no longer
    depend on whether Inductor built a Triton kernel in this process before the fused ops' first
    compile: Inductor sets both only where it does (its ``CachingAutotuner``; its compile path).  A
    process whose Inductor graphs all came from its caches looked for the fused ops' kernels under
    Triton's own defaults, missed every one an earlier process had filed, and compiled them again, one
    after another, in its first calls.  NOTE: H100, torch 2.11, Triton 3.6: a benchmark rerun on warm
    caches compiled 27 kernels in-process (``make_cubin`` 7.3 s) and rebuilt 9 launcher modules (keyed
    by their source alone: another folder), and its fused rows' first calls took 1.8-7.6 s against
    Inductor's 0.13-0.24 s (``python -m cProfile -o warm.prof -m fusion_backend bench --suite
    demos/seeds/conv2d_mul_leaky_gelu.py --no-memory --no-cold``, run twice on the same caches;
    ``pstats`` on ``make_cubin`` and ``_build``)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:  # a torch that keeps them elsewhere: Triton's own defaults
        return
    if os.getenv("TRITON_CACHE_DIR") is None:
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(device)
    _set_triton_ptxas_path()
    _forget_the_assembler_version()


def _forget_the_assembler_version() -> None:
    """Make Triton ask the assembler it now runs for its version again.  WHY: Triton remembers the
    version it puts into every cache key from the first time it is asked in a process
    (``get_ptxas_version`` is an ``lru_cache``), and in a process where Inductor builds kernels it is
    asked before Inductor sets ``TRITON_PTXAS_PATH``: there the fused kernels were keyed with Triton's bundled
    assembler's version though torch's assembled them, and a process where Inductor built nothing keyed
    them with torch's, missed, and compiled them again.  NOTE: H100, torch 2.11, Triton 3.6: with the
    same ``TRITON_PTXAS_PATH`` (torch's, CUDA 13.0) at the key, the first process's key named CUDA
    12.8 (Triton's bundled) and the second's 13.0 (``pytest tests/e2e/test_cuda_graphs_and_decision_gpu.py
    -k second_process``; the key's parts printed by wrapping ``triton.compiler.compiler.get_cache_key``)."""
    try:
        from triton.backends.nvidia import compiler as nvidia
    except ImportError:  # a Triton without the NVIDIA backend: nothing remembered
        return
    getattr(nvidia.get_ptxas_version, "cache_clear", lambda: None)()


def assembler(arch: int) -> tuple[str, str] | None:
    """``(path, version)``: the ``ptxas`` Triton's NVIDIA backend assembles ``arch`` with here, and
    the version it puts into cache keys here; None for another backend (``tools/kernel_compile.py``
    assembles with the same one)."""
    try:
        from triton.backends.nvidia import compiler as nvidia

        try:
            tool = nvidia.get_ptxas(arch)
        except TypeError:  # a Triton with one ptxas for every arch
            tool = nvidia.get_ptxas()
        return str(tool.path), nvidia.get_ptxas_version(arch)
    except Exception:  # noqa: BLE001 - another backend, or a Triton that finds it elsewhere
        return None


@contextlib.contextmanager
def capturing() -> Iterator[dict[str, Job]]:
    """Within: this thread's Triton compiles are recorded into the yielded dict (by kernel and
    specialization) instead of running (see the module docstring)."""
    from triton import knobs

    state = _process_state()
    previous = knobs.runtime.jit_cache_hook

    def hook(*, key: Any, fn: Any, compile: dict[str, Any], **kwargs: Any) -> bool | None:
        jobs = _captured.get()
        if jobs is None:
            return previous(key=key, fn=fn, compile=compile, **kwargs) if previous is not None else None
        kernel = fn.jit_function
        if not _importable(kernel):
            return None  # Triton compiles it here, now
        cache_dir, env_vars, target_fields, named_assembler = state
        options = _options(compile, sys._getframe(1))
        job = Job(kernel.fn.__module__, kernel.fn.__qualname__, dict(compile["signature"]), dict(compile["constants"]),
                  dict(compile["configs"][0]), options, target_fields, cache_dir, env_vars, named_assembler)  # fmt: skip
        jobs.setdefault(f"{job.name}|{key!r}", job)
        return True  # skip the compile here

    jobs: dict[str, Job] = {}
    token = _captured.set(jobs)
    knobs.runtime.jit_cache_hook = hook
    try:
        yield jobs
    finally:
        _captured.reset(token)
        if knobs.runtime.jit_cache_hook is hook:
            knobs.runtime.jit_cache_hook = previous


def ready_pool(starting: bool = False) -> Any:
    """Inductor's compile worker pool when its workers are up, else None (and None without CUDA,
    where no Triton kernel compiles).  Asking starts them (Inductor's ``use_process_pool``), so a
    later first call may find them ready.  With ``starting``, also the pool while its workers are
    still starting: jobs sent to it wait for them, which suits compiles nobody waits on
    (``kernels.launch.compile_in_background``)."""
    import torch

    if not torch.cuda.is_available() or _workers_off is not None:
        return None
    try:
        from torch._inductor.async_compile import AsyncCompile

        if AsyncCompile.use_process_pool():
            return AsyncCompile.process_pool()
        # use_process_pool sent the pool a first job to tell when it is up, where a pool is allowed
        up_soon = starting and getattr(AsyncCompile, "_ready_future", None) is not None
        return AsyncCompile.process_pool() if up_soon else None
    except Exception as err:  # noqa: BLE001 - a torch without the pool, or one not allowed here: threads then
        log.debug("no compile worker pool: %s: %s", type(err).__name__, err)
        return None


def compile_all(pool: Any, jobs: list[Job]) -> int:
    """Run every job on ``pool`` (``submit(fn, *args) -> Future``); returns how many compiled under
    the key this process's launch will look up.  Waits at most :data:`WAIT_S`; what has not compiled
    by then is left to its launch (``submit_all(pool, jobs).collect(WAIT_S)``)."""
    return submit_all(pool, jobs).collect(WAIT_S)


def submit_all(pool: Any, jobs: list[Job]) -> Batch:
    """Send every job to ``pool`` (``submit(fn, *args) -> Future``) and return at once, the sending
    included: a thread of the batch's own sends them (:class:`Batch`).  The :class:`Batch` says when
    they are done and checks what they compiled.

    WHY a thread: a pool whose workers are still starting (a fresh process's first graph) reads no
    job until they are up, and a job is a message on a pipe: once the pipe's buffer is full, the
    send blocks until the workers read.  NOTE: ResNet-50 inference (bf16, H200, a fresh process and
    caches: ``python tools/first_call.py demos/realnets/resnet50.py --dtype bf16 --warm-runs 0``) took
    1.61x Inductor's time to steady state when the compiling thread sent them; a cProfile of its
    deferred decisions' preparations showed one region's 9 kernels blocking that thread 8.4 s in the
    pipe's ``flush``, inside the graph's compile."""
    batch = Batch(time.perf_counter())
    threading.Thread(target=batch.send, args=(pool, jobs), name="fusion-compile-send", daemon=True).start()
    return batch


class Batch:
    """Compile jobs sent to worker processes (:func:`submit_all`): ``futures`` (each job's, by
    future) is complete once ``sent`` is set, and only read after it."""

    def __init__(self, began: float) -> None:
        self.began = began
        self.futures: dict[Future[dict[str, str] | str], Job] = {}
        self.sent = threading.Event()

    def send(self, pool: Any, jobs: list[Job]) -> None:
        """Send ``jobs`` to ``pool`` (the batch's thread; blocks while the pool reads nothing)."""
        try:
            for job in jobs:
                try:
                    self.futures[pool.submit(compile_job, job)] = job
                except Exception as err:  # noqa: BLE001 - a job that does not pickle: its launch compiles it
                    log.debug("compile of %s not sent to a worker: %s: %s", job.name, type(err).__name__, err)
        finally:
            self.sent.set()

    def ready(self) -> bool:
        """Whether every job was sent and has finished (compiled or failed); never waits."""
        return self.sent.is_set() and all(future.done() for future in self.futures)

    def collect(self, timeout: float) -> int:
        """Wait at most ``timeout`` seconds for the jobs; how many compiled under the key this
        process's launch will look up.

        Any job that does not come back compiled under this process's key turns the workers off for
        the process (:func:`ready_pool`), with one log line saying why: a worker whose key differs
        (the parts that differ, :func:`key_parts`) would never be found, and a pool that takes no
        job, a worker that fails, answers late or compiles nothing (it cannot import this package,
        its environment differs) would cost every later first call the same wait for nothing.  The
        kernels compile here then, as before."""
        deadline = time.perf_counter() + timeout
        if not self.sent.wait(timeout):
            _turn_workers_off(f"the worker pool had not taken the compiles after {time.perf_counter() - self.began:.0f} s")
            return 0
        futures = self.futures
        done, pending = wait(futures, timeout=max(0.0, deadline - time.perf_counter()))
        if pending:
            _turn_workers_off(f"{len(pending)} of {len(futures)} worker compiles had not finished after "
                              f"{time.perf_counter() - self.began:.0f} s")
        compiled = 0
        for future in done:
            job = futures[future]
            try:
                result = future.result()
            except Exception as err:  # noqa: BLE001 - it compiles (or fails) again at its launch
                result = f"{type(err).__name__}: {err}"
            if isinstance(result, str):
                _turn_workers_off(f"a worker did not compile {job.name}: {result}")
                continue
            try:
                here = key_parts(job)
            except Exception as err:  # noqa: BLE001 - a Triton whose key this module cannot take apart
                here = {"key": f"{type(err).__name__}: {err}"}
            differ = sorted(part for part in here if here[part] != result.get(part))
            if differ:
                _turn_workers_off(f"a worker's cache key for {job.name} differs from this process's in: {', '.join(differ)}",
                                  "; ".join(f"{p}: {result.get(p)!r} there, {here[p]!r} here" for p in differ))  # fmt: skip
                continue
            compiled += 1
        log.info("compiled %d of %d Triton kernels in worker processes in %.1f s", compiled, len(futures),
                 time.perf_counter() - self.began)  # fmt: skip
        return compiled


def _turn_workers_off(why: str, detail: str = "") -> None:
    """Compile in this process from now on (see :func:`compile_all`); logged once, at INFO."""
    global _workers_off
    if _workers_off is None:
        _workers_off = why
        log.info("compiling Triton kernels in this process from now on: %s%s", why, f" ({detail[:2000]})" if detail else "")
