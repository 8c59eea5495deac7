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

Any other name registered with Dynamo (``torch._dynamo.list_backends()``, e.g. ``aot_eager``,
``cudagraphs``) works too, and ``NAME:MODE`` passes a ``torch.compile`` mode.  Tests and scripts can
pass their own :class:`BenchBackend` objects (see ``extra`` in :func:`resolve_backends`), e.g. a
deliberately wrong one to prove the correctness gate catches it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .errors import BackendSpecError

CompileFn = Callable[[torch.nn.Module], Callable[..., Any]]

#: ``torch.compile`` modes that turn on Inductor's CUDA graphs.
CUDAGRAPH_MODES = frozenset({"max-autotune", "reduce-overhead"})


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
    false zero.
    """

    name: str
    compile: CompileFn
    description: str
    uses_dynamo: bool = True
    cudagraphs: bool = False


def _identity(module: torch.nn.Module) -> Callable[..., Any]:
    return module


def torch_compile_backend(name: str, backend: str, mode: str | None = None,
                          options: dict[str, Any] | None = None) -> BenchBackend:
    """A :class:`BenchBackend` calling ``torch.compile(module, backend=backend, mode=mode, options=options)``."""

    def compile_fn(module: torch.nn.Module) -> Callable[..., Any]:
        kwargs: dict[str, Any] = {}
        if mode is not None:
            kwargs["mode"] = mode
        if options:
            kwargs["options"] = dict(options)
        return torch.compile(module, backend=backend, **kwargs)

    suffix = (f", mode={mode!r}" if mode else "") + (f", options={options!r}" if options else "")
    return BenchBackend(name, compile_fn, f"torch.compile(m, backend={backend!r}{suffix})",
                        cudagraphs=mode in CUDAGRAPH_MODES)


BUILTIN_BACKENDS: dict[str, BenchBackend] = {
    "eager": BenchBackend("eager", _identity, "the module as written (reference)", uses_dynamo=False),
    "inductor": torch_compile_backend("inductor", "inductor"),
    "inductor-max-autotune": torch_compile_backend("inductor-max-autotune", "inductor", "max-autotune"),
    "fusion": torch_compile_backend("fusion", "fusion"),
    "fusion-max-autotune": torch_compile_backend("fusion-max-autotune", "fusion", "max-autotune"),
    "fusion-via-inductor": torch_compile_backend("fusion-via-inductor", "fusion", options={"direct": False}),
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
