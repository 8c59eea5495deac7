"""Triton kernels of the ``conv_global_mean`` fused op: one pass over x forward, one pass over grad_x backward.

What the kernels compute
------------------------
The op (``fusion_backend.ops.conv_global_mean``) reduces the mean over all output positions of a
convolution to sums of the input over a few *index sets*.  Per spatial dim the host computes the
distinct sets of input indices that the kernel taps touch (an arithmetic progression per tap, see the
op module) and encodes them as a bit table: ``bits_dim[i]`` has bit ``j`` set iff input index ``i`` of
that dim belongs to set ``j``.  A set of the full nd problem is a product ``(j1, j2, j3)`` of one set
per dim (dims are padded in front to three with trivial size-1 dims, whose one set is ``{0}``).

* ``_set_sums_kernel`` (forward): for every plane ``(n, c)`` and every set triple,
  ``R[n, c, j1, j2, j3] = sum over i in set1[j1] x set2[j2] x set3[j3] of x[n, c, i]`` -- reading x
  exactly once.
* ``_set_broadcast_kernel`` (backward): the adjoint,
  ``grad_x[n, c, i] = sum over (j1, j2, j3) with i in the product set of Q[n, c, j1, j2, j3]``.

Both work on a plane viewed as ``rows x W`` with ``rows = D*H``: a tile is ``BLOCK_A`` rows by
``BLOCK_W`` columns.  Membership is separable, so the inner dim costs ``J3`` masked row-reductions
(or broadcasts) of the tile, and the two outer dims are handled once per row as a
``[J12_PAD, BLOCK_A]`` mask (``J12 = J1*J2``), never a per-element loop over all ``J1*J2*J3`` sets.

Determinism: no atomics.  A plane may be split into ``SPLIT`` row ranges (for parallelism when there
are few planes); each split writes its own partial row of the output and the launcher sums the splits
in a fixed order.

The plane kernels read x at about the memory's bandwidth in its NCDHW layout (``docs/perf/RESULTS.md``, *Kernel design measurements*); read by them,
a channels_last x (strided loads along W) was several times slower, so ``_set_sums_cl_kernel`` /
``_grad_broadcast_cl_kernel`` tile ``positions x channels`` and each tile row is a contiguous run of
channels.

The fused op's pipeline (``set_sums_partial`` -> ``contract_forward`` forward, ``params_backward`` ->
``grad_broadcast`` backward) is one launch per launcher: the split partials are reduced inside
``_contract_fwd_kernel``, and grad_x's per-set coefficients are formed in ``_set_broadcast_kernel``'s
prologue (``FROM_GRAD``) from ``G`` and the weight.  ``set_sums`` / ``set_broadcast`` remain as the
plain building blocks (tests use them).

The launchers take 5-D views ``(N, C, D, H, W)`` (1-d and 2-d problems unsqueezed in front) with any
strides, so channels_last inputs are read in place.

Modules: ``passes`` (the two full-size passes and their launchers), ``contract`` (the small
kernels: contraction forward, parameter gradients backward), ``common`` (launch plans, weight
addressing).
"""

from .common import NUM_WARPS, Launch, WeightLayout
from .contract import (
    GRAD_DIRECT,
    GRAD_NONE,
    GRAD_SCRATCH,
    ChainArgs,
    ContractTiles,
    contract_forward,
    contract_tiles,
    params_backward,
)
from .passes import MAX_CL_SETS, MAX_SETS_PER_DIM, grad_broadcast, set_broadcast, set_sums, set_sums_partial

__all__ = [
    "ChainArgs",
    "contract_forward",
    "contract_tiles",
    "ContractTiles",
    "grad_broadcast",
    "GRAD_DIRECT",
    "GRAD_NONE",
    "GRAD_SCRATCH",
    "Launch",
    "MAX_CL_SETS",
    "MAX_SETS_PER_DIM",
    "NUM_WARPS",
    "params_backward",
    "set_broadcast",
    "set_sums",
    "set_sums_partial",
    "WeightLayout",
]
