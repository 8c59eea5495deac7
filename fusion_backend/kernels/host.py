"""Host-side integer helpers shared by the kernel launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``constexpr_function``s in recent Triton: called
from host code they unwrap their arguments through Triton's machinery and cost ~2-3 us each.  The
launchers call them several times per launch, and at the seeds' sizes host time is what a training
step waits on (see ``docs/perf/NOTES.md``), so the launchers use these plain-int versions.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
