"""The reductions the channel-reduce kernels compute (``ReductionKind``) and the groups of them the
kernels and their launchers branch on.

The kernels take a reduction as the constexpr ``KIND`` (the member's integer value).  The
predicates are ``triton.constexpr_function``s: host code calls them with a member or its value,
and kernels call them with their ``KIND`` constexpr, where they fold at compile time into the branch
taken, exactly as a comparison of constexprs does.  (A kernel cannot read the enum class itself:
Triton lets kernels read only constexpr globals.)
"""

from __future__ import annotations

import enum

import triton


class ReductionKind(enum.IntEnum):
    """One reduction over dim 1 with torch's semantics (``channel_reduce``'s module docstring); the
    values are the kernels' ``KIND`` codes."""

    MIN = 1
    MAX = 2
    AMIN = 3
    AMAX = 4
    SUM = 5
    MEAN = 6
    LOGSUMEXP = 7
    SOFTMAX = 8
    LOG_SOFTMAX = 9

    @classmethod
    def named(cls, name: str) -> ReductionKind:
        """The member of a torch-style name (``"log_softmax"``); ValueError for an unknown one."""
        try:
            return cls[name.upper()]
        except KeyError:
            known = sorted(k.name.lower() for k in cls)
            raise ValueError(f"unknown reduction {name!r}; known: {known}") from None


@triton.constexpr_function
def is_extremum(kind):  # noqa: ANN001, ANN201 - a constexpr function: an int in, a bool out
    """min, max, amin, amax: the result is one of the column's values."""
    return ReductionKind(kind) <= ReductionKind.AMAX


@triton.constexpr_function
def keeps_winner_index(kind):  # noqa: ANN001, ANN201
    """min, max: the result comes with the first channel holding it, which the backward reads."""
    return ReductionKind(kind) in (ReductionKind.MIN, ReductionKind.MAX)


@triton.constexpr_function
def splits_ties(kind):  # noqa: ANN001, ANN201
    """amin, amax: the backward splits the gradient evenly among the channels equal to the result."""
    return ReductionKind(kind) in (ReductionKind.AMIN, ReductionKind.AMAX)


@triton.constexpr_function
def takes_minimum(kind):  # noqa: ANN001, ANN201
    """min, amin: computed as the max of ``-v``."""
    return ReductionKind(kind) in (ReductionKind.MIN, ReductionKind.AMIN)


@triton.constexpr_function
def sums_values(kind):  # noqa: ANN001, ANN201
    """sum, mean: the statistics are the column's sum."""
    return ReductionKind(kind) in (ReductionKind.SUM, ReductionKind.MEAN)


@triton.constexpr_function
def sums_exponentials(kind):  # noqa: ANN001, ANN201
    """logsumexp, softmax, log_softmax: the statistics are the max and ``sum(exp(v - max))``."""
    return ReductionKind(kind) >= ReductionKind.LOGSUMEXP


@triton.constexpr_function
def is_full_size(kind):  # noqa: ANN001, ANN201
    """softmax, log_softmax: the result has the input's shape (every other kind: one value per column)."""
    return ReductionKind(kind) in (ReductionKind.SOFTMAX, ReductionKind.LOG_SOFTMAX)


@triton.constexpr_function
def is_kind(kind, member):  # noqa: ANN001, ANN201
    """Whether ``kind`` is the member named ``member`` (``"SUM"``): for the branches of one kind."""
    return ReductionKind(kind) is ReductionKind[member]


def backward_reads_y(kind: ReductionKind, has_pre_chain: bool) -> bool:
    """Whether the backward of ``kind`` reads the conv output again: the tie split, the exponentials
    and a pre-chain's derivative need it; min / max differentiate at the saved winner value."""
    return bool(splits_ties(kind) or sums_exponentials(kind) or (sums_values(kind) and has_pre_chain))
