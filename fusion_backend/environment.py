"""Every ``FUSION_*`` environment variable the backend reads: name, default and meaning, in one place.

==========================  ===========================================================================
variable                    meaning
==========================  ===========================================================================
``FUSION_CONV_IMPL``        which conv path ``conv_epilogue`` runs: ``auto`` (default: measured on CUDA),
                            ``library`` (cuDNN + the Triton epilogue) or ``triton`` (the fused kernels)
``FUSION_CONV_AUTOTUNE``    ``0`` turns measuring off: no timed choice between paths (the library path
                            runs) and no tile tuning (each kernel takes its heuristic tile);
                            deterministic first calls.  Anything else, or unset: on
``FUSION_CPU_KERNELS``      ``triton``: CPU tensors run the Triton kernels (needs ``TRITON_INTERPRET=1``
                            before the process starts); unset: they run the plain-torch reference
``FUSION_CACHE_DIR``        where measured choices (region decisions, path choices) are kept across
                            processes; default ``~/.cache/fusion_backend``
``FUSION_DECIDE``           the default of the ``decide`` option (``measure``, ``fuse`` or ``inductor``)
``FUSION_DUMP_DIR``         the default of the ``dump_dir`` option (per-graph dumps)
==========================  ===========================================================================

(The benchmark's ``FUSION_DEMOS_DIR`` and the fuzzer's ``FUSION_FUZZ_*`` belong to those tools.)

WHY read at the time of use, not once at import: users and tests switch them between compiles (a
notebook cell, ``monkeypatch.setenv``), and the per-call plans that depend on them key on
:func:`plan_switches`, so a switched variable gets a new plan rather than a stale one.  A lookup costs
well under a microsecond.  ``TRITON_INTERPRET`` is Triton's own; :func:`triton_interpreter` reads it
once, when ``kernels/host.py`` is imported, as Triton reads it when it decorates a kernel.
"""

from __future__ import annotations

import os
from pathlib import Path

CONV_IMPL = "FUSION_CONV_IMPL"
CONV_AUTOTUNE = "FUSION_CONV_AUTOTUNE"
CPU_KERNELS = "FUSION_CPU_KERNELS"
CACHE_DIR = "FUSION_CACHE_DIR"
DECIDE = "FUSION_DECIDE"
DUMP_DIR = "FUSION_DUMP_DIR"

DEFAULT_CONV_IMPL = "auto"
CONV_IMPLS = ("auto", "library", "triton")


def conv_impl() -> str:
    """``FUSION_CONV_IMPL`` as given (empty or unset: ``auto``); the caller validates it against
    :data:`CONV_IMPLS`, naming the variable in its error."""
    return os.environ.get(CONV_IMPL) or DEFAULT_CONV_IMPL


def measuring() -> bool:
    """Whether choices are measured and tiles tuned (``FUSION_CONV_AUTOTUNE`` is not ``0``)."""
    return os.environ.get(CONV_AUTOTUNE, "1") != "0"


def cpu_kernels_triton() -> bool:
    """Whether CPU tensors were asked to run the Triton kernels (``FUSION_CPU_KERNELS=triton``)."""
    return os.environ.get(CPU_KERNELS, "").lower() == "triton"


def cache_dir() -> Path:
    """Where measured choices are kept across processes (``FUSION_CACHE_DIR``)."""
    return Path(os.environ.get(CACHE_DIR) or Path.home() / ".cache" / "fusion_backend")


def decide() -> str | None:
    """``FUSION_DECIDE``, or None when unset or empty (the option's own default applies)."""
    return os.environ.get(DECIDE) or None


def dump_dir() -> str | None:
    """``FUSION_DUMP_DIR``, or None when unset or empty."""
    return os.environ.get(DUMP_DIR) or None


def plan_switches() -> tuple[str | None, str | None, str | None]:
    """The raw values of the switches a kernel's launch plan or an op's call plan depends on, for
    their cache keys (``FUSION_CONV_IMPL``, ``FUSION_CONV_AUTOTUNE``, ``FUSION_CPU_KERNELS``)."""
    environ = os.environ
    return environ.get(CONV_IMPL), environ.get(CONV_AUTOTUNE), environ.get(CPU_KERNELS)


def triton_interpreter() -> bool:
    """Whether ``TRITON_INTERPRET`` turns Triton's interpreter on (any value but empty or ``0``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
