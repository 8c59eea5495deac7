"""A region's pointwise chains (``ops/chain.py``) lowered to what the Triton launchers take
(``kernel_steps``, ``KernelChains``: operand matrices as ``kernels.epilogue.build_params`` builds them,
fp32 ``(NUM_PARAM_ROWS, C)``), their operand gradients gathered back (``operand_grads``; planned once
per call signature: ``operand_grad_recipe``, ``sum_operand_grads``), and the checks of chains,
operands and pools that every family whose kernels run a chain shares.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Union

import torch
from torch import Tensor

from ..errors import UnsupportedInputError
from ..ir.specs import PoolSpec
from .chain import ChainStep, ChainValue, Const, TensorRef, kernel_code


def channel_stride(shape: Sequence[int], stride: Sequence[int], channels: int, ndim: int) -> int | None:
    """How an operand of ``shape`` and ``stride`` broadcasts against an ``ndim``-dim conv output of
    ``channels`` channels: 0 for one value (at most ``ndim`` dims), the element stride between its
    channels for one value per channel (``(C, 1, ..., 1)`` or ``(1, C, 1, ..., 1)``), else None."""
    if math.prod(shape) == 1 and len(shape) <= ndim:
        return 0
    ones = (1,) * (ndim - 2)
    if tuple(shape) == (channels, *ones):
        return stride[0]
    if tuple(shape) == (1, channels, *ones):
        return stride[1]
    return None


def family_activation(step: ChainStep) -> tuple[str, float] | None:
    """``(name, slope)`` of the conv family's activation (``kernels.conv.hooks.Activation``) that
    computes ``step`` (relu, leaky_relu with a constant slope, gelu, silu), or None: what may follow a
    residual in the family's store, or an input norm in its prologue (the patterns keep nothing else
    there)."""
    name = step.kind.name.lower()
    if name in ("relu", "gelu", "silu"):
        return name, 0.01
    if name == "leaky_relu" and isinstance(step.operands[0], Const):
        return name, step.operands[0].value
    return None


def kernel_steps(chain: Sequence[ChainStep], operands: Sequence[Tensor], y_ndim: int, channels: int) -> list:
    """``chain`` as the launchers take it: ``(op code, [float | tensor])`` per step, a ``Const`` as its
    number, a ``TensorRef`` as its tensor (one value, or one per channel of the ``y_ndim``-dim conv
    output: ``UnsupportedInputError`` otherwise), a ``ChainValue`` as 0.0 (the kernels read it from the
    chain's own slots, no operand row)."""
    steps = []
    for step in chain:
        values: list[Union[float, Tensor]] = []
        for operand in step.operands:
            if isinstance(operand, Const):
                values.append(operand.value)
                continue
            if isinstance(operand, ChainValue):
                values.append(0.0)
                continue
            t = operands[operand.index]
            if channel_stride(t.shape, t.stride(), channels, y_ndim) is None:
                raise UnsupportedInputError(
                    f"operands[{operand.index}] of shape {tuple(t.shape)} is neither a scalar nor per-channel "
                    f"for a conv output with {channels} channels and {y_ndim} dims"
                )
            values.append(t)
        steps.append((kernel_code(step), values))
    return steps


def affine_rows(operands: Sequence[Tensor], weight: int | None, bias: int | None, count: int, device) -> Tensor:
    """A norm's scale and shift as the kernels read them: fp32 ``(2, count)`` contiguous, row 0
    ``operands[weight]`` (ones without one), row 1 ``operands[bias]`` (zeros without one)."""
    if weight is not None and bias is not None:  # one launch (a stack), where filling rows takes two
        return torch.stack((operands[weight].reshape(-1), operands[bias].reshape(-1))).to(device, torch.float32)
    rows = torch.empty((2, count), dtype=torch.float32, device=device)
    for row, index, fill in ((0, weight, 1.0), (1, bias, 0.0)):
        if index is None:
            rows[row].fill_(fill)
        else:
            rows[row].copy_(operands[index].reshape(-1))
    return rows


class KernelChains:
    """One call's chains as the launchers take them: ``pre`` (before the family's reduction or norm)
    and ``post`` (after it) as ``kernel_steps``, their operand matrices ``params`` (the bias row and
    the pre-chain's operands over the C channels) and ``post_params`` (the post-chain's, over
    ``post_columns``: C, or 1 after a reduction over the channels), a norm's ``affine`` rows
    (``affine_rows``, None for a family without one) and the conv bias as C contiguous values (or None).
    ``params`` is built on first use: a family without a pre-chain reads it only behind a pool."""

    def __init__(self, pre: Sequence[ChainStep], post: Sequence[ChainStep], bias: Tensor | None,
                 operands: Sequence[Tensor], ndim: int, channels: int, device: torch.device,
                 post_columns: int | None = None, affine: Tensor | None = None) -> None:  # fmt: skip
        from ..kernels.epilogue import build_params  # lazily: TRITON_INTERPRET is read at import

        self._build, self._bias, self._channels, self._device = build_params, bias, channels, device
        columns = channels if post_columns is None else post_columns
        self.pre = kernel_steps(pre, operands, ndim, channels)
        self.post = kernel_steps(post, operands, ndim, columns)
        self.post_params = build_params(self.post, None, columns, device)
        self.affine = affine
        self.bias = None if bias is None else bias.reshape(-1).contiguous()

    @functools.cached_property
    def params(self) -> Tensor:
        return self._build(self.pre, self._bias, self._channels, self._device)


def norm_chains(cfg: Any, bias: Tensor | None, operands: Sequence[Tensor], ndim: int, channels: int,
                device: torch.device, count: int | None = None, affine: Tensor | None = None) -> KernelChains:  # fmt: skip
    """A norm family's ``KernelChains`` over the C channels, with its scale and shift ``affine_rows``
    over ``count`` values (default one per channel), or ``affine`` where the caller has those rows
    already (a training batch norm's saved statistics hold them: no copies)."""
    if affine is None:
        affine = affine_rows(operands, cfg.weight, cfg.bias, channels if count is None else count, device)
    return KernelChains(cfg.pre, cfg.post, bias, operands, ndim, channels, device, affine=affine)


class PlannedChains:
    """``norm_chains``' work done once per call signature: the chains' op codes (``pre``, ``post``:
    steps without operand values, all a launcher's plan reads of them), the operand matrices' plans and
    the places of their tensors among ``operands``, the norm's affine operands; ``bind(bias, operands)``
    gives a call's ``(params, post_params, affine)`` (``KernelChains``' tensors, built from the call's
    values).  It holds no tensor of a call."""

    def __init__(self, cfg: Any, bias: Tensor | None, operands: Sequence[Tensor], ndim: int, channels: int,
                 device: torch.device, count: int | None = None) -> None:  # fmt: skip
        from ..kernels.epilogue import OperandMatrix  # lazily: TRITON_INTERPRET is read at import

        pre, post = kernel_steps(cfg.pre, operands, ndim, channels), kernel_steps(cfg.post, operands, ndim, channels)
        self.pre, self.post = [(code, ()) for code, _ in pre], [(code, ()) for code, _ in post]
        self.pre_matrix = OperandMatrix(pre, bias, channels, device)
        self.post_matrix = OperandMatrix(post, None, channels, device)
        self.pre_sources, self.post_sources = tensor_sources(cfg.pre), tensor_sources(cfg.post)
        self.has_bias, self.device = bias is not None, device
        self.affine = (cfg.weight, cfg.bias, channels if count is None else count)

    def bind(self, bias: Tensor | None, operands: Sequence[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        params = self.pre_matrix.build([*([bias] if self.has_bias else []), *(operands[i] for i in self.pre_sources)])
        post_params = self.post_matrix.build([operands[i] for i in self.post_sources])
        return params, post_params, affine_rows(operands, *self.affine, self.device)


def tensor_sources(chain: Sequence[ChainStep]) -> tuple[int, ...]:
    """The indices into ``operands`` of a chain's tensor operands, in its operand matrix's row order."""
    return tuple(op.index for step in chain for op in step.operands if isinstance(op, TensorRef))


def norm_operand_grads(operands: Sequence[Tensor], operand_mask: Sequence[bool], cfg: Any,
                       chain_sums: Sequence[tuple[Sequence[ChainStep], Sequence[Tensor | None]]],
                       affine_sums: Sequence[Tensor | None]) -> list[Tensor | None]:  # fmt: skip
    """``operand_grads`` plus the norm's weight and bias gradients (``affine_sums``: None where not
    computed, each wanted one a tensor of its own) added in at ``cfg.weight`` / ``cfg.bias``.  An affine
    operand no chain reads gets its sum alone (no zeros to add it to)."""
    read = {op.index for chain, _ in chain_sums for step in chain for op in step.operands if isinstance(op, TensorRef)}
    alone = {index for index in (cfg.weight, cfg.bias) if index is not None and index not in read}
    grads = operand_grads(operands, [want and i not in alone for i, want in enumerate(operand_mask)], chain_sums)
    for index, total in zip((cfg.weight, cfg.bias), affine_sums, strict=True):
        add_operand_grad(grads, operands, index, total)
    return grads


def wanted_slots(chain: Sequence[ChainStep], operand_mask: Sequence[bool]) -> list[bool]:
    """Per slot: whether the gradient of its (tensor) first operand is wanted."""
    return [
        step.kind.differentiable_operands == (0,) and isinstance(step.operands[0], TensorRef)
        and bool(operand_mask[step.operands[0].index])
        for step in chain
    ]  # fmt: skip


#: Per operand: None (no gradient wanted), or ``(sources, one_value, shape, dtype, device)``, the
#: ``(chain, slot)`` pairs whose per-channel sums add up to its gradient (``operand_grad_recipe``).
GradRecipe = list[Union[tuple[list[tuple[int, int]], bool, torch.Size, torch.dtype, torch.device], None]]


def operand_grad_recipe(chains: Sequence[Sequence[ChainStep]], operands: Sequence[Tensor],
                        operand_mask: Sequence[bool]) -> GradRecipe:  # fmt: skip
    """Which slots of ``chains`` (the ``wanted_slots``: the kernels sum their first operand's gradient)
    each wanted operand's gradient gathers, worked out once for a call signature."""
    slots = [wanted_slots(chain, operand_mask) for chain in chains]
    return [None if not wanted else (
        [(c, k) for c, chain in enumerate(chains) for k, step in enumerate(chain)
         if slots[c][k] and step.operands[0] == TensorRef(i)], t.numel() == 1, t.shape, t.dtype, t.device)
        for i, (t, wanted) in enumerate(zip(operands, operand_mask, strict=True))]  # fmt: skip


def sum_operand_grads(recipe: GradRecipe, sums: Sequence[Sequence[Tensor | None]]) -> list[Tensor | None]:
    """The operand gradients of ``recipe`` from the kernels' per-slot fp32 sums (``sums[c][k]``: chain
    c's slot k): the sums of the slots that read an operand, added in slot order (a one-value operand
    then takes the total over the channels), in its shape and dtype, never a view of a kernel's
    partial sums (the op's outputs must not share storage); zeros for an operand only read where no
    gradient flows (e.g. a clamp bound)."""
    grads: list[Tensor | None] = []
    for entry in recipe:
        if entry is None:
            grads.append(None)
            continue
        sources, one_value, shape, dtype, device = entry
        if not sources:
            grads.append(torch.zeros(shape, dtype=dtype, device=device))
            continue
        total = sums[sources[0][0]][sources[0][1]]
        for c, k in sources[1:]:
            total = total + sums[c][k]
        if one_value:
            total = total.sum()
        elif total.untyped_storage().nbytes() != total.numel() * total.element_size():  # a row of the partials
            total = total.clone()
        grads.append(total.reshape(shape).to(dtype))
    return grads


def operand_grads(operands: Sequence[Tensor], operand_mask: Sequence[bool],
                  chain_sums: Sequence[tuple[Sequence[ChainStep], Sequence[Tensor | None]]]) -> list[Tensor | None]:  # fmt: skip
    """Each wanted operand's gradient from ``(chain, per-slot sums)`` pairs (``sum_operand_grads``)."""
    recipe = operand_grad_recipe([chain for chain, _ in chain_sums], operands, operand_mask)
    return sum_operand_grads(recipe, [sums for _, sums in chain_sums])


def add_operand_grad(grads: list[Tensor | None], operands: Sequence[Tensor], index: int | None,
                     total: Tensor | None) -> None:  # fmt: skip
    """Add ``total`` (None: nothing) into ``grads[index]``, in ``operands[index]``'s shape and dtype."""
    if index is None or total is None:
        return
    t = operands[index]
    g = total.reshape(t.shape).to(t.dtype)
    grads[index] = g if grads[index] is None else grads[index] + g


def pool_unroll_problem(pool: PoolSpec | None) -> str | None:
    """Why the kernels cannot take ``pool``, or None: their windows are unrolled, at most
    ``MAX_WINDOW_VOLUME`` taps."""
    from ..kernels.chain_math import MAX_WINDOW_VOLUME  # lazily: TRITON_INTERPRET is read at import

    if pool is not None and pool.window_volume > MAX_WINDOW_VOLUME:
        return f"pool window of {pool.window_volume} taps exceeds the kernel's unroll limit {MAX_WINDOW_VOLUME}"
    return None


def check_operand_refs(op: str, chains: dict[str, Sequence[ChainStep]], operands: Sequence[Tensor]) -> None:
    """One-line ``UnsupportedInputError`` (naming ``fusion::{op}``) for a chain whose ``TensorRef``
    points past ``operands``."""
    for name, chain in chains.items():
        for step in chain:
            for operand in step.operands:
                if isinstance(operand, TensorRef) and not 0 <= operand.index < len(operands):
                    raise UnsupportedInputError(f"fusion::{op}: the {name} references operands[{operand.index}] but "
                                                f"{len(operands)} operand tensors were given")  # fmt: skip


def check_affine_operands(op: str, operands: Sequence[Tensor], weight: int | None, bias: int | None, count: int,
                          what: str) -> None:  # fmt: skip
    """One-line ``UnsupportedInputError`` (naming ``fusion::{op}``) for a norm's weight or bias that the
    call lacks or that does not hold ``count`` floating values (``what`` says what they are, e.g.
    "one per channel")."""
    for name, index in (("weight", weight), ("bias", bias)):
        if index is None:
            continue
        if index >= len(operands):
            raise UnsupportedInputError(f"fusion::{op}: the norm's {name} is operands[{index}] but {len(operands)} "
                                        "operand tensors were given")  # fmt: skip
        t = operands[index]
        if t.numel() != count or not t.is_floating_point():
            raise UnsupportedInputError(f"fusion::{op}: the norm's {name} must hold {count} floating values ({what}), "
                                        f"got {tuple(t.shape)} {t.dtype}")  # fmt: skip
