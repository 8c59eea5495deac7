"""Timed loops that run with room on CPython's frame stack, so that no callable timed in them pays for
the interpreter's frame-stack chunks instead of its own code.

CPython 3.11+ keeps Python frames in a per-thread stack of memory chunks (16 KiB, more for a large
frame) that it maps from the OS when a call needs one and unmaps as soon as the call that needed it
returns.  A loop whose body's calls reach just past a chunk's end therefore maps, touches and unmaps
a chunk on every call: a minor page fault per page touched, each costing a few microseconds of kernel
time.  Whether a callable's deepest frames cross a chunk's end depends only on how deep the loop
that calls it sits, so two copies of the same compiled code can read different host times in one
process, and which one pays changes from run to run.

``call_with_frame_room(fn)`` calls ``fn()`` from a frame large enough that the interpreter starts a
new chunk for it, sized to leave ``ROOM_BYTES`` free after it: every frame the loop inside ``fn``
pushes fits in that one chunk, which stays mapped until ``fn`` returns.  It costs one map and the
first touch of the chunk's pages per call, so it wraps a whole timing loop, not each timed call.

NOTE: measured on the H200 (torch 2.11, Python 3.12), ResNet-50 bf16 inference, the benchmark's
rounds: every fault the compiled copies took (49-318 per step, all in Triton launches) came from an
instruction of the interpreter on memory unmapped by the time the call returned
(``python tools/bench_step_accounting.py --fault-sites -- --suite demos/realnets/resnet50.py --dtype
bf16 --mode infer --no-memory --no-cold``); the copy that took them changed between runs and read up
to 0.7x the other.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

#: Bytes of frame stack left free above the large frame: far more than the deepest timed call needs
#: (a frame takes 100-500 bytes; a compiled graph's call with its kernel launches is tens of frames).
ROOM_BYTES = 64 * 1024


@functools.cache
def _roomy_caller(room_bytes: int) -> Callable[[Callable[[], T]], T]:
    """A function whose frame holds ``room_bytes`` of local slots (never assigned), so that calling
    it needs a chunk of at least twice that (CPython doubles a chunk's size from 16 KiB until the
    frame fits), leaving about ``room_bytes`` above it.  Built at its first use (compiling its source
    takes about 16 ms)."""
    slots = room_bytes // 8 + 1
    names = " = ".join(f"_{i}" for i in range(slots))
    source = f"def roomy(fn):\n    if fn is None:\n        {names} = None\n    return fn()\n"
    namespace: dict[str, object] = {}
    exec(compile(source, "<frame_room>", "exec"), namespace)  # noqa: S102 (fixed source, built here)
    return namespace["roomy"]  # type: ignore[return-value]


def call_with_frame_room(fn: Callable[[], T]) -> T:
    """``fn()``, called where the frames it pushes (up to ``ROOM_BYTES``) fit in one frame-stack chunk
    that stays mapped until it returns (see the module docstring).  Same result and exceptions."""
    return _roomy_caller(ROOM_BYTES)(fn)
