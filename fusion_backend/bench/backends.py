"""The contenders: what each ``--backends`` name does to a model before it is checked and timed.

A :class:`BenchBackend` is a name plus a function from an ``nn.Module`` (a private deep copy with the
reference weights) to the callable that is run.  Built-ins:

``eager``                  the module itself (the reference every other backend is checked against)
``inductor``               ``torch.compile(m, backend="inductor")``
``inductor-max-autotune``  ``torch.compile(m, backend="inductor", mode="max-autotune")``
``fusion``                 ``torch.compile(m, backend="fusion")``
``fusion-max-autotune``    ``torch.compile(m, backend="fusion", mode="max-autotune")``
``fusion-via-inductor``    ``torch.compile(m, backend="fusion", options={"direct": False})``: graphs of only
                           fused ops go through AOTAutograd and Inductor too (measures the direct runner)
``fusion-unfused``         ``torch.compile(m, backend="fusion", options={"decide": "inductor"})``: matches and
                           reports but rewrites nothing (measures what the backend costs where it leaves
                           every region to Inductor: it should time as ``inductor`` does)
``fusion-fused``           ``torch.compile(m, backend="fusion", options={"decide": "fuse"})``: every matched
                           region rewritten, nothing measured (what the fused ops give the whole model,
                           next to what the decision keeps)
``fusion-decide-all``      ``torch.compile(m, backend="fusion", options={"decide_budget": None})``: every
                           region measured in the first process (no decision budget): the decisions a
                           user's later processes converge to, in one run

Any other name registered with Dynamo (``torch._dynamo.list_backends()``, e.g. ``aot_eager``,
``cudagraphs``) works too, and ``NAME:MODE`` passes a ``torch.compile`` mode.  ``--compile-mode MODE``
(:func:`with_compile_mode`) is shorthand for ``:MODE`` after every compiled backend of a run, so that
Inductor and fusion are timed under the same mode (e.g. both with CUDA graphs).  Tests and scripts can
pass their own :class:`BenchBackend` objects (see ``extra`` in :func:`resolve_backends`), e.g. a
deliberately wrong one to prove the correctness gate catches it.

The verdict of a run compares one fusion backend with one Inductor backend; :func:`pick_contenders`
chooses them from the run's backend names (``fusion`` and ``inductor``, or their ``:MODE`` variants).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import BackendSpecError, ConfigError

CompileFn = Callable[[torch.nn.Module], Callable[..., Any]]

#: ``torch.compile`` modes that turn on Inductor's CUDA graphs.
CUDAGRAPH_MODES = frozenset({"max-autotune", "reduce-overhead"})

#: Dynamo backends that replay CUDA graphs whatever the mode.
CUDAGRAPH_COMPILERS = frozenset({"cudagraphs"})

#: The compiler whose result the verdict judges, and the one it is judged against.
SUBJECT_COMPILER = "fusion"
BASELINE_COMPILER = "inductor"


@dataclass(frozen=True)
class BenchBackend:
    """A named way to turn a module into the callable that is benchmarked.

    ``uses_dynamo`` says ``compile`` goes through ``torch.compile``: the runner then resets Dynamo
    before compiling, so every item compiles from scratch (otherwise the same ``forward`` code object
    compiled for many dtypes/modes/backends hits Dynamo's recompile limit and silently runs eager) and
    the first call's wall time is a true compile time.

    ``cudagraphs`` says the compiled code replays CUDA graphs (Inductor's ``max-autotune`` and
    ``reduce-overhead`` modes).  Their intermediates and outputs live in a private memory pool that
    the allocator's statistics do not show as allocated (measured on H100: 0.001 MiB "peak" for a train
    step holding tens of MiB), so the runner does not report memory for them rather than report a
    false zero; and it starts every step with ``torch.compiler.cudagraph_mark_step_begin()``.

    ``compiler``, ``mode`` and ``options`` are what is passed to ``torch.compile`` (``compiler`` is
    ``None`` for backends that do not call it), so that a mode can be checked against ``--compile-mode``.
    """

    name: str
    compile: CompileFn
    description: str
    uses_dynamo: bool = True
    cudagraphs: bool = False
    compiler: str | None = None
    mode: str | None = None
    options: Mapping[str, Any] | None = None


def _identity(module: torch.nn.Module) -> Callable[..., Any]:
    return module


def torch_compile_backend(name: str, backend: str, mode: str | None = None,
                          options: dict[str, Any] | None = None) -> BenchBackend:
    """A :class:`BenchBackend` calling ``torch.compile(module, backend=backend, mode=mode, options=options)``."""

    def compile_fn(module: torch.nn.Module) -> Callable[..., Any]:
        kwargs: dict[str, Any] = {}
        if mode is not None and options:  # torch.compile takes one: fusion takes the mode's Inductor options
            kwargs["options"] = {**torch._inductor.list_mode_options(mode, None), **options}
        elif mode is not None:
            kwargs["mode"] = mode
        elif options:
            kwargs["options"] = dict(options)
        return torch.compile(module, backend=backend, **kwargs)

    suffix = (f", mode={mode!r}" if mode else "") + (f", options={options!r}" if options else "")
    return BenchBackend(name, compile_fn, f"torch.compile(m, backend={backend!r}{suffix})",
                        cudagraphs=mode in CUDAGRAPH_MODES or backend in CUDAGRAPH_COMPILERS,
                        compiler=backend, mode=mode, options=dict(options) if options else None)


BUILTIN_BACKENDS: dict[str, BenchBackend] = {
    "eager": BenchBackend("eager", _identity, "the module as written (reference)", uses_dynamo=False),
    "inductor": torch_compile_backend("inductor", "inductor"),
    "inductor-max-autotune": torch_compile_backend("inductor-max-autotune", "inductor", "max-autotune"),
    "fusion": torch_compile_backend("fusion", "fusion"),
    "fusion-max-autotune": torch_compile_backend("fusion-max-autotune", "fusion", "max-autotune"),
    "fusion-via-inductor": torch_compile_backend("fusion-via-inductor", "fusion", options={"direct": False}),
    "fusion-unfused": torch_compile_backend("fusion-unfused", "fusion", options={"decide": "inductor"}),
    "fusion-fused": torch_compile_backend("fusion-fused", "fusion", options={"decide": "fuse"}),
    "fusion-decide-all": torch_compile_backend("fusion-decide-all", "fusion", options={"decide_budget": None}),
}


def _dynamo_backends() -> list[str]:
    try:
        return list(torch._dynamo.list_backends(exclude_tags=()))
    except Exception:  # pragma: no cover - private API drift: fall back to the built-ins only
        return []


def resolve_backend(name: str, extra: Mapping[str, BenchBackend] | None = None) -> BenchBackend:
    """The backend called ``name``: from ``extra``, the built-ins, ``NAME:MODE``, or Dynamo's registry.

    Raises :class:`BackendSpecError` listing the known names when nothing matches.
    """
    if extra and name in extra:
        return extra[name]
    if name in BUILTIN_BACKENDS:
        return BUILTIN_BACKENDS[name]
    backend, _, mode = name.partition(":")
    builtin = BUILTIN_BACKENDS.get(backend)
    if mode and builtin is not None and builtin.compiler == "fusion" and builtin.options and builtin.mode is None:
        # a fusion built-in with options under a mode: the mode goes in as its Inductor options
        return torch_compile_backend(name, "fusion", mode, builtin.options)
    known_dynamo = _dynamo_backends()
    if backend in {"inductor", "fusion"} or backend in known_dynamo:
        return torch_compile_backend(name, backend, mode or None)
    known = sorted(set(BUILTIN_BACKENDS) | set(extra or {}))
    raise BackendSpecError(
        f"unknown backend {name!r}; built-in: {', '.join(known)}; torch.compile backends: "
        f"{', '.join(known_dynamo) or '(none found)'}; NAME:MODE passes a torch.compile mode"
    )


def resolve_backends(names: Sequence[str], extra: Mapping[str, BenchBackend] | None = None) -> list[BenchBackend]:
    """Resolve every name (see :func:`resolve_backend`), keeping order."""
    return [resolve_backend(n, extra) for n in names]


def split_backend_name(name: str) -> tuple[str, str | None]:
    """``(compiler, mode)`` a backend name stands for: a built-in's, else ``NAME:MODE`` split.

    >>> split_backend_name("inductor-max-autotune"), split_backend_name("fusion:reduce-overhead")
    (('inductor', 'max-autotune'), ('fusion', 'reduce-overhead'))
    >>> split_backend_name("eager"), split_backend_name("my_backend")
    (('eager', None), ('my_backend', None))
    """
    builtin = BUILTIN_BACKENDS.get(name)
    if builtin is not None:
        return builtin.compiler or name, builtin.mode
    compiler, _, mode = name.partition(":")
    return compiler, mode or None


def pick_contenders(names: Sequence[str]) -> tuple[str | None, str | None]:
    """The fusion backend a run's verdict judges and the Inductor backend it is judged against.

    The subject is ``fusion`` if the run has it, else the first fusion backend without extra
    ``torch.compile`` options (``fusion:MODE``, ``fusion-max-autotune``), else the first fusion backend
    at all.  The baseline is an Inductor backend under the subject's mode, else ``inductor``, else the
    first Inductor backend; of several candidates, the first one listed after the subject, else the
    first.  Either is ``None`` when the run has no backend of that compiler.

    WHY after the subject: the runner compiles a case's backends in the run's order, and the first
    model compiled in a case timed slower than later copies of the same compiled code, on host-bound
    rows by 1-11% (NOTE: ``python -m fusion_backend bench --suite SMALL_ROWS --backends
    eager,inductor,inductor:default,fusion,fusion-unfused --no-memory --no-cold`` and the same with the
    backend order reversed, on the H100: whichever Inductor-code backend came first was the slowest,
    ``docs/perf/RESULTS.md``).  A baseline compiled after the subject cannot gain from that.
    Pairing it with the copy compiled before the subject (their geometric mean per round) would
    cancel a smooth order trend, but NOTE: recomputed from the H100 runs' recorded rounds
    (``round_medians_ms`` in ``docs/perf/h100/*/bench.json``), the pair left the convnets at 70/72
    rows at or above the tie (two other rows below, one where the first copy read 1.08x) and took
    the families from 27/28 to 25/28 (its first copy read up to 2.22x away): the first copy's own
    outliers outweigh the 1-2% trend it would cancel.

    >>> pick_contenders(["eager", "inductor", "fusion"])
    ('fusion', 'inductor')
    >>> pick_contenders(["eager", "inductor", "fusion", "inductor:default"])
    ('fusion', 'inductor:default')
    >>> pick_contenders(["inductor", "inductor:reduce-overhead", "fusion:reduce-overhead"])
    ('fusion:reduce-overhead', 'inductor:reduce-overhead')
    >>> pick_contenders(["eager", "fusion"])
    ('fusion', None)
    """
    parsed = [(n, *split_backend_name(n)) for n in names]
    fusions = [(n, mode) for n, compiler, mode in parsed if compiler == SUBJECT_COMPILER]
    inductors = [(n, mode) for n, compiler, mode in parsed if compiler == BASELINE_COMPILER]
    subject: tuple[str, str | None] | None = None
    if fusions:
        plain = [f for f in fusions if not _has_options(f[0])]
        subject = next((f for f in fusions if f[0] == SUBJECT_COMPILER), plain[0] if plain else fusions[0])
    baseline: str | None = None
    if inductors:
        same_mode = [n for n, mode in inductors if subject is not None
                     and (mode or "default") == (subject[1] or "default") and not _has_options(n)]
        exact = [n for n, _ in inductors if n == BASELINE_COMPILER]
        candidates = same_mode or exact or [inductors[0][0]]
        after = [n for n in candidates if subject is not None and names.index(n) > names.index(subject[0])]
        baseline = (after or candidates)[0]
    return (subject[0] if subject else None), baseline


def _has_options(name: str) -> bool:
    builtin = BUILTIN_BACKENDS.get(name)
    return builtin is not None and bool(builtin.options)


def compile_modes() -> tuple[str, ...]:
    """The ``torch.compile`` modes this torch knows (``torch._inductor.list_mode_options()``)."""
    try:
        from torch._inductor import list_mode_options

        return tuple(list_mode_options())
    except Exception:  # pragma: no cover - private API drift: the modes documented by torch.compile
        return ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def with_compile_mode(names: Sequence[str], mode: str | None) -> list[str]:
    """``names`` with ``:mode`` appended to every backend that goes through ``torch.compile``.

    ``eager`` (and anything else that does not compile) is kept as is, so is a backend that already
    names the same mode (``inductor:reduce-overhead``, ``inductor-max-autotune`` under
    ``max-autotune``).  Raises :class:`ConfigError` for a mode this torch does not know and
    :class:`BackendSpecError` for a backend that names another mode, or passes ``torch.compile``
    options (which takes a mode or options, not both) to a compiler other than fusion (which takes the
    mode's Inductor options among its own: ``fusion-fused:reduce-overhead``).  ``mode=None`` returns
    ``names`` unchanged.

    >>> with_compile_mode(["eager", "inductor", "fusion:reduce-overhead"], "reduce-overhead")
    ['eager', 'inductor:reduce-overhead', 'fusion:reduce-overhead']
    """
    if mode is None:
        return list(names)
    known = compile_modes()
    if mode not in known:
        raise ConfigError(f"unknown --compile-mode {mode!r}; torch.compile modes: {', '.join(known)}")
    out = []
    for name in names:
        backend = resolve_backend(name)
        if not backend.uses_dynamo or backend.compiler is None:
            out.append(name)
        elif backend.options and not (backend.compiler == "fusion" and backend.mode is None):
            raise BackendSpecError(
                f"--compile-mode {mode} cannot apply to backend {name!r}: it passes torch.compile options "
                f"{dict(backend.options)!r}, and torch.compile takes a mode or options, not both; drop one")
        elif backend.mode is None:
            out.append(f"{name}:{mode}")
        elif backend.mode == mode:
            out.append(name)
        else:
            raise BackendSpecError(
                f"--compile-mode {mode} conflicts with backend {name!r}, which names mode {backend.mode!r}; "
                f"drop one, or give the mode per backend as NAME:MODE without --compile-mode")
    return out
