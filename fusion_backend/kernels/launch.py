"""Launch a Triton kernel with little host time: :class:`FastLaunch`.

Why: at the ``seeds`` suite's sizes a training step is host-bound (``python tools/profile_step.py FILE
--mode train`` shows the GPU time against the host time per step).  Triton's generic launch path,
``kernel[grid](*args, **constexprs)``, binds the arguments, computes a specialization key from every
argument, reads several runtime knobs and builds launch metadata before it calls the compiled kernel's
launcher, many times the launcher's own host time (``docs/perf/RESULTS.md``, *Kernel design measurements*).  ``FastLaunch`` remembers the compiled kernel each specialization produced and
calls its launcher directly afterwards.

Contract:

* One ``FastLaunch`` per (kernel, grid, constexprs, launch options), i.e. per launch plan; calling
  it with the kernel's runtime (non-constexpr) arguments, in signature order, launches on the
  current device's current stream, exactly like ``kernel[grid](*args, **constexprs)``.  ``fixed``:
  trailing runtime arguments that are the same on every call of the plan (its shapes and strides);
  they are given once, the calls pass only the arguments before them, and they are not part of the
  call key (they cannot change it).
* The key of a call is finer than Triton's specialization key, so a remembered kernel is always the
  one the generic path would pick: per tensor its dtype and whether its data pointer is 16-byte
  aligned (all Triton specializes a pointer on); every other argument by its exact type and value
  (Triton specializes integers on value classes: equal to 1, divisible by 16, i32/i64/u64); tuples
  element-wise; and the current device (Triton compiles per device).  Unhashable arguments make the
  call take the generic path.  Integer arguments of a plan are shapes and strides, so the number of
  keys per ``FastLaunch`` stays small; past ``MAX_REMEMBERED`` new keys are no longer remembered.
* The generic path is always taken, and the result is the same, when: the call's key has not been
  seen yet (that launch compiles or finds the kernel, which is then remembered); Triton's launch
  hooks are set (profilers such as proton need the metadata the generic path builds); the kernel is
  not a compiled GPU kernel (``TRITON_INTERPRET=1`` returns none) or this Triton's compiled kernel
  lacks the launcher attributes used here (checked when a specialization is remembered).

Compiling ahead (:func:`compile_ahead`): a first call with a new shape times several candidate
implementations (``impl_choice.py``), each a few Triton kernels, an autotuned one with up to three
tiles; compiled one after another they were most of a cold first call (``docs/perf/RESULTS.md``, *Kernel design measurements*).  ``compile_ahead``
runs the candidates once with every launch (:func:`launch`, ``FastLaunch``) replaced by the compile
of that launch, all compiled at once, and returns when all have compiled, so the timing that follows
finds every kernel compiled: in Inductor's compile worker processes where they are up
(``kernels/compile_pool.py``), else on a thread pool (Triton's ``AsyncCompileMode``).
"""

from __future__ import annotations

import contextvars
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import compile_pool
from .host import INTERPRETER

log = logging.getLogger("fusion_backend.launch")

try:  # Triton >= 3.4 keeps the launch hooks in knobs; older versions on CompiledKernel
    from triton import knobs as _knobs

    _RUNTIME_KNOBS: Any = _knobs.runtime
except ImportError:  # pragma: no cover - old Triton
    _RUNTIME_KNOBS = None

#: Specializations remembered per ``FastLaunch`` (a bound on memory if an argument varied per call).
MAX_REMEMBERED = 64
#: Placeholder for a runtime argument in ``FastLaunch``'s argument template.
_RUNTIME = object()

_TENSOR_DESCRIPTORS: tuple[type, ...] = ()
try:  # Triton >= 3.3: host-side tensor descriptors (a box load's arguments)
    from triton.tools.tensor_descriptor import TensorDescriptor as _TRITON_DESCRIPTOR

    _TENSOR_DESCRIPTORS += (_TRITON_DESCRIPTOR,)
except ImportError:  # pragma: no cover - old Triton: no such argument ever comes
    pass
try:  # Gluon's, which carry their shared-memory layout (the TMA forward's arguments)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GLUON_DESCRIPTOR

    _TENSOR_DESCRIPTORS += (_GLUON_DESCRIPTOR,)
except ImportError:  # pragma: no cover - a Triton without Gluon
    pass


def call_key(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """The key of a call with runtime arguments ``args`` (see the module docstring).

    A tensor descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``, a box load's argument, or
    Gluon's) is keyed by everything it holds but its tensor's data: base dtype and alignment, shape,
    strides, block shape, padding, TF32 rounding and (Gluon's) shared-memory layout; finer than
    Triton's key (its dtype and block shape), so the remembered kernel is the generic path's, which the
    direct launch then receives the descriptor as the generic path would.

    NOTE: one comprehension and one ``map`` rather than a function call per argument: this runs on
    every launch, and per-argument Python calls were most of the launch's host time.
    """
    values = tuple(
        [
            a
            if type(a) is int
            else (a.dtype, a.data_ptr() % 16 == 0)
            if isinstance(a, torch.Tensor)
            else call_key(a)
            if type(a) is tuple
            else _descriptor_key(a)
            if type(a) in _TENSOR_DESCRIPTORS
            else a
            for a in args
        ]
    )
    return (tuple(map(type, args)), values)


def _descriptor_key(desc: Any) -> tuple[Any, ...]:
    """``call_key``'s part for a tensor descriptor (its docstring)."""
    return (desc.base.dtype, desc.base.data_ptr() % 16 == 0, tuple(desc.shape), tuple(desc.strides),
            tuple(desc.block_shape), desc.padding, getattr(desc, "round_f32_to_tf32", False),
            getattr(desc, "layout", None))  # fmt: skip



def _hooks_idle() -> bool:
    """True when no launch enter/exit hook is installed (``None`` or an empty ``HookChain``)."""
    if _RUNTIME_KNOBS is None:
        return False
    for hook in (_RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook):
        if hook is None:
            continue
        calls = getattr(hook, "calls", None)
        if not isinstance(calls, list) or calls:
            return False
    return True


def _direct_launcher(compiled: Any) -> tuple[Callable[..., Any], Any, Any] | None:
    """``(launcher, function handle, packed metadata)`` of a compiled kernel, or ``None`` when it is
    not a compiled GPU kernel of a Triton whose launcher this module knows."""
    try:
        run = compiled.run  # loads the module on first access
        function = compiled.function
        metadata = compiled.packed_metadata
    except AttributeError:
        return None
    if not callable(run) or function is None:
        return None
    return run, function, metadata


class FastLaunch:
    """``kernel[grid](*args, **constexprs)`` with the per-launch host work done once per
    specialization (see the module docstring for the contract and when it falls back)."""

    def __init__(
        self, kernel: Any, grid: Sequence[int], constexprs: dict[str, Any], fixed: Sequence[Any] = ()
    ) -> None:
        self.kernel = kernel
        self.grid = tuple(grid)
        self.constexprs = dict(constexprs)
        self.fixed = tuple(fixed)
        self._grid3 = (*self.grid, 1, 1)[:3]
        self._compiled: dict[Any, tuple[Callable[..., Any], Any, Any]] = {}
        self._tail, self._merge = self._constexpr_layout(kernel, self.constexprs)
        params = getattr(kernel, "params", None) or ()
        #: how many runtime (non-constexpr) parameters the kernel has; ``-1`` when not known
        self._n_runtime = sum(1 for p in params if not p.is_constexpr) if params else -1
        #: Triton's ``get_current_device`` / ``get_current_stream``, bound at the first remembered kernel
        self._device_of: Callable[[], int] | None = None
        self._stream_of: Callable[[int], int] | None = None

    @staticmethod
    def _constexpr_layout(
        kernel: Any, constexprs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], list[Any] | None]:
        """How the launcher's full argument list (every parameter, constexprs included, in signature
        order) is built from the runtime arguments: ``(tail, None)`` when every constexpr comes after
        every runtime parameter (the list is ``args + tail``), else ``((), template)``: per parameter
        either a constexpr value or ``_RUNTIME`` for the next runtime argument.  ``((), None)`` when
        the kernel does not describe its parameters (the fast path is then never taken)."""
        params = getattr(kernel, "params", None)
        if not params:
            return (), None
        template: list[Any] = []
        for p in params:
            if p.is_constexpr:
                template.append(constexprs[p.name] if p.name in constexprs else p.default)
            else:
                template.append(_RUNTIME)
        first_const = next((i for i, v in enumerate(template) if v is not _RUNTIME), len(template))
        if all(v is not _RUNTIME for v in template[first_const:]):
            return tuple(template[first_const:]), None
        return (), template

    def _full_args(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if self._merge is None:
            return args + self.fixed + self._tail
        it = iter(args + self.fixed)
        return tuple(next(it) if v is _RUNTIME else v for v in self._merge)

    def __call__(self, *args: Any) -> None:
        if _compiling_ahead.get():
            self.kernel.warmup(*args, *self.fixed, grid=self.grid, **self.constexprs)
            return
        device_of, stream_of = self._device_of, self._stream_of
        if device_of is not None and stream_of is not None and _hooks_idle():
            device = device_of()
            try:
                hit = self._compiled.get((device, call_key(args)))
            except TypeError:  # an unhashable argument
                hit = None
            if hit is not None:
                run, function, metadata = hit
                gx, gy, gz = self._grid3
                run(gx, gy, gz, stream_of(device), function, metadata, None, None, None,
                    *self._full_args(args))  # fmt: skip
                return
        compiled = self.kernel[self.grid](*args, *self.fixed, **self.constexprs)
        self._remember(args, compiled)

    def _remember(self, args: tuple[Any, ...], compiled: Any) -> None:
        if (
            compiled is None
            or len(args) + len(self.fixed) != self._n_runtime
            or len(self._compiled) >= MAX_REMEMBERED
        ):
            return  # interpreter, not a JITFunction, runtime args left to their defaults, or full
        try:
            key = call_key(args)
            hash(key)
        except TypeError:  # an unhashable argument
            return
        direct = _direct_launcher(compiled)
        functions = _driver_functions()
        if direct is None or functions is None:
            return
        self._device_of, self._stream_of = functions
        self._compiled[(self._device_of(), key)] = direct


def _driver_functions() -> tuple[Callable[[], int], Callable[[int], int]] | None:
    """Triton's active driver's ``(get_current_device, get_current_stream)``: the device and stream
    its generic launch path uses; ``None`` when there is no active GPU driver."""
    try:
        from triton.runtime import driver as triton_driver

        active = triton_driver.active
        return active.get_current_device, active.get_current_stream
    except Exception:  # no GPU backend (CPU-only machine): the generic path stays in use
        return None


#: True while ``compile_ahead`` runs its calls: launches only submit their compiles.
_compiling_ahead: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fusion_compiling_ahead", default=False
)
#: True while ``compile_in_background`` runs its calls: every candidate of a choice is wanted.
_every_candidate: contextvars.ContextVar[bool] = contextvars.ContextVar("fusion_every_candidate", default=False)


def compiling_ahead() -> bool:
    """Whether the caller runs inside :func:`compile_ahead` (no kernel runs; results are garbage)."""
    return _compiling_ahead.get()


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> bool:
    """``kernel[grid](*args, **kwargs)`` for a ``JITFunction`` or an autotuned kernel; True.

    Inside :func:`compile_ahead` nothing is launched: the compile of this launch is submitted (for
    an autotuned kernel, of every tile its pruner keeps) and the result is False, so that a caller
    reading launch results (an autotuner's ``best_config``) knows there are none."""
    if _compiling_ahead.get():
        kernel.warmup(*args, grid=grid, **kwargs)
        return False
    kernel[grid](*args, **kwargs)
    return True


def _async_compile_mode() -> Any:
    """Triton's ``AsyncCompileMode`` class, or None (a Triton without it, or under the interpreter)."""
    if INTERPRETER:
        return None
    try:
        from triton.runtime._async_compile import AsyncCompileMode, active_mode
    except ImportError:
        return None
    return None if active_mode.get() is not None else AsyncCompileMode


def compile_ahead(calls: Iterable[Callable[[], object]], speculative: Iterable[Callable[[], object]] = ()) -> bool:
    """Compile every Triton kernel that ``calls`` would launch, in parallel, before they run for real.

    Each call runs once with its launches replaced by compile submissions (see the module
    docstring): torch operations in it run on whatever the skipped kernels left in their outputs, so
    a call must not index memory by values a Triton kernel computed (none of the op paths does).
    Returns after every compile has finished or failed.  A call that raises, or a kernel that fails
    to compile, is skipped: it raises again when it runs for real, where its caller handles it.

    Where Inductor's compile worker processes are up (``kernels.compile_pool``), the compiles run
    there, and so do those of ``speculative``: calls that may run later (a candidate's other tiles),
    whose compiles cost little wall time among the others' on a pool of processes.  Otherwise they
    run on a pool of ``torch._inductor.config.compile_threads`` threads (Inductor's own setting for
    parallel compiles; ``TORCHINDUCTOR_COMPILE_THREADS``) through Triton's ``AsyncCompileMode``, and
    ``speculative`` is left out.  Returns False, having done nothing, under the interpreter, inside
    another compile ahead, or where Triton has no ``AsyncCompileMode`` and no worker pool is up."""
    if INTERPRETER or _compiling_ahead.get():
        return False
    pool = compile_pool.ready_pool()
    if pool is not None:
        _compile_in_workers(pool, [*calls, *speculative])
        return True
    mode_class = _async_compile_mode()
    if mode_class is None:
        return False
    _compile_on_threads(mode_class, calls)
    return True


def compile_in_background(calls: Iterable[Callable[[], object]]) -> compile_pool.Batch | None:
    """Send the compiles of every Triton kernel that ``calls`` would launch, with every candidate of
    each implementation choice (``impl_choice.choose`` runs them all, and answers its default
    without timing or remembering), to Inductor's worker processes, and return at once: the batch
    says when they have compiled (a pool whose workers are still starting takes them: they wait for
    the workers).  None where nothing was sent: no worker pool is allowed, every kernel the calls
    launch is compiled already (in this process, or in Triton's disk cache: ``compile_pool.compiled_on_disk``),
    under the interpreter, or inside a compile ahead.  As in :func:`compile_ahead`, the calls run
    with their launches replaced by compile submissions; a call that raises is skipped."""
    if INTERPRETER or _compiling_ahead.get():
        return None
    pool = compile_pool.ready_pool(starting=True)
    if pool is None:
        return None
    token = _every_candidate.set(True)
    try:
        with compile_pool.capturing() as jobs:
            _run_without_launching(calls)
    finally:
        _every_candidate.reset(token)
    cold = [job for job in jobs.values() if not compile_pool.compiled_on_disk(job)]
    return compile_pool.submit_all(pool, cold) if cold else None


def compiling_every_candidate() -> bool:
    """Whether the caller runs inside :func:`compile_in_background`, which wants the kernels of
    every candidate of an implementation choice, not only of the one a choice would answer."""
    return _every_candidate.get()


def _run_without_launching(calls: Iterable[Callable[[], object]]) -> None:
    """Run ``calls`` with every launch replaced by the compile of that launch (see ``launch``)."""
    token = _compiling_ahead.set(True)
    try:
        for call in calls:
            try:
                call()
            except Exception as err:  # noqa: BLE001 - it raises again when it runs for real
                log.debug("compile ahead: %s raised %s: %s", call, type(err).__name__, err)
    finally:
        _compiling_ahead.reset(token)


def _compile_in_workers(pool: Any, calls: Iterable[Callable[[], object]]) -> None:
    with compile_pool.capturing() as jobs:
        _run_without_launching(calls)
    if jobs:
        compile_pool.compile_all(pool, list(jobs.values()))


def _compile_on_threads(mode_class: Any, calls: Iterable[Callable[[], object]]) -> None:
    from torch._inductor import config as inductor_config

    threads = max(1, int(inductor_config.compile_threads or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="fusion-compile") as pool:
        try:
            mode = mode_class(pool, ignore_errors=True)
        except TypeError:  # an older AsyncCompileMode: a failed compile raises when it finishes
            mode = mode_class(pool)
        began, submitted = time.perf_counter(), 0
        try:
            with mode:
                _run_without_launching(calls)
                submitted = len(getattr(mode, "raw_futures", ()))
            if submitted:
                log.info("compiled %d Triton kernels ahead in %.1f s (%d threads)", submitted,
                         time.perf_counter() - began, threads)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - a failed compile: its launch compiles (and fails) again
            log.debug("compile ahead: a compile failed: %s: %s", type(err).__name__, err)
