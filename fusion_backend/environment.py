"""Every ``FUSION_*`` environment variable the backend reads: name, default and meaning, in one place.

==========================  ===========================================================================
variable                    meaning
==========================  ===========================================================================
``FUSION_CONV_IMPL``        which conv path ``conv_epilogue`` runs: ``auto`` (default: measured on CUDA),
                            ``library`` (cuDNN + the Triton epilogue), ``triton`` (the fused kernels)
                            or ``family`` (the conv kernel family's forward, ``kernels.conv``, where
                            it serves the call; the backward as ``library``); and the conv of
                            ``conv_batch_norm``'s forward (``family``: the family's, with the
                            statistics in its store; else the library conv); for ``batch_norm_conv``
                            every pass's implementation (``family`` / ``library``; else timed per pass);
                            and the conv alone of the fused ops' library paths in calls that save
                            nothing (``ops/library_conv.ConvAlone``: ``family`` the family's plain
                            forward where it serves, ``auto`` timed on CUDA, else aten's)
``FUSION_CONV_AUTOTUNE``    ``0`` turns measuring off: no timed choice between paths (the library path
                            runs) and no tile tuning (each kernel takes its heuristic tile);
                            deterministic first calls.  ``1``, or unset: on
``FUSION_CPU_KERNELS``      ``triton``: CPU tensors run the Triton kernels (needs ``TRITON_INTERPRET=1``
                            before the process starts); ``reference``, or unset: they run the
                            plain-torch reference
``FUSION_CACHE_DIR``        where measured choices (region decisions, path choices) are kept across
                            processes; default ``~/.cache/fusion_backend``
``FUSION_DECIDE``           the default of the ``decide`` option (``measure``, ``fuse`` or ``inductor``)
``FUSION_PATTERNS``         the default of the ``patterns`` option: comma-separated family names (e.g.
                            what one family gives a benchmarked network, next to the others)
``FUSION_DUMP_DIR``         the default of the ``dump_dir`` option (per-graph dumps)
==========================  ===========================================================================

Each reader validates what it reads: a value outside the accepted set raises
``InvalidEnvironmentError`` naming the variable, the value and the accepted values (empty counts as
unset).  :func:`check` reads them all; the backend calls it when it parses its options, so a bad
switch fails the first compile rather than a fused op's call.

(The benchmark's ``FUSION_DEMOS_DIR`` and the fuzzer's ``FUSION_FUZZ_*`` belong to those tools.)

WHY read at the time of use, not once at import: users and tests switch them between compiles (a
notebook cell, ``monkeypatch.setenv``), and the per-call plans that depend on them key on
:func:`plan_switches`, so a switched variable gets a new plan rather than a stale one.
``TRITON_INTERPRET`` is Triton's own; :func:`triton_interpreter` reads it once, when
``kernels/host.py`` is imported, as Triton reads it when it decorates a kernel.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from .errors import InvalidEnvironmentError

CONV_IMPL = "FUSION_CONV_IMPL"
CONV_AUTOTUNE = "FUSION_CONV_AUTOTUNE"
CPU_KERNELS = "FUSION_CPU_KERNELS"
CACHE_DIR = "FUSION_CACHE_DIR"
DECIDE = "FUSION_DECIDE"
DUMP_DIR = "FUSION_DUMP_DIR"
PATTERNS = "FUSION_PATTERNS"

DEFAULT_CONV_IMPL = "auto"
CONV_IMPLS = ("auto", "library", "triton", "family")
CONV_AUTOTUNE_VALUES = ("1", "0")
CPU_KERNELS_VALUES = ("reference", "triton")
#: The policies of the ``decide`` option (``runtime.decision.POLICIES`` is this tuple).
DECIDE_VALUES = ("measure", "fuse", "inductor")


def _read(variable: str, accepted: Sequence[str], default: str, fold_case: bool = False) -> str:
    """``variable``'s value (unset or empty: ``default``), which must be one of ``accepted``."""
    raw = os.environ.get(variable) or ""
    value = raw.lower() if fold_case else raw
    if not value:
        return default
    if value not in accepted:
        raise InvalidEnvironmentError(
            f"{variable}={raw!r} is not accepted: use one of {', '.join(accepted)}, or leave it unset "
            f"(the default: {default})")
    return value


def conv_impl() -> str:
    """``FUSION_CONV_IMPL``, one of :data:`CONV_IMPLS` (empty or unset: ``auto``)."""
    return _read(CONV_IMPL, CONV_IMPLS, DEFAULT_CONV_IMPL)


def measuring() -> bool:
    """Whether choices are measured and tiles tuned (``FUSION_CONV_AUTOTUNE``: ``1`` or unset; ``0``: no)."""
    return _read(CONV_AUTOTUNE, CONV_AUTOTUNE_VALUES, "1") == "1"


def cpu_kernels_triton() -> bool:
    """Whether CPU tensors were asked to run the Triton kernels (``FUSION_CPU_KERNELS=triton``, any
    case; ``reference`` or unset: the plain-torch reference)."""
    return _read(CPU_KERNELS, CPU_KERNELS_VALUES, "reference", fold_case=True) == "triton"


def cache_dir() -> Path:
    """Where measured choices are kept across processes (``FUSION_CACHE_DIR``)."""
    return Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "fusion_backend")


def decide() -> str | None:
    """``FUSION_DECIDE``, one of :data:`DECIDE_VALUES`, or None when unset or empty (the option's own
    default applies)."""
    value = _read(DECIDE, DECIDE_VALUES, "measure")
    return value if os.environ.get(DECIDE) else None


def patterns() -> tuple[str, ...] | None:
    """``FUSION_PATTERNS``'s comma-separated names, or None when unset or empty (the ``patterns``
    option's own default applies; the option checks the names)."""
    raw = os.environ.get(PATTERNS) or ""
    names = tuple(name.strip() for name in raw.split(",") if name.strip())
    return names or None


def dump_dir() -> str | None:
    """``FUSION_DUMP_DIR``, or None when unset or empty."""
    return os.environ.get(DUMP_DIR) or None


def check() -> None:
    """Read every switch that has an accepted set of values, raising ``InvalidEnvironmentError`` on
    the first bad one."""
    conv_impl()
    measuring()
    cpu_kernels_triton()
    decide()


#: ``os.environ``'s own mapping (encoded keys to encoded values) and the plan switches' encoded names;
#: None where the platform's ``os.environ`` has no such mapping
_RAW_ENVIRON = getattr(os.environ, "_data", None)
_PLAN_SWITCH_KEYS = tuple(os.environ.encodekey(name) for name in (CONV_IMPL, CONV_AUTOTUNE, CPU_KERNELS)) \
    if _RAW_ENVIRON is not None else ()


# NOTE: read from ``os.environ``'s own mapping, on every fused op's call: three ``os.environ.get`` calls
# (each encodes the name and decodes the value) took 4.9 us on a 2-core CPU machine, three ``_data.get``
# of the encoded names 0.26 us (``python -c "import os, timeit; e = os.environ; d = e._data; k = e.encodekey('A');
# print(timeit.timeit(lambda: (e.get('A'), e.get('A'), e.get('A')), number=10**5) * 10,
# timeit.timeit(lambda: (d.get(k), d.get(k), d.get(k)), number=10**5) * 10)"``, us per three).
def plan_switches() -> tuple[object, object, object]:
    """The raw values of the switches a kernel's launch plan or an op's call plan depends on, for
    their cache keys (``FUSION_CONV_IMPL``, ``FUSION_CONV_AUTOTUNE``, ``FUSION_CPU_KERNELS``): as
    ``os.environ`` holds them (bytes on POSIX), None where unset; only equality means anything."""
    if _RAW_ENVIRON is None:
        environ = os.environ
        return environ.get(CONV_IMPL), environ.get(CONV_AUTOTUNE), environ.get(CPU_KERNELS)
    get = _RAW_ENVIRON.get
    impl, autotune, cpu = _PLAN_SWITCH_KEYS
    return get(impl), get(autotune), get(cpu)


def triton_interpreter() -> bool:
    """Whether ``TRITON_INTERPRET`` turns Triton's interpreter on (any value but empty or ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
