"""``fusion_backend/frame_room.py``: a loop run under ``call_with_frame_room`` takes no minor page fault
per call at any depth of the caller's frame stack, where the same loop without it does at some depths
(CPython 3.11+ maps and unmaps a frame-stack chunk on every call that reaches past a chunk's end)."""

from __future__ import annotations

import resource
import sys

import pytest

from fusion_backend.frame_room import call_with_frame_room

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11) or not hasattr(resource, "RUSAGE_THREAD"),
                                reason="frame-stack chunks are CPython 3.11+; per-thread fault counts are Linux's")

CALLS = 200


def _nested(k: int) -> int:
    return 0 if k == 0 else _nested(k - 1)


def _at_depth(depth: int, body):  # noqa: ANN001, ANN202
    return body() if depth == 0 else _at_depth(depth - 1, body)


def _faults_per_call() -> float:
    """Minor faults per call of a 20-frame-deep function, ``CALLS`` calls in a row."""
    _nested(20)  # the first touch of a page that stays mapped is not the loop's
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(CALLS):
        _nested(20)
    return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / CALLS


DEPTHS = range(0, 400, 3)  # frames of a few hundred bytes each: several 16 KiB chunks' worth


def test_without_room_some_depths_fault_on_every_call() -> None:
    thrashing = [d for d in DEPTHS if _at_depth(d, _faults_per_call) >= 1]
    assert thrashing, "no caller depth made the loop cross a frame-stack chunk: the test no longer reads the effect"


def test_with_room_no_depth_faults_per_call() -> None:
    faulting = {d: f for d in DEPTHS if (f := _at_depth(d, lambda: call_with_frame_room(_faults_per_call))) >= 0.5}
    assert not faulting, f"faults per call by caller depth: {faulting}"


def test_the_result_and_exceptions_pass_through() -> None:
    assert call_with_frame_room(lambda: 42) == 42

    def fails() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        call_with_frame_room(fails)


def test_the_decision_timing_loop_runs_with_room():
    """``region_timing.time_per_call`` (the decision's and the whole-graph check's timing loop) calls its
    step from a caller depth where the same loop without room faults on every call."""
    from fusion_backend.runtime.region_timing import time_per_call

    thrashing = next(d for d in DEPTHS if _at_depth(d, _faults_per_call) >= 1)

    def timed_loop() -> float:
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        time_per_call(lambda: _nested(20), CALLS, lambda: None)
        return (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) / CALLS

    # the depth's offset from the loop's own frames differs by a few frames: try the neighbourhood
    faults = {d: _at_depth(d, timed_loop) for d in range(max(0, thrashing - 6), thrashing + 7)}
    assert max(faults.values()) < 0.5, f"faults per call by caller depth: {faults}"
